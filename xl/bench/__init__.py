"""Benchmarks, reading segments through one runner (:class:`xl.bench.runner.SegmentRunner`) or through the code
an application itself runs.

- ``python -m xl.bench``: training and evaluation tokens/s at config S on this CPU, and our attention sublayer
  against the 2019 code's formulation (:mod:`xl.bench.throughput`).
- ``python -m xl.bench.gpu``: training tokens/s, peak memory and MFU of an experiment config on a GPU.
- ``python -m xl.bench.port``: config S side by side with Hugging Face's port of the 2019 code.
- ``python -m xl.bench.evalspeed``: evaluation speed against the vanilla transformer (Dai et al., 2019, Table 9).
- ``python -m xl.bench.babilong``: the BABILong scorer against ``xl.evaluate``'s own test step, side by side, and
  the scorer's peak memory at two lengths.
"""
