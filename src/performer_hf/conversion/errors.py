"""The one exception type a conversion raises for problems with its inputs, and its one-line causes."""


class ConversionError(ValueError):
    """A conversion cannot proceed; the message is one line naming the cause and the fix."""


def one_line(error: BaseException) -> str:
    """``error`` as the cause in a one-line message: its type and the first line of its text."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")
