"""Every rank's tensors under their global names, each placed in its global tensor.

So state written by one layout is read by any other: the resharding is DCP's (each reader asks for
the overlap of its own block with the blocks that were written).

A tensor-parallel shard is a ``DTensor`` over the tensor-parallel group (a one-dimensional CPU or
GPU ``DeviceMesh`` made from the group the engine already has) with ``Shard(dim)`` placement in the
parameter's canonical global shape (``resihp.model.shards.ShardPlacement``: fused QKV and
gate/up split per head and per half; a padded vocabulary without its padding, so DTensor's uneven
split is the model's); DCP saves its chunk metadata (offsets and lengths in the global tensor).
Replicated tensors are plain tensors (the same key from every replica is written once). Keys:
``model.<global name>``, ``optim.<global name>.<step|exp_avg|exp_avg_sq>``; a tied LM head is
saved as the embedding it is tied to.

The same views serve the disk path and the in-memory one: every value is a view of the live
parameter or AdamW tensor, so loading into them writes the model in place.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from resihp.model.config import GPTConfig
from resihp.model.gpt import ADAM_KEYS, ensure_adam_state
from resihp.model.shards import ShardPlacement
from resihp.model.tensor_parallel import TPContext

_MESHES: dict[
    int, tuple[object, DeviceMesh]
] = {}  # id(group) -> (the group, held so its id stays its own; mesh)


def tp_mesh(tp: TPContext, device_type: str = "cpu") -> DeviceMesh | None:
    """The one-dimensional mesh of this rank's tensor-parallel group (None without one).

    Its coordinates are the group's ranks, so ``tp.rank`` must be this rank's place in the group
    (world ranks ascending with tensor-parallel rank, as ``torch.distributed.new_group`` orders)."""
    if tp.size == 1 or tp.group is None:
        return None
    key = id(tp.group)
    if key not in _MESHES:
        _MESHES[key] = (tp.group, DeviceMesh.from_group(tp.group, device_type))
    return _MESHES[key][1]


def placements(
    model: torch.nn.Module, tp: TPContext, cfg: GPTConfig | None = None
) -> dict[str, tuple[str, torch.nn.Parameter, ShardPlacement | None]]:
    """Per parameter name: its saved (global) name, the parameter and its shard placement.

    Args:
        model: the module whose parameters are listed.
        tp: this rank's tensor-parallel context.
        cfg: the GPT model's config (None: a module that is not the GPT model, every parameter
            replicated)."""
    cfg = cfg if cfg is not None else getattr(model, "cfg", None)
    out = {}
    for name, p in model.named_parameters():
        if isinstance(cfg, GPTConfig):
            out[name] = (
                cfg.saved_name(name),
                p,
                cfg.shard_placement(cfg.saved_name(name), tuple(p.shape), tp.size),
            )
        else:
            out[name] = (name, p, None)
    return out


def _placed(
    local: torch.Tensor, where: ShardPlacement | None, tp: TPContext, mesh: DeviceMesh | None
) -> torch.Tensor:
    if where is None or where.dim is None:
        return local
    block = where.local_view(local, tp.size, tp.rank)
    if mesh is None:  # one rank holds the whole global tensor
        return block
    stride = torch.empty(where.global_shape, device="meta").stride()
    return DTensor.from_local(
        block,
        mesh,
        [Shard(where.dim)],
        run_check=False,
        shape=torch.Size(where.global_shape),
        stride=stride,
    )


def placed_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    tp: TPContext | None = None,
    cfg: GPTConfig | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's parameters and AdamW state under their global keys, views of the live tensors.

    Tensor-parallel shards are DTensors placed in their global tensor.

    Args:
        model: this rank's model.
        optimizer: its AdamW optimizer (None: parameters only).
        tp: this rank's tensor-parallel group (None: no tensor parallelism).
        cfg: the GPT config (default: ``model.cfg``).
    """
    tp = tp or TPContext(1, 0)
    first = next(model.parameters(), None)
    mesh = tp_mesh(tp, first.device.type if first is not None else "cpu")
    if optimizer is not None:
        ensure_adam_state(model, optimizer)
    out: dict[str, torch.Tensor] = {}
    for saved, p, where in placements(model, tp, cfg).values():
        out[f"model.{saved}"] = _placed(p.detach(), where, tp, mesh)
        if optimizer is None:
            continue
        state = optimizer.state[p]
        for k in ADAM_KEYS:
            out[f"optim.{saved}.{k}"] = (
                state[k] if k == "step" else _placed(state[k], where, tp, mesh)
            )
    return out


def local_blocks(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The local tensors of a placed state (DTensors' own blocks)."""
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}


Extent = tuple[
    tuple[int, ...], tuple[int, ...], int
]  # offsets, sizes in the global tensor; bytes per element


def extents(state: dict[str, torch.Tensor]) -> dict[str, Extent]:
    """Where each tensor of a placed state sits in its global tensor."""
    out = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            chunk = value.__create_chunk_list__()[0]
            out[key] = (tuple(chunk.offsets), tuple(chunk.sizes), value.element_size())
        else:
            out[key] = ((0,) * value.dim(), tuple(value.shape), value.element_size())
    return out


def _volume(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def bytes_to_receive(held: dict[str, Extent], needed: dict[str, Extent]) -> int:
    """The bytes of ``needed`` that ``held`` (what the same rank had before) does not cover.

    The least a layout change must bring to this rank."""
    total = 0
    for key, (offsets, sizes, width) in needed.items():
        have = 0
        if key in held:
            o2, s2, _ = held[key]
            have = _volume(
                tuple(
                    max(0, min(a + n, b + m) - max(a, b))
                    for a, n, b, m in zip(offsets, sizes, o2, s2, strict=True)
                )
            )
        total += (_volume(sizes) - have) * width
    return total


def forget_mesh(group: object) -> None:
    """Drop the cached mesh of a process group that is being destroyed."""
    _MESHES.pop(id(group), None)


def counting_reader(reader, counter: list[int]):
    """``reader`` (a DCP FileSystemReader) adding to ``counter[0]`` the bytes a load reads.

    Every stored item counts whole: DCP reads an item whole, then narrows it to the overlap the
    reader asked for."""
    read_data = reader.read_data

    def counted(plan, planner):
        seen = {}
        for item in plan.items:
            stored = reader.storage_data[item.storage_index]
            seen[(stored.relative_path, stored.offset)] = stored.length
        counter[0] += sum(seen.values())
        return read_data(plan, planner)

    reader.read_data = counted
    return reader


def copy_held(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> set[str]:
    """Fill by local copy every tensor of ``new`` whose block lies inside this rank's in ``old``.

    Both are placed states; returns the keys filled (the rest must be read)."""
    held, needed = extents(old), extents(new)
    done = set()
    with torch.no_grad():
        for key, (offsets, sizes, _) in needed.items():
            if key not in held:
                continue
            o2, s2, _ = held[key]
            if not all(
                b <= a and a + n <= b + m for a, n, b, m in zip(offsets, sizes, o2, s2, strict=True)
            ):
                continue
            source = old[key].to_local() if isinstance(old[key], DTensor) else old[key]
            for dim, (a, n, b) in enumerate(zip(offsets, sizes, o2, strict=True)):
                source = source.narrow(dim, a - b, n)
            target = new[key].to_local() if isinstance(new[key], DTensor) else new[key]
            target.copy_(source)
            done.add(key)
    return done
