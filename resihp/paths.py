"""Where the shipped data lives, shipped files by name, and writing a file whole.

The trained predictors (``models/``) and the traces (``traces/``: length sources, cluster and model
specs, replay scenarios, detector profiles, failure logs) are package data under ``resihp/data``
(in the checkout, links to the repository's ``models/`` and ``traces/``), so an installed package
finds them from any directory.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

from resihp.errors import InputError

DATA = Path(str(files("resihp") / "data"))
TRACES = DATA / "traces"
MODELS = DATA / "models"

# kind -> (folder under DATA, file suffix, what it is in messages)
SHIPPED = {
    "cluster": ("traces/clusters", ".yaml", "cluster"),
    "model": ("traces/models", ".yaml", "model"),
    "scenario": ("traces/scenarios", ".yaml", "scenario"),
    "predictor": ("models", "", "predictor"),
    "alibaba": ("traces/alibaba", ".csv", "Alibaba mini-batch file"),
}


def shipped_names(kind: str) -> list[str]:
    """The names of the shipped files of ``kind`` (``h100-8``, ``gpt-7b``, ...)."""
    folder, suffix, _ = SHIPPED[kind]
    root = DATA / folder
    if not root.is_dir():
        return []
    return sorted(
        p.name.removesuffix(suffix)
        for p in root.iterdir()
        if (p.is_dir() if not suffix else p.name.endswith(suffix))
    )


def resolve(value: str | Path, kind: str) -> Path:
    """``value`` itself when it exists; else the shipped file of ``kind`` it names.

    By bare name (``h100-8-degraded``) or by its repository path
    (``traces/clusters/h100-8-degraded.yaml``) from any directory. A bare name that is neither:
    InputError naming the shipped choices; any other path comes back as given, for its reader to
    report."""
    path = Path(value)
    if path.exists():
        return path
    folder, suffix, what = SHIPPED[kind]
    bare = len(path.parts) == 1
    if bare or path.parent.as_posix().endswith(folder):
        candidate = (
            DATA / folder / (path.name if path.name.endswith(suffix) else path.name + suffix)
        )
        if candidate.exists():
            return candidate
    if not bare:
        return path
    names = ", ".join(shipped_names(kind)) or "none"
    raise InputError(
        f"{value}: cannot read {what} (no such file, and no shipped {what} of that "
        f"name; shipped: {names})"
    )


def write_text_atomic(path: str | Path, text: str, durable: bool = True) -> None:
    """``path`` holds either its old content or all of ``text``, never a part.

    For a reader polling it from another process: a temp file beside it, renamed over it.

    Args:
        path: the file to write.
        text: its new content.
        durable: also survive a power loss (fsync before the rename; not needed on tmpfs).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
