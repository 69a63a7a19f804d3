"""The network: Transformer-XL over one segment and its memory, in plain PyTorch (:mod:`xl.model.transformer`:
``TransformerXL``), with its settings (:mod:`xl.model.config`: ``XLConfig``) and one-token decoding
(:mod:`xl.model.decoding`), and the interface every memory implements for them (:mod:`xl.model.memory`,
:mod:`xl.model.memory_settings`, :mod:`xl.model.eviction`; the variants are :mod:`xl.memory`'s)."""
