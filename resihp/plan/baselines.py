"""Baseline policies behind the planner's interface, for benchmarks and trace replay.

- ``uniform``: no adaptation; the healthy plan stays, so a slow device drags its pipeline and the
  whole step, and a dead one stops the job (throughput 0).
- ``resihp-heuristic``: the published ResiHP adaptation, one heuristic per dimension: each degraded
  TP group keeps its fastest power-of-two subset maximising ``k * min speed``; layers split in
  proportion to stage speed; micro-batches in proportion to replica throughput.
- ``drop-replica``: Oobleck / checkpoint-restart style: every replica holding a dead device is
  dropped and its micro-batches spread evenly over the rest; slow devices are left in place.
"""

from __future__ import annotations

import time

import numpy as np

from resihp.plan.cost import AnalyticCost, CostModel
from resihp.plan.layout import even_split, home_pipelines, layer_ranges, powers_of_two_upto
from resihp.plan.plan import Pipeline, Plan, Stage, Stages, unplaced
from resihp.plan.planner import Planner
from resihp.plan.specs import ClusterSpec, ModelSpec, stage_memory_gb
from resihp.plan.timing import StageCoster, evaluate


def proportional_split(total: int, weights: np.ndarray, caps: np.ndarray | None = None,
                       minimum: int = 1) -> list[int]:
    """Integers proportional to ``weights`` summing to ``total`` (largest remainder), each at
    least ``minimum`` and at most its cap when the caps allow."""
    weights = np.asarray(weights, dtype=np.float64)
    caps = np.full(len(weights), total) if caps is None else np.asarray(caps)
    share = weights / weights.sum() * total
    counts = np.clip(np.floor(share).astype(int), minimum, caps)
    order = np.argsort(-(share - np.floor(share)))
    while counts.sum() < total:
        grown = False
        for i in order:
            if counts.sum() < total and counts[i] < caps[i]:
                counts[i] += 1
                grown = True
        if not grown:
            break
    while counts.sum() > total:
        i = int(np.argmax(counts - share))
        if counts[i] <= minimum:
            break
        counts[i] -= 1
    return counts.tolist()


class _Policy(Planner):
    """Shares the planner's layout, healthy plan and bound; subclasses build the plan."""

    def plan(self, cluster: ClusterSpec, model: ModelSpec, current: Plan | None = None,
             time_limit_s: float = 5.0) -> Plan:
        t0 = time.perf_counter()
        coster = self.coster(cluster, model)
        layout = self.layout(cluster, model, current)
        healthy = self.healthy(cluster, model)
        plan = self.build(cluster, model, coster, healthy if healthy.layout == layout else None,
                          layout)
        plan.policy = self.name
        if sum(p.share(model) for p in plan.pipelines) != model.global_batch_tokens:
            # the policy cannot place the global batch (memory): the job stops
            plan = Plan(len(cluster), layout, [], list(range(len(cluster))), policy=self.name)
        evaluate(plan, coster, self.bound(cluster, model), current)
        plan.solver = {"status": "heuristic", "gap": float("nan"),
                       "solve_s": time.perf_counter() - t0}
        return plan

    def build(self, cluster, model, coster, healthy, layout) -> Plan:  # pragma: no cover
        raise NotImplementedError


def _caps(coster: StageCoster, pipelines: list, total: int) -> np.ndarray:
    """The most micro-batches each replica holds in memory (GPipe keeps all of them in flight)."""
    return np.array([min(total, c) if (c := coster.max_microbatches(st)) is not None else total
                     for st in pipelines], dtype=int)


def _healthy_or_uniform(planner: Planner, cluster, model, healthy, layout) -> Plan:
    from resihp.plan.planner import healthy_plan

    return healthy if healthy is not None else healthy_plan(cluster, model, planner.cost, layout)


class UniformPolicy(_Policy):
    name = "uniform"

    def build(self, cluster, model, coster, healthy, layout) -> Plan:
        base = _healthy_or_uniform(self, cluster, model, healthy, layout)
        return Plan(base.world_size, base.layout, list(base.pipelines), list(base.excluded))


class DropReplicaPolicy(_Policy):
    name = "drop-replica"

    def build(self, cluster, model, coster, healthy, layout) -> Plan:
        base = _healthy_or_uniform(self, cluster, model, healthy, layout)
        alive = [p for p in base.pipelines if coster.alive(p.stages)]
        caps = _caps(coster, [p.stages for p in alive], model.microbatches)
        shares = proportional_split(model.microbatches, np.ones(len(alive)), caps, minimum=0) \
            if alive else []
        pipelines = [Pipeline(i, p.stages, m, home=p.home)
                     for i, (p, m) in enumerate(zip(alive, shares)) if m > 0]
        return Plan(len(cluster), layout, pipelines, unplaced(len(cluster), pipelines))


class HeuristicPolicy(_Policy):
    name = "resihp-heuristic"

    def build(self, cluster, model, coster, healthy, layout) -> Plan:
        base = _healthy_or_uniform(self, cluster, model, healthy, layout)
        pipes = home_pipelines(cluster, layout)
        shares0 = even_split(model.microbatches, layout.dp)
        built: list[tuple[int, tuple[Stage, ...]]] = []
        for r, groups in enumerate(pipes):
            if not any(not cluster.degraded.isdisjoint(g) for g in groups):
                built.append((r, base.pipelines[r].stages))
                continue
            new_groups = [g for g in (self.exclude(g, cluster, model) for g in groups) if g]
            stages = self.split_layers(new_groups, coster, model, shares0[r])
            if stages is not None:
                built.append((r, stages))
        rates = np.array([1.0 / max(sum(fb) for fb in coster.pipeline_fb(st)) for _, st in built])
        caps = _caps(coster, [st for _, st in built], model.microbatches)
        shares = proportional_split(model.microbatches, rates, caps, minimum=0)
        pipelines, dp = [], 0
        for (r, stages), m in zip(built, shares):
            if m > 0:
                pipelines.append(Pipeline(dp, stages, m, home=r))
                dp += 1
        return Plan(len(cluster), layout, pipelines, unplaced(len(cluster), pipelines))

    @staticmethod
    def exclude(group: tuple[int, ...], cluster: ClusterSpec, model: ModelSpec) -> tuple[int, ...]:
        """The fastest power-of-two subset maximising k x (its slowest member's speed)."""
        alive = sorted((r for r in group if cluster.devices[r].alive),
                       key=lambda r: (-cluster.devices[r].speed, r))
        best, best_value = (), 0.0
        for k in powers_of_two_upto(len(alive)):
            if model.heads % k:
                continue
            value = k * cluster.devices[alive[k - 1]].speed
            if value > best_value + 1e-12:
                best, best_value = tuple(sorted(alive[:k])), value
        return best

    @staticmethod
    def split_layers(groups: list[tuple[int, ...]], coster: StageCoster, model: ModelSpec,
                     m: int) -> tuple[Stage, ...] | None:
        """Layers in proportion to each stage's speed (1 / per-layer time), capped by memory."""
        if not groups or len(groups) > model.layers:
            return None
        p = len(groups)
        rates = np.array([1.0 / sum(coster.per_layer_s(g)) for g in groups])
        caps = []
        for s, g in enumerate(groups):
            in_flight = coster.in_flight(p, s, m)
            free = coster.memory_free_gb(g)
            cap = 0
            while cap < model.layers and stage_memory_gb(
                    model, cap + 1, len(g), in_flight, s == 0, s == p - 1) <= free:
                cap += 1
            caps.append(cap)
        if min(caps) < 1 or sum(caps) < model.layers:
            return None
        counts = proportional_split(model.layers, rates, np.array(caps))
        if sum(counts) != model.layers:
            return None
        return Stages(Stage(g, rng) for g, rng in zip(groups, layer_ranges(counts)))


POLICIES: dict[str, type[Planner]] = {
    "resihp": Planner,
    "uniform": UniformPolicy,
    "resihp-heuristic": HeuristicPolicy,
    "drop-replica": DropReplicaPolicy,
}


def make_policy(name: str, cost_model: CostModel | None = None, **kwargs) -> Planner:
    """A policy by name, all with the same ``plan(cluster, model, current, time_limit_s)``."""
    if name not in POLICIES:
        from resihp.errors import InputError

        raise InputError(f"--policy: unknown policy {name!r} (expected one of "
                         f"{', '.join(POLICIES)})")
    return POLICIES[name](cost_model or AnalyticCost(), **kwargs)
