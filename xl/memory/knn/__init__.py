"""The retrieval memory of Memorizing Transformers (Wu et al., 2022): per chosen layer, a large store of the keys and
values that left the local window, searched top-k per query and attended with a learned per-head gate.

- :mod:`xl.memory.knn.store`: the per-row, per-head store (a ring buffer), what enters it and when, documents;
- :mod:`xl.memory.knn.search`: exact top-k by batched products, or faiss; the retrieved entries;
- :mod:`xl.memory.knn.attention`: the gated attention over the retrieved entries, and the default layer.

docs/knn.md describes the design and where it differs from the paper.
"""
