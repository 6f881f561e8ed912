"""Python ``logging`` for resihp: the ``resihp`` logger's records, to stderr and a run's log file.

Records are prefixed with the rank; the log file is in the run folder.

    [resihp rank 1] WARNING fail-slow on rank 1 from step 31 (detected at 36): x2.02

``setup`` is idempotent per (folder, rank); the user's own logging configuration is left alone
(resihp's records still propagate to it when it has handlers of its own).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s [resihp rank {rank}] %(levelname)s %(name)s: %(message)s"
STDERR_FORMAT = "[resihp rank {rank}] %(levelname)s %(message)s"


def setup(
    out: str | Path | None, rank: int = 0, level: int | str = logging.INFO, stderr: bool = True
) -> logging.Logger:
    """Route the ``resihp`` logger's records to ``OUT/logs/rank<R>.log`` and to stderr.

    Stderr gets them unless the application configured logging itself (warnings and above, and
    info on rank 0).

    Args:
        out: the run folder (None: no log file).
        rank: the rank ``R``, in the prefix and the file's name.
        level: the least level logged to the file.
        stderr: log to stderr too (as above)."""
    logger = logging.getLogger("resihp")
    logger.setLevel(level)
    for h in list(logger.handlers):
        if getattr(h, "_resihp", False):
            logger.removeHandler(h)
            h.close()
    if out is not None:
        path = Path(out) / "logs" / f"rank{rank}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(path)
        fh.setFormatter(logging.Formatter(FORMAT.format(rank=rank)))
        fh._resihp = True
        logger.addHandler(fh)
    if stderr and not logging.getLogger().handlers:
        sh = logging.StreamHandler(sys.stderr)
        sh.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        sh.setFormatter(logging.Formatter(STDERR_FORMAT.format(rank=rank)))
        sh._resihp = True
        logger.addHandler(sh)
        logger.propagate = False
    else:
        logger.propagate = True
    return logger


def close() -> None:
    logger = logging.getLogger("resihp")
    for h in list(logger.handlers):
        if getattr(h, "_resihp", False):
            logger.removeHandler(h)
            h.close()
