"""How a replayed job is laid out on the cluster.

A layout holds the replicas, their stages, groups, layers and micro-batches.

Replicas may differ (an Oobleck template with fewer stages, a re-planned replica with moved layers),
so a layout is a list of replicas; ``compile`` groups replicas of the same shape into padded arrays
so that the engine evaluates every replica of a shape in one vectorised call.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from resihp.parallel import apportion


@dataclass(frozen=True)
class Replica:
    """One data-parallel replica: per stage its device group, its layer count and its work factor.

    ``load`` multiplies a stage's compute: ReCycle-style rerouting gives a stage its failed peer's
    micro-batches on top of its own. ``budget`` packs this replica's micro-batches to fewer tokens
    (a planner's per-replica token share).
    """

    groups: tuple[tuple[int, ...], ...]
    layers: tuple[int, ...]
    microbatches: int
    load: tuple[float, ...] = ()
    budget: int | None = None  # micro-batch token budget; None: the model's

    def __post_init__(self) -> None:
        if not self.load:
            object.__setattr__(self, "load", (1.0,) * len(self.groups))

    @property
    def devices(self) -> list[int]:
        return [d for g in self.groups for d in g]


@dataclass(frozen=True)
class ReplicaLayout:
    replicas: tuple[Replica, ...]
    note: str = ""

    @cached_property  # a layout is frozen; policies ask for its devices at every window
    def devices(self) -> np.ndarray:
        """The devices the layout uses, sorted (read-only)."""
        out = np.array(sorted(d for r in self.replicas for d in r.devices), dtype=np.int64)
        out.setflags(write=False)
        return out

    @property
    def microbatches(self) -> int:
        return sum(r.microbatches for r in self.replicas)

    def with_note(self, note: str) -> ReplicaLayout:
        return replace(self, note=note)


@dataclass
class ShapeGroup:
    """Replicas with the same (stages, micro-batches, max group width), as padded arrays."""

    replica_ids: np.ndarray  # [R]
    devices: np.ndarray  # [R, pp, tp_max], -1 pads
    layers: np.ndarray  # [R, pp]
    load: np.ndarray  # [R, pp]
    width: np.ndarray  # [R, pp] devices per group
    microbatches: int
    budget: int | None = None

    @property
    def stages(self) -> int:
        return self.devices.shape[1]


@dataclass
class CompiledLayout:
    layout: ReplicaLayout
    groups: list[ShapeGroup] = field(default_factory=list)
    derived: dict = field(default_factory=dict)  # what the simulator derives once per layout

    def stage_speeds(self, group: ShapeGroup, speeds: np.ndarray) -> np.ndarray:
        """[R, pp] speed of each stage: the slowest device of its tensor-parallel group."""
        padded = np.concatenate([speeds, [np.inf]])
        return padded[group.devices].min(axis=-1)


def compile_layout(layout: ReplicaLayout) -> CompiledLayout:
    by_shape: dict[tuple[int, int, int, int], list[int]] = {}
    for i, r in enumerate(layout.replicas):
        if r.microbatches <= 0:
            continue
        key = (len(r.groups), r.microbatches, max(len(g) for g in r.groups), r.budget or 0)
        by_shape.setdefault(key, []).append(i)
    out = CompiledLayout(layout)
    for (pp, m, tp_max, budget), ids in sorted(by_shape.items()):
        devices = np.full((len(ids), pp, tp_max), -1, dtype=np.int64)
        for k, i in enumerate(ids):
            for s, g in enumerate(layout.replicas[i].groups):
                devices[k, s, : len(g)] = g
        reps = [layout.replicas[i] for i in ids]
        out.groups.append(
            ShapeGroup(
                replica_ids=np.array(ids),
                devices=devices,
                layers=np.array([r.layers for r in reps], dtype=np.float64),
                load=np.array([r.load for r in reps], dtype=np.float64),
                width=(devices >= 0).sum(axis=-1).astype(np.float64),
                microbatches=m,
                budget=budget or None,
            )
        )
    return out


def uniform_layout(
    devices: np.ndarray,
    gpus_per_node: int,
    dp: int,
    pp: int,
    tp: int,
    layers: int,
    microbatches: int,
) -> ReplicaLayout:
    """Megatron's default placement: tp inside a node, then pp, then dp, over ``devices`` in order.

    Replicas beyond what ``devices`` hold are dropped, and the global batch is spread over the
    replicas that remain.

    Args:
        devices: usable device ids, whole nodes' worth, in placement order.
        gpus_per_node: devices per node (not read: ``devices`` come in node order).
        dp: data-parallel replicas.
        pp: pipeline stages per replica.
        tp: tensor-parallel group size.
        layers: the model's layers, split as evenly as whole layers allow over the stages.
        microbatches: the global batch's micro-batches a step.
    """
    devices = np.asarray(devices, dtype=np.int64)
    per_replica = pp * tp
    n_rep = min(dp, len(devices) // per_replica)
    per_stage = tuple(apportion(layers, np.ones(pp), minimum=1))
    mbs = apportion(microbatches, np.ones(n_rep)) if n_rep else []
    replicas = []
    for r in range(n_rep):
        block = devices[r * per_replica : (r + 1) * per_replica].reshape(pp, tp)
        replicas.append(Replica(tuple(tuple(int(d) for d in g) for g in block), per_stage, mbs[r]))
    return ReplicaLayout(tuple(replicas), note=f"uniform dp={n_rep} pp={pp} tp={tp}")
