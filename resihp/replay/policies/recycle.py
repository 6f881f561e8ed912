"""ReCycle-style rerouting of micro-batches to data-parallel peers (fail-stop only)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from resihp.replay.interface import Context, Policy, Reaction
from resihp.replay.layout import ReplicaLayout


class ReCycle(Policy):
    """Keeps every replica running and sends a failed stage's micro-batches to its peers.

    Models ReCycle (Gandhi et al., SOSP 2024): when a device fails, the micro-batches that its
    pipeline stage would have processed are rerouted to the stages at the same position in the other
    data-parallel replicas (which hold the same layers), and the extra work is scheduled into the
    pipeline bubbles (decoupled backpropagation) so that no restart and no rollback is needed; the
    schedule change costs ``costs.reconfig``. Here the extra work of a stage position with ``k``
    failed of ``P`` peers is ``k/(P-k)`` of a stage's micro-batches per surviving peer, minus what
    fits into its ``pp-1`` micro-batch bubble slots; the remainder slows that stage in every replica
    (the failed replica's stage runs on a borrowed peer at the same pace). A repaired device's stage
    resumes its own work. When every peer of a stage position is dead, it falls back to
    checkpoint-restart. Fail-slows are not handled.
    """

    name = "recycle"

    def start(self, ctx: Context) -> ReplicaLayout:
        self.home = ctx.uniform_layout(set())
        return self.home

    exclude_label = "reroute around"

    def layout_without(self, ctx: Context, exclude: set[int]) -> ReplicaLayout | None:
        return self.reroute(ctx, exclude)

    def exclude_cost_s(self, ctx: Context) -> float:
        return ctx.scenario.costs.reconfig_s

    def reroute(self, ctx: Context, exclude: set[int] = frozenset()) -> ReplicaLayout | None:
        home = self.home.replicas
        pp = len(home[0].groups)
        dead = ctx.known_dead | set(exclude)
        failed = np.array([[any(d in dead for d in g) for g in r.groups] for r in home])  # [dp, pp]
        alive_peers = (~failed).sum(axis=0)
        if (alive_peers == 0).any():
            return None
        k = failed.sum(axis=0)
        m = np.array([r.microbatches for r in home]).mean()
        extra = (
            k / alive_peers * m
        )  # micro-batches each surviving peer takes on, per stage position
        load = 1.0 + np.maximum(0.0, extra - (pp - 1)) / m
        replicas = []
        for i, r in enumerate(home):
            groups = list(r.groups)
            for s in np.flatnonzero(failed[i]):
                donor = int(np.flatnonzero(~failed[:, s])[0])
                groups[s] = home[donor].groups[s]
            replicas.append(replace(r, groups=tuple(groups), load=tuple(float(x) for x in load)))
        note = f"rerouting around {int(k.sum())} failed stage(s)" if k.sum() else "home layout"
        return ReplicaLayout(tuple(replicas), note=note)

    def on_stop(self, ctx: Context, devices: list[int]) -> Reaction:
        layout = self.reroute(ctx)
        if layout is None:  # no peer left at some stage: restart on the whole nodes that remain
            self.home = ctx.uniform_layout(ctx.known_dead)
            return Reaction(
                self.home,
                ctx.scenario.costs.restart_s,
                rollback=True,
                label="no peer left: restart from checkpoint",
            )
        return Reaction(layout, ctx.scenario.costs.reconfig_s, label="reroute micro-batches")

    def on_recover(self, ctx: Context, devices: list[int]) -> Reaction | None:
        layout = self.reroute(ctx)
        if layout is None:
            return None
        return Reaction(layout, ctx.scenario.costs.reconfig_s, label="stage resumes its own work")
