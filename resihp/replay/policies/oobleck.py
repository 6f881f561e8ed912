"""Oobleck-style pipeline templates (fail-stop only)."""

from __future__ import annotations

import numpy as np

from resihp.parallel import apportion
from resihp.plan.specs import pipeline_memory_gb
from resihp.replay.interface import Context, Policy, Reaction
from resihp.replay.layout import Replica, ReplicaLayout
from resihp.replay.policies.common import balance_microbatches, believed_speeds


class Oobleck(Policy):
    """Re-instantiates pipelines from templates over the surviving nodes, with no restart.

    Models Oobleck (Jang et al., SOSP 2023): pipeline templates for every node count from the
    smallest that fits the model in memory up to the original pipeline size; after a failure the
    affected pipelines are rebuilt from a smaller template with the layers re-split evenly, missing
    state is copied from the other replicas (``costs.reconfig``, no rollback), and the global batch
    is redistributed so that pipelines of different sizes finish together. A repaired node is added
    back the same way. Simplified: templates are chosen by keeping the original number of pipelines
    where nodes allow (fewer when they do not), with node counts as even as possible; fail-slows are
    not handled.
    """

    name = "oobleck"

    def start(self, ctx: Context) -> ReplicaLayout:
        return self.instantiate(ctx)

    exclude_label = "re-instantiate without"

    def layout_without(self, ctx: Context, exclude: set[int]) -> ReplicaLayout:
        return self.instantiate(ctx, exclude)

    def exclude_cost_s(self, ctx: Context) -> float:
        return ctx.scenario.costs.reconfig_s

    def instantiate(self, ctx: Context, exclude: set[int] = frozenset()) -> ReplicaLayout:
        sc = ctx.scenario
        g, tp, pp, dp = sc.cluster.gpus_per_node, sc.parallel.tp, sc.parallel.pp, sc.parallel.dp
        per_node = g // tp
        nodes = [
            n
            for n in range(len(ctx.job_devices) // g)
            if not any(d in ctx.known_dead or d in exclude for d in range(n * g, (n + 1) * g))
        ]
        max_nodes = max(1, -(-pp // per_node))
        min_nodes = next(
            (k for k in range(1, max_nodes + 1) if self.fits(sc, k * per_node, tp)), max_nodes
        )
        n_pipes = min(dp, len(nodes) // min_nodes)
        sizes = np.minimum(max_nodes, np.full(n_pipes, len(nodes) // max(n_pipes, 1)))
        spare = len(nodes) - sizes.sum()
        for i in range(n_pipes):
            if spare > 0 and sizes[i] < max_nodes:
                sizes[i] += 1
                spare -= 1
        replicas, k = [], 0
        for size in sizes:
            groups = []
            for n in nodes[k : k + size]:
                for s in range(per_node):
                    groups.append(tuple(range(n * g + s * tp, n * g + (s + 1) * tp)))
            groups = groups[:pp] if size == max_nodes else groups
            k += size
            replicas.append(
                Replica(
                    tuple(groups),
                    tuple(apportion(sc.model.layers, np.ones(len(groups)), minimum=1)),
                    1,
                )
            )
        layout = ReplicaLayout(
            tuple(replicas), note=f"oobleck templates {sorted(map(int, sizes))} nodes"
        )
        return balance_microbatches(ctx, layout, believed_speeds(ctx))

    @staticmethod
    def fits(sc, stages: int, tp: int) -> bool:
        """Whether a template of ``stages`` stages of ``tp`` devices fits a device's free memory.

        Layers split evenly, each stage holding 1F1B's in-flight micro-batches.

        Args:
            sc: the scenario (its model and cluster).
            stages: the template's pipeline stages.
            tp: devices per stage (tensor-parallel group size).
        """
        counts = apportion(sc.model.layers, np.ones(stages), minimum=1)
        need = pipeline_memory_gb(sc.model, counts, tp, sc.model.microbatches)
        return max(need) <= sc.cluster.free_memory_gb()

    def on_stop(self, ctx: Context, devices: list[int]) -> Reaction:
        return Reaction(
            self.instantiate(ctx), ctx.scenario.costs.reconfig_s, label="re-instantiate"
        )

    def on_recover(self, ctx: Context, devices: list[int]) -> Reaction | None:
        layout = self.instantiate(ctx)
        if len(layout.devices) <= len(ctx.layout.devices):
            return None
        return Reaction(layout, ctx.scenario.costs.reconfig_s, label="add repaired node")
