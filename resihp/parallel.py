"""The parallel dimensions of a job: the split of a world of ranks into data x pipeline x tensor
parallel groups, with the one rank order every part of resihp uses.

Ranks are ordered with tensor parallel fastest, then data parallel, then pipeline (Megatron order):
``rank = (stage * dp + dp_rank) * tp + tp_rank``. The runtime places its processes so, the
detector's synthetic traces and the replay's ops records number their ranks so, and a Plan's
``layout`` is one of these.
"""

from __future__ import annotations

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
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
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

    def rank_of(self, dp_rank, stage, tp_rank=0):
        """The rank at (dp_rank, stage, tp_rank); also elementwise on numpy arrays."""
        return (stage * self.dp + dp_rank) * self.tp + tp_rank

    def dp_group_ranks(self, stage: int, tp_rank: int) -> list[int]:
        return [self.rank_of(d, stage, tp_rank) for d in range(self.dp)]

    def tp_group_ranks(self, dp_rank: int, stage: int) -> list[int]:
        return [self.rank_of(dp_rank, stage, t) for t in range(self.tp)]

    def to_dict(self) -> dict[str, int]:
        """The Plan JSON ``layout`` form."""
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp}
