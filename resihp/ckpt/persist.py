"""Universal checkpoints written from the memory tier by the node's keeper, off the trainers' path.

With snapshots on (``--snapshot-every``) and ``--ckpt-every N`` on one node, a trainer does not
save at a checkpoint step: its snapshot of that step carries a :class:`PersistRequest` (where the
checkpoint goes, what ``meta.json`` records, and where each slot tensor sits in its global tensor,
the same placement ``resihp.ckpt.reshard`` gives DCP), and the keeper, once every rank's slot of
that step is published, writes the checkpoint with DCP from the slots' bytes, in a thread of its
own. The files are the ones ``resihp.ckpt.universal.save`` writes (format 2, a manifest published
last), so a persisted checkpoint loads into any layout like a saved one.

A slot of a due step is held (``rankR.S.persisting``, naming the keeper's PID) from before its
publication until the keeper has copied its blocks out (one pass over memory; the keeper holds that
copy, the size of the state it writes, while it writes); a trainer about to overwrite that slot, two
snapshots later, waits for the hold (``MemoryTier.begin_write``), which is the only way persisting
can hold training up. Files go to the page cache, then are synced. A checkpoint cut short (the
keeper killed while writing) stays a hidden ``.stepN.partial`` folder that nothing reads; the
checkpoints already on disk are not touched.

No process group: the keeper is one process and writes the node's whole checkpoint (DCP's
``no_dist``), with a planner that lays out every rank's blocks by their global offsets.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from resihp.ckpt.integrity import prune, publish
from resihp.ckpt.memory import MemoryTier, SlotHeader
from resihp.ckpt.reshard import placed_state
from resihp.ckpt.single import single_process
from resihp.ckpt.universal import FORMAT, identity
from resihp.model.config import GPTConfig
from resihp.model.tensor_parallel import TPContext

LOG = "persist.jsonl"  # under OUT/ckpt: one line per checkpoint the keeper wrote


@dataclass(frozen=True)
class Block:
    """One tensor of a slot in a checkpoint.

    Slot shard ``shard`` viewed as ``sizes``/``strides`` from ``storage_offset`` (elements) is the
    block at ``offsets`` of global tensor ``key``, whose shape is ``size``."""

    shard: str
    key: str
    size: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    storage_offset: int


@dataclass
class PersistRequest:
    """What a snapshot's header carries for the keeper to persist it.

    The checkpoint root (``OUT/ckpt``), how many checkpoints to keep (0: all), the ranks of the job,
    whether this rank's model state is written (one replica writes), ``meta`` (rank 0: what
    ``meta.json`` records) and its blocks; ``due``: this step is a checkpoint step (else the request
    serves a flush at the job's breakpoint)."""

    root: str
    keep: int
    world: int
    write: bool
    blocks: list[Block]
    meta: dict | None = None
    due: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PersistRequest:
        blocks = [
            Block(
                b["shard"],
                b["key"],
                tuple(b["size"]),
                tuple(b["offsets"]),
                tuple(b["sizes"]),
                tuple(b["strides"]),
                int(b["storage_offset"]),
            )
            for b in data["blocks"]
        ]
        return cls(**{**data, "blocks": blocks})


def blocks_of(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    local: list[tuple[str, torch.Tensor]],
    tp: TPContext | None,
    cfg: GPTConfig | None,
    rank: int,
    write: bool = True,
) -> list[Block]:
    """Where each of this rank's snapshot tensors goes in a universal checkpoint.

    Its placed state's blocks (model and AdamW state, when ``write``) and its RNG state as
    ``rng.torch.rank<R>``.

    Args:
        model: this rank's model.
        optimizer: its AdamW optimizer.
        local: this rank's snapshot tensors (``resihp.ckpt.snapshot.state_tensors``).
        tp: this rank's tensor-parallel group (None: no tensor parallelism).
        cfg: the GPT config (None: ``model.cfg``).
        rank: this rank, naming its RNG state.
        write: whether this rank's model state is written (one replica writes).
    """
    by_storage = {t.untyped_storage().data_ptr(): (key, t) for key, t in local}
    out = []
    for key, value in (placed_state(model, optimizer, tp, cfg) if write else {}).items():
        block = value.to_local() if isinstance(value, DTensor) else value
        shard, base = by_storage[block.untyped_storage().data_ptr()]
        offsets = (
            value.__create_chunk_list__()[0].offsets
            if isinstance(value, DTensor)
            else (0,) * block.dim()
        )
        out.append(
            Block(
                shard,
                key,
                tuple(value.shape),
                tuple(offsets),
                tuple(block.shape),
                tuple(block.stride()),
                block.storage_offset() - base.storage_offset(),
            )
        )
    rng = next(t for key, t in local if key == "rng.torch")
    out.append(
        Block(
            "rng.torch",
            f"rng.torch.rank{rank}",
            tuple(rng.shape),
            (0,) * rng.dim(),
            tuple(rng.shape),
            tuple(rng.stride()),
            0,
        )
    )
    return out


class _BlockPlanner(DefaultSavePlanner):
    """DCP's default save planner, fed blocks at given global offsets instead of a state dict."""

    def __init__(
        self, blocks: dict[tuple[str, tuple[int, ...]], tuple[torch.Tensor, tuple[int, ...]]]
    ) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.blocks = blocks

    def create_local_plan(self) -> SavePlan:
        items = []
        for (key, offsets), (tensor, size) in self.blocks.items():
            index = MetadataIndex(key, torch.Size(offsets))
            whole = tuple(tensor.shape) == tuple(size)
            items.append(
                WriteItem(
                    index=index,
                    type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size(offsets), tensor.shape),
                        properties=TensorProperties.create_from_tensor(tensor),
                        size=torch.Size(size),
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self.blocks[(index.fqn, tuple(index.offset or ()))][0]


@dataclass
class Persisted:
    """One checkpoint the keeper wrote: its step, folder, bytes and seconds.

    The seconds it held the slots (the most a trainer could have waited) and in all."""

    step: int
    directory: str
    nbytes: int
    hold_s: float
    total_s: float
    reason: str = "due"  # or "breakpoint": the newest step in memory when the job stopped


def write_checkpoint(
    directory: Path, headers: list[SlotHeader], reason: str = "due"
) -> Persisted | None:
    """Write the checkpoint of ``headers`` from tier ``directory``; None if a slot changed under it.

    A slot changed when a trainer began to overwrite it before the keeper held it (the next due
    step is persisted then), or when its bytes no longer match the checksums of its publication.

    Args:
        directory: the memory tier's folder.
        headers: one published slot per rank of the job, all of one step, each with a persist
            request.
        reason: ``due``, or ``breakpoint`` (the newest step in memory when the job stopped),
            recorded in the ``Persisted``.
    """
    t0 = time.monotonic()
    tier = MemoryTier(directory, -1)
    holds = [tier.hold_path(h.slot, h.rank) for h in headers]
    for path in holds:
        with contextlib.suppress(OSError):
            if path.read_text() == str(os.getpid()):
                continue  # held already (a full tier may have no room to write it again)
        path.write_text(str(os.getpid()))
    try:
        # a slot of a due step is held from before its publication, and its trainer waits for the
        # hold before it unlinks the header; a slot taken at a breakpoint has no trainer left. So a
        # header still there as published means the bytes stay as they are until the hold goes
        now = {(h.rank, h.slot): h for h in tier.headers()}
        if any(
            now.get((h.rank, h.slot)) is None or now[(h.rank, h.slot)].published_s != h.published_s
            for h in headers
        ):
            return None
        requests = [PersistRequest.from_dict(h.persist) for h in headers]
        meta = next(r.meta for r in requests if r.meta is not None)
        step = headers[0].step
        root = Path(requests[0].root)
        final = root / f"step{step}"
        # not ``.stepN.partial``: the supervisor removes those when the job's processes end, and a
        # keeper may still be writing then; this keeper writes one at a time, so any other is stale
        tmp = root / f".keeper-{final.name}.partial"
        for stale in root.glob(".keeper-step*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
        blocks: dict = {}
        nbytes = 0
        for header, request in zip(headers, requests, strict=True):
            data = tier.read(header, writable=True)
            if data is None:
                return None
            src = torch.from_numpy(np.asarray(data))
            shards = {s.key: s for s in header.shards}
            for b in request.blocks:
                if (b.key, b.offsets) in blocks:  # a replica's copy of a block already taken
                    continue
                s = shards[b.shard]
                flat = src[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype))
                # copied out (DCP would copy a view of a larger storage anyway), so that the slot
                # is released after one pass over memory, not after the write to disk
                tensor = flat.as_strided(
                    b.sizes, b.strides, flat.storage_offset() + b.storage_offset
                ).clone()
                blocks[(b.key, b.offsets)] = (tensor, b.size)
                nbytes += tensor.numel() * tensor.element_size()
            # the slot still matches the checksums taken at its publication, so the copies are of
            # the published bytes: memory that went bad since is never written as a checkpoint
            if not tier.verify(header, data):
                print(
                    f"resihp keeper: rank {header.rank}'s slot {header.slot} no longer matches its "
                    f"checksums: step {header.step} is not written to disk",
                    file=sys.stderr,
                    flush=True,
                )
                return None
    finally:
        for path in holds:
            path.unlink(missing_ok=True)
    hold_s = time.monotonic() - t0
    writer = dcp.FileSystemWriter(str(tmp), sync_files=False, thread_count=1)
    with single_process():
        dcp.save({}, storage_writer=writer, planner=_BlockPlanner(blocks), no_dist=True)
    del blocks
    for path in [*tmp.iterdir(), tmp]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    meta = {"step": step, "format": FORMAT, **meta}
    (tmp / "meta.json").write_text(json.dumps(meta))
    publish(tmp, final, identity(meta))
    prune(root, requests[0].keep)
    done = Persisted(
        step, str(final), nbytes, round(hold_s, 4), round(time.monotonic() - t0, 4), reason
    )
    with open(root / LOG, "a") as log:
        log.write(json.dumps(asdict(done)) + "\n")
    return done
