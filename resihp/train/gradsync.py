"""Gradient all-reduce when pipelines split their layers differently or differ in shape.

Replicas may differ in depth and tensor-parallel size.

Every unit of the model (the embeddings, each decoder layer, the final norm and head; a tied
embedding is one unit on the first and last stage) is summed over the ranks that hold it in each
data-parallel replica. A tensor-parallel shard is summed block by block in the parameter's global
tensor (``GPTConfig.shard_placement``): each piece of the global tensor is held by exactly one
rank of each replica, whatever that replica's tensor-parallel size, and those ranks sum it. A
replicated parameter held by a tensor-parallel group is summed in lanes (lane j: the j-th rank of
each replica's group, cycling through smaller groups), so every replica counts once. With one layout
everywhere this is the usual per-stage data-parallel group. Pieces with the same holders share one
flat all-reduce; every rank creates every group and runs its all-reduces in one global order, so
collectives cannot cross.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from resihp.model.config import GPTConfig
from resihp.model.gpt import GPTStage
from resihp.model.shards import chunk_rows
from resihp.model.tensor_parallel import TPContext
from resihp.parallel import ParallelDims
from resihp.train.replan import owner

Ranges = Sequence[tuple[int, int]]
Pipelines = Sequence[Sequence[Sequence[int]]]  # replica -> stage -> world ranks in tp order
LOSS = "~loss"  # the last stage's loss rides with the head's pieces (sorts after every name)


def unit_of(name: str, tied: bool = False) -> str:
    if tied and name in ("embed.weight", "head.weight"):
        return "tied"  # one parameter held by the first and the last stage
    if name.startswith("layers."):
        return f"layer{name.split('.')[1]}"
    return "embed" if name.startswith(("embed.", "pos.")) else "head"


def holder_stages(unit: str, ranges: Ranges) -> list[int]:
    """The stages of one replica (with layer ``ranges``) that hold ``unit``."""
    last = len(ranges) - 1
    if unit == "tied":
        return sorted({0, last})
    if unit == "embed":
        return [0]
    if unit == "head":
        return [last]
    return [owner(ranges, int(unit.removeprefix("layer")))]


def pipelines_of(
    dims: ParallelDims, ranks: Sequence[int] | None = None
) -> list[list[tuple[int, ...]]]:
    """A uniform layout as pipelines of world ranks (``ranks[i]``: the world rank of layout rank
    i)."""
    ranks = list(ranks) if ranks is not None else list(range(dims.world_size))
    return [
        [tuple(ranks[r] for r in dims.tp_group_ranks(d, s)) for s in range(dims.pp)]
        for d in range(dims.dp)
    ]


@functools.cache
def _global_params(cfg: GPTConfig) -> dict[str, tuple[int | None, int]]:
    """Every parameter of the whole model: its sharded dimension and that dimension's size."""
    with torch.device("meta"):  # names and global shapes only
        whole = GPTStage(cfg, 0, cfg.layers, TPContext(1, 0))
    out = {}
    for name, p in whole.named_parameters():
        where = cfg.shard_placement(name, tuple(p.shape), 1)
        out[name] = (where.dim, where.global_shape[where.dim] if where.dim is not None else 0)
    return out


class Pieces:
    """Which ranks sum each block of each parameter's gradient.

    The layout is given as pipelines of ranks (replica -> stage -> its tensor-parallel group) and
    each replica's layer ranges. Every key (the summing ranks, ascending) holds one rank of each
    replica (with ``tied``, a tied embedding's key holds its first- and last-stage copies). Pure: no
    process group."""

    def __init__(
        self,
        pipelines: Pipelines,
        replica_ranges: Sequence[Ranges],
        cfg: GPTConfig,
        tied: bool = False,
    ) -> None:
        self.pipelines = [[tuple(s) for s in p] for p in pipelines]
        self.replica_ranges = [list(r) for r in replica_ranges]
        self.cfg, self.tied = cfg, tied
        self.params = _global_params(cfg)
        self._cache: dict[str, list[tuple[tuple[int, ...], int, int]]] = {}

    def of(self, name: str) -> list[tuple[tuple[int, ...], int, int]]:
        """The pieces of parameter ``name``: (members, start, length) along its sharded dimension.

        Length 0 is the whole tensor."""
        if name not in self._cache:
            self._cache[name] = self._find(name)
        return self._cache[name]

    def _find(self, name: str) -> list[tuple[tuple[int, ...], int, int]]:
        unit = unit_of(name, self.tied)
        holding = [
            self.pipelines[d][s]
            for d in range(len(self.pipelines))
            for s in holder_stages(unit, self.replica_ranges[d])
        ]
        dim, n = self.params["embed.weight" if unit == "tied" else name]
        if dim is None:
            lanes = max(len(g) for g in holding)
            return [(tuple(sorted({g[j % len(g)] for g in holding})), 0, 0) for j in range(lanes)]
        bounds = sorted(
            {0, n} | {min(n, i * chunk_rows(n, len(g))) for g in holding for i in range(len(g))}
        )
        out = []
        for a, b in zip(bounds, bounds[1:]):
            if b > a:
                members = {g[min(a // chunk_rows(n, len(g)), len(g) - 1)] for g in holding}
                out.append((tuple(sorted(members)), a, b - a))
        return out

    def needed(self) -> list[tuple[int, ...]]:
        """Every key of the layout, ascending."""
        return sorted({members for name in self.params for members, _, _ in self.of(name)})

    def entries(
        self, model: torch.nn.Module, rank: int, extra: torch.Tensor | None = None
    ) -> dict[tuple[int, ...], list[tuple[str, int, torch.Tensor]]]:
        """Rank ``rank``'s gradient pieces (views into its ``model``'s gradients) by key.

        Each key's pieces are in (name, start) order.

        Args:
            model: the rank's stage model (gradients it lacks are set to zeros).
            rank: the rank.
            extra: a tensor (e.g. the loss) that rides with every piece of the final norm this
                rank sums (replicated on every last stage); None: none."""
        tp = model.tp if isinstance(model, GPTStage) else TPContext(1, 0)
        entries: dict[tuple[int, ...], list[tuple[str, int, torch.Tensor]]] = defaultdict(list)
        for name, p in model.named_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            saved = self.cfg.saved_name(name)
            where = self.cfg.shard_placement(saved, tuple(p.shape), tp.size)
            grad = where.local_view(p.grad, tp.size, tp.rank)
            mine = (
                min(
                    where.global_shape[where.dim],
                    tp.rank * chunk_rows(where.global_shape[where.dim], tp.size),
                )
                if where.dim is not None
                else 0
            )
            for members, start, length in self.of(name):
                if rank not in members:
                    continue
                piece = grad if length == 0 else grad.narrow(where.dim, start - mine, length)
                entries[members].append((saved, start, piece))
        if extra is not None:
            for members, _, _ in self.of("ln_f.weight"):
                if rank in members:
                    entries[members].append((LOSS, 0, extra))
        for key in entries:
            entries[key].sort(key=lambda e: (e[0], e[1]))
        return dict(entries)


class GradSync:
    """The gradient all-reduce of a job whose replicas share one world.

    ``Pieces`` are summed over process groups of the world (every rank creates every group, in one
    order)."""

    def __init__(
        self, pipelines: Pipelines | ParallelDims, tied: bool = False, cfg: GPTConfig | None = None
    ) -> None:
        self.pipelines = [
            [tuple(s) for s in p]
            for p in (pipelines_of(pipelines) if isinstance(pipelines, ParallelDims) else pipelines)
        ]
        self.tied, self.cfg = tied, cfg or GPTConfig(tie_embeddings=tied)
        self.groups: dict[tuple[int, ...], object] = {}
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def prepare(self, replica_ranges: Sequence[Ranges], layers: int) -> None:
        """Collective over the world: create the groups this layout needs (once each)."""
        self.replica_ranges = [list(r) for r in replica_ranges]
        self.pieces = Pieces(self.pipelines, self.replica_ranges, self.cfg, self.tied)
        for members in self.pieces.needed():
            if len(members) > 1 and members not in self.groups:
                self.groups[members] = dist.new_group(list(members))

    def all_reduce(
        self,
        model: torch.nn.Module,
        tp_rank: int | None = None,
        extra: torch.Tensor | None = None,
        after: Callable[[tuple[int, ...], float, int], None] | None = None,
    ) -> None:
        """Sum every parameter's gradient over its holders, piece by piece.

        Args:
            model: this rank's stage model.
            tp_rank: not used: the pieces follow the model's own tensor-parallel context.
            extra: a tensor riding with the head's pieces (e.g. the loss), summed in place too
                (None: none).
            after: ``after(members, seconds, bytes)`` runs after each bucket's all-reduce (fault
                injection on a slow link; None: nothing)."""
        entries = self.pieces.entries(model, self.rank, extra)
        # every piece is read before any is written back: a rank in several lanes adds its own value
        flats = {
            key: torch.cat([t.reshape(-1) for _, _, t in entries[key]])
            for key in sorted(entries)
            if len(key) > 1
        }
        for key, flat in flats.items():
            start = time.perf_counter()
            dist.all_reduce(flat, group=self.groups[key])
            if after is not None:
                after(key, time.perf_counter() - start, flat.numel() * flat.element_size())
        for key, flat in flats.items():
            offset = 0
            for _, _, t in entries[key]:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
