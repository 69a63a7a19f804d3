"""A run's services: callbacks, stops and signals, the console and the progress bar, loggers and W&B records, the
sweep summary."""
