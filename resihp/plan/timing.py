"""Predicted step time of a plan, the capacity bound and the migration cost between plans.

A step is per-stage times from the cost model, pipeline bubbles by the schedule's closed form and
gradient synchronisation.

1F1B with ``m`` equal micro-batches on stages with per-micro-batch times ``t_s = f_s + b_s``:
``sum_s t_s + (m - 1) * max_s t_s`` plus a forward and a backward activation transfer per stage
boundary. GPipe: ``sum_s f_s + (m - 1) max_s f_s + sum_s b_s + (m - 1) max_s b_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from resihp.perf.schedule import pipeline_step_time
from resihp.plan.cost import CostModel, grad_sync_s, p2p_s
from resihp.plan.plan import HashedTuple, Plan, Stage
from resihp.plan.specs import ClusterSpec, ModelSpec, in_flight_microbatches, stage_memory_gb


def closed_form_step(
    fwd: np.ndarray, bwd: np.ndarray, m: int, schedule: str = "1f1b", p2p_s: float = 0.0
) -> float:
    """Critical path of one pipeline over ``m`` equal micro-batches, in seconds.

    Args:
        fwd: each stage's forward seconds per micro-batch.
        bwd: each stage's backward seconds per micro-batch.
        m: the micro-batches (below 1: 0 seconds).
        schedule: ``1f1b`` or ``gpipe``.
        p2p_s: one activation transfer across a stage boundary, in seconds."""
    fwd, bwd = np.asarray(fwd, dtype=np.float64), np.asarray(bwd, dtype=np.float64)
    if m < 1 or fwd.size == 0:
        return 0.0
    comm = 2.0 * (fwd.size - 1) * p2p_s
    if schedule == "gpipe":
        return float(fwd.sum() + (m - 1) * fwd.max() + bwd.sum() + (m - 1) * bwd.max()) + comm
    t = fwd + bwd
    return float(t.sum() + (m - 1) * t.max()) + comm


class StageCoster:
    """Per-stage times and memory for one (cluster, model, cost model).

    They are cached per TP degree and device FLOP rate, per TP group and per pipeline (a tuple of
    stages)."""

    def __init__(self, cluster: ClusterSpec, model: ModelSpec, cost: CostModel) -> None:
        self.cluster, self.model, self.cost = cluster, model, cost
        # what device speeds do not change: shared by ``at_speeds`` copies
        self._layer: dict[tuple[int, float], tuple[float, float]] = {}
        self._head: dict[tuple[int, float], tuple[float, float]] = {}
        self._steps: dict[tuple, float] = {}
        self._fits: dict[tuple, bool] = {}
        self._caps: dict[tuple, int | None] = {}
        self._budgets: dict[tuple, float] = {}
        self._shards: dict[tuple[Stage, ...], float] = {}
        self._full_speed: dict[tuple, tuple[tuple[float, float], ...]] = {}
        self._factors: dict[tuple[int, float], np.ndarray] = {}
        # what they do
        self._groups: dict[tuple[int, ...], tuple[float, float]] = {}
        self._pipelines: dict[tuple, tuple[tuple[float, float], ...]] = {}
        self._alive: dict[tuple[Stage, ...], bool] = {}
        self._slopes: dict[tuple[tuple[Stage, ...], int], tuple[float, float]] = {}

    def at_speeds(self, cluster: ClusterSpec) -> StageCoster:
        """A coster for the same hardware and model at the device speeds of ``cluster``.

        It shares this one's caches of what speeds do not change (memory, full-speed layer times,
        critical paths by stage times)."""
        if (
            cluster.hardware_key is not self.cluster.hardware_key
            and cluster.hardware_key != self.cluster.hardware_key
        ):
            raise ValueError(f"cluster {cluster.name} is not the hardware of this coster")
        new = StageCoster(cluster, self.model, self.cost)
        for name in self._SHARED:
            setattr(new, name, getattr(self, name))
        return new

    _SHARED = (
        "_layer",
        "_head",
        "_steps",
        "_fits",
        "_caps",
        "_budgets",
        "_shards",
        "_full_speed",
        "_factors",
    )

    @property
    def cache_entries(self) -> int:
        """Entries in the caches that ``at_speeds`` copies share."""
        return sum(len(getattr(self, name)) for name in self._SHARED)

    def layer_fb(self, tp: int, tflops: float) -> tuple[float, float]:
        key = (tp, tflops)
        if key not in self._layer:
            self._layer[key] = self.cost.layer_seconds(self.model, self.cluster, tp, tflops)
        return self._layer[key]

    def head_fb(self, tp: int, tflops: float) -> tuple[float, float]:
        key = (tp, tflops)
        if key not in self._head:
            self._head[key] = self.cost.head_seconds(self.model, self.cluster, tp, tflops)
        return self._head[key]

    def microbatch_factors_for(self, tp: int, tflops: float) -> np.ndarray:
        """The relative cost (mean 1) of each of the workload's packed micro-batches on a group.

        The group has ``tp`` devices of this FLOP rate; all ones when the cost model does not tell
        micro-batches apart."""
        key = (tp, tflops)
        if key not in self._factors:
            of = getattr(self.cost, "microbatch_factors", None)
            self._factors[key] = (
                np.asarray(of(self.model, self.cluster, tp, tflops), dtype=np.float64)
                if of
                else np.ones(1)
            )
        return self._factors[key]

    def group_speed(self, ranks: tuple[int, ...]) -> tuple[float, float]:
        """(speed, tflops) of the member that limits the group: the lowest speed * FLOP rate."""
        if ranks not in self._groups:
            slow = min((self.cluster.devices[r] for r in ranks), key=lambda d: d.speed * d.tflops)
            self._groups[ranks] = (slow.speed, slow.tflops)
        return self._groups[ranks]

    def per_layer_s(self, ranks: tuple[int, ...]) -> tuple[float, float]:
        """(fwd, bwd) seconds per layer per micro-batch on this group at its current speed."""
        speed, tflops = self.group_speed(ranks)
        f, b = self.layer_fb(len(ranks), tflops)
        return (f / speed, b / speed) if speed > 0 else (np.inf, np.inf)

    def head_s(self, ranks: tuple[int, ...]) -> tuple[float, float]:
        speed, tflops = self.group_speed(ranks)
        f, b = self.head_fb(len(ranks), tflops)
        return (f / speed, b / speed) if speed > 0 else (np.inf, np.inf)

    def stage_fb(self, stage: Stage, last: bool, scale: float = 1.0) -> tuple[float, float]:
        """(fwd, bwd) seconds of one micro-batch on the stage.

        Args:
            stage: the stage (its ranks and layers).
            last: it is the pipeline's last stage (it runs the LM head).
            scale: the micro-batch's tokens over the model's micro-batch budget (compute, TP and
                p2p traffic all grow with tokens)."""
        f, b = self.per_layer_s(stage.ranks)
        f, b = f * stage.n_layers, b * stage.n_layers
        if last:
            hf, hb = self.head_s(stage.ranks)
            f, b = f + hf, b + hb
        return f * scale, b * scale

    def alive(self, stages: tuple[Stage, ...]) -> bool:
        """Whether every device of the pipeline is alive."""
        dead = self.cluster.dead
        if not dead:
            return True
        if stages not in self._alive:
            self._alive[stages] = all(dead.isdisjoint(s.ranks) for s in stages)
        return self._alive[stages]

    def stages_fit(self, stages: tuple[Stage, ...], m: int, budget: float | None = None) -> bool:
        """Whether every stage's state and in-flight activations fit its smallest device.

        Args:
            stages: the pipeline's stages, in order.
            m: the micro-batches the pipeline carries.
            budget: a micro-batch's tokens (None: the model's budget)."""
        key = (stages, m, budget)
        if key not in self._fits:
            p = len(stages)
            schedule = self.model.schedule
            self._fits[key] = all(
                stage_memory_gb(
                    self.model,
                    st.n_layers,
                    st.tp,
                    in_flight_microbatches(schedule, p, s, m),
                    s == 0,
                    s == p - 1,
                    budget,
                )
                <= self.cluster.free_memory_gb(st.ranks)
                for s, st in enumerate(stages)
            )
        return self._fits[key]

    def max_microbatches(
        self, stages: tuple[Stage, ...], budget: float | None = None
    ) -> int | None:
        """The most micro-batches the replica can hold in memory.

        None when memory does not grow with their number (1F1B once every stage is full)."""
        key = (stages, budget)
        if key not in self._caps:
            self._caps[key] = self._max_microbatches(stages, budget)
        return self._caps[key]

    def _max_microbatches(self, stages: tuple[Stage, ...], budget: float | None) -> int | None:
        if self.model.schedule == "1f1b":
            return None if self.stages_fit(stages, len(stages), budget) else 0
        p, best = len(stages), None
        for s, st in enumerate(stages):
            state = stage_memory_gb(self.model, st.n_layers, st.tp, 0, s == 0, s == p - 1, budget)
            act = (
                stage_memory_gb(self.model, st.n_layers, st.tp, 1, s == 0, s == p - 1, budget)
                - state
            )
            cap = int((self.cluster.free_memory_gb(st.ranks) - state) // act) if act > 0 else None
            best = cap if best is None else (best if cap is None else min(best, cap))
        return best

    def budget_limit(self, stages: tuple[Stage, ...], m: int) -> float:
        """Largest micro-batch (tokens) every stage of a replica of ``m`` micro-batches can hold
        in memory."""
        key = (stages, m)
        if key not in self._budgets:
            limit = np.inf
            p = len(stages)
            for s, stage in enumerate(stages):
                in_flight = in_flight_microbatches(self.model.schedule, p, s, m)
                first, last = s == 0, s == p - 1
                state = stage_memory_gb(self.model, stage.n_layers, stage.tp, 0, first, last)
                per_token = (
                    stage_memory_gb(
                        self.model, stage.n_layers, stage.tp, in_flight, first, last, 1.0
                    )
                    - state
                )
                limit = min(limit, (self.cluster.free_memory_gb(stage.ranks) - state) / per_token)
            self._budgets[key] = float(limit)
        return self._budgets[key]

    @property
    def p2p_s(self) -> float:
        """One micro-batch's activations (bf16) across a stage boundary (``cost.p2p_s``,
        unsplit)."""
        return float(p2p_s(self.model, self.cluster))

    def layer_state_gb(self, tp: int) -> float:
        """Model state of one layer on one device of a TP group of size ``tp``."""
        return stage_memory_gb(self.model, 1, tp, 0, False, False)

    def pipeline_fb(
        self,
        stages: tuple[Stage, ...],
        scale: float = 1.0,
    ) -> tuple[tuple[float, float], ...]:
        """``stage_fb`` of every stage of a pipeline (the last one runs the LM head)."""
        key = (stages, scale)
        fb = self._pipelines.get(key)
        if fb is None:
            # on devices all at full speed a pipeline takes what it takes on the healthy cluster
            full = not any(not self.cluster.degraded.isdisjoint(s.ranks) for s in stages)
            fb = self._full_speed.get(key) if full else None
            if fb is None:
                last = len(stages) - 1
                fb = HashedTuple(self.stage_fb(s, i == last, scale) for i, s in enumerate(stages))
                if self.cluster.links:
                    fb = HashedTuple(self._slow_link_fb(stages, fb, scale))
                if full:
                    self._full_speed[key] = fb
            self._pipelines[key] = fb
        return fb

    def boundary_speed(self, a: Stage, b: Stage) -> float:
        """The speed of the slowest link between two neighbouring stages.

        Each TP rank sends to its counterpart; between groups of different sizes, any pair
        counts."""
        pairs = (
            zip(a.ranks, b.ranks) if a.tp == b.tp else ((x, y) for x in a.ranks for y in b.ranks)
        )
        return min(self.cluster.link_speed(x, y) for x, y in pairs)

    def _slow_link_fb(self, stages: tuple[Stage, ...], fb: tuple, scale: float) -> list:
        """Stage times with each slow boundary's extra transfer time charged to the stage that
        sends over it: the forward's sender before it, the backward's after it."""
        out = [list(x) for x in fb]
        for i in range(len(stages) - 1):
            speed = self.boundary_speed(stages[i], stages[i + 1])
            if speed < 1.0:
                extra = self.p2p_s * scale * (1.0 / speed - 1.0)
                out[i][0] += extra
                out[i + 1][1] += extra
        return [tuple(x) for x in out]

    def pipeline_step(self, stages: tuple[Stage, ...], m: int, scale: float = 1.0) -> float:
        """One replica's step through the schedule's dependency graph (no gradient sync).

        Args:
            stages: the replica's stages, in order.
            m: the micro-batches it carries (below 1: 0 seconds).
            scale: a micro-batch's tokens over the model's micro-batch budget."""
        if m < 1 or not stages:
            return 0.0
        fb = self.pipeline_fb(stages, scale)
        key = (fb, m, scale)
        if key not in self._steps:
            arr = np.array(fb)
            self._steps[key] = float(
                pipeline_step_time(
                    np.broadcast_to(arr[:, :1], (len(fb), m)),
                    np.broadcast_to(arr[:, 1:], (len(fb), m)),
                    self.model.schedule,
                    p2p_s=self.p2p_s * scale,
                )
            )
        return self._steps[key]

    def pipeline_slope(self, stages: tuple[Stage, ...], m_ref: int) -> tuple[float, float]:
        """The pipeline's step as ``T(1) + (m - 1) * slope`` on the schedule's graph.

        Returns ``T(1)`` and the slope taken up to ``m_ref`` (at least 2) micro-batches."""
        key = (stages, m_ref)
        out = self._slopes.get(key)
        if out is None:
            first = self.pipeline_step(stages, 1)
            out = self._slopes[key] = (
                first,
                (self.pipeline_step(stages, m_ref) - first) / (m_ref - 1),
            )
        return out

    def largest_shard(self, stages: tuple[Stage, ...]) -> float:
        """The pipeline's largest per-device gradient shard, in layers (layers / TP size)."""
        if stages not in self._shards:
            self._shards[stages] = max((s.n_layers / s.tp for s in stages), default=0.0)
        return self._shards[stages]

    def dp_sync_s(self, plan: Plan) -> float:
        """Ring all-reduce of bf16 gradients across replicas; the largest per-device shard
        dominates."""
        d = len(plan.pipelines)
        if d < 2:
            return 0.0
        if self.cluster.links and len({len(p.stages) for p in plan.pipelines}) == 1:
            return self._slow_link_sync_s(plan)
        return max(
            self.largest_shard(p.stages) for p in plan.pipelines
        ) * self.sync_s_per_shard_layer(d)

    def _slow_link_sync_s(self, plan: Plan) -> float:
        """With slow links: each stage's replicas reduce their shards over a ring as slow as its
        slowest link; the slowest stage's reduction counts."""
        d = len(plan.pipelines)
        unit = self.sync_s_per_shard_layer(d)
        worst = 0.0
        for s in range(len(plan.pipelines[0].stages)):
            group = [p.stages[s] for p in plan.pipelines]
            speed = self.cluster.slowest_link_within(r for st in group for r in st.ranks)
            worst = max(worst, max(st.n_layers / st.tp for st in group) * unit / speed)
        return worst

    def sync_s_per_shard_layer(self, replicas: int) -> float:
        """All-reduce seconds per layer of per-device gradient shard (bf16, ring over replicas)."""
        return grad_sync_s(self.model, self.cluster, 1.0, replicas)


def migration_seconds(current: Plan | None, new: Plan, coster: StageCoster) -> float:
    """Seconds to move model state into the new layout.

    Each device receives the shards of layers it did not hold in the same TP layout; transfers run
    in parallel, so the slowest receiver counts.

    Args:
        current: the plan in force (None: nothing to move, 0 seconds).
        new: the plan to move to.
        coster: prices the transfers on the cluster."""
    if current is None:
        return 0.0
    held = current.holdings
    worst = 0.0
    for p in new.pipelines:
        if p.stages in held.pipelines:
            continue
        for s in p.stages:
            if s in held.stages:
                continue  # the same group keeps the same layers: nothing moves
            start, end = s.layers
            for t, r in enumerate(s.ranks):
                have = 0
                old = held.stage_of.get(r)
                if old is not None and old.tp == s.tp and old.ranks.index(r) == t:
                    have = max(0, min(end, old.layers[1]) - max(start, old.layers[0]))
                moved = (s.n_layers - have) * coster.layer_state_gb(s.tp)
                worst = max(worst, moved / coster.cluster.inter_node_gbs)
    return worst


@dataclass(frozen=True)
class CapacityBound:
    """Throughput of an ideal plan: every remaining device used at its speed, no imbalance.

    It is the best healthy layout's throughput scaled by the fraction of the cluster's compute (sum
    of speed x FLOP rate over devices) that remains."""

    tokens_per_s: float
    healthy_tokens_per_s: float
    capacity_fraction: float
    layout: object

    def at_speeds(self, cluster: ClusterSpec) -> CapacityBound:
        """This bound, taken at full speed, scaled to the compute that remains in ``cluster``."""
        if self.capacity_fraction != 1.0:
            raise ValueError("only a full-speed bound (capacity_fraction 1) can be scaled")
        frac = capacity_fraction(cluster)
        return replace(self, tokens_per_s=self.tokens_per_s * frac, capacity_fraction=frac)


def evaluate(
    plan: Plan, coster: StageCoster, bound: CapacityBound | None = None, current: Plan | None = None
) -> Plan:
    """Fill the plan's predicted step time, throughput, bound ratio and migration cost.

    Args:
        plan: the plan to fill in; it is returned.
        coster: prices the plan on the cluster and model.
        bound: the capacity bound for the bound ratio (None: left unset).
        current: the plan in force, for the migration cost (None: 0)."""
    placed_dead = not all(coster.alive(p.stages) for p in plan.pipelines)
    # a job that still waits on a dead rank makes no progress
    step = float("inf") if placed_dead or not plan.pipelines else critical_path_step(plan, coster)
    plan.step_time_s = step
    plan.tokens_per_s = coster.model.global_batch_tokens / step if np.isfinite(step) else 0.0
    if bound is not None:
        plan.capacity_tokens_per_s = bound.tokens_per_s
        plan.bound_ratio = plan.tokens_per_s / bound.tokens_per_s if bound.tokens_per_s else 0.0
    plan.migration_s = migration_seconds(current, plan, coster)
    return plan


def critical_path_step(plan: Plan, coster: StageCoster) -> float:
    """The plan's step time through the schedule's dependency graph, plus the gradient all-reduce.

    The slowest replica counts (``resihp.perf.schedule.pipeline_step_time``). Replicas with the same
    stage times are evaluated once, and kept (``StageCoster.pipeline_step``'s cache, shared by the
    costers of one planner: a re-plan changes a few of its pipelines)."""
    model = coster.model
    known = coster._steps
    worst = 0.0
    missing: dict[tuple[int, int], set[tuple]] = {}
    for p in plan.pipelines:
        scale = p.budget(model) / model.microbatch_tokens
        fb = coster.pipeline_fb(p.stages, scale)
        step = known.get((fb, p.microbatches, scale))
        if step is None:
            missing.setdefault((len(p.stages), p.microbatches), set()).add((fb, scale))
        elif step > worst:
            worst = step
    for (stages, m), rows in missing.items():
        rows = sorted(rows)
        arr = np.array([fb for fb, _ in rows])  # [replicas, stages, 2]
        fwd = np.broadcast_to(arr[:, :, :1], (len(arr), stages, m))
        bwd = np.broadcast_to(arr[:, :, 1:], (len(arr), stages, m))
        p2p = coster.p2p_s * np.array([scale for _, scale in rows])
        steps = pipeline_step_time(fwd, bwd, model.schedule, p2p_s=p2p)
        for (fb, scale), step in zip(rows, steps.tolist()):
            known[(fb, m, scale)] = step
        worst = max(worst, float(np.max(steps)))
    return worst + coster.dp_sync_s(plan)


EXPECTED_SAMPLES = 256  # drawn steps per kind of replica


def expected_step(
    plan: Plan, coster: StageCoster, samples: int = EXPECTED_SAMPLES, seed: int = 0
) -> float:
    """The plan's expected step when micro-batches differ in cost, plus the gradient all-reduce.

    The workload's packed micro-batches differ in cost.

    Each replica draws its micro-batches from the cost model's relative costs
    (``StageCoster.microbatch_factors``; a micro-batch has the same relative cost on every stage
    it crosses) and takes the schedule's critical path; the slowest replica sets the step. Per
    kind of replica (same stage times, token scale and cost table) ``samples`` steps are drawn
    (fixed seed); the step's distribution is the product of the kinds' empirical distributions,
    each raised to its number of replicas (replicas draw independently), and its mean is returned.
    ``critical_path_step`` prices the mean micro-batch instead, which is optimistic: a step's
    critical path is a maximum over paths, and the slowest of many replicas a maximum again.

    Args:
        plan: the plan.
        coster: prices the plan on the cluster and model.
        samples: the steps drawn per kind of replica.
        seed: the draws' random seed."""
    model = coster.model
    if not plan.pipelines or not all(coster.alive(p.stages) for p in plan.pipelines):
        return float("inf")
    rng = np.random.default_rng(seed)
    kinds: dict[tuple, int] = {}
    for p in plan.pipelines:
        scale = p.budget(model) / model.microbatch_tokens
        widest = max(p.stages, key=lambda st: st.tp).ranks
        key = (
            coster.pipeline_fb(p.stages, scale),
            scale,
            p.microbatches,
            len(widest),
            coster.group_speed(widest)[1],
        )
        kinds[key] = kinds.get(key, 0) + 1
    draws, counts = [], []
    for (fb, scale, m, width, tflops), count in kinds.items():
        table = coster.microbatch_factors_for(width, tflops)
        arr = np.array(fb)  # [stages, 2]
        factor = table[rng.integers(len(table), size=(samples, m))]  # [K, m]
        fwd = arr[None, :, :1] * factor[:, None, :]
        bwd = arr[None, :, 1:] * factor[:, None, :]
        draws.append(
            np.sort(
                np.asarray(pipeline_step_time(fwd, bwd, model.schedule, p2p_s=coster.p2p_s * scale))
            )
        )
        counts.append(count)
    points = np.unique(np.concatenate(draws))
    cdf = np.ones(len(points))
    for d, count in zip(draws, counts):
        cdf *= (np.searchsorted(d, points, side="right") / len(d)) ** count
    mass = np.diff(np.concatenate([[0.0], cdf]))
    return float((mass * points).sum()) + coster.dp_sync_s(plan)


def capacity_fraction(cluster: ClusterSpec) -> float:
    rate = cluster.tflops
    return float((cluster.speeds * rate).sum() / rate.sum())
