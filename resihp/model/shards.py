"""Where a tensor-parallel shard sits in its parameter's global tensor.

The split of each parameter and the padded row split, without torch (the run configuration and the
checkpoint metadata use it before torch is imported)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def chunk_rows(n: int, tp: int) -> int:
    """Rows per tensor-parallel rank of a dimension of ``n`` split into ``tp``.

    The last ranks' shares are padded when ``tp`` does not divide ``n``: a vocabulary padded to a
    multiple of tp."""
    return -(-n // tp)


def chunk_len(n: int, tp: int, rank: int) -> int:
    """The real (unpadded) rows of ``rank``'s share: torch.chunk's and DTensor's ``Shard`` split.

    Args:
        n: the dimension's rows.
        tp: the tensor-parallel size.
        rank: the tensor-parallel rank.
    """
    per = chunk_rows(n, tp)
    return max(0, min(per, n - rank * per))


# how each split parameter is cut: (dimension, fused groups). A fused parameter (QKV: 3 groups,
# SwiGLU gate/up: 2) is split inside each group (whole heads of Q, K and V; halves of gate and up),
# never per row of the fused tensor, so its shards are the same whichever tp wrote them.
SPLITS = {
    "qkv.weight": (0, 3),
    "qkv.bias": (0, 3),
    "gate_up.weight": (0, 2),
    "gate_up.bias": (0, 2),
    "proj.weight": (1, 1),
    "fc1.weight": (0, 1),
    "fc1.bias": (0, 1),
    "fc2.weight": (1, 1),
}
VOCAB_PARALLEL = ("embed.weight", "head.weight")


@dataclass(frozen=True)
class ShardPlacement:
    """Where one rank's local tensor sits in its parameter's global tensor.

    In the global tensor's canonical (saved) shape: a fused parameter is saved as ``(groups, rows,
    ...)`` and split on dimension 1, so that every tensor-parallel shard is one contiguous block of
    it (what DCP's chunk metadata and DTensor's ``Shard`` describe), whatever the tensor-parallel
    size (one block when it is 1). ``dim`` None: replicated."""

    global_shape: tuple[int, ...]
    dim: int | None
    groups: int = 1

    def local_view(self, local: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
        """``local`` as this rank's block of the canonical global tensor.

        A view: writes go through; padding rows are left out.

        Args:
            local: this rank's shard.
            tp: the tensor-parallel size.
            rank: this rank's tensor-parallel rank.
        """
        if self.dim is None:
            return local
        view = local.view(self.groups, -1, *local.shape[1:]) if self.groups > 1 else local
        return view.narrow(self.dim, 0, chunk_len(self.global_shape[self.dim], tp, rank))

    def block(self, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
        """``rank``'s block of the canonical global tensor ``full``.

        Args:
            full: the global tensor in its canonical shape.
            tp: the tensor-parallel size.
            rank: the tensor-parallel rank.
        """
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


def shard_placement(
    name: str, local_shape: tuple[int, ...], tp: int, vocab: int | None = None
) -> ShardPlacement:
    """The shard placement of parameter ``name``.

    Args:
        name: the parameter's (saved) name.
        local_shape: its shape on a rank of ``tp``.
        tp: the tensor-parallel size.
        vocab: the model's (unpadded) vocabulary when the embedding and LM head are vocabulary
            parallel, else None."""
    shape = tuple(local_shape)
    if vocab is not None and name in VOCAB_PARALLEL:
        return ShardPlacement((vocab, *shape[1:]), 0)
    split = split_of(name)
    if split is None:
        return ShardPlacement(shape, None)
    dim, groups = split
    full = list(shape)
    full[dim] *= tp
    if groups > 1:
        return ShardPlacement((groups, full[0] // groups, *full[1:]), 1, groups)
    return ShardPlacement(tuple(full), dim)
