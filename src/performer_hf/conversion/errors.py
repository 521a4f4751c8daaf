"""The one exception type a conversion raises for problems with its inputs."""


class ConversionError(ValueError):
    """A conversion cannot proceed; the message is one line naming the cause and the fix."""
