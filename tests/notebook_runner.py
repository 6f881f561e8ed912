"""Executes a notebook's code cells in order, in a fresh Python process, as a test would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_notebook(
    path: str | Path,
    timeout_s: float = 600,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess:
    """Run every code cell of ``path``; raise AssertionError with the output if any cell fails.

    ``env`` entries are added to the environment (a notebook reads e.g. ``RESIHP_QUICK=1`` to use a
    short input). Cells run with ``cwd`` (default: the repository root) and a non-interactive
    matplotlib backend.
    """
    cells = json.loads(Path(path).read_text())["cells"]
    source = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    # IPython magics and shell escapes have no meaning outside Jupyter
    script = "\n".join(
        line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))
    )
    full_env = {**os.environ, "MPLBACKEND": "Agg", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"notebook {path} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc
