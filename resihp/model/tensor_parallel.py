"""Megatron-style tensor parallelism for ``DecoderBlock``: the QKV and first MLP projections are
split by output (column parallel: whole attention heads, slices of the FFN; a fused SwiGLU gate/up
projection per half), the attention output and second MLP projections by input (row parallel,
summed with an all-reduce). Optionally the embedding and LM head are split by vocabulary rows
(vocabulary parallel, the vocabulary padded to a multiple of the tensor-parallel size).

Parameters keep their global names; a rank holds a slice of each split one (``shard``), and the
replicated ones (LayerNorms, row-parallel biases, embeddings, LM head) get identical gradients on
every tensor-parallel rank, so only the data-parallel all-reduce is needed for them. ``placement``
says where a rank's shard sits in the global tensor, which is what checkpoints save and reshard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPContext:
    size: int
    rank: int
    group: object = None  # a torch.distributed process group


class WaitClock:
    """Seconds this process has spent inside tensor-parallel collectives. They run inside a compute
    op (forward and backward), so a rank waiting there for a slow peer would look slow itself; the
    engine records each compute op's share (``wait_s``) and the detector takes it out. One per
    process (a process is one rank), since autograd functions get only the group."""

    seconds = 0.0

    @classmethod
    def timed(cls, fn, *args, **kwargs) -> None:
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        cls.seconds += time.perf_counter() - t0


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        WaitClock.timed(dist.all_reduce, grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward; identity backward (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object) -> torch.Tensor:
        x = x.contiguous()
        WaitClock.timed(dist.all_reduce, x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _CopyToTP.apply(x, tp.group) if tp.size > 1 else x


def reduce_from_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _ReduceFromTP.apply(x, tp.group) if tp.size > 1 else x


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dimension forward; this rank's slice of the gradient backward
    (the vocabulary-parallel LM head's logits)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object, size: int, rank: int) -> torch.Tensor:
        ctx.rank, ctx.width = rank, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(size)]
        WaitClock.timed(dist.all_gather, parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[..., ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width].contiguous(), None, None, None


def gather_from_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _GatherFromTP.apply(x, tp.group, tp.size, tp.rank) if tp.size > 1 else x


def chunk_rows(n: int, tp: int) -> int:
    """Rows per tensor-parallel rank of a dimension of ``n`` split into ``tp`` (the last ranks'
    shares are padded when ``tp`` does not divide ``n``: a vocabulary padded to a multiple of tp)."""
    return -(-n // tp)


def chunk_len(n: int, tp: int, rank: int) -> int:
    """The real (unpadded) rows of ``rank``'s share: torch.chunk's and DTensor's ``Shard`` split."""
    per = chunk_rows(n, tp)
    return max(0, min(per, n - rank * per))


# how each split parameter is cut: (dimension, fused groups). A fused parameter (QKV: 3 groups,
# SwiGLU gate/up: 2) is split inside each group (whole heads of Q, K and V; halves of gate and up),
# never per row of the fused tensor, so its shards are the same whichever tp wrote them.
SPLITS = {"qkv.weight": (0, 3), "qkv.bias": (0, 3), "gate_up.weight": (0, 2), "gate_up.bias": (0, 2),
          "proj.weight": (1, 1), "fc1.weight": (0, 1), "fc1.bias": (0, 1), "fc2.weight": (1, 1)}
VOCAB_PARALLEL = ("embed.weight", "head.weight")


@dataclass(frozen=True)
class Placement:
    """Where one rank's local tensor sits in its parameter's global tensor, in the global tensor's
    canonical (saved) shape: a fused parameter is saved as ``(groups, rows, ...)`` and split on
    dimension 1, so that every tensor-parallel shard is one contiguous block of it (what DCP's chunk
    metadata and DTensor's ``Shard`` describe), whatever the tensor-parallel size (one block when
    it is 1). ``dim`` None: replicated."""

    global_shape: tuple[int, ...]
    dim: int | None
    groups: int = 1

    def local_view(self, local: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
        """``local`` as this rank's block of the canonical global tensor (a view: writes go through;
        padding rows are left out)."""
        if self.dim is None:
            return local
        view = local.view(self.groups, -1, *local.shape[1:]) if self.groups > 1 else local
        return view.narrow(self.dim, 0, chunk_len(self.global_shape[self.dim], tp, rank))

    def block(self, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
        """``rank``'s block of the canonical global tensor ``full``."""
        if self.dim is None:
            return full
        n = self.global_shape[self.dim]
        start = min(n, rank * chunk_rows(n, tp))
        return full.narrow(self.dim, start, chunk_len(n, tp, rank))

    def natural(self, full: torch.Tensor) -> torch.Tensor:
        """The canonical global tensor in the parameter's own (unsharded model's) shape."""
        return full.reshape(-1, *full.shape[2:]) if self.groups > 1 else full


def split_of(name: str) -> tuple[int, int] | None:
    for suffix, split in SPLITS.items():
        if name.endswith(suffix):
            return split
    return None


def placement(name: str, local_shape: tuple[int, ...], tp: int, vocab: int | None = None) -> Placement:
    """The placement of parameter ``name`` whose local shape on a rank of ``tp`` is ``local_shape``;
    ``vocab``: the model's (unpadded) vocabulary when the embedding and LM head are
    vocabulary parallel."""
    shape = tuple(local_shape)
    if vocab is not None and name in VOCAB_PARALLEL:
        return Placement((vocab, *shape[1:]), 0)
    split = split_of(name)
    if split is None:
        return Placement(shape, None)
    dim, groups = split
    full = list(shape)
    full[dim] *= tp
    if groups > 1:
        return Placement((groups, full[0] // groups, *full[1:]), 1, groups)
    return Placement(tuple(full), dim)


def full_shape(name: str, local_shape: torch.Size, tp: int) -> tuple[int, ...]:
    """The unsharded model's shape of a split parameter (even splits)."""
    split = split_of(name)
    shape = list(local_shape)
    if split:
        shape[split[0]] *= tp
    return tuple(shape)


def shard(name: str, full: torch.Tensor, tp: int, tp_rank: int, heads: int = 1) -> torch.Tensor:
    """This rank's slice of the global tensor ``full`` (the unsharded model's shape) of ``name``."""
    split = split_of(name)
    if split is None or tp == 1:
        return full
    dim, groups = split
    if groups > 1:
        return full.reshape(groups, -1, *full.shape[1:]).chunk(tp, dim=1)[tp_rank].reshape(-1, *full.shape[1:])
    return full.chunk(tp, dim=dim)[tp_rank]


def unshard(name: str, pieces: list[torch.Tensor], heads: int = 1) -> torch.Tensor:
    """The global tensor from the slices of every tensor-parallel rank, in rank order."""
    split = split_of(name)
    if split is None or len(pieces) == 1:
        return pieces[0]
    dim, groups = split
    if groups > 1:
        rest = pieces[0].shape[1:]
        return torch.cat([p.reshape(groups, -1, *rest) for p in pieces], dim=1).reshape(-1, *rest)
    return torch.cat(pieces, dim=dim)
