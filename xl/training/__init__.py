"""Training and running: the LightningModule (:mod:`xl.training.module`), the optimizer, the metrics, checkpoints
and resumes, callbacks and loggers, the footprint estimate, and the objects an entry point builds from a config
(:mod:`xl.training.build`)."""
