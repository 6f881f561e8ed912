"""The one exception type that the CLI turns into a one-line message and a non-zero exit."""

from __future__ import annotations


class InputError(ValueError):
    """Bad user input: a file, field or value that is not of the expected form.

    The message is a single line that names the file (or option), the field and the expected form.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


def where(path: object, field: str | None = None) -> str:
    """Prefix for messages: ``file`` or ``file: field``."""
    return f"{path}: {field}" if field else f"{path}"
