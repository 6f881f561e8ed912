"""The node's keeper: one process per node and job that owns the memory tier's files.

It runs in a session of its own (``setsid``), so neither a worker's death nor torchrun's kill of
its process group takes it down. It publishes the slots the trainers hand it (checksums off the
trainers' path, :func:`resihp.ckpt.memory.publish`), keeps the explicit copies, and removes the
tier when the job ends: when told to (:func:`stop_keeper`: an ``END`` marker, then SIGTERM) or when
the process that owns the job (the launcher, or torchrun's agent) is gone. Killed or stopped
otherwise (SIGKILL, a SIGTERM of its own), it leaves the files in place; a new keeper
(:func:`ensure_keeper`) takes over the slots still pending.

    python -m resihp.ckpt.keeper --dir /dev/shm/resihp-<job>-n0 --owner PID
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from resihp.ckpt.memory import VERIFY, MemoryTier, publish, read_json, shm_root, verify_all

POLL_S = 0.005
LOCK = "keeper.lock"
PID = "keeper.pid"
END = "END"  # written by stop_keeper: the job is over, SIGTERM means remove the tier


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True


def keeper_pid(directory: Path) -> int | None:
    """The PID of the keeper that holds ``directory``'s lock, or None if no keeper is running."""
    directory = Path(directory)
    try:
        fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        with contextlib.suppress(OSError, ValueError):
            return int((directory / PID).read_text())
        return -1  # locked, pid not written yet
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def ensure_keeper(directory: Path, owner: int, timeout_s: float = 30.0) -> int:
    """Start the keeper of ``directory`` unless one runs; returns its PID. Safe to call from
    several processes at once (one of them starts it)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / "spawn.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        pid = keeper_pid(directory)
        if pid is None:
            proc = subprocess.Popen([sys.executable, "-m", "resihp.ckpt.keeper", "--dir", str(directory),
                                     "--owner", str(owner)], start_new_session=True,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=open(directory / "keeper.log", "a"))  # noqa: SIM115
            deadline = time.monotonic() + timeout_s
            while (pid := keeper_pid(directory)) in (None, -1):
                if proc.poll() is not None:
                    raise RuntimeError(f"memory tier keeper exited with status {proc.returncode} "
                                       f"(see {directory / 'keeper.log'})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"memory tier keeper did not start within {timeout_s:g} s")
                time.sleep(0.01)
        return pid
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def stop_keeper(directory: Path, timeout_s: float = 10.0) -> None:
    """End the job's memory tier: the keeper removes its files and exits (if no keeper runs, the
    files are removed here)."""
    directory = Path(directory)
    pid = keeper_pid(directory)
    if pid not in (None, -1):
        with contextlib.suppress(OSError):
            (directory / END).touch()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    shutil.rmtree(directory, ignore_errors=True)


class Keeper:
    def __init__(self, directory: Path, owner: int | None) -> None:
        self.dir, self.owner = Path(directory), owner
        self.stopping = False
        self.published = 0

    def _stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def run(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        lock = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            sys.exit(0)  # another keeper holds this tier
        (self.dir / PID).write_text(str(os.getpid()))
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        checked = 0.0
        owner_gone = False
        while not self.stopping:
            busy = self.step()
            now = time.monotonic()
            if now - checked > 0.5:
                checked = now
                if self.owner and not _alive(self.owner):
                    owner_gone = True
                    break
                if not self.dir.exists():
                    return
            if not busy:
                time.sleep(POLL_S)
        if owner_gone or (self.dir / END).exists():
            shutil.rmtree(self.dir, ignore_errors=True)  # the job is over: its snapshots go with it
        # else (a SIGTERM not from the job's end): the files stay for the next keeper

    def step(self) -> bool:
        """Publish every pending slot; whether there was any."""
        try:
            pending = sorted(self.dir.glob("rank*.pending.json"))
        except OSError:
            return False
        for path in pending:
            with contextlib.suppress(FileNotFoundError):
                if publish(self.dir, path) is not None:
                    self.published += 1
        request = self.dir / VERIFY
        if request.exists() and not pending:
            verify_all(self.dir)
            request.unlink(missing_ok=True)
        return bool(pending)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="resihp.ckpt.keeper")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--owner", type=int, default=None, help="end with this process")
    args = parser.parse_args(argv)
    Keeper(Path(args.dir), args.owner).run()


if __name__ == "__main__":
    main()


def request_verify(directory: Path) -> None:
    """Ask the keeper to check every slot now (call once the job's trainers have stopped)."""
    with contextlib.suppress(OSError):
        (Path(directory) / VERIFY).touch()


def find_tiers(path: Path) -> list[Path]:
    """The memory tiers ``path`` names: a tier folder itself, or a run folder's job's (its
    ``run.json`` names the job), on every node of this machine."""
    path = Path(path)
    if (path / LOCK).exists() or list(path.glob("rank*.bin")):
        return [path]
    job = read_json(path / "run.json") or {}
    if not job.get("job_id"):
        return []
    return sorted(p for p in shm_root().glob(f"resihp-{job['job_id']}-n*") if p.is_dir())


def inspect_tier(directory: Path, verify: bool = True) -> dict:
    """What a memory tier holds: each published slot (whose state, which step, who holds it, its
    size, whether its bytes match its checksums), the slots still pending, and the keeper."""
    directory = Path(directory)
    slots = []
    for h in MemoryTier(directory, -1).headers():
        tier = MemoryTier(directory, h.rank)
        slots.append({"rank": h.rank, "slot": h.slot, "step": h.step, "holder": h.holder,
                      "bytes": h.nbytes, "tensors": len(h.shards),
                      "verified": tier.verify(h) if verify else None, "published_s": h.published_s})
    pending = sorted(p.name.removesuffix(".pending.json") for p in directory.glob("rank*.pending.json"))
    return {"dir": str(directory), "keeper_pid": keeper_pid(directory), "slots": slots, "pending": pending}
