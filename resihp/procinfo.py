"""What ``/proc`` says of a process: whether it runs, its state, its start time, its parent."""

from __future__ import annotations

import os
from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields or None


def process_state(pid: int) -> str | None:
    """The process's state letter (``T``: stopped, ``Z``: a zombie), or None when it is gone."""
    fields = _stat(pid)
    return fields[0] if fields else None


def start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (None when it is gone or a zombie)."""
    fields = _stat(pid)
    return None if fields is None or fields[0] in "ZX" else int(fields[19])


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid``, or None when it is gone."""
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return process_state(pid) not in ("Z", "X")
