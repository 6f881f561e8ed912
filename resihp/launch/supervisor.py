"""Runs a job's torchrun workers and watches them until every process of the job is gone.

It watches heartbeats (a dead or hung rank is a fail-stop), ranks that never join, workers that
reject their input. Whatever happens, every
process of the job is gone when ``supervise`` returns, and the trace written so far is merged.

Nothing outlives the run: torchrun starts in its own session, wrapped so that the kernel kills it
when this process dies (and each worker asks the same of torchrun); every process of the job is
tracked by PID (:class:`~resihp.train.lifecycle.ProcessTracker`: workers start in sessions of
their own, out of reach of torchrun's process group); SIGTERM, SIGINT and SIGHUP sent to this
process are forwarded to the job, which gets a bounded grace to write its trace before the whole
tree is killed, and ``Outcome.interrupted`` names the signal. The rendezvous store is hosted here,
on loopback (:class:`~resihp.launch.launch.LoopbackStore`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch.distributed as dist
from torch.distributed import Store

from resihp.ckpt.integrity import remove_partial
from resihp.detect.events import Event
from resihp.detect.heartbeat import FINISHED, HeartbeatMonitor, NodeAggregator
from resihp.detect.records import JOB_SECRET_ENV, RECORDS
from resihp.errors import NOTE, InputError
from resihp.launch.launch import forks_workers, torchrun_command, worker_env
from resihp.launch.warm import WARM_AGENTS, AgentProcess
from resihp.opstrace import TRACE_STREAM
from resihp.parallel import ParallelDims
from resihp.procinfo import parent_pid
from resihp.train.config import RunConfig
from resihp.train.controlplane import (
    StepReader,
    StepRecords,
    announce_job,
    append_steps,
    ask_for_stacks,
    await_stacks,
    ended,
    first_failure,
    heartbeat_prefix,
    job_secret,
    mark_ended,
    mark_stopping,
    post_change,
    publish_first_failure,
    read_errors,
    read_job,
    stacks_asked,
    stacks_written,
    stopping,
)
from resihp.train.lifecycle import ProcessTracker, dump_stacks, start_time
from resihp.train.nodes import FIRST_RANK_ENV, Nodes
from resihp.train.store import JobStore

ROOT_CAUSE = re.compile(r"Root Cause.*?local_rank:\s*(\d+)\).*?exitcode\s*:\s*(-?\d+)", re.S)
FAILURE = re.compile(r"local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
FIRST_FAILURE_WAIT_S = 5.0  # node 0's wait for another node's first observed failure


def torchrun_first_failure(lines: list[str], first_rank: int) -> tuple[int, int] | None:
    """torchrun's first observed failure in its output ``lines``: (the job's rank, exit code).

    The job's rank is this node's ``first_rank`` plus torchrun's local rank; torchrun's own global
    rank follows its rendezvous order, not the job's) and its exit code (negative: killed by that
    signal). Where torchrun saw several fail in one look, a rank killed by a signal (not torchrun's
    own SIGTERM) is the root: the others exited because they lost it."""
    text = "\n".join(lines)
    root = ROOT_CAUSE.search(text)
    if root is None:
        return None
    local, code = int(root.group(1)), int(root.group(2))
    if code >= 0 or code == -signal.SIGTERM:
        killed = [
            (int(m.group(1)), int(m.group(2)))
            for m in FAILURE.finditer(text)
            if int(m.group(2)) < 0 and int(m.group(2)) != -signal.SIGTERM
        ]
        local, code = killed[0] if killed else (local, code)
    return first_rank + local, code


@dataclass
class Outcome:
    returncode: int
    error: str | None = None  # one line, when the job did not finish
    input_error: bool = False  # a worker rejected its configuration (exit status 2)
    failure: Event | None = None  # a fail-stop (its step, cause, detected_s)
    stderr_tail: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    interrupted: str | None = None  # the signal that stopped the supervisor ("SIGTERM", ...)
    left_alive: list[int] = field(
        default_factory=list
    )  # PIDs that could not be ended (none, normally)
    errors: list[dict] = field(default_factory=list)  # workers' reasons to stop (the control plane)
    ended_by_node0: bool = False  # another node: node 0 ended the job (or was lost)
    job_id: str | None = (
        None  # the job's id on its store (node 0's, which every node's checkpoints carry)
    )
    control_plane: dict | None = None  # node 0: what the control plane cost (bytes, messages, time)
    replica_failures: list = field(
        default_factory=list
    )  # --recovery replica: replicas lost and relaunched
    replica_catchups: list[dict] = field(
        default_factory=list
    )  # --recovery replica: how each came back
    # --recovery replica: per committed step, in order, the replicas whose ranks trained it
    replica_members: list[list[int]] = field(default_factory=list)
    all_replicas_lost: bool = False  # --recovery replica: no live peer was left to catch up from


def fail_stop(
    dims: ParallelDims,
    rank: int,
    step: int | None,
    cause: str,
    detected_s: float | None = None,
    node: int | None = None,
) -> Event:
    """The supervisor's fail-stop as the detector's one event type.

    Its JSON keeps the supervisor's ``step``, ``cause`` and ``detected_s``.

    Args:
        dims: the job's parallel sizes (the rank's coordinates).
        rank: the rank that stopped.
        step: the step it stopped at (None: unknown).
        cause: ``exited``, ``hang``, ``node`` or the supervisor's other causes.
        detected_s: seconds from the stop to its detection (None: unknown).
        node: the rank's node (None: not recorded).
    """
    where = dims.coords(rank)
    at = -1 if step is None else step
    return Event(
        "fail-stop",
        rank,
        where.dp_rank,
        where.stage,
        where.tp_rank,
        at,
        at,
        0.0,
        1.0,
        step=step,
        cause=cause,
        detected_s=detected_s,
        node=node,
    )


def _disk_full(path: Path, floor_bytes: int = 1 << 20) -> bool:
    try:
        return shutil.disk_usage(path).free < floor_bytes
    except OSError:
        return False


def _ancestors(pid: int) -> set[int]:
    found = set()
    while pid > 1 and pid not in found:
        found.add(pid)
        parent = parent_pid(pid)
        if parent is None:
            break
        pid = parent
    return found


def descends_from(root: int) -> Callable[[int], bool]:
    """Whether a PID is ``root`` or one of its descendants now.

    What a heartbeat's PID must be before a node trusts it: anyone who reaches the job's store can
    write one."""
    return lambda pid: root in _ancestors(pid)


def owned(tracker: ProcessTracker, root: int, pid: int | None) -> bool:
    """Whether ``pid`` is a process this launcher started, checked by PID and start time.

    So no signal reaches another process: one a forged record names, or one that took a dead
    worker's PID.

    Args:
        tracker: the launcher's tracker of the job's processes.
        root: the torchrun it launched (its descendants count too).
        pid: the PID a record names (None: none).
    """
    if pid is None or pid <= 0:
        return False
    if pid not in tracker.known and root in _ancestors(pid):
        tracker.add(pid)
    started = tracker.known.get(pid)
    return started is not None and start_time(pid) == started


def refuse_signal(key: str, pid: int | None, why: str) -> None:
    """Refuse a record's signal to a process this launcher did not start; reported once per key.

    Args:
        key: the store key of the record that asked.
        pid: the PID it named.
        why: what the signal was for.
    """
    RECORDS.reject(
        key, f"it names process {pid}, which this launcher did not start: no signal sent ({why})"
    )


GRACE_S = 5.0  # how long the job may take to stop after SIGTERM before its tree is killed
SETTLE_S = 0.5  # how long a fail-stop waits for the rest of the dead rank's last step's records
STACKS_WAIT_S = 2.0  # how long node 0 waits for another node to write a hung rank's stacks
# a rank whose process is stopped (SIGSTOP, a freezer) this long is hung, without waiting out the
# heartbeat timeout: it cannot make progress until someone resumes it
STOPPED_S = 1.0
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class _Signals:
    """While supervising (main thread only): SIGTERM / SIGINT / SIGHUP set ``received`` instead
    of killing this process, so that the job can be stopped, its trace kept and the run marked."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._old: dict = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in FORWARDED:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.received = self.received or signal.Signals(signum).name

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _stop(proc: AgentProcess, tracker: ProcessTracker, grace_s: float = GRACE_S) -> list[int]:
    """End every process of the job: SIGTERM to all (torchrun and each worker: they are in
    different sessions), up to ``grace_s`` to exit, then SIGKILL to every process tree left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    left = tracker.end_all(grace_s, wait=proc.poll)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # stray grandchildren in torchrun's group
    proc.wait()
    return left


def fault_timeouts(
    cfg: RunConfig, heartbeat_s: float | None, join_s: float | None, hang_s: float | None
) -> tuple[float, float, float | None]:
    """The heartbeat, join and hang timeouts: those given, else the run configuration's.

    Args:
        cfg: the run configuration (``cfg.faults``).
        heartbeat_s: the heartbeat timeout in seconds (None: the configuration's).
        join_s: the join timeout in seconds (None: the configuration's).
        hang_s: the hang timeout in seconds (None: the configuration's).
    """
    faults = cfg.faults
    return (
        faults.heartbeat_timeout_s if heartbeat_s is None else heartbeat_s,
        faults.timeout_s if join_s is None else join_s,
        faults.hang_timeout_s if hang_s is None else hang_s,
    )


def supervise(
    cfg: RunConfig,
    *,
    heartbeat_timeout_s: float | None = None,
    join_timeout_s: float | None = None,
    on_step: Callable[[int], None] | None = None,
    on_steps: Callable[[list[StepRecords], Callable[[dict], None]], None] | None = None,
    on_poll: Callable[[], None] | None = None,
    poll_s: float = 0.2,
    grace_s: float = GRACE_S,
    nodes: Nodes | None = None,
    hang_timeout_s: float | None = None,
    attempt: int = 0,
) -> Outcome:
    """Run this node's part of the job and watch it.

    On node 0 (the only node, by default):
    host the job's store, judge every rank's heartbeats (a dead or hung rank, or a lost node, is a
    fail-stop), read the op records into ``OUT/ops.jsonl`` and hand complete steps to ``on_steps``
    (the live loop, with a function that posts a plan change to the job). On the other nodes: join
    node 0's store, check that the job's configuration is the same, run the workers and the node's
    heartbeat aggregator until node 0 says the job is over (or cannot be reached).

    Args:
        cfg: the run configuration.
        heartbeat_timeout_s: seconds without a beat before a rank is dead (None: ``cfg.faults``).
        join_timeout_s: seconds for every rank to join (None: ``cfg.faults``).
        on_step: called with the newest complete step.
        on_steps: the live loop: called with the complete steps and a function that posts a plan
            change to the job.
        on_poll: called at each look at the job.
        poll_s: seconds between looks.
        grace_s: seconds the job gets to write its trace after SIGTERM before SIGKILL.
        nodes: this node's place in the job (None: the only node).
        hang_timeout_s: seconds without progress before a rank is hung (None: ``cfg.faults``).
        attempt: the restart in place this launch is (node 0 announces it; another node joins that
            launch, taking the faults and the checkpoint node 0 relaunched with).
    """
    heartbeat_timeout_s, join_timeout_s, hang_timeout_s = fault_timeouts(
        cfg, heartbeat_timeout_s, join_timeout_s, hang_timeout_s
    )
    world = cfg.dims().world_size
    if not cfg.job_id:  # the control plane's namespace on the store
        cfg = replace(cfg, job_id=uuid.uuid4().hex[:12])
    nodes = nodes or Nodes(1, 0, world, None)
    nodes.check(world)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / TRACE_STREAM).unlink(missing_ok=True)
    remove_partial(cfg.ckpt_root())  # a checkpoint folder a killed job left half-written
    t0 = time.time()
    host = nodes.node_rank == 0
    with (
        _Signals() as signals,
        JobStore(
            nodes.endpoint,
            host=host,
            timeout_s=max(join_timeout_s, 60.0) if host else join_timeout_s,
        ) as js,
    ):
        if host:
            announce_job(
                js.store,
                cfg.job_id,
                job_config(cfg),
                nodes.nnodes,
                nodes.nproc_per_node,
                attempt=attempt,
                sizes=list(nodes.sizes) if nodes.sizes else None,
            )
        else:
            cfg = _join(js.store, cfg, nodes, join_timeout_s, attempt)
        config_path = out / "config.json"
        config_path.write_text(cfg.to_json())
        watch = _Watch(cfg, nodes, js.store, heartbeat_timeout_s, join_timeout_s, hang_timeout_s)
        try:
            outcome = _supervise(
                cfg,
                out,
                config_path,
                world,
                t0,
                signals,
                js,
                watch,
                nodes,
                on_step,
                on_steps,
                on_poll,
                poll_s,
                grace_s,
            )
            outcome.job_id = cfg.job_id
            return outcome
        finally:
            watch.close()


def await_relaunch(nodes: Nodes, attempt: int, timeout_s: float) -> dict | None:
    """On a node other than 0 whose part is over, wait for node 0's launch ``attempt``.

    A launch is a restart in place or a re-formed layout, announced on node 0's endpoint; returns
    the job's record (``announce_job``), or None if none came within ``timeout_s``. Node 0's store
    goes and comes back between launches: each try connects anew.

    Args:
        nodes: this node's place in the job (node 0's endpoint).
        attempt: the launch waited for.
        timeout_s: how long to wait.
    """
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with JobStore(
                nodes.endpoint, host=False, timeout_s=max(1.0, min(10.0, end - time.monotonic()))
            ) as js:
                job = read_job(
                    js.store, timeout_s=min(2.0, max(0.0, end - time.monotonic())), attempt=attempt
                )
                if job:
                    js.store.set(_seen_key(attempt, nodes.node_rank), "1")
                    return job
        except (InputError, RuntimeError, dist.DistError):
            pass
        time.sleep(0.2)
    return None


def _seen_key(attempt: int, node: int) -> str:
    return f"resihp/relaunch/{attempt}/seen/{node}"


def announce_no_relaunch(nodes: Nodes, attempt: int, reason: str, wait_s: float = 10.0) -> None:
    """On node 0, which will not relaunch the job: say so to the nodes waiting for a relaunch.

    It hosts its store once more with a launch ``attempt`` of no ranks, until every other node
    waiting (``await_relaunch``) has read it or ``wait_s`` is over, so that they end now rather
    than after their wait.

    Args:
        nodes: the job's nodes (this one hosts the store).
        attempt: the launch number announced without ranks.
        reason: why there is no relaunch, for the other nodes.
        wait_s: the most seconds to wait for them to read it.
    """
    try:
        with JobStore(nodes.endpoint, host=True, timeout_s=wait_s) as js:
            store = js.store
            announce_job(
                store,
                "",
                None,
                nodes.nnodes,
                nodes.nproc_per_node,
                attempt=attempt,
                no_relaunch=reason,
            )
            end = time.monotonic() + wait_s
            keys = [_seen_key(attempt, n) for n in range(1, nodes.nnodes)]
            while time.monotonic() < end and not store.check(keys):
                time.sleep(0.1)
    except (InputError, RuntimeError, dist.DistError):
        pass  # the endpoint is taken or gone: the other nodes end after their wait


def job_config(cfg: RunConfig) -> dict:
    """What every node of a job must agree on: the run config without this node's own fields.

    Flat, by option name."""
    own = ("out", "job_id", "device", "threads")
    return json.loads(json.dumps({k: v for k, v in cfg.flags().items() if k not in own}))


def _join(store, cfg: RunConfig, nodes: Nodes, timeout_s: float, attempt: int = 0) -> RunConfig:
    """A node other than 0: the job's identity from node 0, after checking that both agree."""
    job = read_job(store, timeout_s, attempt=attempt)
    if job is None:
        raise InputError(
            f"--rdzv-endpoint {nodes.endpoint}: no job announced there within {timeout_s:g} s "
            "(start node 0 first, or check the endpoint)"
        )
    theirs = job["config"]
    if (
        attempt
    ):  # a relaunch: node 0 chose what it relaunches with (a restart in place, a re-formed layout)
        cfg = cfg.updated(**theirs)
    mine = job_config(cfg)
    differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    sizes = tuple(job["sizes"]) if job.get("sizes") else None
    if differ or (job["nnodes"], job["nproc_per_node"], sizes) != (
        nodes.nnodes,
        nodes.nproc_per_node,
        nodes.sizes,
    ):
        what = ", ".join(
            f"{k} (node 0: {theirs.get(k)!r}, here: {mine.get(k)!r})" for k in differ[:3]
        ) or (
            f"--nnodes/--nproc-per-node (node 0: {job['nnodes']}x{job['nproc_per_node']}, here: "
            f"{nodes.nnodes}x{nodes.nproc_per_node})"
        )
        raise InputError(
            f"--rdzv-endpoint {nodes.endpoint}: this node's configuration differs from the "
            f"job's there (job {job['job_id']}): {what}"
        )
    if ended(store, job["job_id"]):
        raise InputError(
            f"--rdzv-endpoint {nodes.endpoint}: job {job['job_id']} there has already ended"
        )
    return replace(cfg, job_id=job["job_id"])


class _Watch:
    """This node's heartbeat aggregator; on node 0 also the job's heartbeat monitor and the reader
    of its op records."""

    def __init__(
        self,
        cfg: RunConfig,
        nodes: Nodes,
        store,
        heartbeat_timeout_s: float,
        join_timeout_s: float,
        hang_timeout_s: float | None,
    ) -> None:
        self.cfg, self.store = cfg, store
        dims = cfg.dims()
        layout = nodes.layout()
        hb = heartbeat_prefix(cfg.job_id)
        interval = min(0.5, heartbeat_timeout_s / 4)
        self.aggregator = NodeAggregator(
            store,
            nodes.node_rank,
            nodes.ranks,
            interval_s=interval,
            timeout_s=heartbeat_timeout_s,
            prefix=hb,
            startup_s=join_timeout_s,
        ).start()
        self.monitor = self.reader = None
        self.owns: Callable[[int], bool] | None = (
            None  # whether a PID is this launcher's (``owned``)
        )
        if nodes.node_rank == 0:
            places = {
                r: (c.dp_rank, c.stage, c.tp_rank)
                for r in range(dims.world_size)
                for c in [dims.coords(r)]
            }
            # a silent aggregator means a lost node: give it the aggregator's beat interval slack
            self.monitor = HeartbeatMonitor(
                store,
                layout,
                timeout_s=heartbeat_timeout_s + interval,
                prefix=hb,
                places=places,
                startup_s=join_timeout_s,
                hang_timeout_s=hang_timeout_s,
                hang_floor_s=heartbeat_timeout_s,
                stopped_s=STOPPED_S,
            )
            self.reader = StepReader(store, cfg.job_id, layout, owner=True)

    def costs(self) -> dict | None:
        if self.reader is None:
            return None
        return control_plane_costs(
            self.reader, [m["c"] for m in self.aggregator._last.values() if m is not None]
        )

    def pids(self) -> list[int]:
        return [m["pid"] for m in self.aggregator._last.values() if m is not None]

    def pid_of(self, rank: int) -> int | None:
        beat = self.aggregator._last.get(rank)
        return beat["pid"] if beat is not None else None

    def close(self) -> None:
        """This node's processes are stopped. On another node one last aggregate says so: node 0
        keeps its store until every other node's ranks are done or gone (``_linger``), and a node
        whose workers ended between two beats would otherwise hold it there for a whole grace."""
        self.aggregator.stop()
        if self.monitor is None:
            with contextlib.suppress(RuntimeError, dist.DistError):
                self.aggregator.tick()


def control_plane_costs(r: StepReader, beats: list[int]) -> dict | None:
    """The control plane's costs per rank and step, and the reader's store requests per step.

    Per rank and step: record bytes and messages, heartbeat messages (``beats``: each node's
    count), the rank's time spent publishing; the reader's load grows with nodes."""
    if not r.steps:
        return None
    ranks = sum(len(v) for v in r.nodes.values())
    cost = sorted(r.cost_s.values())
    return {
        "ranks": ranks,
        "steps": r.steps,
        "record_bytes_per_rank_step": round(r.bytes / r.parts, 1),
        "record_messages_per_rank_step": round(r.parts / (r.steps * ranks), 3),
        "heartbeat_messages_per_rank_step": round(statistics.mean(beats) / r.steps, 3)
        if beats
        else None,
        "publish_s_per_rank_step": round(cost[len(cost) // 2] / max(1, r.steps - 1), 6)
        if cost
        else None,
        "reader_requests_per_step": round(r.messages / r.steps, 2),
    }


def hand_on_steps(
    reader: StepReader,
    out: Path,
    on_step: Callable[[int], None] | None,
    on_steps: Callable[[list[StepRecords], Callable[[dict], None]], None] | None,
    post: Callable[[dict], None],
) -> None:
    """The complete steps read so far: into the run folder's trace stream, then to the callers.

    Args:
        reader: the op-record reader.
        out: the run folder.
        on_step: called with the newest complete step.
        on_steps: called with the complete steps and ``post``.
        post: posts a plan change to the job.
    """
    steps = reader.complete_steps()
    if steps:
        # a full disk: the job goes on (and says so if it cannot); a line cut short is skipped
        with contextlib.suppress(OSError):
            append_steps(out / TRACE_STREAM, steps)
        if on_step:
            on_step(steps[-1].step)
        if on_steps:
            on_steps(steps, post)


def drain_stderr(
    proc: AgentProcess, lines: list[str], out: Path, tag: str = "", keep_last: int = 0
) -> None:
    """The workers' lines into OUT/logs/workers.log and ``lines``.

    If the log cannot be written (a full disk) the pipe is still drained, or the workers would
    block. A worker's note to the user (``resihp: note: ...``, a memory tier gone full) is said here
    too, each once.

    Args:
        proc: the process whose stderr is read.
        lines: where each line is also kept.
        out: the run folder.
        tag: the prefix of each line in the log.
        keep_last: keep only the last this many in ``lines`` (None: all)."""
    keep, said = None, set()
    with contextlib.suppress(OSError):
        (out / "logs").mkdir(exist_ok=True)
        keep = open(out / "logs" / "workers.log", "a", buffering=1)  # noqa: SIM115 - closed below
    for line in proc.stderr:
        if keep is not None:
            try:
                keep.write(tag + line)
            except OSError:
                with contextlib.suppress(OSError):
                    keep.close()
                keep = None
        if line.startswith(NOTE) and line not in said:
            said.add(line)
            print(line.rstrip("\n"), file=sys.stderr, flush=True)
        lines.append(line.rstrip("\n"))
        if keep_last:
            del lines[:-keep_last]
    if keep is not None:
        with contextlib.suppress(OSError):
            keep.close()


def _supervise(
    cfg,
    out,
    config_path,
    world,
    t0,
    signals,
    js,
    watch,
    nodes,
    on_step,
    on_steps,
    on_poll,
    poll_s,
    grace_s,
) -> Outcome:
    local = len(nodes.ranks)
    proc = WARM_AGENTS.popen(
        torchrun_command(
            config_path,
            local,
            endpoint=js.endpoint,
            nnodes=nodes.nnodes,
            run_id=cfg.job_id or None,
            forked=forks_workers(cfg),
        ),
        worker_env(
            {FIRST_RANK_ENV: str(nodes.ranks[0]), JOB_SECRET_ENV: job_secret()},
            endpoint=js.endpoint,
            node=nodes.node_rank,
            managed=True,
        ),
    )
    tracker = ProcessTracker(proc.pid)
    watch.aggregator.owns = descends_from(proc.pid)
    watch.owns = lambda pid: owned(tracker, proc.pid, pid)
    lines: list[str] = []

    def post(change: dict) -> None:
        post_change(js.store, cfg.job_id, change)

    def read_stderr() -> None:
        drain_stderr(proc, lines, out)

    def read_steps() -> None:
        if watch.reader is not None:
            hand_on_steps(watch.reader, out, on_step, on_steps, post)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    outcome = Outcome(returncode=0)
    answered: set[int] = set()  # the ranks whose stacks node 0 asked this node for
    try:
        while proc.poll() is None:
            time.sleep(poll_s)
            tracker.watch(local)
            if signals.received:
                outcome.interrupted = signals.received
                outcome.error = f"stopped by {signals.received}; all workers were stopped"
                break
            for pid in watch.pids():
                if pid in tracker.known or tracker.known.keys() & _ancestors(pid):
                    tracker.add(pid)
            if watch.monitor is None:  # another node: run until node 0 ends the job
                try:
                    asked = stacks_asked(js.store, cfg.job_id, nodes.node_rank)
                    if asked is not None and asked[0] not in answered:  # a rank of this node hung
                        rank, why = asked
                        pid = watch.pid_of(rank)
                        if pid is not None and owned(tracker, proc.pid, pid):
                            dump_stacks(pid, out / "logs" / "workers.log", why)
                            _kill(pid)  # hung: the job's SIGTERM would cost a grace (``end_hung``)
                        elif pid is not None:
                            refuse_signal(f"heartbeat of rank {rank}", pid, why)
                        answered.add(rank)
                        stacks_written(js.store, cfg.job_id, nodes.node_rank)
                    reason = stopping(js.store, cfg.job_id)
                except (RuntimeError, dist.DistError):
                    reason = "node 0 cannot be reached (its store is gone)"
                if reason is not None:
                    if reason == "finished":  # this node's workers may be finishing on their own
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            proc.wait(timeout=grace_s)
                    # else the job failed: they are stopped now, not after a grace they would spend
                    # blocked on a hung peer (and holding node 0's ranks blocked on them)
                    if proc.poll() == 0 or reason == "finished":
                        break
                    outcome.error = (
                        f"the job ended on node 0: {reason}" if "node 0" not in reason else reason
                    )
                    outcome.ended_by_node0 = True
                    break
                continue
            read_steps()
            if on_poll:
                on_poll()
            failure = _judge(watch, cfg, t0, outcome)
            if failure is not None:
                # a hung rank held its step up for the hang timeout: what of it has not arrived
                # will not
                failure = _settle(
                    failure,
                    watch,
                    read_steps,
                    cfg,
                    0.0 if failure.cause == "hang" else SETTLE_S,
                )
            if failure is not None or outcome.error:
                outcome.failure = failure
                if nodes.nnodes > 1:
                    with contextlib.suppress(RuntimeError, dist.DistError):
                        mark_stopping(js.store, cfg.job_id, outcome.error or _reason(outcome))
                break
    finally:
        outcome.left_alive = _stop(proc, tracker, grace_s)
        reader.join(timeout=5)
        first = torchrun_first_failure(lines, nodes.ranks[0])
        if watch.monitor is None and first is not None:
            with contextlib.suppress(RuntimeError, dist.DistError):
                publish_first_failure(js.store, cfg.job_id, nodes.node_rank, *first)
        if not outcome.left_alive:
            remove_partial(
                cfg.ckpt_root()
            )  # a checkpoint the job did not finish writing is not a checkpoint
    outcome.returncode = proc.returncode
    if watch.monitor is not None:
        with contextlib.suppress(RuntimeError, dist.DistError):
            read_steps()
            outcome.errors = read_errors(js.store, cfg.job_id)
            # a rank that ended on purpose or crashed said so (``_explain`` names it)
            said = any(
                e["kind"] in ("stop", "input")
                or (e["kind"] == "crash" and str(e["rank"]).isdigit())
                for e in outcome.errors
            )
            if (
                outcome.failure is None
                and proc.returncode != 0
                and not outcome.interrupted
                and not said
            ):
                # torchrun may end the job (its ranks lost a peer) before the monitor can tell why:
                # look until a heartbeat timeout has passed (a lost node is silent that long)
                end = time.monotonic() + watch.monitor.timeout_s + 1.0
                while outcome.failure is None and time.monotonic() < end:
                    watch.aggregator.tick()
                    outcome.failure = _judge(watch, cfg, t0, outcome)
                    time.sleep(0.2)
            outcome.control_plane = watch.costs()
            mark_ended(js.store, cfg.job_id, outcome.error or _reason(outcome) or "finished")
            watch.reader.wait_for_followers(grace_s)
            if (
                nodes.nnodes > 1
            ):  # the store goes with this process: let the other nodes see the end
                _linger(watch, grace_s)
    outcome.wall_s = time.time() - t0
    outcome.stderr_tail = lines[-40:]
    _explain(outcome, lines, cfg, out, nodes)
    return outcome


def _linger(watch: _Watch, limit_s: float) -> None:
    """Node 0, the job over: wait (bounded) until every other node's ranks are finished or gone."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        watch.monitor.poll()
        if all(
            v.phase in FINISHED or v.rank in watch.monitor.dead or v.exited
            for v in watch.monitor.views.values()
        ):
            return
        time.sleep(0.2)


def _judge(watch: _Watch, cfg: RunConfig, t0: float, outcome: Outcome) -> Event | None:
    """Node 0's look at every rank: the first fail-stop (dead, hung, or its node lost), or a rank
    that never joined (``outcome.error``)."""
    events = watch.monitor.poll(watch.monitor.min_step())
    if events:
        ev = _first_gone(events, watch)
        # heartbeats lag: every rank finished the steps read so far, so it failed in a later one
        steps = [s for s in (ev.step, watch.reader.next_step) if s is not None]
        if ev.cause == "hang":
            stacks_of_hung(
                watch.monitor, ev.rank, 0, Path(cfg.out), watch.store, cfg.job_id, watch.owns
            )
            end_hung(watch.monitor, ev.rank, 0, watch.owns)
        return fail_stop(
            cfg.dims(),
            ev.rank,
            max(steps) if steps else None,
            ev.cause,
            ev.silent_s,
            node=ev.node,
        )
    missing = [v.rank for v in watch.monitor.views.values() if not v.seen]
    if missing and time.time() - t0 > watch.monitor.startup_s:
        outcome.error = (
            f"rank(s) {missing} never joined within {watch.monitor.startup_s:g} s; all workers "
            "were stopped"
        )
    return None


def _first_gone(events: list[Event], watch: _Watch) -> Event:
    """The event to act on: the first (the lowest rank) of those that did not report losing a peer
    (``lost-peer`` on the control plane: a rank whose send or receive failed because another died
    exits within milliseconds of it, so one look can find both gone, and torchrun's first observed
    failure, stamped in whole seconds, then names the lower of the two), unless several ranks of
    one other node were found exited in one look. torchrun there stops a dead rank's peers within
    its monitor interval, so the lowest need not be the one that died; that node's launcher
    publishes torchrun's first observed failure once its torchrun has ended (waited for, at most
    ``FIRST_FAILURE_WAIT_S``)."""
    lost_peer: set[int] = set()
    if len(events) > 1 and watch.store is not None:
        with contextlib.suppress(RuntimeError, dist.DistError):
            lost_peer = {
                int(e["rank"])
                for e in read_errors(watch.store, watch.cfg.job_id)
                if e["kind"] == "lost-peer" and str(e["rank"]).isdigit()
            }
    events = [e for e in events if not (e.cause == "exited" and e.rank in lost_peer)] or events
    nodes = {e.node for e in events}
    if len(events) < 2 or len(nodes) != 1 or any(e.cause != "exited" for e in events):
        return events[0]
    node = nodes.pop()
    if node in (None, 0):  # node 0's own torchrun output settles it (``_explain``)
        return events[0]
    end = time.monotonic() + FIRST_FAILURE_WAIT_S
    first = None
    with contextlib.suppress(RuntimeError, dist.DistError):
        while (
            first := first_failure(watch.store, watch.cfg.job_id, node)
        ) is None and time.monotonic() < end:
            time.sleep(0.05)
    return next((e for e in events if first is not None and e.rank == first[0]), events[0])


def stacks_of_hung(
    monitor: HeartbeatMonitor,
    rank: int,
    node: int,
    out: Path,
    store: Store | None = None,
    job_id: str = "",
    owns: Callable[[int], bool] | None = None,
) -> None:
    """Have a rank judged hung write its stacks before it is stopped.

    Only while its process still runs (a stopped one runs no handler): its stacks go into
    ``OUT/logs/workers.log`` of its node (``lifecycle.dump_stacks``), signalled here where it runs
    on this launcher's ``node``, else asked of its node's launcher on the job's ``store``
    (``controlplane.ask_for_stacks``) and waited for, at most ``STACKS_WAIT_S``.

    Args:
        monitor: the heartbeat monitor that judged it (its view of the rank).
        rank: the hung rank.
        node: this launcher's node.
        out: the run folder.
        store: the job's store (None: no other node is asked).
        job_id: the job's id on the store.
        owns: whether a PID is one this launcher started (``owned``); no signal goes to any other
            (None: none is sent).
    """
    view = monitor.views.get(rank)
    if view is None or not view.pid or view.stopped:
        return
    why = f"rank {rank} judged hung (no progress for {view.stalled_s:.1f} s)"
    if view.node == node:
        if owns is None or not owns(view.pid):
            refuse_signal(f"heartbeats of node {node}", view.pid, why)
            return
        dump_stacks(view.pid, out / "logs" / "workers.log", why)
    elif store is not None:
        with contextlib.suppress(RuntimeError, dist.DistError):
            ask_for_stacks(store, job_id, view.node, rank, why)
            await_stacks(store, job_id, view.node, STACKS_WAIT_S)


def end_hung(
    monitor: HeartbeatMonitor, rank: int, node: int, owns: Callable[[int], bool] | None = None
) -> None:
    """SIGKILL a rank judged hung whose process runs on this launcher's ``node``.

    Once its stacks are written: it made no progress for the hang timeout, so the SIGTERM that stops
    the job would only cost the whole grace (``GRACE_S``) before the SIGKILL after it (a 1-rank
    restart from memory on CPU took 12.4 s from the hang, 5.1 s of it that grace). Not a stopped
    process: the SIGCONT beside that SIGTERM lets it end as a signalled rank does.

    Args:
        monitor: the heartbeat monitor that judged it (its view of the rank).
        rank: the hung rank.
        node: this launcher's node.
        owns: whether a PID is one this launcher started (``owned``); None: no signal is sent.
    """
    view = monitor.views.get(rank)
    if (
        view is not None
        and view.pid
        and view.node == node
        and not view.stopped
        and owns
        and owns(view.pid)
    ):
        _kill(view.pid)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _settle(
    failure: Event,
    watch: _Watch,
    read_steps: Callable[[], None],
    cfg: RunConfig,
    limit_s: float = SETTLE_S,
) -> Event:
    """A rank found dead right after it finished a step: the other ranks' records of that step may
    still be on their way (a loaded machine). Wait for them (bounded): if the step completes, the
    rank failed in a later one."""
    step = failure.step
    end = time.monotonic() + limit_s
    while step is not None and (watch.reader.next_step or 0) <= step and time.monotonic() < end:
        time.sleep(0.05)
        read_steps()
    later = watch.reader.next_step
    if step is None or later is None or later <= step:
        return failure
    return fail_stop(
        cfg.dims(), failure.rank, later, failure.cause, failure.detected_s, node=failure.node
    )


def _reason(outcome: Outcome) -> str | None:
    f = outcome.failure
    if f is None:
        return None
    if f.cause == "node":
        return (
            f"node {f.node} (rank {f.rank} and its node's other ranks) stopped answering "
            f"at step {f.step} (node)"
        )
    if f.cause == "exception":
        return f"rank {f.rank} crashed ({f.message})"
    signal_ = f" by signal {f.signal}" if f.signal is not None else ""
    return f"rank {f.rank} stopped at step {f.step} ({f.cause}{signal_})"


def _explain(outcome: Outcome, lines: list[str], cfg: RunConfig, out: Path, nodes: Nodes) -> None:
    """The one-line ``error`` of an outcome: a worker's own reason (over the control plane), the
    fail-stop found, or what torchrun said (``lines``: this node's torchrun's output)."""
    errors = outcome.errors
    if not errors:  # before the control plane was joined: the workers' stderr says it
        errors = [
            {"kind": "input", "message": ln.removeprefix("resihp: error: ")}
            for ln in lines
            if ln.startswith("resihp: error:")
        ]
        errors += [
            {"kind": "stop", "message": ln.removeprefix("resihp: stop: ")}
            for ln in lines
            if ln.startswith("resihp: stop:")
        ]
    stops = [e["message"] for e in errors if e["kind"] == "stop"]
    inputs = [e["message"] for e in errors if e["kind"] == "input"]
    if (stops or inputs) and outcome.failure is not None and outcome.failure.cause == "exited":
        outcome.failure = None  # the rank ended on purpose, and said why
    crashes = [e for e in errors if e["kind"] == "crash" and str(e["rank"]).isdigit()]
    if (
        crashes
        and not (stops or inputs)
        and (outcome.failure is None or outcome.failure.cause == "exited")
    ):
        # a rank died of an exception (its peers then lost it): that rank is the fail-stop
        crash = crashes[0]
        outcome.failure = fail_stop(cfg.dims(), int(crash["rank"]), None, "exception")
        outcome.failure.message = crash["message"]
    root = torchrun_first_failure(lines, nodes.ranks[0])
    signalled = root is not None and root[1] < 0
    if (
        signalled
        and outcome.failure is not None
        and not outcome.interrupted
        and outcome.failure.cause == "exited"
        and root[0] != outcome.failure.rank
        and (outcome.failure.node if outcome.failure.node is not None else nodes.node_rank)
        == nodes.node_rank
    ):
        # several ranks were gone when the monitor looked (torchrun stops a dead rank's peers
        # within its monitor interval) and it named the lowest; torchrun's first observed failure,
        # killed by a signal, is the rank that died first
        outcome.failure = fail_stop(
            cfg.dims(),
            root[0],
            outcome.failure.step,
            "exited",
            outcome.failure.detected_s,
            node=outcome.failure.node,
        )
    if outcome.error is None and stops:
        outcome.error = stops[0]
    if (
        signalled
        and outcome.failure is None
        and outcome.returncode != 0
        and not outcome.interrupted
        and not (stops or inputs or outcome.ended_by_node0)
    ):
        outcome.failure = fail_stop(cfg.dims(), root[0], None, "exited")
        outcome.failure.signal = -root[1]
    if outcome.error is None and inputs:
        outcome.error = inputs[0]
        outcome.input_error = True
    if outcome.error is None and outcome.failure is not None:
        outcome.error = f"{_reason(outcome)}; all workers were stopped"
    if outcome.left_alive:
        outcome.error = (
            f"{outcome.error or 'job ended'}; process(es) {outcome.left_alive} could not be ended"
        )
    if outcome.error is None and outcome.returncode != 0 and _disk_full(out):
        # the workers may die of it where no line could say so (a heartbeat, torchrun's own files)
        outcome.error = (
            f"disk full writing {out} (No space left on device); free space and run again"
        )
    if outcome.error is None and outcome.returncode != 0:
        last = next((ln for ln in reversed(lines) if ln.startswith("resihp:")), None)
        outcome.error = (last or f"workers exited with status {outcome.returncode}").removeprefix(
            "resihp: "
        )
