"""The one error type of the data package, so callers can tell a bad setting from a bug."""


class DataError(ValueError):
    """A data setting or input file is unusable; the message names the setting to change."""
