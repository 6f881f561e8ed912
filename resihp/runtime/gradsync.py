"""Gradient all-reduce when pipelines may split their layers differently.

Every unit of the model (the embeddings, each decoder layer, the final norm and head) is summed over
the ranks that hold it in each data-parallel replica: with the same split everywhere that is the
usual per-stage data-parallel group; after a re-plan gave the replicas different splits, a layer's
holders sit on different stages. Units with the same holders share one flat all-reduce. Every rank
creates every group and runs its all-reduces in one global order, so collectives cannot cross.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from resihp.parallel import ParallelDims
from resihp.runtime.replan import owner

Ranges = Sequence[tuple[int, int]]


def unit_of(name: str, tied: bool = False) -> str:
    if tied and name in ("embed.weight", "head.weight"):
        return "tied"  # one parameter held by the first and the last stage
    if name.startswith("layers."):
        return f"layer{name.split('.')[1]}"
    return "embed" if name.startswith(("embed.", "pos.")) else "head"


def holders(unit: str, replica_ranges: Sequence[Ranges], dims: ParallelDims, tp_rank: int) -> tuple[int, ...]:
    """The ranks, one per replica, that hold ``unit`` (on tensor-parallel rank ``tp_rank``)."""
    if unit == "tied":  # the embedding tied to the LM head: first and last stage of every replica
        return tuple(sorted({dims.rank_of(d, s, tp_rank) for d in range(len(replica_ranges))
                             for s in (0, dims.pp - 1)}))
    stages = []
    for ranges in replica_ranges:
        if unit == "embed":
            stages.append(0)
        elif unit == "head":
            stages.append(dims.pp - 1)
        else:
            stages.append(owner(ranges, int(unit.removeprefix("layer"))))
    return tuple(dims.rank_of(d, s, tp_rank) for d, s in enumerate(stages))


class GradSync:
    def __init__(self, dims: ParallelDims, tied: bool = False, ranks: Sequence[int] | None = None) -> None:
        """``ranks``: the world rank of each rank of the layout (default: the same numbers)."""
        self.dims, self.tied = dims, tied
        self.ranks = list(ranks) if ranks is not None else list(range(dims.world_size))
        self.groups: dict[tuple[int, ...], object] = {}

    def _world(self, members: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted(self.ranks[r] for r in members))

    def prepare(self, replica_ranges: Sequence[Ranges], layers: int) -> None:
        """Collective over the world: create the groups this layout needs (once each)."""
        self.replica_ranges = [list(r) for r in replica_ranges]
        units = ["embed", "head", *(["tied"] if self.tied else []), *(f"layer{i}" for i in range(layers))]
        needed = sorted({self._world(holders(u, self.replica_ranges, self.dims, t))
                         for u in units for t in range(self.dims.tp)})
        for members in needed:
            if len(members) > 1 and members not in self.groups:
                self.groups[members] = dist.new_group(list(members))

    def all_reduce(self, model: torch.nn.Module, tp_rank: int, extra: torch.Tensor | None = None,
                   after: Callable[[tuple[int, ...], float, int], None] | None = None) -> None:
        """Sum every parameter's gradient over its holders; ``extra`` (a tensor riding with the
        head's bucket, e.g. the loss) is summed in place too. ``after(members, seconds, bytes)``
        runs after each bucket's all-reduce (fault injection on a slow link)."""
        buckets: dict[tuple[int, ...], list[torch.Tensor]] = defaultdict(list)
        params: dict[tuple[int, ...], list[torch.nn.Parameter]] = defaultdict(list)
        for name, p in model.named_parameters():
            key = self._world(holders(unit_of(name, self.tied), self.replica_ranges, self.dims, tp_rank))
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            buckets[key].append(p.grad)
            params[key].append(p)
        if extra is not None:
            head = self._world(holders("head", self.replica_ranges, self.dims, tp_rank))
            buckets[head].append(extra)
        for key in sorted(buckets):
            if len(key) < 2:
                continue
            grads = buckets[key]
            flat = torch.cat([g.reshape(-1) for g in grads])
            start = time.perf_counter()
            dist.all_reduce(flat, group=self.groups[key])
            if after is not None:
                after(key, time.perf_counter() - start, flat.numel() * flat.element_size())
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
