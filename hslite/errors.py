"""Errors a person reads: each says what was wrong, the value seen and what to do."""


class HSLiteError(Exception):
    """Base of every error hslite reports to a user without a traceback."""

    exit_code = 1


class ConfigError(HSLiteError):
    """A recipe, override or command line that cannot be used as given (usage error)."""

    exit_code = 2


class DataError(HSLiteError):
    """A scene file that is missing, corrupt or inconsistent, or a preprocessing request it cannot satisfy."""

    exit_code = 1


class ModelError(HSLiteError):
    """A model name or size that does not exist, or sizes that do not fit the data."""

    exit_code = 2
