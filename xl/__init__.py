"""Transformer-XL on Lightning + Hydra. Importing the package registers the config schemas (xl.config)."""

from xl import config as _config  # noqa: F401  (Hydra's ConfigStore must hold the schemas before conf/ composes)
