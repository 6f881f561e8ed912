"""Checkpoint-restart: the common practice, with no fail-slow handling."""

from __future__ import annotations

from resihp.replay.interface import Context, Policy, Reaction
from resihp.replay.layout import ReplicaLayout


class CheckpointRestart(Policy):
    """On a fail-stop, restart the job from the last checkpoint on the nodes that are left.

    Models what large jobs do by default (Llama 3's "restart on failure" with periodic checkpoints):
    the work since the last checkpoint is lost, the restart costs ``costs.restart``, and Megatron's
    uniform layout is rebuilt over whole healthy nodes (replicas that no longer fit are dropped and
    the global batch is spread over the rest). A repaired node rejoins at a planned restart taken
    right after a checkpoint (no lost work, one restart). Fail-slows are not handled: the job runs
    at the pace of its slowest device. Simplified: no spare-node pool, no checkpoint save cost.
    """

    name = "checkpoint-restart"
    exclude_label = "restart without"

    def layout_without(self, ctx: Context, exclude: set[int]) -> ReplicaLayout:
        return ctx.uniform_layout(ctx.known_dead | exclude)

    def exclude_cost_s(self, ctx: Context) -> float:
        return ctx.scenario.costs.restart_s

    def on_stop(self, ctx: Context, devices: list[int]) -> Reaction:
        return Reaction(
            ctx.uniform_layout(ctx.known_dead),
            ctx.scenario.costs.restart_s,
            rollback=True,
            label="restart from checkpoint",
        )

    def on_recover(self, ctx: Context, devices: list[int]) -> Reaction | None:
        layout = ctx.uniform_layout(ctx.known_dead)
        if len(layout.devices) <= len(ctx.layout.devices):
            return None  # the node does not complete a replica: nothing to gain from a restart
        return Reaction(
            layout, ctx.scenario.costs.restart_s, label="planned restart with repaired node"
        )
