"""Heuristic plans, one rule per dimension: the ResiHP heuristic and drop-replica.

The ResiHP heuristic takes power-of-two TP subsets, layers in proportion to stage speed and
micro-batches in proportion to replica throughput. The planner seeds its search with them;
``baselines`` wraps them as policies."""

from __future__ import annotations

import numpy as np

from resihp.parallel import ParallelDims, apportion
from resihp.plan.layout import home_pipelines, layer_ranges, powers_of_two_upto, touched_replicas
from resihp.plan.plan import Pipeline, Plan, Stage, Stages, unplaced
from resihp.plan.specs import ClusterSpec, ModelSpec, in_flight_microbatches, stage_memory_gb
from resihp.plan.timing import StageCoster


def replica_caps(coster: StageCoster, pipelines: list, total: int) -> np.ndarray:
    """The most micro-batches each replica holds in memory (GPipe keeps all of them in flight).

    Args:
        coster: the stage coster (its memory model).
        pipelines: each replica's stages.
        total: the global batch's micro-batches (no cap is above it).
    """
    return np.array(
        [
            min(total, c) if (c := coster.max_microbatches(st)) is not None else total
            for st in pipelines
        ],
        dtype=int,
    )


def drop_replica_plan(
    cluster: ClusterSpec, model: ModelSpec, coster: StageCoster, base: Plan, layout: ParallelDims
) -> Plan:
    """Every replica of ``base`` holding a dead device dropped, its micro-batches spread evenly.

    Args:
        cluster: the cluster at its current speeds.
        model: the model.
        coster: the stage coster at those speeds.
        base: the healthy plan.
        layout: its layout.
    """
    alive = (
        [p for p in base.pipelines if coster.alive(p.stages)]
        if coster.cluster.dead
        else base.pipelines
    )
    caps = replica_caps(coster, [p.stages for p in alive], model.microbatches)
    shares = apportion(model.microbatches, np.ones(len(alive)), caps=caps) if alive else []
    pipelines = [
        Pipeline(i, p.stages, m, home=p.home)
        for i, (p, m) in enumerate(zip(alive, shares))
        if m > 0
    ]
    return Plan(len(cluster), layout, pipelines, unplaced(len(cluster), pipelines))


def heuristic_plan(
    cluster: ClusterSpec, model: ModelSpec, coster: StageCoster, base: Plan, layout: ParallelDims
) -> Plan:
    """The published ResiHP adaptation, one heuristic per dimension (see ``baselines``).

    Args:
        cluster: the cluster at its current speeds.
        model: the model.
        coster: the stage coster at those speeds.
        base: the healthy plan (replicas no fault touches keep its stages).
        layout: its layout.
    """
    pipes = home_pipelines(cluster, layout)
    shares0 = apportion(model.microbatches, np.ones(layout.dp))
    built: list[tuple[int, tuple[Stage, ...]]] = []
    touched = touched_replicas(cluster, layout)
    for r, groups in enumerate(pipes):
        if r not in touched:
            built.append((r, base.pipelines[r].stages))
            continue
        new_groups = [g for g in (exclude_slow(g, cluster, model) for g in groups) if g]
        stages = split_layers_by_speed(new_groups, coster, model, shares0[r])
        if stages is not None:
            built.append((r, stages))
    rates = np.array([1.0 / max(map(sum, coster.pipeline_fb(st))) for _, st in built])
    caps = replica_caps(coster, [st for _, st in built], model.microbatches)
    shares = apportion(model.microbatches, rates, caps=caps) if built else []
    pipelines, dp = [], 0
    for (r, stages), m in zip(built, shares):
        if m > 0:
            pipelines.append(Pipeline(dp, stages, m, home=r))
            dp += 1
    return Plan(len(cluster), layout, pipelines, unplaced(len(cluster), pipelines))


def exclude_slow(group: tuple[int, ...], cluster: ClusterSpec, model: ModelSpec) -> tuple[int, ...]:
    """The fastest power-of-two subset maximising k x (its slowest member's speed).

    Args:
        group: the TP group's ranks.
        cluster: the cluster (its devices' speeds and liveness).
        model: the model (a subset's size must divide its heads).
    """
    alive = sorted(
        (r for r in group if cluster.devices[r].alive), key=lambda r: (-cluster.devices[r].speed, r)
    )
    best, best_value = (), 0.0
    for k in powers_of_two_upto(len(alive)):
        if model.heads % k:
            continue
        value = k * cluster.devices[alive[k - 1]].speed
        if value > best_value + 1e-12:
            best, best_value = tuple(sorted(alive[:k])), value
    return best


def split_layers_by_speed(
    groups: list[tuple[int, ...]], coster: StageCoster, model: ModelSpec, m: int
) -> tuple[Stage, ...] | None:
    """Layers in proportion to each stage's speed (1 / per-layer time), capped by memory.

    Args:
        groups: the stages' TP groups, in pipeline order.
        coster: the stage coster.
        model: the model (its layers).
        m: the replica's micro-batches (what memory must hold in flight).
    """
    if not groups or len(groups) > model.layers:
        return None
    p = len(groups)
    rates = np.array([1.0 / sum(coster.per_layer_s(g)) for g in groups])
    caps = []
    for s, g in enumerate(groups):
        in_flight = in_flight_microbatches(model.schedule, p, s, m)
        free = coster.cluster.free_memory_gb(g)
        cap = 0
        while (
            cap < model.layers
            and stage_memory_gb(model, cap + 1, len(g), in_flight, s == 0, s == p - 1) <= free
        ):
            cap += 1
        caps.append(cap)
    if min(caps) < 1 or sum(caps) < model.layers:
        return None
    counts = apportion(model.layers, rates, minimum=1, caps=caps)
    if sum(counts) != model.layers:
        return None
    return Stages(Stage(g, rng) for g, rng in zip(groups, layer_ranges(counts)))
