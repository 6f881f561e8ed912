"""Planning helpers of a run: the plan at start, the planner specs, step estimates and pacing."""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from resihp.ckpt.integrity import step_of
from resihp.opstrace import JobMeta
from resihp.parallel import apportion
from resihp.perf.device import available_memory_gb, measured_tflops
from resihp.plan.plan import Pipeline, Plan, Stage
from resihp.plan.planner import Planner
from resihp.plan.specs import ClusterSpec, ModelSpec
from resihp.plan.timing import StageCoster, expected_step
from resihp.train.config import RunConfig
from resihp.train.planchange import PlanChange


def job_meta(cfg: RunConfig) -> tuple[JobMeta, dict]:
    dims = cfg.dims()
    meta = JobMeta(dims.dp, dims.pp, dims.tp, dims.world_size)
    model = cfg.model
    return meta, {
        **meta.to_dict(),
        "layers": model.layers,
        "hidden": model.hidden,
        "heads": model.heads,
        "ffn_hidden": model.ffn_hidden,
        "vocab": model.vocab,
        "max_seq_len": model.max_seq_len,
    }


# one measurement per launcher process: its relaunches run on the same devices, and each
# measurement (0.2 s) fell inside a relaunch's stall, three times
_device_tflops = functools.cache(measured_tflops)


def planner_specs(cfg: RunConfig):
    """The cluster the job runs on, measured here, and the model it trains.

    The measures are the memory free now, shared by the ranks of this node, and one device's matmul
    rate."""
    world = cfg.dims().world_size
    kind = (
        "cuda"
        if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )
    memory = available_memory_gb(kind) / (world if kind == "cpu" else 1)
    cluster = ClusterSpec.from_dict(
        {
            "name": "local",
            "nodes": [{"name": "local", "devices": world}],
            "device": {"memory_gb": round(memory, 3), "tflops": _device_tflops(kind, cfg.threads)},
            "memory_reserve_gb": 0.0,
        }
    )
    budget = cfg.data.budget
    model = ModelSpec(
        layers=cfg.model.layers,
        hidden=cfg.model.hidden,
        heads=cfg.model.heads,
        ffn_hidden=cfg.model.ffn_hidden,
        vocab=cfg.model.vocab,
        max_seq_len=cfg.model.max_seq_len,
        global_batch_tokens=max(1, cfg.data.global_tokens // budget) * budget,
        microbatch_tokens=budget,
        schedule=cfg.parallel.schedule,
        name="resihp-run",
        workload=cfg.data.source,
        tp=cfg.parallel.tp,
        pp=cfg.parallel.pp,
    )
    return cluster, model


def current_plan(
    cfg: RunConfig,
    cluster,
    model,
    weights: list[float],
    replica_ranges: list[list[tuple[int, int]]],
    groups: list[list[tuple[int, ...]]] | None = None,
):
    """The plan in force, as a planner's ``Plan``.

    Args:
        cfg: the run's configuration (its dimensions).
        cluster: the planner's cluster (``planner_specs``).
        model: the planner's model (``planner_specs``).
        weights: each replica's share of the micro-batches.
        replica_ranges: per replica, each stage's layer range.
        groups: per replica, per stage, its ranks (None: the launch layout)."""
    dims = cfg.dims()
    groups = groups or [
        [tuple(dims.tp_group_ranks(d, s)) for s in range(dims.pp)] for d in range(dims.dp)
    ]
    counts = apportion(model.microbatches, weights, what="micro-batch weights")
    pipelines = [
        Pipeline(
            d,
            tuple(Stage(tuple(groups[d][s]), replica_ranges[d][s]) for s in range(len(groups[d]))),
            counts[d],
            home=d,
        )
        for d in range(len(groups))
    ]
    placed = {r for p in groups for s in p for r in s}
    return Plan(
        dims.world_size,
        dims,
        pipelines,
        [r for r in range(dims.world_size) if r not in placed],
        policy="current",
    )


def plan_at_start(cfg: RunConfig, cluster, model) -> Plan:
    """The plan a run trains its first step under: its launch layout, or the change due then.

    The change is the one scheduled for that step (``live.replan``; a relaunch re-formed by
    ``elastic.reform_around`` applies its planner's layout before its first step, from the
    checkpoint ``--resume`` names).

    Args:
        cfg: the run's configuration.
        cluster: the planner's cluster (``planner_specs``).
        model: the planner's model (``planner_specs``)."""
    dims = cfg.dims()
    first = (
        step_of(Path(cfg.checkpoint.resume)) + 1 if cfg.checkpoint.resume else 0
    )  # -1 + 1: not a stepN
    groups = [[tuple(dims.tp_group_ranks(d, s)) for s in range(dims.pp)] for d in range(dims.dp)]
    weights, ranges = cfg.weights(), [cfg.stage_ranges()] * dims.dp
    for change in cfg.live.replan:
        if int(change["step"]) == first:
            groups, weights, ranges, _, _ = with_change(
                change, cfg, groups, weights, ranges, dims.world_size
            )
    return current_plan(cfg, cluster, model, weights, ranges, groups)


def with_change(
    change: dict,
    cfg: RunConfig,
    groups: list[list[tuple[int, ...]]],
    weights: list[float],
    ranges: list[list[tuple[int, int]]],
    world: int,
) -> tuple[list, list[float], list, bool, bool]:
    """The plan state after a scheduled change (``live.replan``), and what it moved.

    Returns each replica's stage groups, the micro-batch weights, the layer ranges, whether it
    moved ranks and whether it moved layers.

    Args:
        change: the change's JSON form.
        cfg: the run's configuration.
        groups: per replica, per stage, its ranks before the change.
        weights: each replica's share of the micro-batches before it.
        ranges: per replica, each stage's layer range before it.
        world: the job's processes."""
    planned = PlanChange.parse(
        change,
        cfg.dims(),
        cfg.model.layers,
        "live.replan",
        world=world,
        depths=[len(p) for p in groups],
    )
    if planned.layout is not None:
        groups = [[tuple(s) for s in p] for p in planned.layout.pipelines]
    if planned.dp_weights is not None:
        weights = list(planned.dp_weights)
    new_ranges = planned.replica_ranges(cfg.model.layers)
    return groups, weights, new_ranges or ranges, planned.layout is not None, new_ranges is not None


MIN_MEASURED_STEPS = 3  # the fewest steps under one plan that give its measured step time


def trace_step_seconds(trace: pd.DataFrame) -> dict[int, float]:
    """Every step's wall time in an ops trace: the longest ``step`` record among its ranks."""
    steps = trace[trace.optype == "step"]
    return {int(k): float(v) for k, v in steps.groupby("step")["duration"].max().items()}


def step_check(predicted: float | None, seconds: list[float]) -> dict:
    """The median of ``seconds`` (the steps measured under one plan) and ``predicted``'s error.

    The error is ``predicted / measured - 1``; nothing from fewer than ``MIN_MEASURED_STEPS``."""
    if len(seconds) < MIN_MEASURED_STEPS:
        return {}
    measured = statistics.median(seconds)
    return {
        "measured_step_s": round(measured, 6),
        "measured_steps": len(seconds),
        "step_error": round(predicted / measured - 1, 4) if predicted else None,
    }


def trace_compute_seconds(trace: pd.DataFrame) -> dict[int, float]:
    """Every step's compute in an ops trace: its ranks' seconds in forward and backward, summed.

    Time waiting inside tensor-parallel collectives is taken out."""
    comp = trace[trace.optype.isin(("forward-compute", "backward-compute"))]
    if comp.empty:
        return {}
    own = comp["duration"] - (comp["wait_s"].fillna(0.0) if "wait_s" in comp else 0.0)
    return {int(k): float(v) for k, v in own.groupby(comp["step"]).sum().items()}


def plan_compute_s(plan: Plan, coster: StageCoster) -> float:
    """The analytic counterpart of ``trace_compute_seconds``: a step's compute on all the devices.

    That is each stage's micro-batches' forward and backward, on each of its devices. A total, not
    the busiest stage's: the analytic model misprices stages against each other (the head's share of
    a small model), and a plan that merges stages keeps the total."""
    return sum(
        sum(coster.stage_fb(s, i == len(p.stages) - 1)) * p.microbatches * s.tp
        for p in plan.pipelines
        if p.microbatches > 0
        for i, s in enumerate(p.stages)
    )


def predicted_step_s(plan: Plan) -> float:
    """The step a live job should measure under ``plan``.

    That is its expected step with variable micro-batch costs on the critical path
    (``Plan.expected_step_time_s``), else the mean-priced one. The mean misprices a change of
    shares: two replicas of equal shares step at the slower of two variable sums (about 10% above
    the mean on this project's text workload), one replica holding most micro-batches at its own
    sum."""
    expected = plan.expected_step_time_s
    return expected if math.isfinite(expected) else plan.step_time_s


def paced_to(
    cluster: ClusterSpec,
    model: ModelSpec,
    plan: Plan,
    measured: list[float],
    planner: Planner,
    compute: list[float] | None = None,
) -> tuple[ClusterSpec, dict | None]:
    """``cluster`` paced (``ClusterSpec.paced``) so that ``plan`` predicts the measured median.

    Returns it and what was measured; the cluster as it is (and None) from fewer than
    ``MIN_MEASURED_STEPS`` steps. The planner's analytic costs (a matmul benchmark's FLOP rate,
    nominal bandwidths) miss a training loop's own overheads (Python, gloo, several ranks per core)
    by a factor that stays roughly constant across the plans of one job.

    With ``compute`` (each measured step's ``trace_compute_seconds``) and a plan with pipeline
    stages: the devices are paced on the compute alone, and what the step takes beyond it is an
    overhead per stage-boundary transfer (``ClusterSpec.p2p_overhead_s``; gloo's send/recv cost
    milliseconds whatever their bytes), so a plan with fewer stages is not priced with the
    transfers of the launch's. Else one factor for everything.

    Args:
        cluster: the planner's cluster.
        model: the planner's model.
        plan: the plan the steps ``measured`` ran under.
        measured: the steps' times, in seconds.
        planner: the planner (its cost model).
        compute: each measured step's ``trace_compute_seconds`` (None: one factor)."""
    if len(measured) < MIN_MEASURED_STEPS:
        return cluster, None
    median = statistics.median(measured)
    coster = StageCoster(cluster, model, planner.cost)
    # the expected step (variable micro-batches on the critical path), as ``predicted_step_s``
    # prices the plans the pace is then applied to: a mean-priced pace takes the launch's
    # slowest-of-replicas excess for device speed
    analytic = expected_step(plan, coster)
    if not (0 < analytic < float("inf") and median > 0):
        return cluster, None
    record = {
        "steps": len(measured),
        "measured_step_s": round(median, 6),
        "analytic_step_s": analytic,
    }
    deep = any(len(p.stages) > 1 for p in plan.pipelines if p.microbatches > 0)
    own = plan_compute_s(plan, coster)
    if deep and compute and len(compute) >= MIN_MEASURED_STEPS and own > 0:
        factor = statistics.median(compute) / own
        paced = cluster.paced(factor, links=1.0)

        def step_at(overhead: float) -> float:
            return expected_step(
                plan, StageCoster(replace(paced, p2p_overhead_s=overhead), model, planner.cost)
            )

        if step_at(0.0) < median:
            lo, hi = 0.0, median
            for _ in range(40):  # the step grows with the overhead: bisection to the median
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if step_at(mid) < median else (lo, mid)
            overhead = 0.5 * (lo + hi)
            return replace(paced, p2p_overhead_s=overhead), {
                **record,
                "factor": round(factor, 4),
                "compute_s": round(statistics.median(compute), 6),
                "p2p_overhead_s": round(overhead, 6),
            }
    factor = median / analytic
    return cluster.paced(factor), {**record, "factor": round(factor, 4)}
