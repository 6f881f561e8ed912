"""Fault injection for the tests, in the manner of NVRx's ``inject_fault``: real signals to real
processes (by PID), an exception or a hang at a named call, a disk that fills up, corrupted bytes.

Every helper acts only on what the test names: a PID the test started (or found as a descendant of
one it started), a file it wrote, a function it patches for the duration of a ``with`` block."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from resihp.train.lifecycle import start_time
from resihp.train.worker import processes_file


# --- processes ------------------------------------------------------------------------------------
def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status and "\nState:\tX" not in status


def parent_of(pid: int) -> int | None:
    """The parent PID of ``pid`` (None when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (ppid := parent_of(int(entry.name))) is not None:
            kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def descendants(pid: int) -> set[int]:
    kids, found, todo = children_map(), set(), [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def announced(out: Path) -> list[dict]:
    """The worker processes of the run in ``out`` that said who they are
    (``OUT/logs/processes.jsonl``, ``resihp.train.worker.announce``) and are still running it:
    alive, and started when the line says (a PID reused by another process was not)."""
    path = processes_file(out)
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if (
            entry.get("ticks") is not None
            and start_time(entry["pid"]) == entry["ticks"]
            and alive(entry["pid"])
        ):
            found.append(entry)
    return found


def worker_pids(out: Path, world: int, timeout_s: float = 60.0) -> dict[int, int]:
    """rank -> pid of a running job's workers (as they announced themselves), once every rank
    finished a step (node 0's trace)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        pids = {
            e["node"] * e["local_world_size"] + e["local_rank"]: e["pid"] for e in announced(out)
        }
        stream = out / "ops.jsonl"
        if len(pids) == world and stream.exists() and stream.stat().st_size > 0:
            return pids
        time.sleep(0.1)
    raise AssertionError(f"the workers under {out} did not all start within {timeout_s} s")


def inject_signal(pid: int, sig: signal.Signals) -> None:
    """SIGKILL, SIGTERM, SIGSTOP (a hang), ... to one process the test started."""
    os.kill(pid, sig)


def wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    """The PIDs still alive after up to ``timeout_s`` seconds."""
    deadline = time.time() + timeout_s
    left = {p for p in pids if alive(p)}
    while left and time.time() < deadline:
        time.sleep(0.1)
        left = {p for p in left if alive(p)}
    return left


def listening_ports(pids: set[int]) -> list[tuple[str, int, int]]:
    """(local address, port, pid) of every TCP socket in LISTEN state held by ``pids`` (from
    /proc/net/tcp and tcp6 matched to each process's socket inodes)."""
    inodes: dict[str, int] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes[target[8:-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                parts = line.split()
                if parts[3] != "0A" or parts[9] not in inodes:  # 0A: LISTEN
                    continue
                addr, port = parts[1].split(":")
                found.append((_address(addr), int(port, 16), inodes[parts[9]]))
    return found


def _address(hexaddr: str) -> str:
    import ipaddress

    raw = bytes.fromhex(hexaddr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


# --- calls ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def raise_at(monkeypatch, target: str, exc: BaseException, after: int = 0) -> Iterator[None]:
    """Make ``module.attr`` (or ``module.Class.attr``) raise ``exc`` from its call number ``after``
    on (0: the first)."""
    import importlib

    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            mod = importlib.import_module(".".join(parts[:cut]))
            break
        except ModuleNotFoundError:
            continue
    for name in parts[cut:-1]:
        mod = getattr(mod, name)
    attr = parts[-1]
    real = getattr(mod, attr)
    calls = [0]

    def fake(*args, **kwargs):
        calls[0] += 1
        if calls[0] > after:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, attr, fake)
    yield
    monkeypatch.setattr(mod, attr, real)


def enospc(path: str = "") -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


# --- disks ----------------------------------------------------------------------------------------
def can_mount_tmpfs() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None and _try_mount()


def _try_mount() -> bool:
    probe = Path(tempfile.mkdtemp(prefix="resihp-tmpfs-probe-"))
    try:
        ok = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)], capture_output=True
            ).returncode
            == 0
        )
        if ok:
            subprocess.run(["umount", str(probe)], capture_output=True)
        return ok
    finally:
        probe.rmdir()


@contextlib.contextmanager
def small_disk(size: str = "512k") -> Iterator[Path]:
    """A real, small tmpfs (root only): writes past ``size`` fail with ENOSPC."""
    where = Path(tempfile.mkdtemp(prefix="resihp-full-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
        with contextlib.suppress(OSError):
            where.rmdir()


def fill(directory: Path, leave_bytes: int = 0) -> None:
    """Fill the file system of ``directory`` up to ``leave_bytes`` free."""
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize - leave_bytes
    try:
        f = open(directory / ".filler", "wb")  # noqa: SIM115 - closed below
    except OSError:  # already full
        return
    with contextlib.suppress(OSError), f:  # the close (its last flush) may hit the full disk too
        while free > 0:
            n = min(free, 1 << 16)
            f.write(b"\0" * n)
            free -= n
        f.flush()


# --- bytes ----------------------------------------------------------------------------------------
def corrupt_bytes(path: Path, offset: int | None = None, count: int = 4) -> None:
    """Overwrite ``count`` bytes of ``path`` (in the middle by default) with their complement."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    for i in range(at, min(at + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def flip_bit(path: Path, offset: int, mask: int = 0x10) -> None:
    """Flip bits of one byte of ``path`` in place (a file mapped by a live process keeps its size:
    a memory slot going bad under its readers)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ mask]))


def truncate(path: Path, keep: int | None = None) -> None:
    size = path.stat().st_size
    os.truncate(path, size // 2 if keep is None else keep)


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not predicate():
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)
