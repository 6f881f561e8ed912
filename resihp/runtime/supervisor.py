"""Runs a job's torchrun workers and watches them: heartbeats (a dead or hung rank is a
fail-stop), ranks that never join, workers that reject their input. Whatever happens, every
worker process is gone when ``supervise`` returns, and the trace written so far is merged."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from resihp.runtime.config import RunConfig
from resihp.runtime.heartbeat import read_beats, stale_ranks
from resihp.runtime.launch import torchrun_command, worker_env
from resihp.runtime.recorder import read_stream

STEP_LINE = re.compile(r"^step (\d+) loss ([\d.naninf]+)")
ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


@dataclass
class Outcome:
    returncode: int
    error: str | None = None  # one line, when the job did not finish
    input_error: bool = False  # a worker rejected its configuration (exit status 2)
    failure: dict | None = None  # {"kind": "fail-stop", "rank", "step", "detected_s"}
    stderr_tail: list[str] = field(default_factory=list)
    wall_s: float = 0.0


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


def _failed_step(out: Path, rank: int, beats: dict) -> int | None:
    """The step a stopped rank was in: one past the last step in its stream (heartbeats lag)."""
    stream = out / "ranks" / f"rank{rank}.jsonl"
    if stream.exists():
        steps = [r["step"] for r in read_stream(stream) if r.get("optype") == "step"]
        if steps:
            return max(steps) + 1
    beat = beats.get(rank)
    return beat.step if beat else None


def _stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # stray grandchildren
    proc.wait()


def supervise(cfg: RunConfig, *, heartbeat_timeout_s: float = 10.0, join_timeout_s: float = 60.0,
              on_step: Callable[[int], None] | None = None,
              on_poll: Callable[[], None] | None = None, poll_s: float = 0.2) -> Outcome:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*(out / "heartbeats").glob("rank*.json"), *(out / "ranks").glob("rank*.jsonl")]:
        old.unlink()
    config_path = out / "config.json"
    config_path.write_text(cfg.to_json())
    world = cfg.dims().world_size
    t0 = time.time()
    proc = subprocess.Popen(torchrun_command(config_path, world), env=worker_env(), text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    lines: list[str] = []

    def read_stderr() -> None:
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            m = STEP_LINE.match(line)
            if m and on_step:
                on_step(int(m.group(1)))

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    outcome = Outcome(returncode=0)
    try:
        while proc.poll() is None:
            time.sleep(poll_s)
            if on_poll:
                on_poll()
            beats = read_beats(out / "heartbeats")
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
                outcome.failure = {"kind": "fail-stop", "rank": rank, "step": _failed_step(out, rank, beats),
                                   "cause": "process exited" if dead else "heartbeats stopped",
                                   "detected_s": round(now - beats[rank].time, 3)}
                break
    finally:
        _stop(proc)
        reader.join(timeout=5)
    outcome.returncode = proc.returncode
    outcome.wall_s = time.time() - t0
    outcome.stderr_tail = lines[-40:]
    text = "\n".join(lines)
    worker_errors = [ln for ln in lines if ln.startswith("resihp: error:")]
    if outcome.failure is None and proc.returncode != 0:
        m = ROOT_CAUSE.search(text)
        if m and int(m.group(2)) < 0:
            rank = int(m.group(1))
            outcome.failure = {"kind": "fail-stop", "rank": rank,
                               "step": _failed_step(out, rank, read_beats(out / "heartbeats")),
                               "cause": f"killed by signal {-int(m.group(2))}"}
    if outcome.error is None and worker_errors:
        outcome.error = worker_errors[0].removeprefix("resihp: error: ")
        outcome.input_error = True
    if outcome.error is None and outcome.failure is not None:
        f = outcome.failure
        outcome.error = f"rank {f['rank']} stopped at step {f['step']} ({f['cause']}); all workers were stopped"
    if outcome.error is None and proc.returncode != 0:
        last = next((ln for ln in reversed(lines) if ln.startswith("resihp:")), None)
        outcome.error = (last or f"workers exited with status {proc.returncode}").removeprefix("resihp: ")
    return outcome
