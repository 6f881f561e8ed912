"""Runs a job's torchrun workers and watches them: heartbeats (a dead or hung rank is a
fail-stop), ranks that never join, workers that reject their input. Whatever happens, every
process of the job is gone when ``supervise`` returns, and the trace written so far is merged.

Nothing outlives the run: torchrun starts in its own session, wrapped so that the kernel kills it
when this process dies (and each worker asks the same of torchrun); every process of the job is
tracked by PID (:class:`~resihp.runtime.lifecycle.ProcessTracker`: workers start in sessions of
their own, out of reach of torchrun's process group); SIGTERM, SIGINT and SIGHUP sent to this
process are forwarded to the job, which gets a bounded grace to write its trace before the whole
tree is killed, and ``Outcome.interrupted`` names the signal. The rendezvous store is hosted here,
on loopback (:class:`~resihp.runtime.launch.LoopbackStore`)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from resihp.ckpt.integrity import remove_partial
from resihp.detect.events import Event
from resihp.parallel import ParallelDims
from resihp.runtime.config import RunConfig
from resihp.runtime.heartbeat import read_beats, stale_ranks
from resihp.runtime.launch import LoopbackStore, torchrun_command, worker_env
from resihp.runtime.lifecycle import ProcessTracker
from resihp.runtime.recorder import read_stream

STEP_LINE = re.compile(r"^step (\d+) loss ([\d.naninf]+)")
ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


@dataclass
class Outcome:
    returncode: int
    error: str | None = None  # one line, when the job did not finish
    input_error: bool = False  # a worker rejected its configuration (exit status 2)
    failure: Event | None = None  # a fail-stop; extra: step, cause, detected_s
    stderr_tail: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    interrupted: str | None = None  # the signal that stopped the supervisor ("SIGTERM", ...)
    left_alive: list[int] = field(default_factory=list)  # PIDs that could not be ended (none, normally)


def fail_stop(dims: ParallelDims, rank: int, step: int | None, cause: str,
              detected_s: float | None = None) -> Event:
    """The supervisor's fail-stop as the detector's one event type (its JSON keeps the
    supervisor's ``step``, ``cause`` and ``detected_s``)."""
    where = dims.coords(rank)
    at = -1 if step is None else step
    extra = {"step": step, "cause": cause}
    if detected_s is not None:
        extra["detected_s"] = detected_s
    return Event("fail-stop", rank, where.dp_rank, where.stage, where.tp_rank, at, at, 0.0, 1.0,
                 extra=extra)


def _disk_full(path: Path, floor_bytes: int = 1 << 20) -> bool:
    try:
        return shutil.disk_usage(path).free < floor_bytes
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    return "\nState:\tZ" not in state and "\nState:\tX" not in state


def _ancestors(pid: int) -> set[int]:
    found = set()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat[stat.rindex(")") + 2:].split()[1])
    return found


def _failed_step(out: Path, rank: int, beats: dict) -> int | None:
    """The step a stopped rank was in: one past the last step in its stream (heartbeats lag)."""
    stream = out / "ranks" / f"rank{rank}.jsonl"
    if stream.exists():
        steps = [r["step"] for r in read_stream(stream) if r.get("optype") == "step"]
        if steps:
            return max(steps) + 1
    beat = beats.get(rank)
    return beat.step if beat else None


SCAN_S = 1.0  # seconds between scans for the job's processes once all are known
GRACE_S = 5.0  # how long the job may take to stop after SIGTERM before its tree is killed
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


def _stop(proc: subprocess.Popen, tracker: ProcessTracker, grace_s: float = GRACE_S) -> list[int]:
    """End every process of the job: SIGTERM to all (torchrun and each worker: they are in
    different sessions), up to ``grace_s`` to exit, then SIGKILL to every process tree left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    left = tracker.end_all(grace_s, wait=proc.poll)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # stray grandchildren in torchrun's group
    proc.wait()
    return left


def supervise(cfg: RunConfig, *, heartbeat_timeout_s: float = 10.0, join_timeout_s: float = 60.0,
              on_step: Callable[[int], None] | None = None,
              on_poll: Callable[[], None] | None = None, poll_s: float = 0.2,
              grace_s: float = GRACE_S) -> Outcome:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*(out / "heartbeats").glob("rank*.json"), *(out / "ranks").glob("rank*.jsonl")]:
        old.unlink()
    remove_partial(out)  # a checkpoint folder a killed job left half-written
    config_path = out / "config.json"
    config_path.write_text(cfg.to_json())
    world = cfg.dims().world_size
    t0 = time.time()
    with _Signals() as signals, LoopbackStore(timeout_s=max(join_timeout_s, 60.0)) as store:
        return _supervise(cfg, out, config_path, world, t0, signals, store, heartbeat_timeout_s,
                          join_timeout_s, on_step, on_poll, poll_s, grace_s)


def _supervise(cfg, out, config_path, world, t0, signals, store, heartbeat_timeout_s, join_timeout_s,
               on_step, on_poll, poll_s, grace_s) -> Outcome:
    proc = subprocess.Popen(torchrun_command(config_path, world, endpoint=store.endpoint),
                            env=worker_env(endpoint=store.endpoint), text=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    tracker = ProcessTracker(proc.pid)
    lines: list[str] = []

    def read_stderr() -> None:
        # the workers' lines (per-step progress, warnings, errors) are kept in OUT/logs/workers.log;
        # if that cannot be written (a full disk) the pipe is still drained, or the workers would block
        keep = None
        with contextlib.suppress(OSError):
            (out / "logs").mkdir(exist_ok=True)
            keep = open(out / "logs" / "workers.log", "a", buffering=1)  # noqa: SIM115 - closed below
        for line in proc.stderr:
            if keep is not None:
                try:
                    keep.write(line)
                except OSError:
                    with contextlib.suppress(OSError):
                        keep.close()
                    keep = None
            lines.append(line.rstrip("\n"))
            m = STEP_LINE.match(line)
            if m and on_step:
                on_step(int(m.group(1)))
        if keep is not None:
            with contextlib.suppress(OSError):
                keep.close()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    outcome = Outcome(returncode=0)
    scanned = 0.0
    try:
        while proc.poll() is None:
            time.sleep(poll_s)
            # a scan reads /proc (milliseconds): every poll until torchrun and each worker are
            # known, then once a second (a worker's own children are ended with its process group)
            if len(tracker.known) <= world or time.time() - scanned >= SCAN_S:
                tracker.scan()
                scanned = time.time()
            if signals.received:
                outcome.interrupted = signals.received
                outcome.error = f"stopped by {signals.received}; all workers were stopped"
                break
            if on_poll:
                on_poll()
            beats = read_beats(out / "heartbeats")
            for beat in beats.values():
                if beat.pid in tracker.known or tracker.known.keys() & _ancestors(beat.pid):
                    tracker.add(beat.pid)
            now = time.time()
            if len(beats) < world and now - t0 > join_timeout_s:
                missing = sorted(set(range(world)) - set(beats))
                outcome.error = (f"rank(s) {missing} never joined within {join_timeout_s:g} s; "
                                 f"all workers were stopped")
                break
            dead = [r for r, b in beats.items() if b.phase != "done" and not pid_alive(b.pid)]
            hung = stale_ranks(beats, heartbeat_timeout_s, now)
            if dead or hung:
                rank = (dead or hung)[0]
                outcome.failure = fail_stop(cfg.dims(), rank, _failed_step(out, rank, beats),
                                            "process exited" if dead else "heartbeats stopped",
                                            round(now - beats[rank].time, 3))
                break
    finally:
        outcome.left_alive = _stop(proc, tracker, grace_s)
        reader.join(timeout=5)
        if not outcome.left_alive:
            remove_partial(out)  # a checkpoint the job did not finish writing is not a checkpoint
    outcome.returncode = proc.returncode
    outcome.wall_s = time.time() - t0
    outcome.stderr_tail = lines[-40:]
    text = "\n".join(lines)
    worker_errors = [ln for ln in lines if ln.startswith("resihp: error:")]
    stops = [ln for ln in lines if ln.startswith("resihp: stop:")]  # a worker's own reason to stop
    if outcome.error is None and stops:
        outcome.error = stops[0].removeprefix("resihp: stop: ")
    if outcome.failure is None and proc.returncode != 0 and not outcome.interrupted:
        m = ROOT_CAUSE.search(text)
        if m and int(m.group(2)) < 0:
            rank = int(m.group(1))
            outcome.failure = fail_stop(cfg.dims(), rank,
                                        _failed_step(out, rank, read_beats(out / "heartbeats")),
                                        f"killed by signal {-int(m.group(2))}")
    if outcome.error is None and worker_errors:
        outcome.error = worker_errors[0].removeprefix("resihp: error: ")
        outcome.input_error = True
    if outcome.error is None and outcome.failure is not None:
        f = outcome.failure
        outcome.error = (f"rank {f.rank} stopped at step {f.extra['step']} ({f.extra['cause']}); all "
                         "workers were stopped")
    if outcome.left_alive:
        outcome.error = (f"{outcome.error or 'job ended'}; process(es) {outcome.left_alive} could not "
                         f"be ended")
    if outcome.error is None and proc.returncode != 0 and _disk_full(out):
        # the workers may die of it where no line could say so (a heartbeat, torchrun's own files)
        outcome.error = (f"disk full writing {out} (No space left on device); free space and run "
                         "again")
    if outcome.error is None and proc.returncode != 0:
        last = next((ln for ln in reversed(lines) if ln.startswith("resihp:")), None)
        outcome.error = (last or f"workers exited with status {proc.returncode}").removeprefix("resihp: ")
    return outcome
