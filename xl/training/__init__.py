"""Training and running, in sub-packages: checkpoints and run folders (:mod:`xl.training.checkpoints`), the
LightningModule and what it trains with (:mod:`xl.training.loop`), a run's services (:mod:`xl.training.services`:
callbacks, loggers, console, stops); here, the objects an entry point builds from a config (:mod:`xl.training.build`),
a run read back (:mod:`xl.training.runs`), an evaluation's results and the Hydra callbacks."""
