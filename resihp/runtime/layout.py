"""The split of a world of ranks into data x pipeline x tensor parallel groups, and of layers into stages.

Ranks are ordered with tensor parallel fastest, then data parallel, then pipeline (Megatron order):
``rank = (stage * dp + dp_rank) * tp + tp_rank``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from resihp.errors import InputError


@dataclass(frozen=True)
class Coords:
    dp_rank: int
    stage: int
    tp_rank: int


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    pp: int
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InputError(f"--{name}: expected a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise InputError(
                f"--dp {self.dp} x --pp {self.pp} x --tp {self.tp} = {self.world_size} ranks, "
                f"but the world has {world_size} processes"
            )

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise InputError(f"rank {rank} is not in [0, {self.world_size})")
        return Coords(dp_rank=(rank // self.tp) % self.dp, stage=rank // (self.tp * self.dp),
                      tp_rank=rank % self.tp)

    def rank_of(self, dp_rank: int, stage: int, tp_rank: int = 0) -> int:
        return (stage * self.dp + dp_rank) * self.tp + tp_rank

    def dp_group_ranks(self, stage: int, tp_rank: int) -> list[int]:
        return [self.rank_of(d, stage, tp_rank) for d in range(self.dp)]

    def tp_group_ranks(self, dp_rank: int, stage: int) -> list[int]:
        return [self.rank_of(dp_rank, stage, t) for t in range(self.tp)]


def balanced_layers(layers: int, pp: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges ``[first, last)``, one per stage, sizes differing by at most one."""
    if pp > layers:
        raise InputError(f"--pp {pp}: cannot split {layers} layers into {pp} non-empty stages")
    base, extra = divmod(layers, pp)
    ranges, first = [], 0
    for stage in range(pp):
        last = first + base + (1 if stage < extra else 0)
        ranges.append((first, last))
        first = last
    return ranges


def parse_layer_split(text: str, layers: int, pp: int) -> list[tuple[int, int]]:
    """``"3,2,2,1"`` (layers per stage) into contiguous ranges covering ``[0, layers)``."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise InputError(f"--layer-split {text!r}: expected comma-separated layer counts, e.g. 2,2") from None
    return ranges_from_counts(counts, layers, pp, source=f"--layer-split {text!r}")


def ranges_from_counts(counts: Sequence[int], layers: int, pp: int,
                       source: str = "layer split") -> list[tuple[int, int]]:
    if len(counts) != pp or any(c < 1 for c in counts) or sum(counts) != layers:
        raise InputError(f"{source}: expected {pp} positive layer counts summing to {layers}, "
                         f"got {list(counts)}")
    ranges, first = [], 0
    for c in counts:
        ranges.append((first, first + c))
        first += c
    return ranges
