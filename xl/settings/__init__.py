"""How a setting is declared: its default, its allowed values and its help (:mod:`xl.settings.bounds`), shared by
every schema and every memory's config. Imports nothing of ``xl``."""
