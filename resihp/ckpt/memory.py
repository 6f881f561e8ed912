"""The memory tier: per rank two snapshot slots (A and B) as named files in ``/dev/shm``.

The files outlive the process that wrote them (plain files, not ``multiprocessing.shared_memory``,
whose resource tracker unlinks a segment when its creator is SIGKILLed).

A tier is one folder per job and node, ``/dev/shm/resihp-<job>-n<node>`` (``RESIHP_SHM`` moves
the root, for tests). Files, per rank R and slot S (``A``, ``B``, or ``copy``: the explicit replica
of another rank's newest slot, kept for ranks without a data-parallel peer):

- ``rankR.S.bin``: the slot's bytes, every tensor at its offset (``Shard``);
- ``rankR.S.pending.json``: written by the trainer (atomically, after the copy is complete): the
  step, the layout and the shards; the node's keeper (``resihp.ckpt.keeper``) reads the bytes,
  computes each shard's crc32 and publishes
- ``rankR.S.json``: the header, written last and renamed into place. A slot without a header is
  never read; the trainer unlinks the header before it writes the slot again, so a copy cut short
  (a kill in the middle of it) leaves a slot that nothing uses, never a torn one.

Space is reserved up front (``posix_fallocate``), so a full ``/dev/shm`` is one line at start, not
a SIGBUS in the middle of a copy. A tier that fills while the job runs (another process, or a slot
that grows) is found before each snapshot (:meth:`MemoryTier.lack`): that snapshot is not taken
(:class:`TierFull`), and the slots already published stay as they are.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from resihp.errors import InputError
from resihp.paths import write_text_atomic
from resihp.procinfo import pid_alive

SLOTS = ("A", "B")
COPY = "copy"
VERIFY = "VERIFY"  # a request to the keeper: check every slot now (the trainers have stopped)
VERIFIED = "verified.json"  # its verdicts
ALIGN = 64
CRC_CHUNK = 1 << 24  # crc32 in 16 MiB pieces (zlib releases the GIL on large buffers)
HEADROOM = 1 << 20  # what a snapshot needs beside its bytes: its pending file, header and holds


def shm_root() -> Path:
    return Path(os.environ.get("RESIHP_SHM", "/dev/shm"))


def tier_dir(job_id: str, node: int = 0) -> Path:
    """The memory tier of job ``job_id`` on node ``node``."""
    return shm_root() / f"resihp-{job_id}-n{node}"


@dataclass(frozen=True)
class Shard:
    """One tensor's place in a slot."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class SlotHeader:
    """What a slot holds: whose state (``rank``), of which step, in which layout.

    ``crc32`` per shard once the keeper has published it; ``holder``: the rank whose memory holds
    the slot (the owner itself, or the holder of an explicit copy)."""

    rank: int
    slot: str
    step: int
    layout: dict
    shards: list[Shard]
    nbytes: int
    holder: int
    copy_to: int | None = None  # the keeper also keeps a copy of this slot for that rank
    crc32: list[int] = field(default_factory=list)
    published_s: float | None = None
    persist: dict | None = None  # resihp.ckpt.persist.PersistRequest: the keeper writes it to disk

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SlotHeader:
        shards = [
            Shard(s["key"], s["dtype"], tuple(s["shape"]), int(s["offset"]), int(s["nbytes"]))
            for s in data["shards"]
        ]
        return cls(**{**data, "shards": shards})


def plan_shards(tensors: list) -> tuple[list[Shard], int]:
    """Offsets for ``tensors`` (``(key, torch.Tensor)`` pairs) in a slot, each aligned to 64 bytes.

    Returns the shards and the slot's size. (No torch import here: the keeper starts without
    it.)"""
    shards, offset = [], 0
    for key, t in tensors:
        n = t.numel() * t.element_size()
        shards.append(Shard(key, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, n))
        offset += -(-n // ALIGN) * ALIGN
    return shards, max(offset, ALIGN)


def crc_of(buffer: memoryview | np.ndarray, shard: Shard) -> int:
    view = memoryview(buffer)[shard.offset : shard.offset + shard.nbytes]
    crc = 0
    for start in range(0, shard.nbytes, CRC_CHUNK):
        crc = zlib.crc32(view[start : start + CRC_CHUNK], crc)
    return crc


def write_json_atomic(path: Path, data: dict) -> None:
    """``path`` appears complete or not at all (tmpfs: no fsync needed)."""
    write_text_atomic(path, json.dumps(data), durable=False)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _holder(path: Path) -> int | None:
    """The PID in a hold file; None if there is none (a hold being written counts as held)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        return int(text)
    except ValueError:
        return os.getpid()  # written but not filled yet: held, by someone alive


class TierFull(RuntimeError):
    """The memory tier's file system has no room for a snapshot.

    Its message is one line: the tier, the bytes it needs and those free."""

    def __init__(self, directory: Path, need: int, free: int, then: str = "") -> None:
        self.dir, self.need, self.free = Path(directory), need, free
        super().__init__(
            f"memory tier {self.dir} is full: a snapshot needs {_mib(need)} and {_mib(free)} "
            f"is free{then}"
        )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def free_bytes(directory: Path) -> int:
    """The bytes free for an unprivileged writer on ``directory``'s file system."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class MemoryTier:
    """One rank's view of its node's tier: its slots, and the headers of every slot there."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.dir, self.rank = Path(directory), rank
        self.dir.mkdir(parents=True, exist_ok=True)
        self._maps: dict[str, np.memmap] = {}

    # --- paths ------------------------------------------------------------------------------------
    def data_path(self, slot: str, rank: int | None = None) -> Path:
        return self.dir / f"rank{self.rank if rank is None else rank}.{slot}.bin"

    def header_path(self, slot: str, rank: int | None = None) -> Path:
        return self.dir / f"rank{self.rank if rank is None else rank}.{slot}.json"

    def pending_path(self, slot: str, rank: int | None = None) -> Path:
        return self.dir / f"rank{self.rank if rank is None else rank}.{slot}.pending.json"

    # --- capacity ---------------------------------------------------------------------------------
    def check_capacity(self, need_bytes: int, ranks_here: int = 1) -> None:
        """One line if the tier's file system cannot hold the slots of ``ranks_here`` ranks.

        Each rank needs ``need_bytes`` and ``HEADROOM``; space this rank's slots already hold counts
        as available."""
        st = os.statvfs(self.dir)
        free = st.f_bavail * st.f_frsize
        held = sum(self.data_path(s).stat().st_size for s in SLOTS if self.data_path(s).exists())
        need = max(0, need_bytes * ranks_here - held * ranks_here) + HEADROOM * ranks_here
        if need > free:
            raise InputError(
                f"--snapshot-every: the memory tier needs {need / 2**20:.0f} MiB in "
                f"{self.dir.parent} ({ranks_here} rank(s) x {need_bytes / 2**20:.0f} MiB: two "
                f"slots, and the copies a rank keeps) but {free / 2**20:.0f} MiB is free; "
                "enlarge it (mount -o remount,size=... /dev/shm), set RESIHP_SHM to a larger "
                "tmpfs, or snapshot less state"
            )

    def lack(self, slot: str, nbytes: int) -> TierFull | None:
        """Whether writing ``nbytes`` into ``slot`` would find the file system full.

        Counts the bytes the slot's file does not hold yet, plus ``HEADROOM``, against those
        free."""
        try:
            held = self.data_path(slot).stat().st_blocks * 512
        except OSError:
            held = 0
        need = max(0, nbytes - held) + HEADROOM
        free = free_bytes(self.dir)
        return TierFull(self.dir, need, free) if need > free else None

    # --- writing (the trainer) --------------------------------------------------------------------
    def open_slot(self, slot: str, nbytes: int) -> np.memmap:
        """This rank's slot ``slot`` as ``nbytes`` bytes mapped from the shared file.

        Space is reserved; a smaller file grows, a larger one shrinks."""
        cached = self._maps.get(slot)
        if cached is not None and cached.shape[0] == nbytes:
            return cached
        self._maps.pop(slot, None)
        path = self.data_path(slot)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != nbytes:
                os.ftruncate(fd, nbytes)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise TierFull(self.dir, nbytes, free_bytes(self.dir)) from None
                raise InputError(
                    f"--snapshot-every: cannot reserve {nbytes / 2**20:.0f} MiB for a "
                    f"snapshot slot in {self.dir} ({exc.strerror}); enlarge /dev/shm"
                ) from None
        finally:
            os.close(fd)
        mm = np.memmap(path, dtype=np.uint8, mode="r+", shape=(nbytes,))
        self._maps[slot] = mm
        return mm

    def hold_path(self, slot: str, rank: int | None = None) -> Path:
        """The keeper's hold on a slot it is persisting to disk (its content: the keeper's PID)."""
        return self.dir / f"rank{self.rank if rank is None else rank}.{slot}.persisting"

    def begin_write(self, slot: str, timeout_s: float = 60.0, keeper_alive=None) -> float:
        """Make ``slot`` writable and return the seconds waited for its hold.

        Waits until the keeper has published its previous content (its pending file is gone) and no
        longer holds it for a checkpoint (a slot of a checkpoint step is held from before its
        publication; a hold whose keeper died is void), then unlinks its header, so that a slot cut
        short is never read. Raises :class:`TierFull` at once where the keeper cannot publish for
        lack of room.

        Args:
            slot: the slot's name.
            timeout_s: how long to wait for the keeper.
            keeper_alive: called while waiting; restarts a keeper that died (None: not checked)."""
        pending = self.pending_path(slot)
        deadline = time.monotonic() + timeout_s
        delay = 0.0005
        while pending.exists():
            if free_bytes(self.dir) < HEADROOM:  # the keeper cannot write the header
                raise TierFull(self.dir, HEADROOM, free_bytes(self.dir))
            if keeper_alive is not None:
                keeper_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"memory tier {self.dir}: the keeper did not publish slot {slot} of "
                    f"rank {self.rank} within {timeout_s:g} s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        t0, delay = time.monotonic(), 0.0005
        while (holder := _holder(self.hold_path(slot))) is not None:
            if not pid_alive(holder):
                self.hold_path(slot).unlink(missing_ok=True)
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"memory tier {self.dir}: the keeper held slot {slot} of rank "
                    f"{self.rank} for a checkpoint longer than {timeout_s:g} s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        self.header_path(slot).unlink(missing_ok=True)
        return time.monotonic() - t0

    def mark_written(self, header: SlotHeader) -> None:
        """The slot's bytes are complete: hand them to the keeper to checksum and publish.

        Raises :class:`TierFull` if there is no room for the request."""
        try:
            write_json_atomic(self.pending_path(header.slot), header.to_dict())
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            with contextlib.suppress(OSError):
                self.pending_path(header.slot).with_name(
                    f".{self.pending_path(header.slot).name}.tmp"
                ).unlink()
            raise TierFull(self.dir, HEADROOM, free_bytes(self.dir)) from None

    def close(self) -> None:
        self._maps.clear()

    # --- reading ----------------------------------------------------------------------------------
    def headers(self) -> list[SlotHeader]:
        """Every published header in the tier (any rank's)."""
        found = []
        for path in sorted(self.dir.glob("rank*.json")):
            if path.name.endswith(".pending.json"):
                continue
            data = read_json(path)
            if data is not None:
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    found.append(SlotHeader.from_dict(data))
        return found

    def held(self) -> list[SlotHeader]:
        """The published slots this rank's memory holds: its own, and the copies it keeps."""
        return [h for h in self.headers() if h.holder == self.rank]

    def read(self, header: SlotHeader, writable: bool = False) -> np.ndarray | None:
        """The bytes of a published slot, mapped; None if the file is missing or too short.

        Read-only unless ``writable``, which torch wants of an array it wraps; too short is shorter
        than its header says."""
        path = self.data_path(header.slot, header.rank)
        try:
            if path.stat().st_size < header.nbytes:
                return None
            return np.memmap(
                path, dtype=np.uint8, mode="r+" if writable else "r", shape=(header.nbytes,)
            )
        except (OSError, ValueError):
            return None

    def verify(self, header: SlotHeader, data: np.ndarray | None = None) -> bool:
        """Whether a slot's bytes match its header's checksums."""
        data = self.read(header) if data is None else data
        if data is None or len(header.crc32) != len(header.shards):
            return False
        return all(crc_of(data, s) == c for s, c in zip(header.shards, header.crc32, strict=True))

    def checked(self, header: SlotHeader) -> bool | None:
        """The keeper's verdict on a slot, if it checked this very slot; else None.

        This very slot: same step, same publication, checked after the trainers stopped
        (:func:`verify_all`)."""
        entry = (read_json(self.dir / VERIFIED) or {}).get(
            self.header_path(header.slot, header.rank).name
        )
        if (
            entry is None
            or entry.get("step") != header.step
            or entry.get("published_s") != header.published_s
        ):
            return None
        return bool(entry.get("ok"))

    def newest_step(self) -> int | None:
        """The newest step of this rank's own published slots."""
        steps = [h.step for h in self.headers() if h.rank == self.rank and h.slot in SLOTS]
        return max(steps) if steps else None

    def free_slot(self) -> str:
        """The slot to write next: not the one holding this rank's newest published step."""
        steps = {}
        for h in self.headers():
            if h.rank == self.rank and h.slot in SLOTS:
                steps[h.slot] = h.step
        return min(SLOTS, key=lambda s: (steps.get(s, -1), s))


def verify_all(directory: Path) -> dict:
    """Check every published slot of a tier against its checksums; written to ``verified.json``.

    The keeper does it while a job relaunches, so that the restoring ranks need not."""
    tier = MemoryTier(directory, -1)
    verdicts = {
        tier.header_path(h.slot, h.rank).name: {
            "step": h.step,
            "published_s": h.published_s,
            "ok": tier.verify(h),
        }
        for h in tier.headers()
    }
    write_json_atomic(Path(directory) / VERIFIED, verdicts)
    return verdicts


def publish(directory: Path, pending: Path) -> SlotHeader | None:
    """The keeper's part for one pending slot; None if the pending file is gone.

    Checksum its bytes, write the header (atomically), keep the explicit copy it asks for, drop the
    pending file."""
    data = read_json(pending)
    if data is None:
        return None
    header = SlotHeader.from_dict(data)
    tier = MemoryTier(directory, header.rank)
    buf = tier.read(header)
    if buf is None:  # the slot's file was removed under it: nothing to publish
        pending.unlink(missing_ok=True)
        return None
    header.crc32 = [crc_of(buf, s) for s in header.shards]
    header.published_s = time.time()
    write_json_atomic(tier.header_path(header.slot), header.to_dict())
    if header.copy_to is not None:
        _keep_copy(tier, header, buf)
    pending.unlink(missing_ok=True)
    return header


def _keep_copy(tier: MemoryTier, header: SlotHeader, buf: np.ndarray) -> None:
    """The explicit replica: ``rankR.copy.bin`` (one, the newest), held by ``header.copy_to``."""
    tier.header_path(COPY).unlink(missing_ok=True)
    path = tier.data_path(COPY)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, header.nbytes)
        os.posix_fallocate(fd, 0, header.nbytes)
    finally:
        os.close(fd)
    dst = np.memmap(path, dtype=np.uint8, mode="r+", shape=(header.nbytes,))
    dst[:] = buf
    dst.flush()
    del dst
    copy = SlotHeader(
        **{
            **header.to_dict(),
            "shards": header.shards,
            "slot": COPY,
            "holder": header.copy_to,
            "copy_to": None,
        }
    )
    write_json_atomic(tier.header_path(COPY), copy.to_dict())
