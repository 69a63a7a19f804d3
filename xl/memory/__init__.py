"""The recurrent memories: one module per variant, and the store that keeps a run's memory.

The interface they implement is the model's, which calls it (this package imports the model, never the reverse):

- :mod:`xl.model.memory`: what a memory provides to the forward pass and the decoder (:class:`~xl.model.memory.Memory`);
- :mod:`xl.model.memory_settings`: the settings every memory shares, and the base of each variant's own
  (:class:`~xl.model.memory_settings.MemoryConfig`, named by ``_target_`` in ``conf/memory/*.yaml``).

The variants and what they share:

- :mod:`xl.memory.cache`: the Transformer-XL memory;
- :mod:`xl.memory.compressive`: the compressive memory (Rae et al., 2019);
- :mod:`xl.memory.tokens`: memory tokens over the cache (Bulatov et al., 2022);
- :mod:`xl.memory.rmt`: memory tokens laid out as the Recurrent Memory Transformer's models;
- :mod:`xl.memory.lmrmt`: memory tokens laid out as the models of the authors' LM-RMT code;
- :mod:`xl.memory.store`: one memory per stage of a run, and its place in checkpoints.

A variant is one module with its config dataclass and its :class:`~xl.model.memory.Memory`, and one YAML file that
names the config class (docs/memories.md). This package imports nothing on import: import the module you need.
"""
