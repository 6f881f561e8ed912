"""Resilience policies replayed side by side: each a small class over
``resihp.replay.engine.Policy``."""

from __future__ import annotations

from resihp.errors import InputError
from resihp.replay.interface import Policy
from resihp.replay.policies.greyhound import Greyhound, OobleckGreyhound, ReCycleGreyhound
from resihp.replay.policies.oobleck import Oobleck
from resihp.replay.policies.recycle import ReCycle
from resihp.replay.policies.resihp import Resihp
from resihp.replay.policies.restart import CheckpointRestart

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        Resihp,
        CheckpointRestart,
        Oobleck,
        ReCycle,
        Greyhound,
        OobleckGreyhound,
        ReCycleGreyhound,
    )
}


def make_policies(names: str | list[str] | None) -> list[Policy]:
    """Policy objects by name (comma-separated or a list); all of them when ``names`` is empty."""
    if not names:
        return [cls() for cls in POLICIES.values()]
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise InputError(
            f"--policies: unknown policy {', '.join(unknown)} "
            f"(expected some of {', '.join(POLICIES)})"
        )
    return [POLICIES[n]() for n in dict.fromkeys(names)]
