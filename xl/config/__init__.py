"""The config: every group's schema (:mod:`xl.config.schema`), the rules between settings (:mod:`xl.config.rules`),
composing a config and reporting a bad one in one sentence (:mod:`xl.config.compose`), and the reference tables of
docs/configuration.md (:mod:`xl.config.reference`)."""
