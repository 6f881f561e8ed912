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
import errno
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from resihp.ckpt.integrity import candidates, step_of
from resihp.ckpt.memory import (
    HEADROOM,
    SLOTS,
    VERIFY,
    MemoryTier,
    SlotHeader,
    free_bytes,
    publish,
    read_json,
    shm_root,
    verify_all,
    write_json_atomic,
)
from resihp.errors import SetupError, disk_full
from resihp.procexit import run_then_exit
from resihp.procinfo import pid_alive, process_state, start_time

POLL_S = 0.005
LOCK_WAIT_S = 1.0  # a keeper finding the tier's lock held retries this long: it may be a probe
LOCK = "keeper.lock"
PID = "keeper.pid"
PERSIST_JOIN_S = (
    8.0  # a stopping keeper waits this long for the checkpoint it writes (stop_keeper: 10 s)
)
END = "END"  # written by stop_keeper: the job is over, SIGTERM means remove the tier
FLUSH = "FLUSH"  # a request (request_flush): finish the checkpoints owed, maybe write the newest
FLUSHED = "flushed.json"  # the keeper's answer to it
PERSIST_FAILED = "persist_failed.json"  # the first checkpoint the keeper could not write, and why
OWNER = "owner.json"  # the job's owner as the keeper saw it at start: PID and start time
STOPPED_KEEPER_S = 2.0  # a keeper process stopped (SIGSTOP, a debugger) this long is replaced
_stopped_since: dict[tuple[int, int | None], float] = {}  # (keeper PID, start time) -> first seen


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


def ensure_keeper(directory: Path, owner: int, timeout_s: float = 60.0, warm: bool = False) -> int:
    """Start the keeper of ``directory`` unless one runs; returns its PID.

    Safe to call from several processes at once (one of them starts it).

    Args:
        directory: the memory tier's folder.
        owner: the PID of the process that owns the tier (the keeper ends with it).
        timeout_s: how long to wait for the keeper to start.
        warm: the job's checkpoints are written from memory, so the keeper loads torch as it
            starts.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / "spawn.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        pid = keeper_pid(directory)
        if pid not in (None, -1) and _replace_if_stopped(directory, pid):
            pid = None
        if pid is None:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "resihp.ckpt.keeper",
                    "--dir",
                    str(directory),
                    "--owner",
                    str(owner),
                    *(["--warm"] if warm else []),
                ],
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=open(directory / "keeper.log", "a"),  # noqa: SIM115
            )
            deadline = time.monotonic() + timeout_s
            while (pid := keeper_pid(directory)) in (None, -1):
                if proc.poll() is not None:
                    raise SetupError(
                        f"memory tier keeper exited with status {proc.returncode} "
                        f"(see {directory / 'keeper.log'})"
                    )
                if time.monotonic() > deadline:
                    raise SetupError(
                        f"memory tier keeper did not start within {timeout_s:g} s "
                        f"(see {directory / 'keeper.log'})"
                    )
                time.sleep(0.01)
        return pid
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _is_keeper_of(pid: int, directory: Path) -> bool:
    """Whether ``pid`` is a keeper process of ``directory`` (its command line says so): no other
    process is ever signalled, whatever a PID file in the tier names."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"resihp.ckpt.keeper" in args and str(directory).encode() in args


def _replace_if_stopped(directory: Path, pid: int) -> bool:
    """A keeper stopped for ``STOPPED_KEEPER_S`` publishes nothing and would stall every snapshot
    until its timeout: it is killed, so that a new one is started (a checkpoint it was writing is
    never published half-written; its holds pass to the new keeper, which writes what they keep).
    True if so."""
    key = (pid, start_time(pid))
    if process_state(pid) not in ("T", "t"):
        _stopped_since.pop(key, None)
        return False
    first = _stopped_since.setdefault(key, time.monotonic())
    if time.monotonic() - first < STOPPED_KEEPER_S or not _is_keeper_of(pid, directory):
        return False
    for hold in directory.glob("rank*.persisting"):  # held on for the keeper that takes over
        with contextlib.suppress(OSError):
            if hold.read_text().strip() == str(pid):
                hold.write_text(str(os.getpid()))
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while keeper_pid(directory) not in (None,) and time.monotonic() < deadline:
        time.sleep(0.01)  # the lock is released once the process is gone
    _stopped_since.pop(key, None)
    print(
        f"resihp: memory tier {directory}: its keeper (PID {pid}) was stopped for "
        f"{STOPPED_KEEPER_S:g} s; a new keeper takes over",
        file=sys.stderr,
        flush=True,
    )
    return keeper_pid(directory) is None


def stop_keeper(directory: Path, timeout_s: float = 10.0) -> None:
    """End the job's memory tier: the keeper removes its files and exits.

    If no keeper runs, the files are removed here."""
    directory = Path(directory)
    pid = keeper_pid(directory)
    if pid not in (None, -1):
        with contextlib.suppress(OSError):
            (directory / END).touch()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    shutil.rmtree(directory, ignore_errors=True)


def _load_persist() -> None:
    from resihp.ckpt import persist  # noqa: F401  (deferred: see Keeper._write)


def request_flush(directory: Path, newest: bool, timeout_s: float = 120.0) -> dict | None:
    """Ask the keeper to finish the checkpoints it owes, and wait for its answer.

    The answer has ``step`` (the checkpoint written for the breakpoint, or None) and ``error``; None
    if no keeper runs or none answers within ``timeout_s``.

    Args:
        directory: the memory tier's folder.
        newest: also write the newest step complete in memory when no checkpoint has it (the
            job's breakpoint).
        timeout_s: how long to wait for the answer.
    """
    directory = Path(directory)
    if keeper_pid(directory) in (None, -1):
        return None
    ident = f"{os.getpid()}-{time.time()}"
    try:
        write_json_atomic(directory / FLUSH, {"id": ident, "newest": newest})
    except OSError:  # a full tier: no request can reach the keeper (persist_failure says what)
        return None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = read_json(directory / FLUSHED)
        if answer is not None and answer.get("id") == ident:
            return answer
        if keeper_pid(directory) in (None, -1):
            return None
        time.sleep(0.02)
    return None


def complete_steps(headers: list[SlotHeader], due_only: bool) -> list[tuple[int, list[SlotHeader]]]:
    """The steps, newest first, for which every rank has its own published slot to persist.

    Each with those slots; a slot counts with a persist request (``due_only``: one marked due)."""
    by_step: dict[int, dict[int, SlotHeader]] = {}
    world = None
    for h in headers:
        if h.persist is None or h.slot == "copy" or (due_only and not h.persist.get("due")):
            continue
        world = int(h.persist["world"])
        by_step.setdefault(h.step, {})[h.rank] = h
    return [
        (step, [ranks[r] for r in sorted(ranks)])
        for step, ranks in sorted(by_step.items(), reverse=True)
        if world is not None
        and len(ranks) == world
        and any(ranks[r].persist.get("meta") for r in ranks)
    ]


def newest_on_disk(root: Path) -> int:
    """The newest checkpoint step under ``root`` (-1: none)."""
    found = candidates(root)
    return step_of(found[0]) if found else -1


class Keeper:
    def __init__(self, directory: Path, owner: int | None, warm: bool = False) -> None:
        self.dir, self.owner = Path(directory), owner
        self.stopping = False
        self.published = 0
        self._persisting: threading.Thread | None = None
        self._writing: set[Path] = set()  # the holds of the checkpoint being written
        self._persisted: set[int] = set()  # steps written (or found moot) by this keeper
        self._persists = False  # a slot asked for a checkpoint: torch and DCP are (being) loaded
        self._owed: set[int] | None = None  # due steps complete at the first look, to write in turn
        self._dirty = False  # a slot was published or a checkpoint finished since the last look
        self._full = False  # the tier had no room for the last header it wrote
        if warm:
            self._warm()

    def _adopt_holds(self) -> None:
        """A predecessor's holds (a keeper replaced while it was stopped) become this keeper's:
        their checkpoints are still owed, and the trainers keep those slots until they are
        written."""
        holds = list(self.dir.glob("rank*.persisting"))
        for hold in holds:
            with contextlib.suppress(OSError):
                hold.write_text(str(os.getpid()))
        if holds:
            self._dirty = True
            if not self._persists:
                self._warm()

    def _stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def run(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        lock = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                # ``keeper_pid`` probes the lock for an instant (the job starting this keeper polls
                # it, and a CI run once caught the keeper's own try in such an instant: it left as
                # if another held the tier); another keeper holds it for good
                if time.monotonic() > deadline:
                    sys.exit(0)
                time.sleep(0.01)
        (self.dir / PID).write_text(str(os.getpid()))
        self._adopt_holds()
        if self.owner:  # what tells a later job whether this tier's job is over (left_tiers)
            write_json_atomic(
                self.dir / OWNER, {"pid": self.owner, "start": start_time(self.owner)}
            )
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        checked = 0.0
        owner_gone = False
        while not self.stopping:
            busy = self.step()
            now = time.monotonic()
            if now - checked > 0.5:
                checked = now
                if self.owner and not pid_alive(self.owner):
                    owner_gone = True
                    break
                if not self.dir.exists():
                    return
            if not busy:
                time.sleep(POLL_S)
        if self._persisting is not None:
            # a checkpoint being written finishes (its publication and the pruning of older ones)
            # before the tier it reads from goes; stop_keeper's SIGKILL bounds the wait
            self._persisting.join(timeout=PERSIST_JOIN_S)
        if owner_gone or (self.dir / END).exists():
            shutil.rmtree(self.dir, ignore_errors=True)  # the job is over: its snapshots go with it
        # else (a SIGTERM not from the job's end): the files stay for the next keeper

    def step(self) -> bool:
        """Publish every pending slot, start a checkpoint that is due, answer a flush.

        Returns whether there was any work."""
        # the flush request is read before the pending slots are listed: a trainer's last slot,
        # pending before its job asked for the flush, is then published and written first (read
        # after the listing, a flush answered at once could leave that slot's checkpoint unwritten)
        flush = read_json(self.dir / FLUSH)
        try:
            pending = sorted(self.dir.glob("rank*.pending.json"))
        except OSError:
            return False
        if self._full and free_bytes(self.dir) < HEADROOM:
            pending = []  # still no room: no checksum of a slot it cannot publish
        for path in pending:
            try:
                self._hold_if_due(path)
                if publish(self.dir, path) is not None:
                    self.published += 1
                    self._dirty = True
            except FileNotFoundError:
                pass
            except (
                OSError
            ) as exc:  # a full tier: the slot stays pending, published once there is room
                if exc.errno != errno.ENOSPC:
                    raise
                if not self._full:
                    print(
                        f"resihp keeper: memory tier {self.dir} is full: {path.name} waits to be "
                        f"published",
                        file=sys.stderr,
                        flush=True,
                    )
                self._full = True
                break
        else:
            self._full = self._full and not pending
        request = self.dir / VERIFY
        if request.exists() and not pending:
            self._release()  # the trainers have stopped: nobody finishes an incomplete checkpoint
            verify_all(self.dir)
            request.unlink(missing_ok=True)
        if self._persists and self._dirty:
            self._persist_due()
        if flush is not None and not pending:
            self._flush(flush)
        return bool(pending)

    # --- checkpoints to disk (resihp.ckpt.persist) ------------------------------------------------
    def _warm(self) -> None:
        """Load torch and DCP in the background, so that the first checkpoint does not wait for
        them."""
        self._persists = True
        self._persisting = threading.Thread(
            target=_load_persist, name="resihp-persist-import", daemon=True
        )
        self._persisting.start()

    def _hold_if_due(self, pending: Path) -> None:
        """A slot of a checkpoint step is held from its publication on (its trainer does not write
        it again until the keeper has written the checkpoint or found it moot)."""
        data = read_json(pending)
        request = (data or {}).get("persist") or {}
        if not request:
            return
        if not self._persists:
            self._warm()
        if request.get("due") and int(data["step"]) not in self._persisted:
            MemoryTier(self.dir, int(data["rank"])).hold_path(data["slot"]).write_text(
                str(os.getpid())
            )

    def _release(self, keep: set[Path] = frozenset()) -> None:
        """Drop every hold except ``keep`` and those of the checkpoint being written."""
        for path in self.dir.glob("rank*.persisting"):
            if path not in keep and path not in self._writing:
                path.unlink(missing_ok=True)

    def _persist_due(self) -> None:
        """Start writing the newest checkpoint step complete in memory (first those owed at the
        first look, oldest first); release the holds it makes moot (older steps, steps written
        already, slots whose trainer went on without them)."""
        if self._persisting is not None and self._persisting.is_alive():
            return
        self._dirty = False
        self._writing = set()
        tier = MemoryTier(self.dir, -1)
        headers = tier.headers()
        published = {tier.hold_path(h.slot, h.rank): h.step for h in headers if h.slot in SLOTS}
        due = complete_steps(headers, due_only=True)
        if due and self._owed is None:
            # what was due before this keeper's first look (a keeper taking over from one that was
            # stopped or killed) is written oldest first: the newest alone would make it moot
            on_disk = newest_on_disk(Path(due[0][1][0].persist["root"]))
            self._owed = {step for step, _ in due if step > on_disk}
        owed = [d for d in due if d[0] in (self._owed or set()) and d[0] not in self._persisted]
        chosen = owed[-1] if owed else (due[0] if due else None)
        newest = chosen[0] if chosen else None
        moot = {p for p, step in published.items() if newest is not None and step <= newest}
        keep = {p for p in self.dir.glob("rank*.persisting") if p in published and p not in moot}
        if newest is not None and newest not in self._persisted:
            self._persisted.add(newest)
            slots = chosen[1]
            self._writing = {tier.hold_path(h.slot, h.rank) for h in slots}
            self._persisting = threading.Thread(
                target=self._write, args=(slots, "due"), name="resihp-persist", daemon=True
            )
            self._persisting.start()
        self._release(keep)

    def _write(self, headers: list, reason: str) -> int | None:
        try:
            # deferred: torch and DCP (seconds to import) only in a keeper whose job persists, and
            # in this thread, never in the loop that publishes the trainers' slots
            from resihp.ckpt import persist

            done = persist.write_checkpoint(self.dir, headers, reason)
        except (
            BaseException
        ) as exc:  # a failed checkpoint must not take the memory tier down with it
            # (DCP's CheckpointException, what a full disk raises in its writer, is a BaseException)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            print(
                f"resihp keeper: checkpoint of step {headers[0].step} failed: {exc!r}",
                file=sys.stderr,
                flush=True,
            )
            if not (self.dir / PERSIST_FAILED).exists():  # the launcher reads it (persist_failure)
                # the cause, not DCP's wrapper of it (its per-rank failures)
                cause = disk_full(exc) or next(
                    iter((getattr(exc, "failures", None) or {}).values()), exc
                )
                first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:300]
                with contextlib.suppress(OSError):
                    write_json_atomic(
                        self.dir / PERSIST_FAILED,
                        {
                            "step": headers[0].step,
                            "error": f"{type(cause).__name__}: {first}",
                            "disk_full": disk_full(exc) is not None or _full(headers),
                        },
                    )
            return None
        finally:
            self._dirty = True  # newer steps may have become complete meanwhile
        return done.step if done is not None else None

    def _flush(self, request: dict) -> None:
        """The job's end: finish the checkpoints owed and, at a breakpoint, write the newest step
        complete in memory unless a checkpoint has it."""
        step, error = None, None
        try:
            if self._persisting is not None:
                self._persisting.join()
            if self._persists:
                self._persist_due()
                if self._persisting is not None:
                    self._persisting.join()
                self._writing = set()
                complete = complete_steps(MemoryTier(self.dir, -1).headers(), due_only=False)
                if request.get("newest") and complete:
                    newest, headers = complete[0]
                    root = Path(headers[0].persist["root"])
                    if newest > newest_on_disk(root):
                        step = self._write(headers, "breakpoint")
                self._release()
        except Exception as exc:
            error = repr(exc)
        with contextlib.suppress(
            OSError
        ):  # a full tier: the job's end finds no answer, and says so
            write_json_atomic(
                self.dir / FLUSHED, {"id": request.get("id"), "step": step, "error": error}
            )
        (self.dir / FLUSH).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="resihp.ckpt.keeper")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--owner", type=int, default=None, help="end with this process")
    parser.add_argument(
        "--warm", action="store_true", help="load torch at start (the job checkpoints from memory)"
    )
    args = parser.parse_args(argv)
    Keeper(Path(args.dir), args.owner, args.warm).run()


if __name__ == "__main__":
    # without the teardown of torch's modules (``resihp.procexit``): the job's end waits for this
    # process to exit (``stop_keeper``), 0.6 s of it that teardown
    run_then_exit(main)


def request_verify(directory: Path) -> None:
    """Ask the keeper to check every slot now (call once the job's trainers have stopped)."""
    with contextlib.suppress(OSError):
        (Path(directory) / VERIFY).touch()


def find_tiers(path: Path) -> list[Path]:
    """The memory tiers ``path`` names, on every node of this machine.

    A tier folder itself, or a run folder's job's (its ``run.json`` names the job)."""
    path = Path(path)
    if (path / LOCK).exists() or list(path.glob("rank*.bin")):
        return [path]
    job = read_json(path / "run.json") or {}
    if not job.get("job_id"):
        return []
    return sorted(p for p in shm_root().glob(f"resihp-{job['job_id']}-n*") if p.is_dir())


def inspect_tier(directory: Path, verify: bool = True) -> dict:
    """What a memory tier holds: its published slots, the slots still pending, and the keeper.

    For each published slot: whose state, which step, who holds it, its size, whether its bytes
    match its checksums."""
    directory = Path(directory)
    slots = []
    for h in MemoryTier(directory, -1).headers():
        tier = MemoryTier(directory, h.rank)
        slots.append(
            {
                "rank": h.rank,
                "slot": h.slot,
                "step": h.step,
                "holder": h.holder,
                "bytes": h.nbytes,
                "tensors": len(h.shards),
                "verified": tier.verify(h) if verify else None,
                "published_s": h.published_s,
            }
        )
    pending = sorted(
        p.name.removesuffix(".pending.json") for p in directory.glob("rank*.pending.json")
    )
    return {
        "dir": str(directory),
        "keeper_pid": keeper_pid(directory),
        "slots": slots,
        "pending": pending,
    }


@dataclass(frozen=True)
class LeftTier:
    """A memory tier of another job in the tier root.

    Its folder, its owner (the launcher or torchrun's agent) as its keeper recorded it, and whether
    that owner is provably gone."""

    path: Path
    owner_pid: int | None  # None: no owner recorded (a keeper of an older resihp, or starting)
    owner_dead: bool  # the owner's PID is gone or names another process (its start time differs)
    keeper_running: bool
    nbytes: int

    @property
    def reclaimable(self) -> bool:
        """Its job is over for sure: no keeper holds it and its owner is provably dead."""
        return self.owner_dead and not self.keeper_running

    def describe(self) -> str:
        owner = (
            f"owner PID {self.owner_pid} {'gone' if self.owner_dead else 'running'}"
            if self.owner_pid is not None
            else "no owner recorded"
        )
        return (
            f"{self.path} ({self.nbytes / 2**20:.0f} MiB, {owner}; remove it with "
            f"rm -rf {self.path} once its job is over)"
        )


def _size(directory: Path) -> int:
    total = 0
    for entry in directory.glob("*"):
        with contextlib.suppress(OSError):
            total += entry.stat().st_size
    return total


def left_tiers(exclude: Path | None = None, root: Path | None = None) -> list[LeftTier]:
    """The memory tiers in ``root`` (default: the tier root) other than ``exclude``.

    Each with its owner's state, judged by the PID and start time its keeper recorded."""
    found = []
    for path in sorted((root or shm_root()).glob("resihp-*-n*")):
        if not path.is_dir() or (exclude is not None and path == Path(exclude)):
            continue
        record = read_json(path / OWNER) or {}
        pid, started = record.get("pid"), record.get("start")
        pid = pid if isinstance(pid, int) and pid > 0 else None
        dead = pid is not None and (start_time(pid) is None or start_time(pid) != started)
        found.append(LeftTier(path, pid, dead, keeper_pid(path) is not None, _size(path)))
    return found


def reclaim_dead_tiers(exclude: Path | None = None) -> list[LeftTier]:
    """Remove the tiers of jobs provably over; returns those removed.

    A job is over when its tier has no keeper and its owner is gone (a launcher and keeper
    SIGKILLed together leave theirs); each removal is said in one line on stderr."""
    gone = []
    for tier in left_tiers(exclude):
        if tier.reclaimable:
            shutil.rmtree(tier.path, ignore_errors=True)
            gone.append(tier)
            print(
                f"resihp: removed the memory tier {tier.path} of a dead job "
                f"({tier.nbytes / 2**20:.0f} MiB; its owner PID {tier.owner_pid} is gone)",
                file=sys.stderr,
                flush=True,
            )
    return gone


def _full(headers: list) -> bool:
    """Whether the checkpoint root of ``headers`` has no space left (DCP's writer may lose the
    errno: a zip writer's "unexpected pos")."""
    try:
        st = os.statvfs(Path(headers[0].persist["root"]))
    except (OSError, KeyError, TypeError, IndexError):
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)


def persist_failure(directory: Path) -> dict | None:
    """The first checkpoint the keeper of ``directory`` could not write, or None.

    It carries ``step``, ``error`` and ``disk_full``; a due slot still pending at the job's end (a
    full tier left no room to publish it) is one too."""
    failed = read_json(Path(directory) / PERSIST_FAILED)
    if failed is not None:
        return failed
    stuck = []
    for path in Path(directory).glob("rank*.pending.json"):
        data = read_json(path) or {}
        if ((data.get("persist") or {}).get("due")) and isinstance(data.get("step"), int):
            stuck.append(data["step"])
    if not stuck:
        return None
    return {
        "step": min(stuck),
        "error": f"the memory tier {directory} had no room to publish its snapshot",
        "disk_full": True,
    }
