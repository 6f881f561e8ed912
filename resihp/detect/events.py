"""Detector events and the event JSON of docs/DESIGN.md."""

from __future__ import annotations

from dataclasses import dataclass

DEVICE_FAULTS = ("fail-slow", "fail-stop", "link-slow")
NOT_DEVICE_FAULTS = ("workload-imbalance", "stage-imbalance", "shared-link-slow")


@dataclass
class Event:
    """One finding of the detector or the supervisor.

    ``rank`` is None for findings about a whole stage or replica. A ``link-slow`` names both ends
    of its link in ``ranks`` (``rank`` is one of them). The optional fields are the evidence of
    one kind of finding; the JSON form (``to_dict``) carries those that are set.
    """

    kind: str
    rank: int | None
    dp_rank: int | None
    stage: int | None
    tp_rank: int | None
    onset_step: int
    detected_step: int
    slowdown: float
    confidence: float
    end_step: int | None = None
    ranks: list[int] | None = None
    # fail-slow: the phases slowed ("forward", "backward+optimizer") and what they cost the step
    phase: str | None = None
    rank_slowdown: float | None = None
    from_start: bool = False  # slow since the job's first steps (no healthy baseline of its own)
    # the effect-size floor: the factor the alarm was raised at and the floor in force
    alarm_factor: float | None = None
    alarm_floor: float | None = None
    # links: "pipeline" or "gradient-sync"; a shared finding's links, their factors, replicas
    traffic: str | None = None
    links: list[list[int]] | None = None
    link_factors: list[float] | None = None
    replicas: list[int] | None = None
    # fail-stop: "exited", "hang", "node", "exception" or "shared"; the last step the rank
    # finished, how long it was silent, when it was seen, its node, its signal, its error
    cause: str | None = None
    step: int | None = None
    silent_s: float | None = None
    detected_s: float | None = None
    node: int | None = None
    signal: int | None = None
    message: str | None = None

    @property
    def is_device_fault(self) -> bool:
        return self.kind in DEVICE_FAULTS

    @property
    def slowdown_of_rank(self) -> float:
        """What the finding costs its rank's step.

        ``rank_slowdown`` for a fail-slow of some phases alone, otherwise the slowdown itself."""
        return float(self.slowdown if self.rank_slowdown is None else self.rank_slowdown)

    def to_dict(self) -> dict:
        out = {
            "kind": self.kind,
            "rank": _int(self.rank),
            "dp_rank": _int(self.dp_rank),
            "stage": _int(self.stage),
            "tp_rank": _int(self.tp_rank),
            "onset_step": int(self.onset_step),
            "detected_step": int(self.detected_step),
            "slowdown": round(float(self.slowdown), 4),
            "confidence": round(float(self.confidence), 4),
            "end_step": _int(self.end_step),
        }
        if self.ranks is not None:
            out["ranks"] = [int(r) for r in self.ranks]
        if self.from_start:
            out["from_start"] = True
        if self.kind == "fail-stop":
            # the supervisor's record: its step is there even when unknown (None)
            out["step"] = self.step
        for name in _EVIDENCE:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


_EVIDENCE = (
    "phase",
    "rank_slowdown",
    "alarm_factor",
    "alarm_floor",
    "traffic",
    "links",
    "link_factors",
    "replicas",
    "cause",
    "silent_s",
    "detected_s",
    "node",
    "signal",
    "message",
)


def _int(value: object) -> int | None:
    return None if value is None else int(value)


def events_json(events: list[Event], steps: int, ranks: int, **extra: object) -> dict:
    """The ``resihp detect --json`` document: events in detection order, then step and rank counts.

    Args:
        events: the events found.
        steps: the steps observed.
        ranks: the ranks observed.
        **extra: further fields of the document (noise, budget).
    """
    ordered = sorted(
        events, key=lambda e: (e.detected_step, e.kind, -1 if e.rank is None else e.rank)
    )
    return {
        "events": [e.to_dict() for e in ordered],
        "steps": int(steps),
        "ranks": int(ranks),
        **extra,
    }
