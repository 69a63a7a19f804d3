"""The training loop: the LightningModule (:mod:`xl.training.loop.module`), gradient windows, the optimizer,
non-finite steps and a curriculum's stages."""
