"""User-facing errors: one line that names the key(s) and the fix, printed without a traceback."""


class HpcrlError(Exception):
    """Base class for errors the CLI reports as a single line."""


class ConfigError(HpcrlError):
    """The composed configuration is invalid; the message names the key and how to fix it."""


class DoesNotFitError(ConfigError):
    """The memory estimate says the job would run out of GPU memory."""
