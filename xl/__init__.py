"""xl: Transformer-XL's segment-level recurrence and its memories, on PyTorch Lightning and Hydra.

The library: :mod:`xl.model` (the network), :mod:`xl.memory` (the memories), :mod:`xl.data` (corpora, tokenizers,
the ordered loader), :mod:`xl.training` (the LightningModule and what a run needs), :mod:`xl.config` (schemas and
rules), :mod:`xl.hub` (sharing models). The applications are the modules and packages beside them (``train``,
``evaluate``, ``generate``, ``probe``, ``footprint``, ``export``, ``convert``, ``babilong``) and the benchmarks
(``bench``); the library never imports them.
"""

__version__ = "0.2.0"
