"""Pieces several policies share: per-replica time estimates and micro-batch balancing."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from resihp.parallel import apportion
from resihp.replay.interface import Context
from resihp.replay.layout import Replica, ReplicaLayout


def stage_times(ctx: Context, replica: Replica, speeds: np.ndarray) -> np.ndarray:
    """Expected seconds of one mean micro-batch (forward + backward) on each stage of a replica.

    Args:
        ctx: the policy's context (its cost model).
        replica: the replica whose stages are timed (each stage's load multiplies its time).
        speeds: each device's believed speed as a fraction of a healthy one (a stage runs at its
            slowest device's).
    """
    padded = np.concatenate([speeds, [np.inf]])
    sp = np.array([padded[list(g)].min() for g in replica.groups])
    last = np.arange(len(replica.groups)) == len(replica.groups) - 1
    with np.errstate(divide="ignore"):
        return ctx.stage_seconds(
            np.array(replica.layers), np.array([len(g) for g in replica.groups]), sp, last
        ) * np.array(replica.load)


def balance_microbatches(ctx: Context, layout: ReplicaLayout, speeds: np.ndarray) -> ReplicaLayout:
    """Give each replica micro-batches so that all finish together (1F1B: sum + (m-1) x max).

    Starts from counts proportional to each replica's pace, then moves single micro-batches from the
    replica predicted to finish last to the one predicted to finish first while that helps.

    Args:
        ctx: the policy's context (its cost model and the step's micro-batches).
        layout: the layout whose replicas get new micro-batch counts.
        speeds: each device's believed speed as a fraction of a healthy one.
    """
    per = [stage_times(ctx, r, speeds) for r in layout.replicas]
    first = np.array([p.sum() - p.max() for p in per])
    each = np.array([p.max() for p in per])
    pace = 1.0 / each  # 0 where a replica cannot run (a dead stage)
    counts = np.array(
        apportion(ctx.total_microbatches, pace)
        if pace.sum() > 0
        else np.zeros(len(pace), dtype=int)
    )
    for _ in range(4 * len(counts) + ctx.total_microbatches):
        finish = np.where(counts > 0, first + counts * each, 0.0)
        slow = int(np.argmax(finish))
        after = first + (counts + 1) * each
        fast = int(np.argmin(after))
        if slow == fast or after[fast] >= finish[slow] or counts[slow] == 0:
            break
        counts[slow] -= 1
        counts[fast] += 1
    reps = tuple(replace(r, microbatches=int(c)) for r, c in zip(layout.replicas, counts))
    return replace(layout, replicas=reps)


def believed_speeds(ctx: Context, slow: dict[int, float] | None = None) -> np.ndarray:
    """Device speeds as a policy believes them: known-dead at 0, detected slowdowns applied."""
    speeds = np.ones(len(ctx.scenario.cluster))
    for d, factor in (slow or {}).items():
        speeds[d] = 1.0 / factor
    speeds[list(ctx.known_dead)] = 0.0
    return speeds
