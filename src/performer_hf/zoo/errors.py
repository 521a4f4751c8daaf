"""The error every zoo failure is reported with."""


class ZooError(ValueError):
    """A zoo build cannot run or failed: the message names the cause and the fix."""
