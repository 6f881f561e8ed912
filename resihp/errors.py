"""The exception types that the CLI turns into a one-line message and a non-zero exit.

Bad input exits 2; a part of the job this machine could not start exits 1."""

from __future__ import annotations

import sys


class InputError(ValueError):
    """Bad user input: a file, field or value that is not of the expected form.

    The message is a single line that names the file (or option), the field and the expected form.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class SetupError(RuntimeError):
    """A part of the job that this machine could not start or reach (a memory tier's keeper).

    Not the user's input, not a bug; one line that says what and where to look."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


NOTE = "resihp: note: "  # a worker's line for the user: its launcher says it too, once


def note(message: str) -> None:
    """Tell the user ``message`` in one line on stderr (from a worker: its launcher repeats it)."""
    print(f"{NOTE}{' '.join(message.split())}", file=sys.stderr, flush=True)


def where(path: object, field: str | None = None) -> str:
    """Prefix for messages: ``file`` or ``file: field``."""
    return f"{path}: {field}" if field else f"{path}"


DISK_FULL_ERRNOS = (28, 122, 27)  # ENOSPC, EDQUOT, EFBIG


def disk_full(exc: BaseException | None) -> BaseException | None:
    """The error in ``exc``'s chain that says the disk is full, or None.

    Full means ENOSPC, quota or file too large. Follows causes, contexts and the per-rank failures
    that torch.distributed.checkpoint wraps (its CheckpointException), and Arrow's messages that
    carry the errno only in their text."""
    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and (
            e.errno in DISK_FULL_ERRNOS or "No space left on device" in str(e)
        ):
            return e
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for f in failures.values():  # DCP: (exception, traceback) per rank
                f = f[0] if isinstance(f, tuple) and f else f
                stack.append(f if isinstance(f, BaseException) else None)
    return None
