"""CP-SAT model of one pipeline: its degraded TP groups re-formed and its layers split.

How each of its degraded TP groups is re-formed, and the contiguous layer range of every resulting
stage.

Decisions: one option per home group (keep, exclude, split, drop; see ``group_options``), layers
per candidate stage, which active stage is first (embedding) and last (LM head).
Objective, in integer ticks: ``horizon * ((m - 1) * max_s t_s + sum_s t_s + 2 * p2p * (stages-1)
+ R * all-reduce growth) + R * migration``, i.e. the 1F1B step time with its bubble, plus the
job-wide costs (a larger gradient shard slows every step's all-reduce; moving state pauses the job),
weighted by the R replicas over which the allocation spreads this replica's own gain, the migration
amortised over ``horizon`` steps, so that a small gain never pays for a large move.
Memory: each stage's model state and in-flight activations fit its smallest device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ortools.sat.python import cp_model

from resihp.plan.layout import group_options
from resihp.plan.plan import Stage, Stages
from resihp.plan.sat import deterministic_solver
from resihp.plan.specs import stage_memory_gb
from resihp.plan.timing import StageCoster

TICKS_PER_S = 1e7  # 0.1 microsecond resolution
MB = 1e3  # memory in MB


@dataclass(frozen=True)
class PipelineSolution:
    stages: tuple[Stage, ...]
    migration_s: float  # the solver's estimate for this pipeline; plans report their own
    status: str
    gap: float


@dataclass(frozen=True)
class _Candidate:
    group: int
    option: int
    ranks: tuple[int, ...]


def solve_key(
    coster: StageCoster,
    groups: list[tuple[int, ...]],
    m: int,
    current: dict[tuple[int, ...], tuple[int, int]] | None = None,
    horizon_steps: float = 100.0,
    sync: tuple[float, float] | None = None,
    replicas: int = 1,
    regroup: bool = True,
) -> tuple:
    """What ``solve_pipeline`` with these arguments answers, as a cache key.

    Beyond the hardware, the model and the cost model behind ``coster``: the groups, their devices'
    speeds, the layer ranges that the plan in force gives to the candidate stages, and the other
    arguments. Not the time limit: the search of one CP-SAT worker is deterministic and the limit
    only cuts it short, so an answer proven optimal within some time is the answer to any limit at
    least that long.

    Args:
        coster: the stage coster at the cluster's speeds.
        groups: the pipeline's home TP groups, in order.
        m: the replica's micro-batches.
        current: per TP group of the plan in force its layer range (seeds the hint and prices
            migration; None: a new job).
        horizon_steps: steps over which a migration is amortised.
        sync: ``(floor, seconds)`` of the gradient all-reduce's largest shard (None: not priced).
        replicas: how many replicas share the work.
        regroup: False keeps every group whole.
    """
    cluster = coster.cluster
    speeds = tuple(cluster.devices[r].speed for g in groups for r in g)
    held: tuple = ()
    if current:
        subs = {
            sub
            for g in groups
            for opt in group_options(g, cluster, coster.model.heads)
            for sub in opt
        }
        held = tuple(sorted((sub, current[sub]) for sub in subs if sub in current))
    return (
        tuple(groups),
        speeds,
        max(1, m),
        held,
        bool(current),
        horizon_steps,
        sync,
        replicas,
        regroup,
    )


def solve_pipeline(
    coster: StageCoster,
    groups: list[tuple[int, ...]],
    m: int,
    current: dict[tuple[int, ...], tuple[int, int]] | None = None,
    horizon_steps: float = 100.0,
    time_limit_s: float = 1.0,
    sync: tuple[float, float] | None = None,
    replicas: int = 1,
    regroup: bool = True,
) -> PipelineSolution | None:
    """Best re-formation and layer split of the pipeline over home ``groups``, for ``m``.

    ``current`` maps a TP group (ranks tuple) of the plan in force to its layer range; it seeds the
    solver's hint and prices migration. ``sync = (floor, seconds)``: the gradient all-reduce waits
    for the largest per-device shard of any replica, in layers / TP size; ``floor`` is the largest
    elsewhere and each unit above it costs ``seconds`` of every step. ``replicas``: how many
    replicas share the work, i.e. how much more a job-wide second weighs than one of this replica's
    own (which the micro-batch allocation spreads over the others). ``regroup``: False keeps
    every group whole (only the layer split is decided). Returns None if no option fits in memory
    (or, kept whole, a group holds a dead device).

    Args:
        coster: the stage coster at the cluster's speeds.
        groups: the pipeline's home TP groups, in order.
        m: the replica's micro-batches.
        current: per TP group of the plan in force its layer range (seeds the hint and prices
            migration; None: a new job).
        horizon_steps: steps over which a migration is amortised.
        time_limit_s: the CP-SAT time limit.
        sync: ``(floor, seconds)`` of the gradient all-reduce's largest shard (None: not priced).
        replicas: how many replicas share the work.
        regroup: False keeps every group whole.
    """
    model, cluster = coster.model, coster.cluster
    m = max(1, m)
    if not regroup and not cluster.dead.isdisjoint(r for g in groups for r in g):
        return None  # a group kept whole with a dead device in it cannot run
    options = [group_options(g, cluster, model.heads) if regroup else [[g]] for g in groups]
    cands: list[_Candidate] = [
        _Candidate(gi, oi, sub)
        for gi, opts in enumerate(options)
        for oi, opt in enumerate(opts)
        for sub in opt
    ]
    # Upper bound on the number of active stages at or after each candidate (for in-flight memory).
    max_after_group = [0] * (len(groups) + 1)
    for gi in range(len(groups) - 1, -1, -1):
        max_after_group[gi] = max_after_group[gi + 1] + max(len(o) for o in options[gi])

    mdl = cp_model.CpModel()
    choose = [
        [mdl.new_bool_var(f"g{gi}o{oi}") for oi in range(len(opts))]
        for gi, opts in enumerate(options)
    ]
    for row in choose:
        mdl.add_exactly_one(row)
    L = model.layers
    n, first, last, t, active, t_max = [], [], [], [], [], []
    tick = lambda s: int(round(s * TICKS_PER_S))  # noqa: E731
    for j, c in enumerate(cands):
        x = choose[c.group][c.option]
        active.append(x)
        within = options[c.group][c.option].index(c.ranks)
        # 1F1B: the most stages that can follow, whatever ``m`` (so any later allocation fits);
        # GPipe: all ``m`` micro-batches (the allocation then caps ``m`` per replica)
        in_flight = max_after_group[c.group + 1] + len(options[c.group][c.option]) - within
        in_flight = in_flight if model.schedule == "1f1b" else m
        free = coster.cluster.free_memory_gb(c.ranks)
        per_layer = stage_memory_gb(model, 1, len(c.ranks), in_flight, False, False)
        emb = stage_memory_gb(model, 0, len(c.ranks), 0, True, False)  # the embedding (or head)
        cap = max(0, min(L, int(free // per_layer)))
        nj = mdl.new_int_var(0, cap, f"n{j}")
        mdl.add(nj <= cap * x)
        mdl.add(nj >= x)
        fj, lj = mdl.new_bool_var(f"first{j}"), mdl.new_bool_var(f"last{j}")
        mdl.add_implication(fj, x)
        mdl.add_implication(lj, x)
        # whole MB, the stage's memory rounded up and the free memory down: truncating both let
        # a split 2.5 MB over a device's memory through (16 layers of 1.3424 GB and the embedding
        # on 22 GB), which StageCoster.stages_fit then refused, and the re-plan found no plan
        mdl.add(
            math.ceil(per_layer * MB) * nj + math.ceil(emb * MB) * (fj + lj)
            <= math.floor(free * MB)
        )
        f, b = coster.per_layer_s(c.ranks)
        hf, hb = coster.head_s(c.ranks)
        # the bound of the very expression below: ticks rounded per term can sum past the rounded
        # total, which made a feasible stage infeasible (and a re-plan fail) by a tick or two
        t_max.append(tick(f + b) * cap + tick(hf + hb))
        tj = mdl.new_int_var(0, t_max[-1], f"t{j}")
        mdl.add(tj == tick(f + b) * nj + tick(hf + hb) * lj)
        n.append(nj)
        first.append(fj)
        last.append(lj)
        t.append(tj)
    if not cands:
        return None
    mdl.add_exactly_one(first)
    mdl.add_exactly_one(last)
    for j in range(len(cands)):
        for k in range(j + 1, len(cands)):
            if cands[j].group == cands[k].group and cands[j].option != cands[k].option:
                continue  # never active together
            mdl.add(last[j] + active[k] <= 1)
            mdl.add(first[k] + active[j] <= 1)
    mdl.add(sum(n) == L)
    z = mdl.new_int_var(0, max(t_max), "max_t")
    mdl.add_max_equality(z, t)
    stages_active = sum(active)
    comm = tick(2.0 * coster.p2p_s)

    # Migration: a stage formed by a group of the plan in force keeps the overlap of its old and
    # new ranges; everything else it holds arrives over the network.
    current = current or {}
    rates = [tick(coster.layer_state_gb(len(c.ranks)) / cluster.inter_node_gbs) for c in cands]
    worst = mdl.new_int_var(0, L * max(rates), "w")  # the bound of the ticks below, as they round
    prefix = 0
    hints: dict[cp_model.IntVar, int] = {}
    for j, c in enumerate(cands):
        start = prefix
        prefix = prefix + n[j]
        rate = rates[j]
        if c.ranks in current:
            cb, ce = current[c.ranks]
            ov = mdl.new_int_var(0, max(0, ce - cb), f"ov{j}")
            # the overlap max(0, min(n, end - cb, ce - start, ce - cb)): a range wholly before or
            # after the old one (an inactive option's candidate, n = 0, sits anywhere) overlaps
            # nothing
            meets = mdl.new_bool_var(f"meets{j}")  # the bounds hold, or the overlap is 0
            mdl.add(ov <= start + n[j] - cb).only_enforce_if(meets)
            mdl.add(ov <= ce - start).only_enforce_if(meets)
            mdl.add(ov == 0).only_enforce_if(meets.Not())
            mdl.add(ov <= n[j])
            mdl.add(worst >= rate * (n[j] - ov))
            hints[choose[c.group][c.option]] = 1  # once per option (CP-SAT refuses a repeat)
            hints[n[j]] = ce - cb
        elif current:
            mdl.add(worst >= rate * n[j])
    for var, value in hints.items():
        mdl.add_hint(var, value)
    horizon = max(1, int(round(horizon_steps)))
    step_ticks = (m - 1) * z + sum(t) + comm * stages_active
    if sync is not None:
        # largest shard in 1/64 layer units (TP sizes are powers of two up to 64)
        floor, per_unit = sync
        shard = mdl.new_int_var(int(floor * 64), 64 * L, "shard")
        for j, c in enumerate(cands):
            mdl.add(shard >= (64 // len(c.ranks)) * n[j])
        job_ticks = tick(per_unit / 64) * (shard - int(floor * 64))
    else:
        job_ticks = 0
    # This replica's own step counts once; the all-reduce and the migration pause hold up the whole
    # job, which the allocation rebalances over ``replicas`` replicas: weigh them accordingly.
    weight = max(1, replicas)
    mdl.minimize(horizon * (step_ticks + weight * job_ticks) + weight * (worst if current else 0))

    solver = deterministic_solver(time_limit_s)
    status = solver.solve(mdl)
    if status == cp_model.MODEL_INVALID:  # a bug here, not a pipeline that does not fit
        raise RuntimeError(f"pipeline model invalid: {mdl.validate()}")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    stages, where = [], 0
    for j, c in enumerate(cands):
        k = solver.value(n[j])
        if solver.value(active[j]) and k:
            stages.append(Stage(c.ranks, (where, where + k)))
            where += k
    obj, bound = solver.objective_value, solver.best_objective_bound
    gap = 0.0 if status == cp_model.OPTIMAL or obj <= 0 else max(0.0, (obj - bound) / obj)
    return PipelineSolution(
        stages=Stages(stages),
        migration_s=solver.value(worst) / TICKS_PER_S if current else 0.0,
        status="optimal" if status == cp_model.OPTIMAL else "feasible",
        gap=gap,
    )
