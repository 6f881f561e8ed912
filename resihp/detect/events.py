"""Detector events and the event JSON of docs/DESIGN.md."""

from __future__ import annotations

from dataclasses import dataclass, field

DEVICE_FAULTS = ("fail-slow", "fail-stop", "link-slow")
NOT_DEVICE_FAULTS = ("workload-imbalance", "stage-imbalance", "shared-link-slow")


@dataclass
class Event:
    """One finding of the detector.

    ``rank`` is None for findings about a whole stage or replica. A ``link-slow``
    names both ends of its link in ``ranks`` (``rank`` is one of them) and its traffic
    (``extra["traffic"]``: ``pipeline`` or ``gradient-sync``)."""

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
    extra: dict = field(default_factory=dict)
    ranks: list[int] | None = None

    @property
    def is_device_fault(self) -> bool:
        return self.kind in DEVICE_FAULTS

    @property
    def rank_slowdown(self) -> float:
        """What the finding costs its rank's step (x).

        For a fail-slow of one phase alone (``extra["phase"]``), ``extra["rank_slowdown"]``;
        otherwise the slowdown itself."""
        return float(self.extra.get("rank_slowdown", self.slowdown))

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
        out.update(self.extra)
        return out


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
