"""The parallel dimensions of a job, and the one rank order every part of resihp uses.

The dimensions split a world of ranks into data x pipeline x tensor parallel groups.

Ranks are ordered with tensor parallel fastest, then data parallel, then pipeline (Megatron order):
``rank = (stage * dp + dp_rank) * tp + tp_rank``. The runtime places its processes so, the
detector's synthetic traces and the replay's ops records number their ranks so, and a Plan's
``layout`` is one of these.

``apportion`` splits a whole number of things (layers over stages, micro-batches over replicas) in
proportion to weights: the one integer split of the planner, the replay and the runtime.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from resihp.errors import InputError

# The pipeline schedules: the runtime runs and the planner plans SCHEDULES; the performance model
# (perf.schedule) also prices the interleaved one.
SCHEDULES = ("1f1b", "gpipe")
MODELLED_SCHEDULES = SCHEDULES + ("interleaved",)


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
        return Coords(
            dp_rank=(rank // self.tp) % self.dp,
            stage=rank // (self.tp * self.dp),
            tp_rank=rank % self.tp,
        )

    def rank_of(self, dp_rank, stage, tp_rank=0):
        """The rank at (dp_rank, stage, tp_rank); also elementwise on numpy arrays.

        Args:
            dp_rank: the data-parallel replica.
            stage: the pipeline stage.
            tp_rank: the tensor-parallel rank.
        """
        return (stage * self.dp + dp_rank) * self.tp + tp_rank

    def dp_group_ranks(self, stage: int, tp_rank: int) -> list[int]:
        return [self.rank_of(d, stage, tp_rank) for d in range(self.dp)]

    def tp_group_ranks(self, dp_rank: int, stage: int) -> list[int]:
        return [self.rank_of(dp_rank, stage, t) for t in range(self.tp)]

    def to_dict(self) -> dict[str, int]:
        """The Plan JSON ``layout`` form."""
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp}


@dataclass(frozen=True)
class Placement:
    """Which world ranks train: per data-parallel replica, per pipeline stage, its TP group.

    Replicas may differ in depth and stages (of one replica too) in tensor-parallel size, as the
    planner's plans do; world ranks in no group are hot spares. ``tp_rank`` is a rank's index in
    its group. JSON form (``to_dict``): ``{"pipelines": [[[ranks of stage 0], ...], ...]}``;
    ``parse`` also reads the uniform shorthand ``{"dp", "pp", "tp", "ranks"?}``.
    """

    pipelines: tuple[tuple[tuple[int, ...], ...], ...]

    @classmethod
    def uniform(cls, dims: ParallelDims, ranks: Sequence[int] | None = None) -> Placement:
        """The groups of ``dims`` in its rank order, over ``ranks`` (default: 0 .. world - 1)."""
        order = list(range(dims.world_size)) if ranks is None else list(ranks)
        return cls(
            tuple(
                tuple(tuple(order[r] for r in dims.tp_group_ranks(d, s)) for s in range(dims.pp))
                for d in range(dims.dp)
            )
        )

    @classmethod
    def of(cls, pipelines: Sequence[Sequence[Sequence[int]]]) -> Placement:
        """A placement from nested sequences (lists from JSON, an engine's groups)."""
        return cls(tuple(tuple(tuple(int(r) for r in s) for s in p) for p in pipelines))

    @classmethod
    def parse(cls, data: object, world: int, where: str = "plan") -> Placement:
        """The placement in ``data`` (either JSON form), or InputError naming ``where``.

        Args:
            data: the decoded JSON value.
            world: the job's processes; every rank must lie in ``[0, world)``, none twice.
            where: what the value came from, for the error.
        """
        form = (
            f'{where} layout: expected {{"dp", "pp", "tp", "ranks"?}} or {{"pipelines": '
            f"[[[world ranks of a stage], ...], ...]}}"
        )
        if not isinstance(data, Mapping):
            raise InputError(f"{form}, got {data!r}")
        if "pipelines" in data:
            pipes = data["pipelines"]
            ok = (
                isinstance(pipes, (list, tuple))
                and pipes
                and all(
                    isinstance(p, (list, tuple))
                    and p
                    and all(isinstance(s, (list, tuple)) and s for s in p)
                    for p in pipes
                )
            )
            if not ok:
                raise InputError(f"{form}, got {dict(data)}")
            placed = cls(tuple(tuple(tuple(s) for s in p) for p in pipes))
        else:
            try:
                dims = ParallelDims(*(int(data.get(k, 1)) for k in ("dp", "pp", "tp")))
            except (TypeError, ValueError):
                raise InputError(f"{form}, got {dict(data)}") from None
            ranks = data.get("ranks", list(range(dims.world_size)))
            if not isinstance(ranks, (list, tuple)) or len(ranks) != dims.world_size:
                raise InputError(
                    f"{where} layout ranks: expected {dims.world_size} world ranks for dp "
                    f"{dims.dp} x pp {dims.pp} x tp {dims.tp}, got {ranks!r}"
                )
            placed = cls.uniform(dims, ranks)
        ranks = placed.ranks
        if len(set(ranks)) != len(ranks) or not all(
            isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world for r in ranks
        ):
            raise InputError(
                f"{where} layout: expected distinct world ranks in [0, {world}), got {ranks}"
            )
        return placed

    @property
    def ranks(self) -> list[int]:
        """Every placed rank, replica by replica, stage by stage."""
        return [r for p in self.pipelines for s in p for r in s]

    @property
    def depths(self) -> list[int]:
        """Each replica's number of stages."""
        return [len(p) for p in self.pipelines]

    @property
    def dims(self) -> ParallelDims | None:
        """The placement as one dp x pp x tp split, or None.

        None unless every replica has the same depth and every stage the same group size (its ranks
        in any order)."""
        shapes = {(len(p), len(s)) for p in self.pipelines for s in p}
        return ParallelDims(len(self.pipelines), *shapes.pop()) if len(shapes) == 1 else None

    def spares(self, world: int) -> list[int]:
        """The world ranks in no group."""
        placed = set(self.ranks)
        return [r for r in range(world) if r not in placed]

    def coords(self) -> dict[int, Coords]:
        """Each placed rank's (dp_rank, stage, tp_rank)."""
        return {
            r: Coords(d, s, t)
            for d, p in enumerate(self.pipelines)
            for s, group in enumerate(p)
            for t, r in enumerate(group)
        }

    def to_dict(self) -> dict[str, list]:
        return {"pipelines": [[list(s) for s in p] for p in self.pipelines]}


def apportion(
    total: int,
    weights: Sequence[float] | np.ndarray,
    *,
    minimum: int = 0,
    caps: Sequence[int] | np.ndarray | None = None,
    what: str = "weights",
) -> list[int]:
    """``total`` split into integers in proportion to ``weights`` (largest remainder).

    Each count starts at the floor of its exact share, held to at least ``minimum`` and at most its
    cap; then, round by round, the counts furthest below their share get one more (ties to the
    lower index) until the counts reach ``total``, or those furthest above theirs one less (never
    below ``minimum``). Equal weights give the larger counts to the first parts. Where the caps
    (or ``minimum``) do not allow ``total``, the sum falls short of it (or passes it): callers that
    need the exact total check.

    Args:
        total: the whole number to split.
        weights: one per part; finite and non-negative with a positive sum.
        minimum: the least count of each part.
        caps: the most each part may get (None: no caps).
        what: what the weights are, for the InputError.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise InputError(f"{what} must be non-negative with a positive sum, got {list(weights)}")
    share = total * w / w.sum()
    hi = (
        np.full(w.size, np.iinfo(np.int64).max)
        if caps is None
        else np.asarray(caps, dtype=np.int64)
    )
    counts = np.minimum(np.maximum(np.floor(share).astype(np.int64), minimum), hi)
    while (short := total - int(counts.sum())) > 0:
        room = counts < hi
        if not room.any():
            break
        order = np.argsort(np.where(room, counts - share, np.inf), kind="stable")
        counts[order[: min(short, int(room.sum()))]] += 1
    while (over := int(counts.sum()) - total) > 0:
        spare = counts > minimum
        if not spare.any():
            break
        order = np.argsort(np.where(spare, share - counts, np.inf), kind="stable")
        counts[order[: min(over, int(spare.sum()))]] -= 1
    return counts.tolist()
