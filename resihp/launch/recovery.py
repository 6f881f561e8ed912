"""Recovery after a launch ends: one strategy, chosen over the launch's typed result, runs it.

A launch ends in an ``Outcome`` (the supervisor's typed record: return code, fail-stop event,
interruption, replica records). ``recovery_for`` picks the first strategy of ``STRATEGIES`` that
applies to it, and the strategy relaunches and joins the relaunch's summary to the launch's:

- ``RestartInPlace`` (``--recovery restart``): the same layout, every rank restored from its memory
  tier or a peer's, else the newest checkpoint;
- ``RelaunchReplicas`` (replica mode, every replica lost): the whole job from its newest checkpoint;
- ``ExcludeRank`` (a lost rank, with checkpoints): the survivors re-formed around it as the planner
  says, from the newest checkpoint, on every node.

A node other than 0 follows node 0's relaunches (``follow_relaunches``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar, Protocol

import pandas as pd

from resihp.ckpt.integrity import step_of
from resihp.launch.replicas import supervise_replicas
from resihp.launch.summary import live_fields, live_loop, replica_fields, run_summary, write_summary
from resihp.launch.supervisor import Outcome, announce_no_relaunch, await_relaunch, supervise
from resihp.progress import progress_bar
from resihp.train.config import RunConfig
from resihp.train.elastic import latest_checkpoint, layout_without, reform_around, relaunch_config
from resihp.train.engine_snapshots import (
    flush_checkpoints,
    recovery_record,
    restartable,
    start_keeper,
    stop_keepers,
    verify_ahead,
)
from resihp.train.inject import carried_faults
from resihp.train.nodes import Nodes
from resihp.train.planning import (
    predicted_step_s,
    step_check,
    trace_compute_seconds,
    trace_step_seconds,
)

RESTARTS = 3  # relaunches in place (--recovery restart) before the job is given up
RELAUNCH_WAIT_S = 120.0  # how long another node waits for node 0 to relaunch the job
NODE0_FINISHED = "the job ended on node 0: finished"


@dataclass
class LaunchResult:
    """How one launch ended, as recovery reads it: its configuration, outcome and summary."""

    cfg: RunConfig
    outcome: Outcome
    summary: dict
    nodes: Nodes
    json_out: bool = False
    keeper: Callable[[], None] | None = None  # polled while a launch runs: restarts a dead keeper
    attempt: int = 1  # the relaunch this result's recovery would be (1: the first)


class RecoveryStrategy(Protocol):
    """A way to go on after a launch failed: whether it applies, and the relaunch it makes."""

    name: ClassVar[str]

    def applies(self, result: LaunchResult) -> bool: ...

    def recover(self, result: LaunchResult) -> LaunchResult: ...


def _replicas(cfg: RunConfig) -> bool:
    return cfg.faults.recovery.startswith("replica")


def _skipped(skipped: list[tuple[Path, str]]) -> list[str]:
    return [f"{p.name}: {why}" for p, why in skipped]


def _ops(out: Path, columns: list[str] | None = None) -> pd.DataFrame | None:
    """The ops trace a launch into ``out`` recorded, or None."""
    ops = out / "ops.parquet"
    return pd.read_parquet(ops, columns=columns) if ops.exists() else None


def _first_step_s(trace: pd.DataFrame | None) -> float | None:
    """When a launch started its first step (its ops trace), or None."""
    if trace is None:
        return None
    steps = trace[trace.optype == "step"]
    return float(steps.start_ts.min()) if len(steps) else None


def _joined_losses(summary: dict, resumed: int, after: dict) -> list:
    """The launch's losses of the steps before ``resumed``, then the relaunch's."""
    first = summary.get("first_step") or 0
    return list(summary.get("losses") or [])[: max(0, resumed - first)] + list(
        after.get("losses") or []
    )


def _ended(result: LaunchResult, summary: dict, again: Outcome) -> LaunchResult:
    """The launch's result after its relaunch ended in ``again``, the summary written."""
    if again.interrupted:
        summary["interrupted"] = again.interrupted
    write_summary(Path(result.cfg.out), summary)
    return replace(result, outcome=again, summary=summary)


def _watched(new: RunConfig, launch: Callable, json_out: bool) -> tuple[Outcome, dict, float]:
    """Run a relaunch as the launch was: its progress shown, its live loop watching its steps (the
    relaunch's layout taken as the plan in force); its outcome, summary and start time."""
    loop = live_loop(new)
    started = time.time()
    with progress_bar("after restart", new.train.steps, enabled=not json_out) as advance:
        again = launch(lambda s: advance(s + 1), loop.on_steps if loop else None)
    after = run_summary(new, again)
    if _replicas(new):
        replica_fields(Path(new.out), again, after)
    if loop is not None and not again.interrupted:
        after.update(live_fields(new, loop, after))
        write_summary(Path(new.out), after)
    return again, after, started


class RestartInPlace:
    """``--recovery restart``: relaunch the same layout, every rank restored from memory.

    Each rank restores from its memory tier or a peer's, else the newest checkpoint of this job,
    else step 0. Up to ``RESTARTS`` relaunches. The losses join the run's before the failure to
    those after it, from the step it went on at.
    """

    name: ClassVar[str] = "restart"

    def applies(self, result: LaunchResult) -> bool:
        """Whether the run asked for restarts in place and its outcome can be restarted."""
        return result.cfg.faults.recovery == "restart" and restartable(result.outcome)

    def recover(self, result: LaunchResult) -> LaunchResult:
        """Relaunch in place until a launch ends that cannot be restarted."""
        cfg, summary = result.cfg, result.summary
        out, before, first = Path(cfg.out), Path(cfg.out), summary.get("first_step") or 0
        losses, records = list(summary.get("losses") or []), []
        before_summary, after, again = summary, {}, result.outcome
        for attempt in range(1, RESTARTS + 1):
            ckpt, _ = latest_checkpoint(cfg)
            # the faults injected are the failed run's; one during=restore strikes the first restore
            during = (
                [
                    text
                    for text, f in zip(cfg.faults.inject, cfg.fault_list(), strict=True)
                    if f.during == "restore"
                ]
                if attempt == 1
                else []
            )
            new = cfg.relaunched_into(
                out / ("restart" if attempt == 1 else f"restart-{attempt}"),
                inject=during,
                resume=str(ckpt) if ckpt else cfg.checkpoint.resume,
            )
            failure, why = again.failure, again.error
            verify_ahead(cfg.job_id)  # the keeper checks the slots while the job relaunches
            with progress_bar(
                "after restart", new.train.steps, enabled=not result.json_out
            ) as advance:
                again = supervise(
                    new,
                    on_step=lambda s: advance(s + 1),
                    on_poll=result.keeper,
                    nodes=result.nodes,
                    attempt=attempt,
                )
            after = run_summary(new, again)
            record = recovery_record(
                before, Path(new.out), failure, before_summary, after, cause=why
            )
            records.append(record)
            resumed = (
                record["resumed_step"]
                if record["resumed_step"] is not None
                else len(losses) + first
            )
            losses = losses[: max(0, resumed - first)] + list(after.get("losses") or [])
            before, before_summary = Path(new.out), after
            if not restartable(again):
                break
        summary.update(
            {
                "recovery": records[0]
                if len(records) == 1
                else {**records[-1], "restarts": records},
                "losses": losses,
                "first_step": first,
                "steps": first + len(losses),
                "loss_last": losses[-1] if losses else None,
                "after_restart": after,
                "tokens_per_s_after": after.get("tokens_per_s"),
                "error": again.error,
            }
        )
        return _ended(result, summary, again)


class RelaunchReplicas:
    """Replica mode with checkpoints, every replica lost: the whole job from its newest checkpoint.

    No live peer holds the state, so the job is relaunched whole into OUT/restart, with the
    slowdowns still in force (a stop, hang or error injected before struck once: it took the job
    down). The summary's losses go on from the checkpoint (``restart``: where from, and how long
    the relaunch took).
    """

    name: ClassVar[str] = "relaunch-replicas"

    def applies(self, result: LaunchResult) -> bool:
        """Whether every replica of a one-node replica-mode job with checkpoints was lost."""
        cfg, outcome = result.cfg, result.outcome
        return (
            _replicas(cfg)
            and outcome.all_replicas_lost
            and bool(cfg.checkpoint.ckpt_every)
            and result.nodes.nnodes == 1
            and not outcome.interrupted
        )

    def recover(self, result: LaunchResult) -> LaunchResult:
        """Relaunch every replica from the newest checkpoint that verifies."""
        cfg, summary = result.cfg, result.summary
        out = Path(cfg.out)
        ckpt, skipped = latest_checkpoint(cfg)
        if ckpt is None:
            summary["restart"] = {
                "restarted": False,
                "reason": "no checkpoint of this job that verifies",
                "skipped": _skipped(skipped),
            }
            write_summary(out, summary)
            return result
        resumed = step_of(ckpt) + 1
        world = cfg.dims().world_size
        ahead = [
            f.spec()
            for f in carried_faults(cfg.fault_list(), list(range(world)), resumed)
            if f.kind in ("slow", "link")
        ]
        new = relaunch_config(cfg, ckpt, out / "restart", inject=ahead)
        again, after, t0 = _watched(
            new,
            lambda on_step, on_steps: supervise_replicas(new, on_step=on_step, on_steps=on_steps),
            result.json_out,
        )
        first = _first_step_s(_ops(Path(new.out), ["optype", "start_ts"]))
        losses = _joined_losses(summary, resumed, after)
        summary.update(
            {
                "restart": {
                    "restarted": True,
                    "reason": "every replica was lost",
                    "restart_from": str(ckpt),
                    "resumed_step": resumed,
                    "skipped": _skipped(skipped),
                    "restart_s": round(first - t0, 3) if first is not None else None,
                },
                "plan_changes": [
                    *(summary.get("plan_changes") or []),
                    *(after.get("plan_changes") or []),
                ],
                "after_restart": after,
                "losses": losses,
                "loss_last": losses[-1] if losses else None,
                "steps": resumed + len(after.get("losses") or []),
                "tokens_per_s_after": after.get("tokens_per_s"),
                "error": again.error,
            }
        )
        return _ended(result, summary, again)


class ExcludeRank:
    """A lost rank with checkpoints: restart from the newest, the survivors re-formed around it.

    The survivors take the planner's layout (else the surviving uniform layout). On several nodes
    every survivor stays on its node (``Nodes.sizes``: the nodes' ranks in order) and the other
    nodes' launchers join the relaunch node 0 announces (``follow_relaunches``); where that cannot
    be (a memory tier, a node with no survivor, no re-formed plan) node 0 tells them there is none,
    and the summary names the checkpoint the survivors resume from. A rank lost in the relaunch is
    excluded in turn.
    """

    name: ClassVar[str] = "exclude"

    def applies(self, result: LaunchResult) -> bool:
        """Whether a rank was lost in a job with checkpoints outside replica mode."""
        cfg, outcome = result.cfg, result.outcome
        return (
            outcome.failure is not None
            and bool(cfg.checkpoint.ckpt_every)
            and not outcome.interrupted
            and not _replicas(cfg)
        )

    def recover(self, result: LaunchResult) -> LaunchResult:
        """Write the newest snapshot to disk, then relaunch the survivors from it."""
        flush_checkpoints(result.cfg, breakpoint=True)  # keeper-written checkpoints first
        return self._relaunch(result)

    def _relaunch(self, result: LaunchResult) -> LaunchResult:
        cfg, outcome, summary, nodes = result.cfg, result.outcome, result.summary, result.nodes
        out = Path(cfg.out)
        ckpt, skipped = latest_checkpoint(cfg)
        rank = outcome.failure.rank
        multi = nodes.nnodes > 1
        reformed = (
            self._reformed(cfg, outcome, summary, ckpt)
            if ckpt and not (multi and cfg.snapshot_interval())
            else None
        )
        new_nodes = nodes
        if multi:  # each survivor on its node: the nodes' new rank counts
            node_of = {r: n for n, rs in nodes.layout().items() for r in rs}
            sizes = (
                tuple(sum(node_of[old] == n for old in reformed.ranks) for n in range(nodes.nnodes))
                if reformed
                else ()
            )
            if not sizes or min(sizes) == 0:
                why = (
                    "no checkpoint of this job that verifies"
                    if not ckpt
                    else "a memory tier on several nodes is not relaunched re-formed"
                    if cfg.snapshot_interval()
                    else "a node has no device left"
                    if sizes
                    else "no re-formed plan for the survivors"
                )
                announce_no_relaunch(nodes, result.attempt, why)
                summary["recovery"] = {
                    "restarted": False,
                    "reason": why,
                    "checkpoint": str(ckpt) if ckpt else None,
                    "skipped": _skipped(skipped),
                }
                write_summary(out, summary)
                return result
            new_nodes = replace(nodes, sizes=sizes)
        new = (
            reformed.cfg
            if reformed
            else layout_without(cfg, rank, ckpt, out / "restart")
            if ckpt
            else None
        )
        if new is None:
            summary["recovery"] = {
                "restarted": False,
                "reason": "no checkpoint of this job that verifies"
                if not ckpt
                else "no device left to continue on",
                "skipped": _skipped(skipped),
            }
            write_summary(out, summary)
            return result
        t0 = time.time()
        keeper = start_keeper(new, 0)  # the relaunch's own memory tier, if it snapshots
        again, after, _ = _watched(
            new,
            lambda on_step, on_steps: supervise(
                new,
                on_step=on_step,
                on_poll=keeper,
                on_steps=on_steps,
                nodes=new_nodes if multi else None,
                attempt=result.attempt if multi else 0,
            ),
            result.json_out,
        )
        if again.failure is not None and not again.interrupted and new.checkpoint.ckpt_every:
            # another device lost in the relaunch: re-formed around it in turn, from the
            # relaunch's newest checkpoint, so ``after`` then holds both relaunches' losses and
            # plan changes
            flush_checkpoints(new, breakpoint=True)
            nested = self._relaunch(
                LaunchResult(
                    new, again, after, new_nodes, result.json_out, attempt=result.attempt + 1
                )
            )
            after, again = nested.summary, nested.outcome
        stop_keepers(new, breakpoint=again.error is not None)
        change = self._change(rank, ckpt, skipped, new, reformed, t0)
        losses = _joined_losses(summary, change["resumed_step"], after)
        # the launch's own live changes, this exclusion, then the relaunch's (and any later one)
        before = [c for c in summary.get("plan_changes") or [] if c.get("kind") != "exclude"]
        summary.update(
            {
                "plan_changes": [*before, change, *(after.get("plan_changes") or [])],
                "after_restart": after,
                "losses": losses,
                "loss_last": losses[-1] if losses else None,
                "steps": change["resumed_step"] + len(after.get("losses") or []),
                "tokens_per_s_after": after.get("tokens_per_s"),
                "error": again.error,
            }
        )
        return _ended(result, summary, again)

    @staticmethod
    def _reformed(cfg: RunConfig, outcome: Outcome, summary: dict, ckpt: Path):
        """The planner's layout for the survivors, priced on the launch layout's healthy steps
        (the warm-up step 0 aside, before the loss and any change); None where it has none."""
        trace = _ops(Path(cfg.out))
        before = trace_step_seconds(trace) if trace is not None else {}
        computed = trace_compute_seconds(trace) if trace is not None else {}
        ends = [outcome.failure.step] + [
            c.get("applied_step") for c in summary.get("plan_changes") or []
        ]
        stop = min((s for s in ends if s is not None), default=None)
        healthy = [s for s in before if s > 0 and (stop is None or s < stop)]
        compute = [computed[s] for s in healthy if s in computed]
        return reform_around(
            cfg,
            outcome.failure.rank,
            ckpt,
            Path(cfg.out) / "restart",
            measured=[before[s] for s in healthy],
            compute=compute if len(compute) == len(healthy) else None,
        )

    @staticmethod
    def _change(rank: int, ckpt: Path, skipped, new: RunConfig, reformed, t0: float) -> dict:
        """The exclusion as a plan change: where it restarted from, its layout, how long it took
        and, for the planner's layout, its plan and its estimate against the relaunch's steps."""
        trace = _ops(Path(new.out))
        first = _first_step_s(trace)
        change = {
            "kind": "exclude",
            "rank": rank,
            "restart_from": str(ckpt),
            "resumed_step": step_of(ckpt) + 1,
            "layout": {"dp": new.parallel.dp, "pp": new.parallel.pp, "tp": new.parallel.tp},
            "restart_s": round(first - t0, 3) if first else None,
            "skipped": _skipped(skipped),
        }
        if reformed is not None:  # the planner's layout: pipelines of the relaunch's ranks
            change.update(
                applied=True,
                layout=reformed.change["layout"],
                ranks=reformed.ranks,
                layer_splits=reformed.change["layer_splits"],
                dp_weights=reformed.change["dp_weights"],
                predicted_step_s=predicted_step_s(reformed.plan),
                plan=reformed.plan.to_dict(),
                planner_calibration=reformed.calibration,
            )
            # the estimate against the relaunch's steps after the one that re-formed the groups
            relaunched = trace_step_seconds(trace) if trace is not None else {}
            change.update(
                step_check(
                    change["predicted_step_s"],
                    [v for s, v in relaunched.items() if s > change["resumed_step"]],
                )
            )
        return change


STRATEGIES: tuple[RecoveryStrategy, ...] = (RestartInPlace(), RelaunchReplicas(), ExcludeRank())


def recovery_for(result: LaunchResult) -> RecoveryStrategy | None:
    """The first strategy of ``STRATEGIES`` that applies to ``result``, or None."""
    return next((s for s in STRATEGIES if s.applies(result)), None)


def recover(result: LaunchResult) -> LaunchResult:
    """``result`` after the recovery that applies to it, or as it is where none does."""
    strategy = recovery_for(result)
    return strategy.recover(result) if strategy is not None else result


def follow_relaunches(
    cfg: RunConfig, outcome: Outcome, nodes: Nodes, reformed: bool
) -> tuple[Outcome, Nodes]:
    """A node other than 0: after its part of a failed launch, join each relaunch node 0 announces.

    Each relaunch runs in node 0's configuration of it, until one ends well, node 0 announces none,
    none comes within the wait, or this node is stopped.

    Args:
        cfg: this node's configuration of the launch.
        outcome: how this node's part of the launch ended.
        nodes: the job's nodes (their ranks may change with a relaunch).
        reformed: re-formed around a lost device (into OUT/restart, OUT/restart/restart, ..., on
            the ranks node 0 gives this node), else a restart in place (--recovery restart: into
            OUT/restart, restart-2, ...).

    Returns:
        The last outcome, and this node's part of the last launch.
    """
    out = Path(cfg.out)
    for attempt in range(1, RESTARTS + 1):
        failed = (outcome.error not in (None, NODE0_FINISHED)) or outcome.returncode != 0
        if not failed or outcome.interrupted or outcome.input_error:
            break
        # node 0 relaunches once it has stopped every node's workers and written its summary
        job = await_relaunch(nodes, attempt, max(RELAUNCH_WAIT_S, cfg.faults.timeout_s))
        if not job or job.get("no_relaunch"):  # none came, or node 0 said there is none
            if job:
                outcome.error = (
                    f"{outcome.error}; node 0 does not relaunch it: {job['no_relaunch']}"
                )
            break
        if job.get("sizes"):
            nodes = replace(nodes, sizes=tuple(job["sizes"]))
        out = (
            out / "restart"
            if reformed
            else Path(cfg.out) / ("restart" if attempt == 1 else f"restart-{attempt}")
        )
        # node 0's configuration of the relaunch (its layout, checkpoint, faults still ahead)
        outcome = supervise(
            cfg.updated(**job["config"], out=str(out)), nodes=nodes, attempt=attempt
        )
    return outcome, nodes
