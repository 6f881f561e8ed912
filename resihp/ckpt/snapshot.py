"""Snapshots of a rank's model and AdamW state into the memory tier, and the restore from it.

Snapshots are taken off the training path.

Taking one (:class:`Snapshotter`): after the optimizer step of step ``s`` the trainer calls
``snapshot``; a thread copies every parameter, AdamW tensor and the RNG state into the free slot
while the next step's forward and backward run (they read the parameters, never write them); the
next optimizer step waits for the copy first (an optimizer step pre-hook: torchtitan's
``maybe_wait_for_staging``), so a snapshot is never torn. State on a GPU is copied on a side stream
that starts after the optimizer step's kernels, straight into the slot's shared memory pinned once
(``cudaHostRegister``), so the device-to-host copy overlaps the next forward and backward instead
of queueing behind them on the training stream. Once the copy is complete the trainer
marks the slot written; the node's keeper checksums and publishes it.

Restoring (:func:`restore`, collective): every rank verifies the slots its memory holds (its own
two, and explicit copies of other ranks), the ranks exchange what they hold, and all pick the newest
step for which every rank's state is complete and verified somewhere, counting data-parallel peers
(the same state) and explicit copies (NVRx's ``find_latest``). A rank loads from its node's
memory if the slot is there (its own, or a peer's or copy on the same node: the tier is shared
memory), else a holder on another node sends it over the (gloo) group, straight into the rank's
tensors, once every rank has agreed that what it must read or send is there (so a failure leaves
every model untouched). None when no step is complete everywhere: the caller goes on to the next
tier (disk).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from resihp.ckpt.memory import SLOTS, MemoryTier, SlotHeader, TierFull, plan_shards
from resihp.errors import note
from resihp.model.gpt import ADAM_KEYS, ensure_adam_state

RNG_KEY = "rng.torch"


def state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[tuple[str, torch.Tensor]]:
    """What a snapshot holds, by this rank's local names: parameters, AdamW state, the RNG."""
    ensure_adam_state(model, optimizer)
    out = []
    for name, p in model.named_parameters():
        out.append((f"model.{name}", p.detach()))
        for k in ADAM_KEYS:
            out.append((f"optim.{name}.{k}", optimizer.state[p][k]))
    out.append((RNG_KEY, torch.get_rng_state()))
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def comparable(layout: dict) -> dict:
    """The part of a layout that must match to restore (``run``: state restored, not compared)."""
    return {k: v for k, v in layout.items() if k != "run"}


class Snapshotter:
    """One rank's snapshots every ``every`` steps into ``tier``.

    ``copy_to``: the rank that keeps an explicit copy of each (a rank with no data-parallel peer),
    or None. ``held``: a context around the wait for the keeper to release a slot (the trainer's
    heartbeat says it waits on its keeper, a wait bounded by ``timeout_s``, not a hang)."""

    def __init__(
        self,
        tier: MemoryTier,
        every: int,
        copy_to: int | None = None,
        keeper_alive: Callable[[], None] | None = None,
        timeout_s: float = 60.0,
        held: Callable[[], AbstractContextManager] = nullcontext,
    ) -> None:
        self.tier, self.every, self.copy_to = tier, every, copy_to
        self.keeper_alive, self.timeout_s, self.held = keeper_alive, timeout_s, held
        self._next = tier.free_slot()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._full_copy: tuple[int, str, TierFull] | None = None  # a copy not handed on: no room
        self._hooked: torch.optim.Optimizer | None = None
        self._hook = None
        self.blocked_s: list[float] = []  # per snapshot: how long the trainer waited for it
        self.copy_s: list[float] = []  # per snapshot: how long the copy took (in the background)
        self.fence_waits = 0  # optimizer steps that found a copy still running
        self.held_s: list[float] = []  # per snapshot: the wait for the keeper to release the slot
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pinned: dict[str, tuple[int, int, bool]] = {}  # slot -> (address, bytes, pinned)
        self.skipped: list[int] = []  # the steps whose snapshot the full tier had no room for
        self.full: TierFull | None = None  # why the newest of them was not taken
        self._last_step: int | None = None  # the step of the snapshot before this one

    def due(self, step: int) -> bool:
        return self.every > 0 and (step + 1) % self.every == 0

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Fence ``optimizer``'s steps: each waits for the copy in flight.

        Attach again after a re-plan replaced the optimizer."""
        if optimizer is self._hooked:
            return
        if self._hook is not None:
            self._hook.remove()
        self._hook = optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.fence())
        self._hooked = optimizer

    def snapshot(
        self,
        step: int,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        layout: dict,
        persist: Callable[[list[tuple[str, torch.Tensor]]], dict] | None = None,
        tensors: list[tuple[str, torch.Tensor]] | None = None,
    ) -> bool:
        """Start copying this rank's state after step ``step`` into the free slot.

        False if the tier has no room for it (:class:`~resihp.ckpt.memory.TierFull`: not taken,
        said once).

        Args:
            step: the step just finished.
            model: the model whose parameters and AdamW state are copied (with ``optimizer``),
                unless ``tensors`` names what to copy.
            optimizer: the optimizer whose next step waits for the copy.
            layout: what the slot's state is laid out as (restored only into the same).
            persist: given the tensors copied, the request for the keeper to write them to disk
                (``resihp.ckpt.persist.PersistRequest`` as a dict), or None.
            tensors: the (key, tensor) pairs to copy in place of the model's and optimizer's.
        """
        t0 = time.perf_counter()
        self.fence()
        self.attach(optimizer)
        slot = self._next
        if tensors is None:
            tensors = state_tensors(model, optimizer)
        shards, nbytes = plan_shards(tensors)
        try:
            full = self.tier.lack(slot, nbytes)
            if full is not None:
                raise full
            with self.held():
                self.held_s.append(self.tier.begin_write(slot, self.timeout_s, self.keeper_alive))
            buf = torch.from_numpy(self.tier.open_slot(slot, nbytes))
        except TierFull as exc:
            self._skip(step, exc)
            return False
        header = SlotHeader(
            self.tier.rank,
            slot,
            step,
            layout,
            shards,
            nbytes,
            holder=self.tier.rank,
            copy_to=self.copy_to,
            persist=persist(tensors) if persist is not None else None,
        )
        gpu = next((t.device for _, t in tensors if t.is_cuda), None)
        ready = None
        if gpu is not None:
            self._pin(slot, buf)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(gpu))  # after the optimizer step's kernels
        self._error = None
        self._thread = threading.Thread(
            target=self._copy,
            args=(buf, tensors, header, gpu, ready),
            name="resihp-snapshot",
            daemon=True,
        )
        self._thread.start()
        self._next = SLOTS[1 - SLOTS.index(slot)]
        self._last_step = step
        self.blocked_s.append(time.perf_counter() - t0)
        return True

    def _skip(self, step: int, full: TierFull) -> None:
        """A snapshot the full tier has no room for is not taken; the first of a run of them is
        said in one line (the slots published before stay, the newest is named)."""
        if not self.skipped or self.skipped[-1] != self._last_step:
            newest = self.tier.newest_step()
            note(
                f"{full}; snapshots go on without it from step {step} until there is room "
                f"(newest snapshot in memory: {'none' if newest is None else f'step {newest}'})"
            )
        self.skipped.append(step)
        self.full = full
        self._last_step = step

    @property
    def pinned(self) -> bool | None:
        """Whether the slots a GPU copy went into are page-locked (None: no GPU copy yet)."""
        return all(p for _, _, p in self._pinned.values()) if self._pinned else None

    def _pin(self, slot: str, buf: torch.Tensor) -> None:
        """Page-lock a slot's mapping once, so that copies into it run at full DMA speed without
        blocking the host; a mapping the driver refuses stays pageable (slower, still correct)."""
        key = (buf.data_ptr(), buf.numel())
        old = self._pinned.get(slot)
        if old is not None and old[:2] == key:
            return
        if old is not None and old[2]:
            torch.cuda.cudart().cudaHostUnregister(old[0])
        rc = torch.cuda.cudart().cudaHostRegister(key[0], key[1], 0)
        self._pinned[slot] = (*key, int(rc) == 0)

    def _copy(
        self,
        buf: torch.Tensor,
        tensors: list[tuple[str, torch.Tensor]],
        header: SlotHeader,
        gpu: torch.device | None = None,
        ready: torch.cuda.Event | None = None,
    ) -> None:
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                if gpu is None:
                    for (_, t), s in zip(tensors, header.shards, strict=True):
                        buf[s.offset : s.offset + s.nbytes].copy_(_bytes(t))
                else:
                    stream = self._streams.setdefault(gpu, torch.cuda.Stream(gpu))
                    with torch.cuda.device(gpu), torch.cuda.stream(stream):
                        stream.wait_event(ready)
                        for (_, t), s in zip(tensors, header.shards, strict=True):
                            buf[s.offset : s.offset + s.nbytes].copy_(
                                _bytes(t), non_blocking=t.is_cuda
                            )
                    stream.synchronize()
            self.tier.mark_written(header)
        except TierFull as exc:  # the slot stays unpublished (its header was removed before)
            self._full_copy = (header.step, header.slot, exc)
        except BaseException as exc:  # handed to the trainer at the fence
            self._error = exc
        self.copy_s.append(time.perf_counter() - t0)

    def fence(self) -> None:
        """Wait for the copy in flight (called before every optimizer step)."""
        thread = self._thread
        if thread is None:
            return
        t0 = time.perf_counter()
        if thread.is_alive():
            self.fence_waits += 1
        thread.join()
        self._thread = None
        if self.blocked_s:
            self.blocked_s[-1] += time.perf_counter() - t0
        if self._full_copy is not None:
            (step, slot, full), self._full_copy = self._full_copy, None
            self._next = slot  # written again next time: the other slot keeps the newest published
            self._skip(step, full)
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"snapshot copy failed: {error}") from error

    def close(self) -> None:
        """Finish the copy in flight (a stopping trainer keeps its last complete step)."""
        try:
            self.fence()
        finally:
            if self._hook is not None:
                self._hook.remove()
            for address, _, pinned in self._pinned.values():
                if pinned:
                    torch.cuda.cudart().cudaHostUnregister(address)
            self._pinned.clear()
            self.tier.close()


# --- restore --------------------------------------------------------------------------------------
@dataclass
class Restored:
    step: int  # the snapshot's step: training goes on at step + 1
    source: str  # "memory" (every rank from its own memory) or "peer" (some over the network)
    sources: list[str]  # per rank
    restore_s: float  # the slowest rank's restore time
    run: dict  # the run state recorded with the snapshot (layout["run"])
    # this rank's time in each phase: inventory (checking its slots, exchanging what every rank
    # holds), transfer (agreeing that every slot is ready, then receiving a peer's slot straight
    # into the model and optimizer, or sending its own), load (copying its own slot into the model
    # and optimizer, while the transfers run), agree (the closing all-reduce)
    phases_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "source": self.source,
            "sources": self.sources,
            "restore_s": round(self.restore_s, 4),
            "run": self.run,
            "phases_s": {k: round(v, 4) for k, v in self.phases_s.items()},
        }


def find_latest(
    inventory: list[list[dict]], peers: Callable[[int], list[int]], world: int
) -> tuple[int, dict[int, dict]] | None:
    """The newest step whose state is held, verified, for every rank, and each rank's slot to load.

    A rank's state is held in its own slot, a data-parallel peer's, or an explicit copy; the slot
    to load is its own memory first, then a peer's slot, then a copy. None: no such step.

    Args:
        inventory: per rank ``h``, the verified headers it holds (dicts with ``rank``, ``holder``,
            ``slot``, ``step``).
        peers: per rank, the ranks that hold the same state (itself and its data-parallel peers).
        world: the number of ranks.
    """
    held = [h for per_rank in inventory for h in per_rank]
    for step in sorted({h["step"] for h in held}, reverse=True):
        at = [h for h in held if h["step"] == step]
        choice = {}
        for r in range(world):
            same = set(peers(r))
            options = [h for h in at if h["rank"] in same]
            if not options:
                break
            choice[r] = min(
                options,
                key=lambda h: (
                    h["holder"] != r,
                    h["rank"] != h["holder"],
                    h["slot"] not in SLOTS,
                    h["holder"],
                    h["slot"],
                ),
            )
        else:
            return step, choice
    return None


def restore(
    tier: MemoryTier,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    layout: dict,
    peers: Callable[[int], list[int]],
    group: dist.ProcessGroup | None = None,
    before_transfer: Callable[[], None] | None = None,
) -> Restored | None:
    """Collective: load the newest step complete for every rank from the memory tier, or None.

    Every rank of ``group`` calls it, and every rank returns alike.

    Args:
        tier: this node's memory tier.
        model: this rank's model, filled in place.
        optimizer: its AdamW optimizer, filled in place.
        layout: this rank's layout fields; only snapshots taken in the same layout are loaded.
        peers: per rank, the ranks that hold the same state (itself and its data-parallel peers).
        group: the gloo process group (None: the default group).
        before_transfer: called once every rank has agreed what to load (fault injection).
    """
    t0 = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    want = comparable(layout)
    mine = [h.to_dict() for h in tier.held() if comparable(h.layout) == want and _good(tier, h)]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (str(tier.dir), mine), group=group)
    t_inventory = time.perf_counter()
    tiers = [t for t, _ in gathered]
    found = find_latest([held for _, held in gathered], peers, world)
    if found is None:
        return None
    step, choice = found
    header = SlotHeader.from_dict(choice[rank])
    # a slot in this rank's own node's tier is read from the shared memory, whoever holds it
    local = {r: tiers[r] == tiers[c["holder"]] for r, c in choice.items()}
    transfers = sorted((c["holder"], r) for r, c in choice.items() if not local[r])
    # before any byte lands in the model: every slot to read is there and every slot to receive fits
    # this rank's tensors; else every rank alike goes on to the next tier with its model untouched
    sending = {dst: SlotHeader.from_dict(choice[dst]) for src, dst in transfers if src == rank}
    mapped = {dst: tier.read(h, writable=True) for dst, h in sending.items()}
    data = tier.read(header, writable=True) if local[rank] else None
    tensors = dict(state_tensors(model, optimizer))
    ready = (
        all(m is not None for m in mapped.values())
        and _fits(header, tensors)
        and (not local[rank] or data is not None)
    )
    flag = torch.tensor([1 if ready else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if flag.item() < 1:
        return None
    if before_transfer is not None:
        before_transfer()
    # every transfer, in the same order on every rank: (holder -> rank), one message per tensor,
    # received straight into this rank's parameters and AdamW state (pages it has already touched:
    # no receive buffer, no copy after). The holder checked the slot against its checksums (the
    # inventory above), and the transport checks what it carries.
    sends, receives, tag = [], [], 0
    rng = torch.empty_like(tensors[RNG_KEY])
    for src, dst in transfers:
        h = SlotHeader.from_dict(choice[dst])
        if src == rank:
            payload = torch.from_numpy(mapped[dst])
            sends += [
                dist.isend(
                    payload[sh.offset : sh.offset + sh.nbytes], dst, group=group, tag=tag + i
                )
                for i, sh in enumerate(h.shards)
            ]
        elif dst == rank:
            receives += [
                dist.irecv(
                    _bytes(rng) if sh.key == RNG_KEY else _bytes(tensors[sh.key]),
                    src,
                    group=group,
                    tag=tag + i,
                )
                for i, sh in enumerate(h.shards)
            ]
        tag += len(h.shards)
    t_posted = time.perf_counter()
    ok = (
        _load(header, data, tensors) if data is not None else True
    )  # beside the transfers in flight
    t_load = time.perf_counter()
    for w in receives:
        w.wait()
    if receives:
        torch.set_rng_state(rng)
    for w in sends:
        w.wait()
    t_transfer = time.perf_counter()
    # every rank loaded (min of the flags) and the slowest rank's time (min of the negated times)
    both = torch.tensor([1.0 if ok else 0.0, -(time.perf_counter() - t0)], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)
    if both[0] < 1:
        return None
    sources = ["peer" if choice[r]["holder"] != r else "memory" for r in range(world)]
    phases = {
        "inventory": t_inventory - t0,
        "load": t_load - t_posted,
        "transfer": t_transfer - t_inventory - (t_load - t_posted),
        "agree": time.perf_counter() - t_transfer,
    }
    return Restored(
        step,
        "peer" if "peer" in sources else "memory",
        sources,
        float(-both[1]),
        dict(header.layout.get("run", {})),
        phases,
    )


def _good(tier: MemoryTier, header: SlotHeader) -> bool:
    """A slot's bytes match its checksums: the keeper's verdict if it checked this slot while the
    job relaunched (``resihp.ckpt.memory.verify_all``), else checked here."""
    verdict = tier.checked(header)
    return tier.verify(header) if verdict is None else verdict


def _fits(header: SlotHeader, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether a slot's shards are exactly this rank's tensors (keys, shapes, dtypes)."""
    by_key = {s.key: s for s in header.shards}
    if set(by_key) != set(tensors):
        return False
    return all(
        tuple(by_key[k].shape) == tuple(t.shape)
        and by_key[k].dtype == str(t.dtype).removeprefix("torch.")
        for k, t in tensors.items()
    )


def _load(header: SlotHeader, data: np.ndarray, tensors: dict[str, torch.Tensor]) -> bool:
    """Copy a slot's bytes into this rank's tensors (``state_tensors``); False if its shards do
    not fit them."""
    if not _fits(header, tensors):
        return False
    by_key = {s.key: s for s in header.shards}
    src = torch.from_numpy(np.asarray(data))
    with torch.no_grad():
        for key, t in tensors.items():
            s = by_key[key]
            piece = src[s.offset : s.offset + s.nbytes]
            if key == RNG_KEY:
                torch.set_rng_state(piece.clone())
            else:
                _bytes(t).copy_(piece)
    return True
