"""Link alarms that began together, judged as one cause (the detector's ``shared-link-slow``).

Several links whose transfers rose from the same step (within ``ONSET_TOLERANCE`` steps) are not
several independent link faults: a fault of one cable or NIC slows the links through it, and links
of different replicas share no cable. What they share is a switch on their paths, or the workload
(every replica's upstream stage sending longer sequences at once). Such a group is reported as one
finding of kind ``shared-link-slow`` naming every link, and never as ``link-slow`` device faults: no
replica is benched for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from resihp.detect.events import Event

ONSET_TOLERANCE = 1  # links whose onsets differ by at most this many steps began together
SHARED_KIND = "shared-link-slow"


@dataclass
class LinkAlarm:
    """One link in alarm, with what its finding needs.

    The key its finding is held under, its ends, traffic, onset, measured factor against its own
    healthy transfers, confidence, and whether it clears the floor."""

    key: tuple[str, int]
    ranks: list[int]
    traffic: str
    onset: int
    factor: float
    confidence: float
    ready: bool


def onset_groups(
    alarms: list[LinkAlarm], tolerance: int = ONSET_TOLERANCE
) -> list[list[LinkAlarm]]:
    """``alarms`` of one traffic cut into groups of onsets chained within ``tolerance`` steps."""
    out: list[list[LinkAlarm]] = []
    for a in sorted(alarms, key=lambda x: (x.onset, x.key)):
        if out and a.onset - out[-1][-1].onset <= tolerance:
            out[-1].append(a)
        else:
            out.append([a])
    return out


def shared_event(
    group: list[LinkAlarm], step: int, floor: float, stage_of: np.ndarray, dp_of: np.ndarray
) -> Event:
    """The one finding of a group of links that began together (module doc).

    Every link's ends in ``ranks``, the links and their factors in ``links`` and ``link_factors``,
    the median factor as its ``slowdown``; ``stage`` where every link crosses the same stage
    boundary.

    Args:
        group: the links in alarm that began together.
        step: the step the finding is made at.
        floor: the alarm floor (the least slowdown reported).
        stage_of: each rank's pipeline stage.
        dp_of: each rank's data-parallel replica (below 0: none).
    """
    ranks = sorted({r for a in group for r in a.ranks})
    stages = {int(stage_of[a.ranks[0]]) for a in group}
    replicas = sorted({int(dp_of[r]) for r in ranks if dp_of[r] >= 0})
    factor = float(np.median([a.factor for a in group]))
    ev = Event(
        SHARED_KIND,
        None,
        None,
        stages.pop() if len(stages) == 1 else None,
        None,
        min(a.onset for a in group),
        step,
        factor,
        float(max(a.confidence for a in group)),
    )
    ev.ranks = ranks
    ev.traffic = group[0].traffic
    ev.cause = "shared"
    ev.links = [list(a.ranks) for a in group]
    ev.link_factors = [round(a.factor, 4) for a in group]
    ev.replicas = replicas
    ev.alarm_factor = round(factor, 4)
    ev.alarm_floor = floor
    return ev


def join(ev: Event, alarm: LinkAlarm) -> None:
    """Add a link that began with an open shared finding's links to it."""
    links, factors = ev.links or [], ev.link_factors or []
    if list(alarm.ranks) in links:
        return
    ev.links, ev.link_factors = [*links, list(alarm.ranks)], [*factors, round(alarm.factor, 4)]
    ev.ranks = sorted(set(ev.ranks or []) | set(alarm.ranks))
