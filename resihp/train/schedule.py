"""Pipeline schedules as data: per stage, the ordered list of forward/backward actions.

The engine walks this list; sends are asynchronous and receives block, so any schedule whose
receive order matches its neighbour's send order runs without deadlock. The orders themselves are
``resihp.perf.schedule.rank_order`` (one model chunk per rank), so the runtime runs exactly the
schedule the performance model predicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from resihp.errors import InputError
from resihp.parallel import SCHEDULES
from resihp.perf.schedule import FWD, rank_order


@dataclass(frozen=True)
class Action:
    kind: Literal["F", "B"]
    mb: int  # index into this replica's micro-batches

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}"


def _actions(name: str, pp: int, stage: int, n_mb: int) -> list[Action]:
    return [
        Action("F" if op.phase == FWD else "B", op.mb)
        for op in rank_order(name, pp, n_mb, 1, stage)
    ]


def gpipe(pp: int, stage: int, n_mb: int) -> list[Action]:
    """All forwards, then all backwards.

    Args:
        pp: the pipeline's stages.
        stage: this rank's stage.
        n_mb: the micro-batches of the step."""
    return _actions("gpipe", pp, stage, n_mb)


def one_f_one_b(pp: int, stage: int, n_mb: int) -> list[Action]:
    """Non-interleaved 1F1B (PipeDream-flush) actions of one stage.

    ``pp - stage - 1`` warm-up forwards, then alternate one forward and one backward, then drain
    the remaining backwards.

    Args:
        pp: the pipeline's stages.
        stage: this rank's stage.
        n_mb: the micro-batches of the step."""
    return _actions("1f1b", pp, stage, n_mb)


def schedule_for(name: str, pp: int, stage: int, n_mb: int) -> list[Action]:
    """One stage's actions under the schedule ``name``; InputError for an unknown one.

    Args:
        name: the schedule (``--schedule``), one of ``SCHEDULES``.
        pp: the pipeline's stages.
        stage: this rank's stage.
        n_mb: the micro-batches of the step."""
    if name not in SCHEDULES:
        raise InputError(f"--schedule: expected one of {', '.join(SCHEDULES)}, got {name!r}")
    return _actions(name, pp, stage, n_mb)
