"""One node's replicas in replica mode (``resihp run --recovery replica``).

Each is launched as its own torchrun on the job's store with a heartbeat aggregator of its own
(``ReplicaLauncher``, used on every node), and the part of a node other than 0 (``serve_replicas``):
run its replicas until node 0 ends the job, stop one that node 0 evicted and relaunch it when told.
Node 0's part, which judges every replica, is ``replicas.supervise_replicas``."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from resihp.detect.heartbeat import NodeAggregator, node_key, rank_key
from resihp.detect.records import JOB_SECRET_ENV
from resihp.launch.launch import forks_workers, torchrun_command, worker_env
from resihp.launch.supervisor import (
    Outcome,
    _Signals,
    _stop,
    descends_from,
    drain_stderr,
    owned,
    refuse_signal,
)
from resihp.launch.warm import WARM_AGENTS, AgentProcess
from resihp.train.config import RunConfig
from resihp.train.controlplane import (
    ended,
    heartbeat_prefix,
    job_secret,
    node_left,
    replica_order,
    replica_state,
    stacks_asked,
    stacks_written,
)
from resihp.train.lifecycle import ProcessTracker, dump_stacks
from resihp.train.nodes import Nodes
from resihp.train.replica import ATTEMPT_ENV, GPU_OFFSET_ENV, REPLICA_ENV


@dataclass
class ReplicaProcess:
    """One launch (``attempt``) of a replica on this node: its torchrun and heartbeat aggregator."""

    replica: int
    attempt: int
    proc: AgentProcess
    tracker: ProcessTracker
    aggregator: NodeAggregator
    lines: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)


def replica_ranks(cfg: RunConfig) -> dict[int, list[int]]:
    """Each data-parallel replica's ranks (its pipeline and tensor-parallel ranks)."""
    dims, par = cfg.dims(), cfg.parallel
    return {
        d: sorted(dims.rank_of(d, s, t) for s in range(par.pp) for t in range(par.tp))
        for d in range(par.dp)
    }


def node_replicas(cfg: RunConfig, nodes: Nodes) -> list[int]:
    """The replicas ``nodes``' node runs.

    Node ``n`` runs ``n k .. n k + k - 1``, ``k`` = nproc_per_node / (pp x tp). Their ranks are not
    contiguous (stage-major: ``ParallelDims.rank_of``)."""
    per_node = nodes.nproc_per_node // (cfg.parallel.pp * cfg.parallel.tp)
    return [d for d in range(cfg.parallel.dp) if d // per_node == nodes.node_rank]


@dataclass
class ReplicaLauncher:
    """Launches this node's replicas, each its own torchrun on the job's store.

    Each has a heartbeat aggregator of its own (each replica is a node of the monitor)."""

    cfg: RunConfig
    store: dist.Store
    endpoint: str
    config_path: Path
    interval_s: float
    heartbeat_timeout_s: float
    join_timeout_s: float
    first: int = 0  # this node's first replica: its ranks take the node's first GPUs

    def launch(self, d: int, attempt: int) -> ReplicaProcess:
        cfg, store = self.cfg, self.store
        hb = heartbeat_prefix(cfg.job_id)
        ranks = replica_ranks(cfg)[d]
        per = len(ranks)
        for key in [node_key(hb, d), *(rank_key(hb, d, r) for r in ranks)]:
            store.delete_key(key)  # the last attempt's beats (its dead PIDs) are not this one's
        env = worker_env(
            {
                REPLICA_ENV: str(d),
                ATTEMPT_ENV: str(attempt),
                GPU_OFFSET_ENV: str((d - self.first) * per),
                JOB_SECRET_ENV: job_secret(),
            },
            endpoint=self.endpoint,
            node=d,
            managed=True,
        )
        proc = WARM_AGENTS.popen(
            torchrun_command(
                self.config_path,
                per,
                endpoint=self.endpoint,
                run_id=f"{cfg.job_id}-r{d}-a{attempt}",
                forked=forks_workers(cfg),
            ),
            env,
        )
        agg = NodeAggregator(
            store,
            d,
            ranks,
            interval_s=self.interval_s,
            timeout_s=self.heartbeat_timeout_s,
            prefix=hb,
            startup_s=self.join_timeout_s,
        )
        agg.owns = descends_from(proc.pid)
        agg.start()
        rep = ReplicaProcess(d, attempt, proc, ProcessTracker(proc.pid), agg)
        threading.Thread(
            target=drain_stderr,
            args=(proc, rep.lines, Path(cfg.out), f"[replica {d} attempt {attempt}] ", 200),
            daemon=True,
        ).start()
        return rep


def stop_replicas(replicas: Iterable[ReplicaProcess], grace_s: float, failed: bool) -> None:
    """End each replica's processes and stop its aggregator: the job is over.

    Args:
        replicas: the replicas to stop.
        grace_s: seconds a running replica gets before it is killed.
        failed: the job failed: no grace (a finished replica's processes end at once anyway).
    """
    for rep in replicas:
        with contextlib.suppress(Exception):
            _stop(rep.proc, rep.tracker, grace_s if rep.proc.poll() is None and not failed else 0.5)
        rep.aggregator.stop()


def serve_replicas(
    launcher: ReplicaLauncher,
    mine: list[int],
    signals: _Signals,
    node: int,
    poll_s: float,
    grace_s: float,
    t0: float,
) -> Outcome:
    """A node other than 0 in replica mode: run this node's replicas until node 0 ends the job.

    Or until node 0 cannot be reached; stop a replica node 0 evicted, and relaunch it when told to.

    Args:
        launcher: this node's replica launcher.
        mine: the replicas this node runs.
        signals: the SIGTERM/SIGINT the launcher received.
        node: this node's rank.
        poll_s: seconds between looks at the replicas and the store.
        grace_s: seconds a stopped replica gets before it is killed.
        t0: the launch's start (``time.time()``), for the outcome's wall time.
    """
    cfg, store = launcher.cfg, launcher.store
    outcome = Outcome(returncode=0)
    live = {}
    for d in mine:
        live[d] = launcher.launch(d, 0)
        replica_state(store, cfg.job_id, d, 0, "launched")
    said_done: set[tuple[int, int]] = set()
    answered: set[tuple[int, int, int]] = (
        set()
    )  # (replica, attempt, rank) whose stacks were written
    try:
        while True:
            time.sleep(poll_s)
            if signals.received:
                outcome.interrupted = signals.received
                outcome.error = f"stopped by {signals.received}; all workers were stopped"
                break
            try:
                for d, rep in list(live.items()):
                    rep.tracker.watch(len(rep.aggregator.ranks))
                    order = replica_order(store, cfg.job_id, d)
                    if order is not None and order[0] > rep.attempt:  # node 0 evicted it
                        stop_replicas([live.pop(d)], grace_s, failed=True)
                        if order[1]:
                            live[d] = launcher.launch(d, order[0])
                            replica_state(store, cfg.job_id, d, order[0], "launched")
                        continue
                    asked = stacks_asked(store, cfg.job_id, d)  # node 0 judged a rank of it hung
                    if asked is not None and (d, rep.attempt, asked[0]) not in answered:
                        beat = rep.aggregator._last.get(asked[0])  # its last beat names its process
                        if beat is not None and owned(rep.tracker, rep.proc.pid, beat["pid"]):
                            dump_stacks(
                                beat["pid"], Path(cfg.out) / "logs" / "workers.log", asked[1]
                            )
                        elif beat is not None:
                            refuse_signal(f"heartbeat of rank {asked[0]}", beat["pid"], asked[1])
                        answered.add((d, rep.attempt, asked[0]))
                        stacks_written(store, cfg.job_id, d)
                    if rep.proc.poll() == 0 and (d, rep.attempt) not in said_done:
                        replica_state(store, cfg.job_id, d, rep.attempt, "done")
                        said_done.add((d, rep.attempt))
                reason = ended(store, cfg.job_id)
            except (RuntimeError, dist.DistError):
                reason = "node 0 cannot be reached (its store is gone)"
            if reason is not None:
                outcome.ended_by_node0 = True
                if reason != "finished":
                    outcome.error = (
                        reason if "node 0" in reason else f"the job ended on node 0: {reason}"
                    )
                break
    finally:
        stop_replicas(live.values(), grace_s, failed=outcome.error is not None)
        with contextlib.suppress(RuntimeError, dist.DistError):
            node_left(store, cfg.job_id, node)
    outcome.job_id = cfg.job_id
    outcome.returncode = 0 if outcome.error is None else 1
    outcome.wall_s = time.time() - t0
    return outcome
