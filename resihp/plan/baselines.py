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

from resihp.errors import InputError
from resihp.plan.cost import AnalyticCost, CostModel
from resihp.plan.heuristics import drop_replica_plan, heuristic_plan
from resihp.plan.plan import Plan
from resihp.plan.planner import Planner, healthy_plan
from resihp.plan.specs import ClusterSpec, ModelSpec
from resihp.plan.timing import evaluate


class _Policy(Planner):
    """Shares the planner's layout, healthy plan and bound; subclasses build the plan."""

    def plan(
        self,
        cluster: ClusterSpec,
        model: ModelSpec,
        current: Plan | None = None,
        time_limit_s: float = 5.0,
    ) -> Plan:
        t0 = time.perf_counter()
        coster = self.coster(cluster, model)
        layout = self.layout(cluster, model, current)
        healthy = self.healthy(cluster, model)
        plan = self.build(
            cluster, model, coster, healthy if healthy.layout == layout else None, layout
        )
        plan.policy = self.name
        if sum(p.share(model) for p in plan.pipelines) != model.global_batch_tokens:
            # the policy cannot place the global batch (memory): the job stops
            plan = Plan(len(cluster), layout, [], list(range(len(cluster))), policy=self.name)
        evaluate(plan, coster, self.bound(cluster, model), current)
        plan.solver = {
            "status": "heuristic",
            "gap": float("nan"),
            "solve_s": time.perf_counter() - t0,
        }
        return plan

    def build(self, cluster, model, coster, healthy, layout) -> Plan:  # pragma: no cover
        raise NotImplementedError

    def base(self, cluster: ClusterSpec, model: ModelSpec, healthy: Plan | None, layout) -> Plan:
        """The healthy plan of this layout (the one given, or a new one)."""
        return healthy if healthy is not None else healthy_plan(cluster, model, self.cost, layout)


class UniformPolicy(_Policy):
    name = "uniform"

    def build(self, cluster, model, coster, healthy, layout) -> Plan:
        """The policy's plan for ``cluster`` from the healthy plan of ``layout``.

        Args:
            cluster: the cluster at its current speeds.
            model: the model.
            coster: the stage coster at those speeds.
            healthy: the healthy plan (None: made here).
            layout: the layout the plan keeps.
        """
        base = self.base(cluster, model, healthy, layout)
        return Plan(base.world_size, base.layout, list(base.pipelines), list(base.excluded))


class DropReplicaPolicy(_Policy):
    name = "drop-replica"

    def build(self, cluster, model, coster, healthy, layout) -> Plan:
        """The policy's plan for ``cluster`` from the healthy plan of ``layout``.

        Args:
            cluster: the cluster at its current speeds.
            model: the model.
            coster: the stage coster at those speeds.
            healthy: the healthy plan (None: made here).
            layout: the layout the plan keeps.
        """
        return drop_replica_plan(
            cluster, model, coster, self.base(cluster, model, healthy, layout), layout
        )


class HeuristicPolicy(_Policy):
    name = "resihp-heuristic"

    def build(self, cluster, model, coster, healthy, layout) -> Plan:
        """The policy's plan for ``cluster`` from the healthy plan of ``layout``.

        Args:
            cluster: the cluster at its current speeds.
            model: the model.
            coster: the stage coster at those speeds.
            healthy: the healthy plan (None: made here).
            layout: the layout the plan keeps.
        """
        return heuristic_plan(
            cluster, model, coster, self.base(cluster, model, healthy, layout), layout
        )


POLICIES: dict[str, type[Planner]] = {
    "resihp": Planner,
    "uniform": UniformPolicy,
    "resihp-heuristic": HeuristicPolicy,
    "drop-replica": DropReplicaPolicy,
}


def make_policy(name: str, cost_model: CostModel | None = None, **kwargs) -> Planner:
    """A policy by name, all with the same ``plan(cluster, model, current, time_limit_s)``.

    Args:
        name: the policy (one of ``POLICIES``).
        cost_model: the cost model (None: ``AnalyticCost``).
        **kwargs: passed on to the policy's constructor.
    """
    if name not in POLICIES:
        raise InputError(
            f"--policy: unknown policy {name!r} (expected one of {', '.join(POLICIES)})"
        )
    return POLICIES[name](cost_model or AnalyticCost(), **kwargs)
