"""Megatron-style tensor parallelism for ``DecoderBlock``: the QKV and first MLP projections are
split by output (column parallel: whole attention heads, slices of the FFN), the attention output
and second MLP projections by input (row parallel, summed with an all-reduce).

Parameters keep their global names; a rank holds a slice of each split one (``shard``), and the
replicated ones (LayerNorms, row-parallel biases, embeddings, LM head) get identical gradients on
every tensor-parallel rank, so only the data-parallel all-reduce is needed for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPContext:
    size: int
    rank: int
    group: object = None  # a torch.distributed process group


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward; identity backward (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _CopyToTP.apply(x, tp.group) if tp.size > 1 else x


def reduce_from_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _ReduceFromTP.apply(x, tp.group) if tp.size > 1 else x


# how each split parameter is cut: (dimension, "heads" for QKV's (3, heads, head_dim) rows or "even")
SPLITS = {"qkv.weight": (0, "heads"), "qkv.bias": (0, "heads"), "proj.weight": (1, "even"),
          "fc1.weight": (0, "even"), "fc1.bias": (0, "even"), "fc2.weight": (1, "even")}


def split_of(name: str) -> tuple[int, str] | None:
    for suffix, split in SPLITS.items():
        if name.endswith(suffix):
            return split
    return None


def full_shape(name: str, local_shape: torch.Size, tp: int) -> tuple[int, ...]:
    split = split_of(name)
    shape = list(local_shape)
    if split:
        shape[split[0]] *= tp
    return tuple(shape)


def shard(name: str, full: torch.Tensor, tp: int, tp_rank: int, heads: int) -> torch.Tensor:
    """This rank's slice of the global tensor ``full`` of parameter ``name``."""
    split = split_of(name)
    if split is None or tp == 1:
        return full
    dim, how = split
    if how == "heads":
        rest = full.shape[1:]
        per = heads // tp
        grouped = full.reshape(3, heads, -1, *rest)[:, tp_rank * per:(tp_rank + 1) * per]
        return grouped.reshape(-1, *rest)
    return full.chunk(tp, dim=dim)[tp_rank]


def unshard(name: str, pieces: list[torch.Tensor], heads: int) -> torch.Tensor:
    """The global tensor from the slices of every tensor-parallel rank, in rank order."""
    split = split_of(name)
    if split is None or len(pieces) == 1:
        return pieces[0]
    dim, how = split
    if how == "heads":
        rest = pieces[0].shape[1:]
        per = heads // len(pieces)
        return torch.cat([p.reshape(3, per, -1, *rest) for p in pieces], dim=1).reshape(-1, *rest)
    return torch.cat(pieces, dim=dim)
