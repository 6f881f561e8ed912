"""The launcher of a job with replica-level fault tolerance (``resihp run --recovery replica``).

Each data-parallel replica runs as its own torchrun (its pipeline and tensor-parallel ranks), all
on the job's store. The launcher hosts the store and the quorum's first generation, aggregates each
replica's heartbeats, and judges them: a dead or hung rank (or a replica whose workers exit with an
error) evicts its replica from the quorum, which the survivors see at their next vote; the
replica's processes are killed (which also frees any survivor blocked on it in a collective) and
relaunched alone, to catch up from a live peer and rejoin. The survivors are never restarted.
On several nodes this is node 0's part (it also judges the other nodes' replicas, and tells their
launchers to stop and relaunch one: ``replica_launch.serve_replicas``).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch.distributed as dist

from resihp.ckpt.integrity import remove_partial
from resihp.detect.heartbeat import HeartbeatMonitor
from resihp.errors import InputError
from resihp.ft.quorum import DecisionChain, Generation, Member, Quorum
from resihp.launch.replica_launch import (
    ReplicaLauncher,
    node_replicas,
    replica_ranks,
    serve_replicas,
    stop_replicas,
)
from resihp.launch.supervisor import (
    GRACE_S,
    STOPPED_S,
    Outcome,
    _join,
    _Signals,
    control_plane_costs,
    fail_stop,
    fault_timeouts,
    hand_on_steps,
    job_config,
    owned,
    stacks_of_hung,
)
from resihp.opstrace import TRACE_STREAM
from resihp.train.config import RunConfig
from resihp.train.controlplane import (
    StepReader,
    StepRecords,
    announce_job,
    heartbeat_prefix,
    mark_ended,
    nodes_left,
    order_replica,
    plan_key,
    post_change,
    prefix_of,
    read_errors,
    replica_attempt,
)
from resihp.train.nodes import Nodes
from resihp.train.replica import BEAT_S
from resihp.train.store import JobStore

MAX_RELAUNCHES = 3  # per replica: a replica that keeps failing is left out, the others go on
HANG_FACTOR, HANG_FLOOR_S = 2.0, 3.0


@dataclass
class ReplicaFailure:
    """One replica lost and relaunched (the launcher's record)."""

    replica: int
    attempt: int
    rank: int | None
    cause: str
    step: int | None
    detected_s: float | None
    at: float  # when it was evicted (wall clock)
    relaunched: bool

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def supervise_replicas(
    cfg: RunConfig,
    *,
    heartbeat_timeout_s: float | None = None,
    join_timeout_s: float | None = None,
    on_step: Callable[[int], None] | None = None,
    on_steps: Callable[[list[StepRecords], Callable[[dict], None]], None] | None = None,
    hang_timeout_s: float | None = None,
    poll_s: float = 0.1,
    grace_s: float = GRACE_S,
    nodes: Nodes | None = None,
) -> Outcome:
    """Launch this node's replicas, watch them on the job's store, relaunch a lost one alone.

    Complete steps go to ``on_steps`` (the live loop) with a ``post`` for plan changes: the next
    commit carries the newest one to every rank. On several nodes (``nodes``, each holding whole
    replicas) node 0 hosts the store and the quorum and judges every replica; another node runs
    its replicas and stops or relaunches one when node 0 says so
    (``replica_launch.serve_replicas``).

    Args:
        cfg: the run configuration (``--recovery replica``, ``--dp`` 2 or more).
        heartbeat_timeout_s: seconds without a beat before a rank is dead (None: ``cfg.faults``).
        join_timeout_s: seconds for every rank to join (None: ``cfg.faults``).
        on_step: called with the newest complete step.
        on_steps: the live loop: called with the complete steps and ``post``.
        hang_timeout_s: seconds without progress before a rank is hung (None: ``cfg.faults``).
        poll_s: seconds between looks.
        grace_s: seconds a stopped replica gets to end before SIGKILL.
        nodes: this node's place in the job (None: the only node).
    """
    heartbeat_timeout_s, join_timeout_s, hang_timeout_s = fault_timeouts(
        cfg, heartbeat_timeout_s, join_timeout_s, hang_timeout_s
    )
    if cfg.parallel.dp < 2:
        raise InputError(
            f"--recovery replica: needs --dp 2 or more (the replica is the unit of "
            f"failure), got --dp {cfg.parallel.dp}"
        )
    dims = cfg.dims()
    per = cfg.parallel.pp * cfg.parallel.tp
    nodes = nodes or Nodes(1, 0, dims.world_size, None)
    nodes.check(dims.world_size)
    if nodes.sizes is not None or nodes.nproc_per_node % per:
        raise InputError(
            f"--recovery replica on {nodes.nnodes} nodes: each node holds whole replicas, so "
            f"--nproc-per-node must be a multiple of pp x tp = {per} (got {nodes.nproc_per_node})"
        )
    host = nodes.node_rank == 0
    if host and not cfg.job_id:
        cfg = replace(cfg, job_id=uuid.uuid4().hex[:12])
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / TRACE_STREAM).unlink(missing_ok=True)
    remove_partial(cfg.ckpt_root())
    ranks = replica_ranks(cfg)
    mine = node_replicas(cfg, nodes)
    t0 = time.time()
    outcome = Outcome(returncode=0)
    with (
        _Signals() as signals,
        JobStore(
            nodes.endpoint,
            host=host,
            timeout_s=max(join_timeout_s, 60.0) if host else join_timeout_s,
        ) as js,
    ):
        store = js.store
        if host:
            announce_job(store, cfg.job_id, job_config(cfg), nodes.nnodes, nodes.nproc_per_node)
        else:
            cfg = _join(store, cfg, nodes, join_timeout_s)
        config_path = out / "config.json"
        config_path.write_text(cfg.to_json())
        interval = min(BEAT_S, heartbeat_timeout_s / 4)
        launcher = ReplicaLauncher(
            cfg,
            store,
            js.endpoint,
            config_path,
            interval,
            heartbeat_timeout_s,
            join_timeout_s,
            first=min(mine),
        )
        if not host:
            return serve_replicas(launcher, mine, signals, nodes.node_rank, poll_s, grace_s, t0)
        quorum = Quorum(store, cfg.job_id, per, cfg.faults.timeout_s, plan_key=plan_key(cfg.job_id))
        quorum.set_replicas(cfg.parallel.dp)
        first_step = resumed_step(cfg)
        first = quorum.start([Member(d, 0) for d in range(cfg.parallel.dp)], first_step)
        chain = DecisionChain(quorum, first)
        store.set(f"{prefix_of(cfg.job_id)}/ops/first", str(first_step))
        hb = heartbeat_prefix(cfg.job_id)
        places = {
            r: (c.dp_rank, c.stage, c.tp_rank)
            for r in range(dims.world_size)
            for c in [dims.coords(r)]
        }
        # a false hang costs one replica's relaunch here, not the job: judge hangs sooner (a process
        # stopped for a second; no progress for 2 x the median step, at least 3 s: a relaunched
        # replica's start-up can hold a loaded machine's survivors back for a second or two)
        monitor = HeartbeatMonitor(
            store,
            ranks,
            timeout_s=heartbeat_timeout_s + interval,
            prefix=hb,
            places=places,
            startup_s=join_timeout_s,
            hang_timeout_s=hang_timeout_s,
            hang_factor=HANG_FACTOR,
            hang_floor_s=min(heartbeat_timeout_s, HANG_FLOOR_S),
            stopped_s=STOPPED_S,
        )
        reader = StepReader(
            store, cfg.job_id, ranks, first_step, owner=True, members=quorum.committed
        )
        live = {d: launcher.launch(d, 0) for d in mine}  # this node's replicas
        away = {d for d in ranks if d not in mine}  # other nodes' replicas still in the job
        lost_nodes: set[int] = set()  # nodes whose launcher went silent
        attempts = dict.fromkeys(ranks, 0)
        pending: set[int] = set()  # relaunches ordered on another node, not yet said launched
        done: set[int] = set()

        def read_steps() -> None:
            hand_on_steps(
                reader,
                out,
                on_step,
                on_steps,
                post=lambda change: post_change(store, cfg.job_id, change),
            )

        def lose(
            d: int, rank: int | None, cause: str, step: int | None, detected_s: float | None
        ) -> None:
            bad = [e for e in read_errors(store, cfg.job_id) if e["kind"] == "input"]
            if bad:  # it stopped on bad input (said just before it exited): the job stops, exit 2
                outcome.error, outcome.input_error = bad[0]["message"], True
                return
            attempt = attempts[d]
            quorum.evict(Member(d, attempt), cause)
            chain.abort_for(Member(d, attempt))  # the survivors redo the step in flight without it
            if cause == "hang" and rank is not None:
                # each replica is a node of the monitor; another node's replica's stacks are asked
                # of that node's launcher
                stacks_of_hung(
                    monitor,
                    rank,
                    d if d in live else -1,
                    out,
                    store,
                    cfg.job_id,
                    (lambda pid, r=live[d]: owned(r.tracker, r.proc.pid, pid))
                    if d in live
                    else None,
                )
            at = time.time()
            if d in live:
                stop_replicas([live[d]], grace_s, failed=True)
            for other in [*live, *away]:  # held up by the lost replica, not hung themselves
                if other != d:
                    if other in live:
                        live[other].aggregator.excuse()
                    monitor.excuse(ranks[other], 2 * interval + HANG_FLOOR_S)
            chain.advance()
            reader.lost(
                d, chain.step
            )  # it trained no step from there on; it may not have published its last
            members = [m for m in chain.gen.members if not quorum.is_evicted(m)]
            # a replica whose node's launcher went silent (a lost node) has nobody to relaunch it
            again = (
                attempt < MAX_RELAUNCHES
                and bool(members)
                and not quorum.finished()
                and not (d in away and cause == "node")
            )
            outcome.replica_failures.append(
                ReplicaFailure(d, attempt, rank, cause, step, detected_s, at, again)
            )
            if not members:
                outcome.error = (
                    f"every replica was lost (replica {d}: {cause}); no live peer holds the "
                    "state to go on from"
                )
                outcome.all_replicas_lost = True
            if d in away:  # its node stops it, and relaunches it if told to
                order_replica(store, cfg.job_id, d, attempt + 1, again)
                if cause == "node":
                    lost_nodes.add(d // (nodes.nproc_per_node // per))
            if again:
                attempts[d] = attempt + 1
                monitor.reset(d)
                if d in live:
                    live[d] = launcher.launch(d, attempt + 1)
                else:
                    pending.add(d)  # judged afresh once its node has relaunched it (no stale beats)
            else:
                live.pop(d, None)
                away.discard(d)

        seen_reports = 0  # the workers' reports (read_errors) handled so far
        try:
            while (live or away) and outcome.error is None:
                time.sleep(poll_s)
                if signals.received:
                    outcome.interrupted = signals.received
                    outcome.error = f"stopped by {signals.received}; all workers were stopped"
                    break
                for rep in live.values():
                    rep.tracker.watch(per)
                for d in list(pending):
                    if replica_attempt(store, cfg.job_id, d, "launched") == attempts[d]:
                        monitor.reset(d)
                        pending.discard(d)
                for d in away - done:
                    if replica_attempt(store, cfg.job_id, d, "done") == attempts[d]:
                        done.add(d)
                in_job = set(live) | away
                read_steps()
                chain.advance()
                chain.abort_evicted()
                reports = read_errors(store, cfg.job_id)
                for e in reports[
                    seen_reports:
                ]:  # a rank that crashed said so: its replica is lost now
                    if e["kind"] == "input":  # bad input fails every replica alike: the job stops
                        outcome.error, outcome.input_error = e["message"], True
                        break
                    d = dims.coords(int(e["rank"])).dp_rank if str(e["rank"]).isdigit() else None
                    if e["kind"] == "crash" and d in in_job and d not in done and d not in pending:
                        lose(d, int(e["rank"]), "exception", None, None)
                seen_reports = len(reports)
                if outcome.input_error:
                    break
                for d, rep in list(
                    live.items()
                ):  # a worker gone: known at this poll, not at the next beat
                    gone = rep.aggregator.exited_now() if d not in done else []
                    if gone and d in live:
                        rank, step, silent_s = gone[0]
                        lose(d, rank, "exited", step, silent_s)
                for ev in monitor.poll(monitor.min_step()):
                    d = dims.coords(ev.rank).dp_rank
                    if d in (set(live) | away) and d not in done and d not in pending:
                        lose(
                            d,
                            ev.rank,
                            ev.cause,
                            ev.step,
                            ev.silent_s,
                        )
                for d, rep in list(live.items()):
                    rc = rep.proc.poll()
                    if rc is None or d in done:
                        continue
                    if rc == 0:
                        done.add(d)
                        continue
                    errors = [e for e in read_errors(store, cfg.job_id) if e["rank"] in ranks[d]]
                    if any(e["kind"] == "input" for e in errors):
                        outcome.error = errors[0]["message"]
                        outcome.input_error = True
                        break
                    lose(d, None, f"workers exited with status {rc}", None, None)
                in_job = set(live) | away
                if done and in_job <= done:
                    break
                if quorum.finished() and all(d in done or attempts[d] > 0 for d in in_job):
                    # the survivors are through; a replica still catching up has nothing to join
                    end = time.monotonic() + min(
                        grace_s, 1.0
                    )  # it gets an end of stream, or is stopped
                    while time.monotonic() < end and any(
                        r.proc.poll() is None for r in live.values()
                    ):
                        time.sleep(0.1)
                    done.update(d for d, r in live.items() if r.proc.poll() == 0)
                    break
        finally:
            stop_replicas(live.values(), grace_s, failed=outcome.error is not None)
            beats = [
                m["c"]
                for rep in live.values()
                for m in rep.aggregator._last.values()
                if m is not None
            ]
            with contextlib.suppress(RuntimeError, dist.DistError):
                read_steps()
                outcome.errors = read_errors(store, cfg.job_id)
                outcome.replica_catchups = _catchups(store, quorum, outcome.replica_failures)
                outcome.replica_members = _members(quorum, first_step, cfg.train.steps)
                outcome.control_plane = control_plane_costs(reader, beats)
                (out / "plan_changes.json").write_text(
                    json.dumps(_applied_plans(quorum, first, cfg.parallel.dp))
                )
                mark_ended(store, cfg.job_id, outcome.error or "finished")
                reader.wait_for_followers(grace_s)
                # the store goes with this process: the other nodes see the end and stop their
                # replicas
                end = time.monotonic() + grace_s + 2.0
                waited = [n for n in range(1, nodes.nnodes) if n not in lost_nodes]
                while not nodes_left(store, cfg.job_id, waited) and time.monotonic() < end:
                    time.sleep(0.1)
    if outcome.error is None and not done and not quorum.finished():
        # every step committed is the job done, even where each replica was relaunched on the way
        outcome.error = "no replica finished the job"
    outcome.returncode = 0 if outcome.error is None else 1
    outcome.wall_s = time.time() - t0
    if outcome.error and not outcome.interrupted and outcome.replica_failures:
        last = outcome.replica_failures[-1]
        outcome.failure = fail_stop(
            dims,
            last.rank if last.rank is not None else ranks[last.replica][0],
            last.step,
            last.cause,
            last.detected_s,
        )
    return outcome


def resumed_step(cfg: RunConfig) -> int:
    """The job's first step: after the checkpoint it resumes (``--resume``, resolved), else 0."""
    if not cfg.checkpoint.resume:
        return 0
    # deferred: torch.distributed.checkpoint, for start-up time
    from resihp.ckpt.universal import read_meta

    return int(read_meta(cfg.checkpoint.resume)["step"]) + 1


def _members(quorum: Quorum, first_step: int, steps: int) -> list[list[int]]:
    """The recorded membership: per committed step from ``first_step``, the replicas that trained
    it."""
    found = []
    for step in range(first_step, steps):
        members = quorum.committed(step)
        if members is None:
            break
        found.append(members)
    return found


def _applied_plans(quorum: Quorum, first: Generation, replicas: int) -> list[dict]:
    """Each plan change the commits carried, with the step every rank applied it at (the one
    after the first commit that carried it) and, where it re-formed replicas' groups, what that
    moved: bytes summed over those replicas (written, read, and the least their layouts need),
    seconds of the slowest."""
    applied, seen = [], set()
    for d in quorum.decisions(first):
        if d.commit and d.plan is not None and d.plan.get("id") not in seen:
            seen.add(d.plan.get("id"))
            entry = {"step": d.step + 1, **d.plan}
            records = quorum.relayouts(d.plan.get("id"), replicas)
            if records:
                entry.update(
                    {
                        k: sum(r[k] for r in records)
                        for k in ("moved_bytes", "written_bytes", "read_bytes", "minimum_bytes")
                    }
                )
                entry["relayout_s"] = max(r["relayout_s"] for r in records)
            applied.append(entry)
    return applied


def _catchups(store, quorum: Quorum, failures: list[ReplicaFailure]) -> list[dict]:
    """What each relaunched replica reported about its catch-up (absent: it never rejoined)."""
    found = []
    for f in failures:
        if not f.relaunched:
            continue
        key = f"{quorum.prefix}/catchup/{f.replica}/{f.attempt + 1}"
        if store.check([key]):
            found.append(
                {"replica": f.replica, "attempt": f.attempt + 1, **json.loads(store.get(key))}
            )
    return found


def recovery_summary(outcome: Outcome, trace) -> dict | None:
    """The summary's ``recovery`` object for replica-level fault tolerance, or None without a loss.

    From the launcher's records and the ops trace: per lost replica when it was found, what the
    survivors lost (the time of aborted attempts and of forming the next group, in seconds and in
    median failure-free steps), when it rejoined and how long its catch-up took once the state was
    there."""
    if not outcome.replica_failures:
        return None
    steps = trace[trace.optype == "step"]
    per_step = steps.groupby("step").duration.max()
    lost_ops = trace[trace.optype.isin(["ft-abort", "ft-regroup"])]
    catchups = {(c["replica"], c["attempt"]): c for c in outcome.replica_catchups}
    records = []
    for f in outcome.replica_failures:
        came = catchups.get((f.replica, f.attempt + 1))
        # the step the survivors redid (the heartbeat's step of the lost rank may lag behind it)
        aborts = lost_ops[
            (lost_ops.optype == "ft-abort")
            & (lost_ops.dp_rank != f.replica)
            & (lost_ops.step >= (f.step or 0))
        ]
        first = int(aborts.step.min()) if len(aborts) else f.step if f.step is not None else 0
        until = (
            came["from_step"] if came else int(per_step.index.max()) + 1 if len(per_step) else first
        )
        before = per_step[per_step.index < first]
        median = (
            float(before.median())
            if len(before)
            else float(per_step.median())
            if len(per_step)
            else None
        )
        window = lost_ops[
            (lost_ops.step >= first) & (lost_ops.step <= until) & (lost_ops.dp_rank != f.replica)
        ]
        # per survivor rank: aborted attempts (their time, in wait_s) and group re-formation
        lost = window.assign(lost=window.wait_s.where(window.optype == "ft-abort", window.duration))
        stall_s = float(lost.groupby("rank").lost.sum().max()) if len(lost) else 0.0
        records.append(
            {
                "mode": "replica",
                "lost_replica": f.replica,
                "attempt": f.attempt,
                "rank": f.rank,
                "cause": f.cause,
                "failed_step": first,
                "detected_s": f.detected_s,
                "survivor_stall_s": round(stall_s, 4),
                "survivor_stall_steps": round(stall_s / median, 3) if median else None,
                "aborted_attempts": int(
                    (window.optype == "ft-abort").groupby(window["rank"]).sum().max()
                )
                if len(window)
                else 0,
                "survivors_restarted": False,
                "relaunched": f.relaunched,
                "rejoined_step": came["from_step"] if came else None,
                "catchup_s": round(came["admitted_ts"] - came["state_ts"], 4)
                if came and came.get("state_ts")
                else None,
                "restart_s": round(came["requested_ts"] - f.at, 4) if came else None,
                "replayed_steps": came["replayed_steps"] if came else None,
                "transfer_bytes": came["bytes"] if came else None,
                "source": "peer" if came else None,
            }
        )
    first = records[0]
    return {**first, "failures": records} if len(records) > 1 else first
