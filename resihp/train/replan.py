"""Applying a new plan to a running job at a step boundary, without losing a step's mathematics.

- micro-batch re-allocation: the replicas' shares of each step's micro-batches change; the global
  batch, and so the loss (summed over tokens / global tokens) and gradients, stay the same;
- layer re-partitioning: contiguous layer ranges move between the stages of every pipeline; each
  moved layer's parameters and AdamW state (``step``, ``exp_avg``, ``exp_avg_sq``) go from the old
  owner to the new one by global name, over point-to-point sends walked in global layer order (so
  every rank's sends and receives are in one consistent order and cannot deadlock).

- a new layout (``relayout``): the data x pipeline x tensor-parallel split itself changes (tensor-
  parallel groups re-formed, a device excluded as a hot spare or taken back, ranks moved between
  pipelines, another depth): every rank builds the new generation of process groups and the state
  is resharded into it by global name from memory with the checkpoints' own code
  (``resihp.ckpt.reshard.placed_state`` through DCP, over shared memory on one node).

A plan change is a ``planchange.PlanChange`` (its JSON form: ``{"version", "dp_weights"?,
"layer_split"? | "layer_splits"?, "reason"?}``); pipelines may split their layers differently
(``gradsync`` sums each layer's gradient over whichever stages hold it).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from resihp.ckpt.integrity import safe_reader
from resihp.model.config import GPTConfig
from resihp.model.gpt import ADAM_KEYS, DecoderBlock, GPTStage
from resihp.model.tensor_parallel import TPContext


def owner(ranges: Sequence[tuple[int, int]], layer: int) -> int:
    return next(s for s, (a, b) in enumerate(ranges) if a <= layer < b)


def layer_state(
    model: GPTStage, optimizer: torch.optim.Optimizer, layer: int
) -> list[torch.Tensor]:
    """A layer's parameters and AdamW state as a flat list in a fixed order.

    Args:
        model: the stage model holding the layer.
        optimizer: its AdamW optimizer.
        layer: the layer's global index."""
    out = []
    for _, p in sorted(model.layers[str(layer)].named_parameters()):
        state = optimizer.state.get(p, {})
        out.append(p.detach())
        for key in ADAM_KEYS:
            value = state.get(key)
            out.append(
                torch.zeros(1 if key == "step" else p.shape, device=p.device)
                if value is None
                else value.detach().reshape(1 if key == "step" else p.shape).float()
            )
    return out


def layer_templates(cfg: GPTConfig, tp: TPContext) -> list[tuple[int, ...]]:
    """Shapes, in ``layer_state`` order, of one layer's tensors on this tensor-parallel rank."""
    block = DecoderBlock(cfg, tp)
    shapes = []
    for _, p in sorted(block.named_parameters()):
        shapes += [tuple(p.shape), (1,), tuple(p.shape), tuple(p.shape)]
    return shapes


def repartition(
    model: GPTStage,
    optimizer: torch.optim.Optimizer,
    cfg: GPTConfig,
    tp: TPContext,
    old_ranges: Sequence[tuple[int, int]],
    new_ranges: Sequence[tuple[int, int]],
    stage: int,
    peer_of: Callable[[int], int],
    lr: float,
    device: torch.device,
) -> tuple[GPTStage, torch.optim.Optimizer, int]:
    """Move layers between the stages of this rank's pipeline.

    Returns the new stage model, its optimizer and the bytes sent.

    Args:
        model: this rank's stage model.
        optimizer: its AdamW optimizer.
        cfg: the model's shape.
        tp: this rank's tensor-parallel context.
        old_ranges: each stage's layer range before.
        new_ranges: each stage's layer range after.
        stage: this rank's stage.
        peer_of: ``peer_of(stage)``: the rank holding that stage beside this one.
        lr: the new optimizer's learning rate.
        device: the device the new stage model goes to."""
    moved: dict[int, list[torch.Tensor]] = {}
    sent = 0
    shapes = None
    for layer in range(cfg.layers):
        src, dst = owner(old_ranges, layer), owner(new_ranges, layer)
        if src == dst or stage not in (src, dst):
            continue
        peer = peer_of(dst if stage == src else src)
        if stage == src:
            for t in layer_state(model, optimizer, layer):
                dist.send(t.contiguous(), peer)
                sent += t.numel() * t.element_size()
        else:
            shapes = shapes or layer_templates(cfg, tp)
            bufs = [torch.empty(s, device=device) for s in shapes]
            for b in bufs:
                dist.recv(b, peer)
            moved[layer] = bufs
    kept = {
        layer: layer_state(model, optimizer, layer)
        for layer in range(*new_ranges[stage])
        if layer not in moved
    }
    ends = {n: p.detach() for n, p in model.named_parameters() if not n.startswith("layers.")}
    end_state = {
        n: optimizer.state.get(p, {})
        for n, p in model.named_parameters()
        if not n.startswith("layers.")
    }
    model = GPTStage(cfg, *new_ranges[stage], tp).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    with torch.no_grad():
        for layer, tensors in {**kept, **moved}.items():
            params = sorted(model.layers[str(layer)].named_parameters())
            for i, (_, p) in enumerate(params):
                value, step, avg, avg_sq = tensors[4 * i : 4 * i + 4]
                p.copy_(value)
                optimizer.state[p] = {
                    "step": step.reshape(()).clone(),
                    "exp_avg": avg.clone(),
                    "exp_avg_sq": avg_sq.clone(),
                }
        for name, p in model.named_parameters():
            if name in ends:
                p.copy_(ends[name])
                if end_state[name]:
                    optimizer.state[p] = {k: v.clone() for k, v in end_state[name].items()}
    return model, optimizer, sent


Rebuilt = tuple[torch.nn.Module, torch.optim.Optimizer, TPContext] | None


def _exchange_dir(control_group: object, out: str) -> str:
    """A fresh folder every rank sees: in shared memory when the whole job is on this node, else
    under the run folder; rank 0 makes it and tells the others."""
    box = [None]
    if dist.get_rank() == 0:
        one_node = (
            int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())) == dist.get_world_size()
        )
        base = Path("/dev/shm") if one_node and Path("/dev/shm").is_dir() else Path(out)
        base.mkdir(parents=True, exist_ok=True)
        box[0] = tempfile.mkdtemp(prefix="resihp-relayout-", dir=base)
    dist.broadcast_object_list(box, 0, group=control_group)
    return box[0]


def relayout(
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    tp: TPContext,
    cfg: GPTConfig,
    rebuild: Callable[[], Rebuilt],
    control_group: object,
    out: str,
    write: bool = True,
) -> dict:
    """Collective over the world: move every rank's state into a new layout, resharded.

    ``rebuild()`` forms the new layout and returns this rank's new stage model, optimizer and
    tensor-parallel context (None: a spare); each new tensor (under its
    global key and placement, as a checkpoint holds it) that lies inside what the rank held is
    copied locally; the keys some rank still needs are written, as a checkpoint writes them, into a
    shared-memory folder and read back with DCP's resharding. Returns the bytes moved (written +
    read), the least the two layouts need (each rank's new blocks less what it already held), and
    the seconds.

    Args:
        model: this rank's stage model (None: a spare).
        optimizer: its AdamW optimizer (None: a spare).
        tp: this rank's tensor-parallel context.
        cfg: the model's shape.
        rebuild: forms the new layout and returns this rank's new state.
        control_group: the gloo group over the world.
        out: the run folder (the exchange folder goes under it where the job spans nodes).
        write: whether this rank's state is written (one replica's ranks suffice; replicas of
            different tensor-parallel sizes would write overlapping blocks)."""
    # deferred for start-up time: torch.distributed.checkpoint and DTensor (~2.5 s on a loaded
    # machine) only in runs that reshard or checkpoint
    import torch.distributed.checkpoint as dcp

    # deferred for start-up time, as above (resihp.ckpt.reshard imports DTensor)
    from resihp.ckpt.reshard import (
        bytes_to_receive,
        copy_held,
        counting_reader,
        extents,
        placed_state,
    )

    start = time.perf_counter()
    old = placed_state(model, optimizer, tp, cfg) if model is not None else {}
    held = extents(old)
    built = rebuild()  # the old tensors stay alive in ``old`` until they are written or copied
    new = placed_state(*built[:2], built[2], cfg) if built is not None else {}
    minimum = bytes_to_receive(held, extents(new))
    local = copy_held(old, new)
    wanted = sorted(k for k in new if k not in local)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, wanted, group=control_group)
    needed = set().union(*everyone)  # a key is written whole (DCP checks its blocks fill it)
    written, read = 0, [0]
    if needed:
        directory = _exchange_dir(control_group, out)
        dcp.save(
            {k: v for k, v in old.items() if k in needed} if write else {}, checkpoint_id=directory
        )
        if dist.get_rank() == 0:
            written = sum(p.stat().st_size for p in Path(directory).iterdir())
        dcp.load(
            {k: new[k] for k in wanted},
            storage_reader=counting_reader(safe_reader(directory), read),
        )
    del old
    totals = torch.tensor([written, read[0], minimum], dtype=torch.float64)
    dist.all_reduce(totals, group=control_group)  # also: every rank has read before the folder goes
    if needed and dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=control_group)
    return {
        "moved_bytes": int(totals[0] + totals[1]),
        "written_bytes": int(totals[0]),
        "read_bytes": int(totals[1]),
        "minimum_bytes": int(totals[2]),
        "relayout_s": round(float(seconds), 4),
    }


def retire_groups(groups: Sequence[object]) -> None:
    """Destroy a past generation's process groups this rank belongs to."""
    from resihp.ckpt.reshard import forget_mesh  # deferred for start-up time (see relayout)

    for group in groups:
        if isinstance(group, dist.ProcessGroup):
            forget_mesh(group)
            dist.destroy_process_group(group)
