"""The resihp planner: TP groups, layer splits and micro-batches re-planned around slow devices.

It re-plans by decomposition:

1. The healthy layout (TP x PP x DP) fixes each replica's home TP groups (from the plan in force,
   or chosen for the healthy cluster).
2. Replicas whose groups are all healthy keep the healthy split; each other replica is one small
   CP-SAT model (``solve_pipeline``: group re-formation + layer split + memory + migration), solved
   independently and in parallel, warm-started from the plan in force.
3. CP-SAT allocates the global batch's micro-batches across replicas (``allocate_microbatches``);
   replicas whose share changed are re-solved for their new micro-batch count, then allocated again.
4. Live devices no replica uses are chained into extra pipelines where they can hold the model.
5. A few whole plans are assembled from these parts (with or without re-formed replicas and extra
   pipelines; optionally with token budgets, ``resihp.plan.tokens``) and the one with the shortest
   predicted step (plus amortised migration) is returned.
Every plan is evaluated by the same ``timing.evaluate`` as the baselines: the schedule's critical
path (``resihp.perf.schedule.pipeline_step_time``) plus the gradient all-reduce.

A ``Planner`` lives as long as the job and re-plans at every detection: it keeps what device speeds
do not change (``resihp.plan.memo``: healthy plan, home pipelines, memory fits, stage times at full
speed) and the pipeline solves it proved optimal, so a re-plan at 16,384 devices costs about the
few pipelines a fault touches. None of this changes a plan: a warm planner returns what a new one
would.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np

from resihp.errors import InputError
from resihp.parallel import ParallelDims, apportion
from resihp.perf.schedule import pipeline_step_time
from resihp.plan.allocation import allocate_microbatches
from resihp.plan.cost import AnalyticCost, CostModel, grad_sync_s
from resihp.plan.designs import FIRST_ROUNDS, design_plans, first_pool, free_devices
from resihp.plan.heuristics import drop_replica_plan, heuristic_plan
from resihp.plan.layout import (
    binary_chunks,
    choose_layout,
    home_groups,
    home_pipelines,
    layer_ranges,
    replica_load,
    touched_replicas,
    uniform_layer_counts,
)
from resihp.plan.links import boundary_moves, rank_swaps, replica_drops
from resihp.plan.memo import HardwareMemo
from resihp.plan.pipeline_solver import PipelineSolution, solve_key, solve_pipeline
from resihp.plan.plan import Pipeline, Plan, Stage, Stages, plan_problems, unplaced
from resihp.plan.specs import ClusterSpec, ModelSpec, stage_memory_gb
from resihp.plan.timing import CapacityBound, StageCoster, evaluate, expected_step
from resihp.plan.tokens import balance_tokens, balanced, proportional_counts

WITHIN_REPLICAS = (
    "within-replicas"  # ``Planner(regroup=...)``: groups re-formed inside each replica
)


def within_homes(plan: Plan, homes: list[list[tuple[int, ...]]]) -> bool:
    """Whether ``plan`` keeps every replica on ranks of its own ``homes`` groups.

    One pipeline each, in order, none empty."""
    pipes = sorted(plan.pipelines, key=lambda p: p.dp_rank)
    return len(pipes) == len(homes) and all(
        p.stages and set(p.ranks) <= {r for g in homes[d] for r in g} for d, p in enumerate(pipes)
    )


def own_groups(
    pipe: Pipeline, homes: list[list[tuple[int, ...]]], current: Plan
) -> list[tuple[int, ...]]:
    """The groups a replica of ``current`` was launched with.

    Its home groups where it runs on ranks of them and no other pipeline holds one (its left-out
    ranks are its hot spares), else the groups it has now.

    Args:
        pipe: the replica's pipeline in ``current``.
        homes: each replica's home groups, by home index.
        current: the plan in force.
    """
    if pipe.home is not None:
        home = homes[pipe.home]
        ranks = {r for g in home for r in g}
        others = {r for p in current.pipelines if p is not pipe for r in p.ranks}
        if set(pipe.ranks) <= ranks and ranks.isdisjoint(others):
            return list(home)
    return list(pipe.groups)


def healthy_plan(
    cluster: ClusterSpec,
    model: ModelSpec,
    cost: CostModel | None = None,
    layout: ParallelDims | None = None,
    time_limit_s: float = 2.0,
    token_budgets: bool = False,
) -> Plan:
    """The plan for the cluster with every device healthy.

    The best layout, every replica with the same layer split (optimised by CP-SAT for the LM head
    and the memory of early stages) and an even share of the micro-batches; with
    ``token_budgets``, of the tokens where that is faster (``floor(M / dp)`` micro-batches each, a
    little over the model's budget: at 16,384 devices 682 replicas of 3 micro-batches, where whole
    micro-batches left two replicas a fourth).

    Args:
        cluster: the cluster (its speeds are ignored: every device counts as healthy).
        model: the model to train.
        cost: the cost model (default: ``AnalyticCost``).
        layout: the TP x PP x DP layout (default: the best for the healthy cluster).
        time_limit_s: the CP-SAT time limit of the layer split, in seconds.
        token_budgets: share the global batch's tokens, not only whole micro-batches.
    """
    healthy = StageCoster(cluster.healthy(), model, cost or AnalyticCost())
    layout = layout or choose_layout(healthy.cluster, model, healthy, token_budgets)
    pipes = home_pipelines(healthy.cluster, layout)
    shares = apportion(model.microbatches, np.ones(layout.dp))
    m = replica_load(model, layout.dp, True)[0] if token_budgets else shares[0]
    sol = solve_pipeline(healthy, pipes[0], m, None, time_limit_s=time_limit_s)
    counts = (
        [s.n_layers for s in sol.stages]
        if sol is not None and len(sol.stages) == layout.pp
        else uniform_layer_counts(model.layers, layout.pp)
    )
    pipelines = [
        Pipeline(
            r,
            Stages(Stage(g, rng) for g, rng in zip(groups, layer_ranges(counts))),
            shares[r],
            home=r,
        )
        for r, groups in enumerate(pipes)
    ]
    plan = Plan(
        len(cluster), layout, pipelines, unplaced(len(cluster), pipelines), policy="healthy"
    )
    bound = capacity_bound(cluster, model, healthy.cost, layout)
    plan = evaluate(plan, healthy, bound)
    if token_budgets and layout.dp > 1:
        even = evaluate(balance_tokens(proportional_counts(plan, healthy), healthy), healthy, bound)
        # every home replica kept (the re-plans and baselines index the healthy plan by it)
        if (
            even.step_time_s < plan.step_time_s
            and len(even.pipelines) == len(plan.pipelines)
            and not plan_problems(even, cluster, model)
        ):
            plan = even
    plan.expected_step_time_s = expected_step(plan, healthy)
    return plan


def capacity_bound(
    cluster: ClusterSpec,
    model: ModelSpec,
    cost: CostModel | None = None,
    layout: ParallelDims | None = None,
) -> CapacityBound:
    """Throughput of an ideal plan that uses every device at its current speed with no imbalance.

    Start from the best healthy layout with its integer constraints relaxed: every stage holds
    ``layers / pp`` layers plus an equal share of the LM head, every replica ``M / dp``
    micro-batches; its 1F1B step (bubble, activation transfers and gradient all-reduce included)
    gives tokens/s per unit of compute used. Scale that by the compute the cluster has now
    (sum of speed x FLOP rate). A re-plan that shortens pipelines shrinks the bubble and can pass
    this bound by at most the bubble fraction.

    Args:
        cluster: the cluster at its current device speeds.
        model: the model to train.
        cost: the cost model (default: ``AnalyticCost``).
        layout: the layout (default: the best for the healthy cluster).
    """
    coster = StageCoster(cluster, model, cost or AnalyticCost())
    if layout is None:
        healthy = StageCoster(cluster.healthy(), model, coster.cost)
        layout = choose_layout(healthy.cluster, model, healthy)
    tflops = max(d.tflops for d in cluster.devices)
    f, b = coster.layer_fb(layout.tp, tflops)
    hf, hb = coster.head_fb(layout.tp, tflops)
    per_stage = np.array(
        [[(model.layers * f + hf) / layout.pp, (model.layers * b + hb) / layout.pp]] * layout.pp
    )
    m = model.microbatches / layout.dp
    lo = max(1, int(np.floor(m)))
    t_lo = _equal_stages_step(per_stage, lo, model.schedule, coster.p2p_s)
    t_hi = _equal_stages_step(per_stage, lo + 1, model.schedule, coster.p2p_s)
    step = t_lo + (m - lo) * (t_hi - t_lo)  # linear in m for equal stages
    step += grad_sync_s(model, cluster, model.layers / layout.pp / layout.tp, layout.dp)
    tokens = model.global_batch_tokens / step
    used = sum(
        cluster.devices[r].tflops
        for g in home_groups(cluster, layout.tp)[: layout.pp * layout.dp]
        for r in g
    )
    total = sum(d.tflops for d in cluster.devices)
    return CapacityBound(tokens * total / used, tokens, 1.0, layout).at_speeds(cluster)


def _equal_stages_step(per_stage: np.ndarray, m: int, schedule: str, p2p_s: float) -> float:
    p = len(per_stage)
    return float(
        pipeline_step_time(
            np.broadcast_to(per_stage[:, :1], (p, m)),
            np.broadcast_to(per_stage[:, 1:], (p, m)),
            schedule,
            p2p_s=p2p_s,
        )
    )


def check_layout(cluster: ClusterSpec, model: ModelSpec, layout: ParallelDims, where: str) -> None:
    """Check that ``layout`` fits the cluster's devices and the model's layers.

    Else a one-line ``InputError``.

    Args:
        cluster: the cluster.
        model: the model.
        layout: the TP x PP x DP layout to check.
        where: what the error names as the layout's source (e.g. ``current plan``).
    """
    groups = len(home_groups(cluster, layout.tp))
    if layout.tp * layout.pp * layout.dp > len(cluster) or layout.pp * layout.dp > groups:
        raise InputError(
            f"{where}: layout tp={layout.tp} pp={layout.pp} dp={layout.dp} needs more "
            f"devices than the cluster's {len(cluster)}"
        )
    if layout.pp > model.layers:
        raise InputError(
            f"{where}: layout pp={layout.pp} exceeds the model's {model.layers} layers"
        )


class Planner:
    """``Planner(cost_model).plan(cluster, model, current, time_limit_s) -> Plan``.

    ``horizon_steps``: steps over which a state migration is amortised when weighed against the
    step-time gain it buys. ``threads``: pipelines solved at once. ``token_budgets``: also give
    replicas unequal micro-batch counts and token shares of the global batch (``Pipeline.tokens``,
    micro-batches never smaller than the model's budget) where whole micro-batches are too coarse;
    only for consumers that pack each replica's share with its own budget
    (``Pipeline.budget(model)``), so off by default. ``expected_steps``: fill each plan's
    ``expected_step_time_s`` (variable micro-batch costs on the critical path; some
    milliseconds per plan at 16,384 devices), which a caller that measures its steps can skip.
    ``regroup``: False re-plans only layer splits and micro-batch shares, every stage keeping its
    group of the plan in force: for a job that cannot move ranks between its groups while it runs.
    ``WITHIN_REPLICAS``: each replica's groups may be re-formed (a slow device left out as a hot
    spare, a smaller tensor-parallel group, another depth) from the ranks that replica was launched
    with, and no rank moves to another replica (replica-level fault tolerance, where each replica
    is a job of its own and its ranks share a process group only with each other).
    """

    name = "resihp"

    def __init__(
        self,
        cost_model: CostModel | None = None,
        horizon_steps: float = 100.0,
        threads: int | None = None,
        token_budgets: bool = False,
        expected_steps: bool = True,
        regroup: bool | str = True,
    ) -> None:
        if regroup not in (True, False, WITHIN_REPLICAS):
            raise ValueError(
                f"regroup: expected True, False or {WITHIN_REPLICAS!r}, got {regroup!r}"
            )
        self.cost = cost_model or AnalyticCost()
        self.regroup = regroup
        self.expected_steps = expected_steps
        self.token_budgets = token_budgets
        self.horizon_steps = horizon_steps
        self.threads = threads or max(1, os.cpu_count() or 1)
        self._memos: dict[tuple, HardwareMemo] = {}
        self._last: HardwareMemo | None = None
        self._pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        """The pool the pipeline solves run in, kept across re-plans: starting its threads anew at
        every re-plan cost the 16,384-GPU replay's main thread about 0.8 s (each start waits for
        the new thread to take the interpreter lock from the busy ones)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="resihp-solve")
        return self._pool

    def _memo(self, cluster: ClusterSpec, model: ModelSpec) -> HardwareMemo:
        last = self._last
        if last is not None and last.hardware_key is cluster.hardware_key and last.model == model:
            return last  # re-plans of one job: ``with_speeds`` keeps the hardware key object
        key = (cluster.hardware_key, model)
        if key not in self._memos:
            healthy = healthy_plan(cluster, model, self.cost, token_budgets=self.token_budgets)
            bound = capacity_bound(cluster.healthy(), model, self.cost, healthy.layout)
            coster = StageCoster(cluster.healthy(), model, self.cost)
            self._memos[key] = HardwareMemo(cluster, model, healthy, bound, coster)
        self._last = self._memos[key]
        return self._last

    def healthy(self, cluster: ClusterSpec, model: ModelSpec) -> Plan:
        """The healthy plan of this cluster and model (cached: it is the same at every
        detection)."""
        return self._memo(cluster, model).healthy

    def bound(self, cluster: ClusterSpec, model: ModelSpec) -> CapacityBound:
        return self._memo(cluster, model).bound.at_speeds(cluster)

    def coster(self, cluster: ClusterSpec, model: ModelSpec) -> StageCoster:
        """A coster at the cluster's device speeds.

        It shares what speeds do not change with the planner's earlier calls."""
        return self._memo(cluster, model).coster.at_speeds(cluster)

    def layout(self, cluster: ClusterSpec, model: ModelSpec, current: Plan | None) -> ParallelDims:
        """The layout a plan keeps: the plan in force's (checked), else the healthy plan's.

        Args:
            cluster: the cluster at its current speeds.
            model: the model.
            current: the plan in force (None: a new job).
        """
        if current is not None:
            current.check_against(cluster)
            check_layout(cluster, model, current.layout, "current plan")
            return current.layout
        return self.bound(cluster, model).layout

    def plan(
        self,
        cluster: ClusterSpec,
        model: ModelSpec,
        current: Plan | None = None,
        time_limit_s: float = 5.0,
    ) -> Plan:
        """The best plan for the cluster at its current device speeds.

        Args:
            cluster: the cluster, its devices at their current (believed) speeds; 0 is dead.
            model: the model to train.
            current: the plan in force, warm-starting the solves and priced for migration (None:
                a new job).
            time_limit_s: the seconds the CP-SAT solves of this re-plan share.
        """
        t0 = time.perf_counter()
        memo = self._memo(cluster, model)
        memo.trim()
        coster = memo.coster.at_speeds(cluster)
        layout = self.layout(cluster, model, current)
        bound = self.bound(cluster, model)
        pipes = memo.home_pipelines(layout)
        even = dict(enumerate(apportion(model.microbatches, np.ones(layout.dp))))
        share = dict(even)
        held: dict[tuple[int, ...], tuple[int, int]] | None = None
        if current is not None:
            held = {s.ranks: s.layers for p in current.pipelines for s in p.stages}
            share.update(
                {
                    p.home: p.microbatches
                    for p in current.pipelines
                    if p.home is not None and p.home in share
                }
            )
        healthy = memo.healthy
        counts = (
            [s.n_layers for s in healthy.pipelines[0].stages]
            if healthy.layout == layout
            else uniform_layer_counts(model.layers, layout.pp)
        )
        # replica id -> solution; ids 0..dp-1 are the home replicas, later ids spare pipelines.
        # A replica is kept when ``group_options`` keeps each of its groups whole.
        kept: dict[int, PipelineSolution] = {}
        affected = []
        fixed = self.regroup is not True and current is not None
        within = self.regroup == WITHIN_REPLICAS
        if fixed:
            # the groups in force, whatever the layout's home groups: every pipeline re-split
            # (the solver keeps its groups whole), its share re-allocated; within replicas, each
            # replica's own groups (``own_groups``), which the solver may re-form
            ordered = sorted(current.pipelines, key=lambda p: p.dp_rank)
            pipes = [own_groups(p, pipes, current) if within else list(p.groups) for p in ordered]
            even = dict(enumerate(apportion(model.microbatches, np.ones(len(pipes)))))
            share = {r: p.microbatches for r, p in enumerate(ordered)}
            affected = list(range(len(pipes)))
        whole = memo.whole_at_full_speed(layout)
        touched = touched_replicas(cluster, layout)
        for r, stages in enumerate(memo.home_stages(layout, counts) if not fixed else []):
            if whole[r] and r not in touched:
                kept[r] = PipelineSolution(stages, 0.0, "kept", 0.0)
            else:
                affected.append(r)
        # Two weightings of the job-wide costs against a replica's own step (see
        # ``solve_pipeline``): 1 (the replica is the bottleneck) and dp (the allocation spreads
        # its gain over every replica); the evaluator picks between the plans they lead to.
        weights = [1, layout.dp] if layout.dp > 1 and affected else [1]
        waves = -(-len(affected) // self.threads) if affected else 1
        per_solve = max(0.05, 0.7 * time_limit_s / (len(weights) * (2 * waves + 1) + 1))
        log = _SolveLog()
        floor = max(
            (st.n_layers / st.tp for sol in kept.values() for st in sol.stages), default=0.0
        )
        sync = (floor, coster.sync_s_per_shard_layer(layout.dp)) if layout.dp > 1 else None
        pool = self._executor()
        context = _Context(
            cluster,
            model,
            layout,
            coster,
            pipes,
            held,
            even,
            affected,
            sync,
            per_solve,
            log,
            memo.solves,
            memo.leftover(layout),
            pool,
            floor=1 if fixed else 0,
        )

        seen: set[tuple] = set()

        def places(plan: Plan) -> list[tuple[tuple[int, ...], ...]]:
            return [p.groups for p in sorted(plan.pipelines, key=lambda p: p.dp_rank)]

        def usable(plans: list[Plan]) -> list[Plan]:
            """Plans that run (the global batch placed, memory respected, no dead rank), each
            once: the two weightings and the allocations often build the same plan. Without
            ``regroup``, only those that keep the groups in force (within replicas: that keep
            every replica, on its own ranks)."""
            out = []
            for c in plans:
                key = tuple(
                    (p.dp_rank, p.stages, p.microbatches, p.tokens, p.home) for p in c.pipelines
                )
                if fixed and not (
                    within_homes(c, pipes) if within else places(c) == places(current)
                ):
                    continue
                if (
                    key not in seen
                    and c.pipelines
                    and sum(p.share(model) for p in c.pipelines) == model.global_batch_tokens
                    and all(
                        coster.stages_fit(p.stages, p.microbatches, p.budget(model))
                        and coster.alive(p.stages)
                        for p in c.pipelines
                    )
                ):
                    out.append(evaluate(c, coster, bound, current))
                seen.add(key)
            return out

        try:
            # every weighting's first solves start now, beside the work below and each other
            for weight in weights:
                for r in affected:
                    self._submit(context, pipes[r], max(1, share[r]), sync, weight)
            # the heuristic baselines' plans are candidates too, so the optimizer never ends
            # behind them
            candidates = usable(self._baseline_plans(context, healthy)) if not fixed else []
            for weight in weights:
                try:
                    candidates += usable(self._candidates(context, dict(kept), dict(share), weight))
                except InputError:
                    if not candidates:
                        raise
                if any(c.bound_ratio >= 0.99 for c in candidates):
                    break  # close enough to the bound: the other weighting cannot gain much
            # pipelines designed for the devices at hand (mixed TP sizes and depths), alone or
            # beside pipelines kept from the plan in force or the best plan so far
            best = min(candidates, key=lambda p: p.step_time_s, default=None)
            if not fixed:
                candidates += usable(self._designed_plans(context, memo, current, best))
            # around a slow link between data-parallel peers: fewer layers on its stage
            candidates += usable([m for c in list(candidates) for m in boundary_moves(c, cluster)])
            if not fixed:
                # ... or its end trades places with another stage of its pipeline
                candidates += usable([m for c in list(candidates) for m in rank_swaps(c, cluster)])
                # ... or the replica holding an end leaves, the others take its micro-batches
                candidates += usable(
                    [m for c in list(candidates) for m in replica_drops(c, cluster)]
                )
        finally:
            # the solves of a weighting not needed: those not started are dropped, those running
            # end before the plan is returned (they fill the planner's cache, as the next call
            # would find it)
            for future in context.futures.values():
                future.cancel()
            wait(list(context.futures.values()))
        if not candidates:
            raise InputError(
                f"cluster {cluster.name}: no plan of model {model.name} fits in "
                "memory on the remaining devices" + (" in the groups in force" if fixed else "")
            )
        # the same trade as inside the solver: step time plus migration amortised over the horizon
        plan = min(
            candidates,
            key=lambda p: (p.step_time_s + p.migration_s / self.horizon_steps, p.migration_s),
        )
        plan.solver = {
            **log.summary(),
            "solve_s": time.perf_counter() - t0,
            "pipelines_solved": log.pipelines,
        }
        if self.expected_steps:
            # the step to expect with variable micro-batches (``step_time_s`` prices the mean one)
            plan.expected_step_time_s = expected_step(plan, coster)
        return plan

    def _candidates(
        self,
        ctx: _Context,
        solutions: dict[int, PipelineSolution | None],
        share: dict[int, int],
        weight: int,
    ) -> list[Plan]:
        """Solve the affected replicas (two rounds: solve, allocate, re-solve those whose
        micro-batch count moved), add spare-device pipelines, and assemble whole plans: the
        allocation; without the re-formed replicas; with the spare pipelines; and, with token
        budgets, each balanced by tokens. They are compared later on the evaluator's step time,
        which unlike the allocation sees the gradient all-reduce."""
        cluster, model, layout, coster = ctx.cluster, ctx.model, ctx.layout, ctx.coster

        def allocate(
            dropped: frozenset[int] = frozenset(),
            sols: dict[int, PipelineSolution | None] | None = None,
        ) -> dict[int, int]:
            sols = solutions if sols is None else sols
            live = [r for r, sol in sols.items() if sol is not None and r not in dropped]
            if not live:
                raise InputError(
                    f"cluster {cluster.name}: no replica of layout tp={layout.tp} "
                    f"pp={layout.pp} can run model {model.name} on the remaining "
                    "devices"
                )
            # T_r(m) ~ T_r(1) + (m - 1) * slope_r through the schedule's dependency graph,
            # the slope taken up to the replica's present share (p2p latencies included)
            first, each = zip(
                *(coster.pipeline_slope(sols[r].stages, max(2, share.get(r, 0))) for r in live)
            )
            caps = [coster.max_microbatches(sols[r].stages) for r in live]
            try:
                alloc, status, gap = allocate_microbatches(
                    first, each, model.microbatches, ctx.per_solve, caps, ctx.floor
                )
            except ValueError as exc:
                raise InputError(
                    f"cluster {cluster.name}: the global batch of model "
                    f"{model.name} does not fit in memory on the remaining "
                    f"devices ({exc})"
                ) from None
            ctx.log.add(f"allocation:{status}", gap)
            return dict(zip(live, alloc))

        todo = {r: max(1, share[r]) for r in ctx.affected}
        solved_for: dict[int, int] = {}
        for _ in range(2):
            solves = {
                r: self._submit(ctx, ctx.pipes[r], m, ctx.sync, weight) for r, m in todo.items()
            }
            for r, solve in solves.items():
                solutions[r] = solve.result()
                ctx.log.pipelines += 1
            solved_for.update(todo)
            share = allocate()
            # re-solve the replicas whose micro-batch count moved: the bubble weighs with it
            todo = {
                r: share.get(r, 0)
                for r in ctx.affected
                if solutions[r] is not None and 0 < share.get(r, 0) != solved_for[r]
            }
            if not todo:
                break
        for r in ctx.affected:
            if solutions[r] is not None:
                ctx.log.add(solutions[r].status, solutions[r].gap)
        # ways to use the live devices no replica holds (each a set of spare pipelines)
        alternatives = (
            self._spare_pipelines(ctx, solutions, min(ctx.even.values()) or 1)
            if self.regroup is True
            else []
        )
        ctx.log.pipelines += sum(len(spares) for spares in alternatives)
        reformed = frozenset(
            r
            for r in ctx.affected
            if solutions[r] is not None
            and any(len(s.ranks) != layout.tp for s in solutions[r].stages)
        )
        shares = [(solutions, share)]
        if reformed and len(reformed) < sum(s is not None for s in solutions.values()):
            shares.append((solutions, allocate(reformed)))
        for spares in alternatives or [{}]:
            sols = {**solutions, **spares}
            if spares:
                shares.append((sols, allocate(sols=sols)))
            if self.token_budgets:
                keep = {
                    r: ctx.even.get(r, min(ctx.even.values()))
                    for r, sol in sols.items()
                    if sol is not None
                }
                shares.append((sols, keep))
                shares.append((sols, {r: m for r, m in keep.items() if r not in reformed}))
                if spares:
                    shares.append((sols, {r: m for r, m in keep.items() if r not in spares}))
        plans = [self._assemble(cluster, layout, sols, sh) for sols, sh in shares]
        if self.token_budgets:
            plans += [balance_tokens(c, coster) for c in plans]
            plans += [b for c in plans[-len(shares) :] for b in balanced(c, coster)]
        return plans

    def _designed_plans(
        self, ctx: _Context, memo: HardwareMemo, current: Plan | None, best: Plan | None
    ) -> list[Plan]:
        """Plans of designed pipelines (``resihp.plan.designs``) on the full-speed live devices:
        all of them designed anew; and, re-planning, only those of the pipelines a fault touched
        designed anew beside the untouched ones, or every pipeline that still runs kept as it is
        (its micro-batches re-allocated; free devices designed into new ones); and the pipelines
        of ``best`` (the best candidate so far) that run slow devices kept, every full-speed
        device around them designed anew. Not where the model fixes its TP or PP size."""
        model, cluster = ctx.model, ctx.cluster
        if model.tp or model.pp:
            return []
        keeps: list[list[Pipeline]] = [[]]
        if current is not None:
            touched = cluster.degraded
            keeps.append([p for p in current.pipelines if touched.isdisjoint(p.ranks)])
            # every pipeline that still runs kept, the micro-batches moved (nothing migrates)
            keeps.append([p for p in current.pipelines if cluster.dead.isdisjoint(p.ranks)])
        slow = cluster.degraded - cluster.dead
        if best is not None and slow:
            # the best plan so far's pipelines that run slow devices (re-formed around them by
            # CP-SAT), the full-speed devices around them designed anew
            keeps.append([p for p in best.pipelines if not slow.isdisjoint(p.ranks)])
        broken = any(
            d.speed < 1.0 for d in cluster.devices
        )  # a node with a device not at full speed
        # designs that cannot beat the best plan so far are not built; with token budgets a
        # balanced plan can be some percent faster than its whole micro-batches
        target = (
            best.step_time_s * (1.05 if self.token_budgets else 1.0) if best is not None else None
        )
        firsts = FIRST_ROUNDS if broken else ("all",)
        # slow devices in pipelines of their own, and also joining designed pipelines as short
        # stages (which is better depends on the micro-batches each pipeline carries); the two
        # share the packing of the full-speed devices
        plans, done = [], set()
        for keep in keeps:
            free = free_devices(cluster, keep)
            for first in firsts:
                # a first round designing for the devices another did builds the same plans
                key = (
                    tuple((p.stages, p.home) for p in keep),
                    frozenset(first_pool(cluster, free, first)),
                )
                if key in done:
                    continue
                done.add(key)
                plans += design_plans(
                    ctx.coster,
                    ctx.layout,
                    memo.designer,
                    keep,
                    self.name,
                    ctx.per_solve,
                    first_round=first,
                    target_s=target,
                    token_budgets=self.token_budgets,
                    variants=(False, True) if slow else (False,),
                )
        if self.token_budgets:
            plans += [b for c in plans for b in balanced(c, ctx.coster)]
        return plans

    def _baseline_plans(self, ctx: _Context, healthy: Plan) -> list[Plan]:
        """The ResiHP-style heuristic and drop-replica plans (with token budgets when enabled)."""
        base = (
            healthy
            if healthy.layout == ctx.layout
            else healthy_plan(ctx.cluster, ctx.model, self.cost, ctx.layout)
        )
        plans = [
            build(ctx.cluster, ctx.model, ctx.coster, base, ctx.layout)
            for build in (heuristic_plan, drop_replica_plan)
        ]
        for plan in plans:
            plan.policy = self.name
        if self.token_budgets:
            plans += [b for c in plans if c.pipelines for b in balanced(c, ctx.coster)]
        return plans

    def _submit(
        self,
        ctx: _Context,
        groups: list[tuple[int, ...]],
        m: int,
        sync: tuple[float, float] | None,
        replicas: int,
    ) -> Future:
        """``solve_pipeline``'s answer to come: from the planner's cache (an answer proven
        optimal in no more than this call's time limit), from the same solve already started in
        this call, or from a new solve in the pool."""
        key = solve_key(
            ctx.coster, groups, m, ctx.held, self.horizon_steps, sync, replicas, self.regroup
        )
        if key not in ctx.futures:
            sol, seconds = ctx.solves.get(key, (None, np.inf))
            if seconds <= ctx.per_solve:
                ctx.futures[key] = Future()
                ctx.futures[key].set_result(sol)
            else:
                ctx.futures[key] = ctx.pool.submit(
                    self._solve, ctx, key, list(groups), m, sync, replicas
                )
        return ctx.futures[key]

    def _solve(
        self,
        ctx: _Context,
        key: tuple,
        groups: list[tuple[int, ...]],
        m: int,
        sync: tuple[float, float] | None,
        replicas: int,
    ) -> PipelineSolution | None:
        t0 = time.perf_counter()
        sol = solve_pipeline(
            ctx.coster,
            groups,
            m,
            ctx.held,
            self.horizon_steps,
            ctx.per_solve,
            sync,
            replicas,
            self.regroup,
        )
        if sol is not None and sol.status == "optimal":
            ctx.solves[key] = (sol, time.perf_counter() - t0)
        return sol

    def _spare_pipelines(
        self, ctx: _Context, solutions: dict[int, PipelineSolution | None], m: int
    ) -> list[dict[int, PipelineSolution]]:
        """Extra pipelines from live devices no replica uses (the rest of a broken TP group, or
        devices the layout leaves over), power-of-two TP groups inside each node, two ways: chained
        into pipelines across nodes while the CP-SAT model finds no split that fits in memory (the
        groups left over lengthen the last one); and all in one pipeline. Which carries more
        depends on the micro-batches each gets: both are candidates."""
        # kept replicas use all of their home groups: the others' and the layout's leftovers remain
        used = {
            x
            for r in ctx.affected
            if solutions[r] is not None
            for s in solutions[r].stages
            for x in s.ranks
        }
        maybe = ctx.leftover.union(*(g for r in ctx.affected for g in ctx.pipes[r]))
        free = frozenset(x for x in maybe if x not in used and x not in ctx.cluster.dead)
        if free not in ctx.spares_seen:  # the two weightings often leave the same devices over
            ctx.spares_seen[free] = self._build_spares(ctx, free, m, max(solutions) + 1)
        return ctx.spares_seen[free]

    def _build_spares(
        self,
        ctx: _Context,
        free: frozenset[int],
        m: int,
        first_id: int,
    ) -> list[dict[int, PipelineSolution]]:
        cluster, model, coster = ctx.cluster, ctx.model, ctx.coster
        by_node: dict[int, list[int]] = {}
        for r in free:
            by_node.setdefault(cluster.devices[r].node, []).append(r)
        groups = []
        for ranks in by_node.values():
            ranks.sort(key=lambda r: (-cluster.devices[r].speed, r))
            groups += [tuple(sorted(g)) for g in binary_chunks(ranks) if model.heads % len(g) == 0]
        if not groups or sum(len(g) for g in groups) < 2:
            return []
        groups.sort(key=lambda g: (-len(g), g))
        # a lower bound on what a pipeline must hold: all model state, one micro-batch per layer
        state_gb = stage_memory_gb(model, model.layers, 1, 1, True, True)
        out: dict[int, PipelineSolution] = {}
        chains: dict[int, list[tuple[int, ...]]] = {}
        chain: list[tuple[int, ...]] = []
        next_id = first_id
        for g in groups:
            chain.append(g)
            if len(chain) > model.layers:
                break
            if sum(coster.cluster.free_memory_gb(c) * len(c) for c in chain) < state_gb:
                continue  # cannot hold the model state, whatever the split
            sol = self._submit(ctx, chain, m, None, 1).result()
            if sol is not None and len(sol.stages) == len(chain):
                out[next_id], chains[next_id] = sol, chain
                next_id += 1
                chain = []
        per_replica = ctx.layout.tp * ctx.layout.pp

        def whole(chain: list[tuple[int, ...]]) -> PipelineSolution | None:
            """One pipeline of every group of ``chain``, at micro-batches in proportion to its
            devices; None if the model leaves a group out."""
            m_chain = max(1, round(m * sum(len(g) for g in chain) / per_replica))
            sol = self._submit(ctx, chain, m_chain, None, 1).result()
            return sol if sol is not None and len(sol.stages) == len(chain) else None

        if chain and out and len(chains[next_id - 1]) + len(chain) <= model.layers:
            # the groups left over (too few to hold the model alone) lengthen the last pipeline
            longer = whole(chains[next_id - 1] + chain)
            if longer is not None:
                out[next_id - 1] = longer
        alternatives = [out] if out else []
        if (len(out) > 1 or (chain and out)) and len(groups) <= model.layers:
            one = whole(groups)
            if one is not None and {first_id: one} != out:
                alternatives.append({first_id: one})
        return alternatives

    def _assemble(
        self,
        cluster: ClusterSpec,
        layout: ParallelDims,
        solutions: dict[int, PipelineSolution | None],
        share: dict[int, int],
    ) -> Plan:
        pipelines = []
        for r in sorted(solutions):
            if solutions[r] is not None and share.get(r, 0) > 0:
                pipelines.append(
                    Pipeline(
                        len(pipelines),
                        solutions[r].stages,
                        share[r],
                        home=r if r < layout.dp else None,
                    )
                )
        return Plan(
            len(cluster), layout, pipelines, unplaced(len(cluster), pipelines), policy=self.name
        )


@dataclass
class _Context:
    """What every candidate construction of one ``Planner.plan`` call shares."""

    cluster: ClusterSpec
    model: ModelSpec
    layout: ParallelDims
    coster: StageCoster
    pipes: list[list[tuple[int, ...]]]
    held: dict[tuple[int, ...], tuple[int, int]] | None
    even: dict[int, int]
    affected: list[int]
    sync: tuple[float, float] | None
    per_solve: float
    log: _SolveLog
    solves: dict[tuple, tuple[PipelineSolution, float]]  # the planner's: answer, seconds
    leftover: frozenset[int]  # live or not, the devices no home replica uses
    pool: ThreadPoolExecutor
    floor: int  # the least micro-batches a replica takes: 1 where every replica must stay
    futures: dict[tuple, Future] = field(default_factory=dict)  # this call's, by ``solve_key``
    spares_seen: dict[frozenset[int], list[dict[int, PipelineSolution]]] = field(
        default_factory=dict
    )


class _SolveLog:
    """Statuses and gaps of the CP-SAT solves behind one plan."""

    def __init__(self) -> None:
        self.statuses: list[str] = []
        self.gaps: list[float] = []
        self.pipelines = 0

    def add(self, status: str, gap: float) -> None:
        self.statuses.append(status)
        if np.isfinite(gap):
            self.gaps.append(gap)

    def summary(self) -> dict:
        done = all(s.endswith("optimal") or s == "kept" for s in self.statuses)
        return {
            "status": "optimal" if done else "time-limit",
            "gap": max(self.gaps) if self.gaps else 0.0,
        }
