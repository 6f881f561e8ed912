"""The life of a run's processes and of its folder (no torch import: the launcher wrapper runs
this).

- ``RunFolder``: a run folder belongs to one job at a time (an ``flock`` the kernel drops when the
  job's process dies, however it dies) and records that job in ``OUT/run.json``: its id, model hash,
  state (running, done, failed, interrupted) and, when interrupted, the checkpoint it can resume
  from.
- ``die_with_parent``: a process asks the kernel for SIGKILL when its parent dies
  (PR_SET_PDEATHSIG), so the death of ``resihp run`` (even by SIGKILL) takes torchrun, and
  torchrun's takes each worker. ``python -m resihp.train.lifecycle --parent PID -- CMD...`` sets it
  and then execs CMD. ``die_with`` is the same for a process that must die with another than its
  parent (a warm agent: with its launcher, not with the server that forked it).
- ``ProcessTracker``: the PIDs of every process of the job (with their start times, so a reused PID
  is never signalled), found as descendants of the launched process however they re-parent or
  re-group; it can end them all, SIGTERM first and SIGKILL to the whole process group after a grace.
- ``enable_stack_dumps`` / ``dump_stacks``: a worker judged hung writes every thread's Python stack
  to the run's ``logs/workers.log`` before it is stopped (``faulthandler`` on SIGUSR1: it writes
  from the signal handler, so a thread blocked inside a C call, a collective or a store wait, shows
  too).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import math
import os
import secrets
import select
import signal
import sys
import threading
import time
from pathlib import Path

from resihp.errors import InputError
from resihp.paths import write_text_atomic
from resihp.procinfo import start_time

PR_SET_PDEATHSIG = 1
LOCK_NAME = ".resihp.lock"
RUN_FILE = "run.json"
PREVIOUS = "previous"
# what one job writes into its run folder (checkpoints aside): a later job in the folder moves them
JOB_OUTPUTS = (
    "summary.json",
    "ops.jsonl",
    "ops.parquet",
    "job.yaml",
    "config.json",
    "plan_changes.json",
    "resume.json",
    "restore.json",
    "controlplane.json",
    "live.json",
    "timeline.png",
    "card.json",
    "logs",
    "ranks",
    "tensorboard",
    "profiles",
    "restart",
    "restart-*",
)


# --- a run folder belongs to one job --------------------------------------------------------------
def new_job_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


class RunFolder:
    """Holds ``OUT``'s lock for the life of this process; ``record`` writes ``OUT/run.json``."""

    def __init__(self, out: str | Path, job_id: str | None = None) -> None:
        self.out = Path(out)
        self.job_id = job_id or new_job_id()
        self._fd: int | None = None
        self.info: dict = {}

    def acquire(self, if_busy: str = "fail") -> RunFolder:
        """Take the folder; InputError naming the job that holds it, if another one does.

        With ``if_busy="subfolder"``, a fresh ``OUT/<job id>`` is taken instead of the error."""
        import fcntl

        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(
                f"--out {self.out}: cannot create the run folder ({exc.strerror})"
            ) from None
        fd = os.open(self.out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another job"
            os.close(fd)
            if if_busy == "subfolder":
                self.out = self.out / self.job_id
                return self.acquire("fail")
            raise InputError(
                f"--out {self.out}: run folder in use by {holder}; choose another --out "
                f"or pass --if-busy subfolder"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"job {self.job_id} (pid {os.getpid()})".encode(), 0)
        self._fd = fd
        return self

    def retire_previous(self) -> Path | None:
        """Move the outputs of the job that used this folder before into ``OUT/previous/<job id>/``.

        They are its summary, trace, logs and restarts, so that none is read back as this job's; its
        checkpoints stay (each names its job; ``--resume OUT`` takes them). Returns where they went,
        or None when there were none."""
        outputs = [p for name in JOB_OUTPUTS for p in sorted(self.out.glob(name))]
        if not outputs:
            return None
        try:
            old = json.loads((self.out / RUN_FILE).read_text()).get("job_id")
        except (OSError, ValueError, AttributeError):
            old = None
        name = str(old) if old and str(old).replace("-", "").isalnum() else f"unknown-{self.job_id}"
        dest = self.out / PREVIOUS / name
        if dest.exists():
            dest = dest.with_name(f"{name}-{self.job_id}")
        dest.mkdir(parents=True)
        for path in outputs:
            os.replace(path, dest / path.name)
        return dest

    def record(self, **fields: object) -> None:
        self.info.update({"job_id": self.job_id, "pid": os.getpid(), **fields})
        write_text_atomic(self.out / RUN_FILE, json.dumps(self.info, indent=1), durable=False)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        # an error the run did not record itself (a keeper that never started, a store that could
        # not listen): the folder must not say "running" for a job whose process has ended
        if exc is not None and self.info.get("state") == "running":
            code = getattr(exc, "exit_code", getattr(exc, "code", 1))  # SystemExit, typer's Exit
            if isinstance(exc, KeyboardInterrupt):
                self._record_end(state="interrupted")
            elif code not in (0, None):
                self._record_end(state="failed", error=f"{type(exc).__name__}: {exc}"[:500])
        self.release()

    def _record_end(self, **fields: object) -> None:
        with contextlib.suppress(OSError):
            self.record(**fields, ended=time.time())


# --- nothing outlives the run ---------------------------------------------------------------------
def die_with_parent(expected_parent: int | None = None) -> None:
    """Ask for SIGKILL when the parent dies (Linux); exit now if it is already gone."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(137)  # the parent died before the request took effect


def die_with(pid: int, started: int | None) -> None:
    """SIGKILL to this process when process ``pid`` (started at ``started``, clock ticks) ends.

    A thread waits on its pidfd (Linux); exit now if it is gone already."""
    if not sys.platform.startswith("linux"):
        return
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(137)
    if start_time(pid) != started:  # gone (a zombie), or its PID reused by another process
        os._exit(137)

    def watch() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="resihp-die-with", daemon=True).start()


STACKS_SIGNAL = signal.SIGUSR1
STACKS_SETTLE_S = 0.3  # for the stacks to reach the log before the process is stopped


def enable_stack_dumps() -> None:
    """This worker writes its threads' stacks to its stderr on ``STACKS_SIGNAL``.

    Call it first: the signal's default action would end a process that did not."""
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def dump_stacks(pid: int, log: Path, why: str) -> bool:
    """Ask a worker for its stacks, after a line in ``log`` saying ``why``; False where it is gone.

    The stacks land in the same log through the worker's stderr.

    Args:
        pid: the worker's process, one that called ``enable_stack_dumps``, on this host, not
            stopped (a stopped process runs no handler).
        log: the log file the worker's stderr goes to.
        why: the reason, one line."""
    with contextlib.suppress(OSError), open(log, "a") as f:
        f.write(f"resihp: {why}; its stacks (process {pid}) follow\n")
    try:
        os.kill(pid, STACKS_SIGNAL)
    except (ProcessLookupError, PermissionError):
        return False
    time.sleep(STACKS_SETTLE_S)
    return True


def guarded(cmd: list[str]) -> list[str]:
    """``cmd`` run so that it dies with this process (see the module docstring)."""
    return [
        sys.executable,
        "-m",
        "resihp.train.lifecycle",
        "--parent",
        str(os.getpid()),
        "--",
        *cmd,
    ]


def _parents() -> dict[int, int]:
    parents = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    return parents


class ProcessTracker:
    """Every process of one job: the launched root and all its descendants ever seen."""

    def __init__(self, root: int) -> None:
        self.known: dict[int, int] = {}  # pid -> start time
        self._scanned = -math.inf
        self.add(root)

    def add(self, pid: int) -> None:
        started = start_time(pid)
        if started is not None and pid not in self.known:
            self.known[pid] = started

    def scan(self) -> None:
        """Add the descendants of every known process (orphans keep their place: they were seen)."""
        parents = _parents()
        changed = True
        while changed:
            changed = False
            for pid, ppid in parents.items():
                if ppid in self.known and pid not in self.known and start_time(pid) is not None:
                    self.add(pid)
                    changed = True

    def watch(self, workers: int, every_s: float = 1.0) -> None:
        """While the job runs: scan for its processes, every call until all are known, then less.

        A scan reads all of /proc (about 10 ms here), so scan every call until the root and its
        ``workers`` are known, then at most once every ``every_s`` (a worker's own children are
        ended with its process group)."""
        now = time.monotonic()
        if len(self.known) <= workers or now - self._scanned >= every_s:
            self.scan()
            self._scanned = now

    def alive(self) -> list[int]:
        return [pid for pid, started in self.known.items() if start_time(pid) == started]

    def signal(self, sig: int, groups: bool = False) -> None:
        """Send ``sig`` to each live process of the job.

        With ``groups``, also to the process group each of them leads: a worker's own children."""
        for pid in self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if groups and os.getpgid(pid) == pid:
                    os.killpg(pid, sig)
                os.kill(pid, sig)

    def end_all(self, grace_s: float = 5.0, wait=None) -> list[int]:
        """End every process of the job: SIGTERM, up to ``grace_s`` to exit, then SIGKILL.

        SIGCONT follows SIGTERM, so a stopped process can act on it; SIGKILL goes to each and to the
        groups they lead. ``wait`` reaps direct children (``Popen.poll``). Returns the PIDs still
        alive (none, normally)."""
        self.scan()
        self.signal(signal.SIGTERM)
        self.signal(signal.SIGCONT)
        deadline = time.time() + grace_s
        while self.alive() and time.time() < deadline:
            if wait:
                wait()
            time.sleep(0.05)
            self.scan()
        for _ in range(50):
            if not self.alive():
                break
            self.scan()
            self.signal(signal.SIGKILL, groups=True)
            if wait:
                wait()
            time.sleep(0.05)
        return self.alive()


def _main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[0] != "--parent" or argv[2] != "--":
        sys.exit("usage: python -m resihp.train.lifecycle --parent PID -- CMD...")
    die_with_parent(int(argv[1]))
    os.execvp(argv[3], argv[3:])


if __name__ == "__main__":
    _main(sys.argv[1:])
