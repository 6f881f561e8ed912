"""Megatron-style tensor parallelism for ``DecoderBlock``.

The QKV and first MLP projections are split by output (column parallel: whole attention heads,
slices of the FFN; a fused SwiGLU gate/up projection per half), the attention output and second MLP
projections by input (row parallel, summed with an all-reduce). Optionally the embedding and LM head
are split by vocabulary rows (vocabulary parallel, the vocabulary padded to a multiple of the
tensor-parallel size).

Parameters keep their global names; a rank holds a slice of each split one (``shard``), and the
replicated ones (LayerNorms, row-parallel biases, embeddings, LM head) get identical gradients on
every tensor-parallel rank, so only the data-parallel all-reduce is needed for them. ``placement``
(``resihp.model.shards``) says where a rank's shard sits in the global tensor, which is what
checkpoints save and reshard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from resihp.model.shards import split_of


@dataclass(frozen=True)
class TPContext:
    size: int
    rank: int
    group: object = None  # a torch.distributed process group


class WaitClock:
    """Seconds this process has spent inside tensor-parallel collectives.

    They run inside a compute op (forward and backward), so a rank waiting there for a slow peer
    would look slow itself; the engine records each compute op's share (``wait_s``) and the detector
    takes it out. One per process (a process is one rank), since autograd functions get only the
    group."""

    seconds = 0.0

    @classmethod
    def timed(cls, fn, *args, **kwargs) -> None:
        """Call ``fn`` and add the seconds it took to ``seconds``.

        Args:
            fn: the collective to time.
            *args: its positional arguments.
            **kwargs: its keyword arguments.
        """
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
        return (
            grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width].contiguous(),
            None,
            None,
            None,
        )


def gather_from_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _GatherFromTP.apply(x, tp.group, tp.size, tp.rank) if tp.size > 1 else x


def full_shape(name: str, local_shape: torch.Size, tp: int) -> tuple[int, ...]:
    """The unsharded model's shape of a split parameter (even splits).

    Args:
        name: the parameter's global name.
        local_shape: its shape on one rank.
        tp: the tensor-parallel size.
    """
    split = split_of(name)
    shape = list(local_shape)
    if split:
        shape[split[0]] *= tp
    return tuple(shape)


def shard(name: str, full: torch.Tensor, tp: int, tp_rank: int, heads: int = 1) -> torch.Tensor:
    """This rank's slice of the global tensor ``full`` (the unsharded model's shape) of ``name``.

    Args:
        name: the parameter's global name.
        full: the global tensor.
        tp: the tensor-parallel size.
        tp_rank: this rank's tensor-parallel rank.
        heads: unused; kept for callers that pass the attention heads.
    """
    split = split_of(name)
    if split is None or tp == 1:
        return full
    dim, groups = split
    if groups > 1:
        return (
            full.reshape(groups, -1, *full.shape[1:])
            .chunk(tp, dim=1)[tp_rank]
            .reshape(-1, *full.shape[1:])
        )
    return full.chunk(tp, dim=dim)[tp_rank]


def unshard(name: str, pieces: list[torch.Tensor], heads: int = 1) -> torch.Tensor:
    """The global tensor from the slices of every tensor-parallel rank, in rank order.

    Args:
        name: the parameter's global name.
        pieces: every tensor-parallel rank's slice, in rank order.
        heads: unused; kept for callers that pass the attention heads.
    """
    split = split_of(name)
    if split is None or len(pieces) == 1:
        return pieces[0]
    dim, groups = split
    if groups > 1:
        rest = pieces[0].shape[1:]
        return torch.cat([p.reshape(groups, -1, *rest) for p in pieces], dim=1).reshape(-1, *rest)
    return torch.cat(pieces, dim=dim)
