"""Pipeline schedules as data: per stage, the ordered list of forward/backward actions.

The engine walks this list; sends are asynchronous and receives block, so any schedule whose
receive order matches its neighbour's send order runs without deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from resihp.errors import InputError

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class Action:
    kind: Literal["F", "B"]
    mb: int  # index into this replica's micro-batches

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}"


def gpipe(pp: int, stage: int, n_mb: int) -> list[Action]:
    """All forwards, then all backwards."""
    return [Action("F", m) for m in range(n_mb)] + [Action("B", m) for m in range(n_mb)]


def one_f_one_b(pp: int, stage: int, n_mb: int) -> list[Action]:
    """Non-interleaved 1F1B (PipeDream-flush): ``pp - stage - 1`` warm-up forwards, then
    alternate one forward and one backward, then drain the remaining backwards."""
    warmup = min(pp - stage - 1, n_mb)
    actions = [Action("F", m) for m in range(warmup)]
    for i in range(n_mb - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    actions += [Action("B", m) for m in range(n_mb - warmup, n_mb)]
    return actions


def schedule_for(name: str, pp: int, stage: int, n_mb: int) -> list[Action]:
    if name == "1f1b":
        return one_f_one_b(pp, stage, n_mb)
    if name == "gpipe":
        return gpipe(pp, stage, n_mb)
    raise InputError(f"--schedule: expected one of {', '.join(SCHEDULES)}, got {name!r}")
