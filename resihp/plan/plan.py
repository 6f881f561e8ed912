"""A parallel plan: which ranks form each pipeline stage, its layers, and each replica's
micro-batches.

JSON form (docs/DESIGN.md): per rank its (dp_rank, stage, tp_rank) or ``excluded``; per pipeline its
stages with layer ranges ``[start, end)``; per data-parallel replica its micro-batch count; the
predicted step time, the capacity bound it was measured against and the migration cost from the
plan it replaces.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain, repeat
from pathlib import Path
from typing import Any

import numpy as np

from resihp.errors import InputError
from resihp.parallel import ParallelDims, Placement
from resihp.plan.specs import ClusterSpec, ModelSpec, stage_memory_gb


@dataclass(frozen=True)
class Stage:
    ranks: tuple[int, ...]  # the tensor-parallel group; tp_rank is the index in this tuple
    layers: tuple[int, int]  # [start, end)

    @property
    def tp(self) -> int:
        return len(self.ranks)

    @property
    def n_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    def __hash__(self) -> int:
        # stages (and tuples of them) key the planner's caches: hash once, not at every lookup
        try:
            return self.__dict__["_hash"]
        except KeyError:
            object.__setattr__(self, "_hash", hash((self.ranks, self.layers)))
            return self.__dict__["_hash"]


class HashedTuple(tuple):
    """A tuple that computes its hash once.

    For tuples that key caches and are looked up thousands of times per plan (a pipeline's stages,
    its stage times)."""

    def __hash__(self) -> int:
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = self.__dict__["_hash"] = tuple.__hash__(self)
            return value


class Stages(HashedTuple):
    """A pipeline's stages in order."""


@dataclass(frozen=True)
class Pipeline:
    dp_rank: int
    stages: tuple[Stage, ...]
    microbatches: int
    home: int | None = None  # index of the replica of the healthy layout it was built from
    tokens: int | None = None  # its share of the global batch; None: microbatches x model budget

    def share(self, model: ModelSpec) -> int:
        return (
            self.tokens if self.tokens is not None else self.microbatches * model.microbatch_tokens
        )

    def budget(self, model: ModelSpec) -> float:
        """Mean tokens per micro-batch (the packing budget is its ceiling)."""
        return self.share(model) / self.microbatches if self.microbatches else 0.0

    @property
    def ranks(self) -> list[int]:
        return [r for s in self.stages for r in s.ranks]

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Its stages' groups (ranks), in pipeline order."""
        return tuple(s.ranks for s in self.stages)


@dataclass(frozen=True)
class Holdings:
    """The model state a plan puts on its devices.

    The stage each placed rank belongs to, and the plan's stages and pipelines (as tuples of
    stages)."""

    stage_of: dict[int, Stage]
    stages: frozenset[Stage]
    pipelines: frozenset[tuple[Stage, ...]]

    @classmethod
    def of(cls, plan: Plan) -> Holdings:
        stages = [s for p in plan.pipelines for s in p.stages]
        ranks = chain.from_iterable(s.ranks for s in stages)
        owners = chain.from_iterable(repeat(s, len(s.ranks)) for s in stages)
        return cls(
            dict(zip(ranks, owners)), frozenset(stages), frozenset(p.stages for p in plan.pipelines)
        )


@dataclass
class Plan:
    world_size: int
    layout: ParallelDims
    pipelines: list[Pipeline]
    excluded: list[int]
    policy: str = "resihp"
    step_time_s: float = float("nan")
    tokens_per_s: float = float("nan")
    capacity_tokens_per_s: float = float("nan")
    bound_ratio: float = float("nan")
    migration_s: float = 0.0
    solver: dict[str, Any] = field(default_factory=dict)
    # expected step with variable micro-batch costs on the critical path (``timing.expected_step``)
    expected_step_time_s: float = float("nan")

    @property
    def placement(self) -> Placement:
        """Its pipelines' groups, replica by replica (``dp_rank`` order)."""
        return Placement.of(p.groups for p in sorted(self.pipelines, key=lambda p: p.dp_rank))

    def coords(self) -> dict[int, tuple[int, int, int]]:
        """rank -> (dp_rank, stage, tp_rank) for every placed rank."""
        out = {}
        for p in self.pipelines:
            for s, stage in enumerate(p.stages):
                for t, r in enumerate(stage.ranks):
                    out[r] = (p.dp_rank, s, t)
        return out

    @property
    def microbatches(self) -> dict[int, int]:
        return {p.dp_rank: p.microbatches for p in self.pipelines}

    @cached_property
    def holdings(self) -> Holdings:
        """What its devices hold (computed once: a plan's pipelines do not change once built)."""
        return Holdings.of(self)

    def to_dict(self) -> dict[str, Any]:
        place = self.coords()
        excluded = set(self.excluded)
        ranks = []
        for r in range(self.world_size):
            if r in place:
                dp, s, t = place[r]
                ranks.append({"rank": r, "dp_rank": dp, "stage": s, "tp_rank": t})
            elif r in excluded:
                ranks.append({"rank": r, "excluded": True})
        return {
            "policy": self.policy,
            "world_size": self.world_size,
            "layout": self.layout.to_dict(),
            "ranks": ranks,
            "pipelines": [
                {
                    "dp_rank": p.dp_rank,
                    "home": p.home,
                    "microbatches": p.microbatches,
                    **({"tokens": p.tokens} if p.tokens is not None else {}),
                    "stages": [
                        {
                            "stage": s,
                            "tp": st.tp,
                            "ranks": list(st.ranks),
                            "layers": list(st.layers),
                        }
                        for s, st in enumerate(p.stages)
                    ],
                }
                for p in self.pipelines
            ],
            "microbatches": {str(p.dp_rank): p.microbatches for p in self.pipelines},
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "capacity_tokens_per_s": self.capacity_tokens_per_s,
            "bound_ratio": self.bound_ratio,
            "migration_s": self.migration_s,
            "solver": self.solver,
            **(
                {"expected_step_time_s": self.expected_step_time_s}
                if np.isfinite(self.expected_step_time_s)
                else {}
            ),
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=True)

    def save(self, path: str | Path) -> None:
        try:
            Path(path).write_text(self.to_json())
        except OSError as exc:
            raise InputError(f"{path}: cannot write the plan ({exc.strerror})") from None

    @classmethod
    def from_json(cls, text: str, where: str = "plan") -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        return cls.from_dict(data, where)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise InputError(f"{path}: cannot read plan ({exc.strerror})") from None
        return cls.from_json(text, str(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "plan") -> Plan:
        def need(obj: Any, key: str, kind: type | tuple, ctx: str) -> Any:
            if not isinstance(obj, Mapping) or key not in obj:
                raise InputError(f"{where}: {ctx}field {key!r} is missing")
            value = obj[key]
            if isinstance(value, bool) or not isinstance(value, kind):
                raise InputError(f"{where}: {ctx}field {key!r} has the wrong type, got {value!r}")
            return value

        world = need(data, "world_size", int, "")
        lay = need(data, "layout", Mapping, "")
        degrees = {k: need(lay, k, int, "layout: ") for k in ("dp", "pp", "tp")}
        if min(degrees.values()) < 1:
            raise InputError(f"{where}: layout: degrees must be positive integers, got {degrees}")
        layout = ParallelDims(**degrees)
        pipelines = []
        for i, p in enumerate(need(data, "pipelines", list, "")):
            ctx = f"pipelines[{i}]: "
            stages = []
            for j, s in enumerate(need(p, "stages", list, ctx)):
                sctx = f"{ctx}stages[{j}]: "
                ranks = need(s, "ranks", list, sctx)
                layers = need(s, "layers", list, sctx)
                if not ranks or not all(
                    isinstance(r, int) and not isinstance(r, bool) for r in ranks
                ):
                    raise InputError(
                        f"{where}: {sctx}field 'ranks' must be a non-empty list of integer ranks"
                    )
                if len(layers) != 2 or not all(isinstance(x, int) for x in layers):
                    raise InputError(f"{where}: {sctx}field 'layers' must be [start, end)")
                stages.append(Stage(tuple(ranks), (layers[0], layers[1])))
            home = p.get("home")
            tokens = need(p, "tokens", int, ctx) if "tokens" in p else None
            pipelines.append(
                Pipeline(
                    need(p, "dp_rank", int, ctx),
                    Stages(stages),
                    need(p, "microbatches", int, ctx),
                    home if isinstance(home, int) else None,
                    tokens,
                )
            )
        excluded = [
            r["rank"]
            for r in data.get("ranks", []) or []
            if isinstance(r, Mapping) and r.get("excluded")
        ]
        num = {
            k: float(data[k])
            for k in (
                "step_time_s",
                "tokens_per_s",
                "capacity_tokens_per_s",
                "bound_ratio",
                "migration_s",
                "expected_step_time_s",
            )
            if isinstance(data.get(k), (int, float)) and not isinstance(data.get(k), bool)
        }
        return cls(
            world_size=world,
            layout=layout,
            pipelines=pipelines,
            excluded=sorted(excluded),
            policy=str(data.get("policy", "resihp")),
            solver=dict(data.get("solver") or {}),
            **num,
        )

    def check_against(self, cluster: ClusterSpec, where: str = "current plan") -> None:
        """Raise InputError if the plan names devices the cluster does not have."""
        if self.world_size != len(cluster):
            raise InputError(
                f"{where}: world_size {self.world_size} does not match the cluster's "
                f"{len(cluster)} devices"
            )
        n = len(cluster)
        for p in self.pipelines:
            for s in p.stages:
                if s.ranks and (min(s.ranks) < 0 or max(s.ranks) >= n):
                    r = next(r for r in s.ranks if not 0 <= r < n)
                    raise InputError(
                        f"{where}: unknown device rank {r} in pipeline "
                        f"{p.dp_rank} (cluster has ranks 0..{n - 1})"
                    )


def _stage_ranks(stages: tuple[Stage, ...]) -> np.ndarray:
    """The ranks of a pipeline's stages as one array (kept on a ``HashedTuple`` of them: a
    re-plan assembles plans of the same pipelines many times)."""
    held = getattr(stages, "__dict__", None)
    if held is not None and "_ranks" in held:
        return held["_ranks"]
    out = np.fromiter(chain.from_iterable(s.ranks for s in stages), dtype=np.int64)
    if held is not None:
        held["_ranks"] = out
    return out


def unplaced(world_size: int, pipelines: list[Pipeline]) -> list[int]:
    """The ranks of ``range(world_size)`` that no pipeline places, in order."""
    arrays = [_stage_ranks(p.stages) for p in pipelines]
    ranks = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
    placed = np.zeros(world_size, dtype=bool)
    placed[ranks[(ranks >= 0) & (ranks < world_size)]] = True
    return np.flatnonzero(~placed).tolist()


def plan_problems(plan: Plan, cluster: ClusterSpec, model: ModelSpec) -> list[str]:
    """Everything that makes the plan unusable on this cluster; empty when it is valid.

    Args:
        plan: the plan to check.
        cluster: the cluster it is for (its devices, their nodes, memory and liveness).
        model: the model it places (its layers, heads, schedule and memory needs).
    """
    problems = []
    seen: dict[int, str] = {}
    for p in plan.pipelines:
        if not p.stages:
            problems.append(f"pipeline {p.dp_rank} has no stages")
            continue
        where = 0
        for s, stage in enumerate(p.stages):
            name = f"pipeline {p.dp_rank} stage {s}"
            if stage.layers[0] != where or stage.n_layers < 1:
                problems.append(f"{name}: layers {stage.layers} do not continue at {where}")
            where = stage.layers[1]
            if stage.tp & (stage.tp - 1) or model.heads % stage.tp:
                problems.append(
                    f"{name}: tensor-parallel size {stage.tp} is not a power of two "
                    f"dividing heads {model.heads}"
                )
            nodes = {cluster.devices[r].node for r in stage.ranks if 0 <= r < len(cluster)}
            if len(nodes) > 1:
                problems.append(f"{name}: tensor-parallel group spans nodes {sorted(nodes)}")
            for r in stage.ranks:
                if not 0 <= r < len(cluster):
                    problems.append(f"{name}: unknown rank {r}")
                    continue
                if r in seen:
                    problems.append(f"rank {r} placed twice ({seen[r]} and {name})")
                seen[r] = name
                if not cluster.devices[r].alive:
                    problems.append(f"{name}: rank {r} is dead")
            in_flight = len(p.stages) - s if model.schedule == "1f1b" else p.microbatches
            need = stage_memory_gb(
                model,
                stage.n_layers,
                stage.tp,
                min(in_flight, max(1, p.microbatches)),
                s == 0,
                s == len(p.stages) - 1,
                p.budget(model) or None,
            )
            have = (
                min(cluster.devices[r].memory_gb for r in stage.ranks if 0 <= r < len(cluster))
                - cluster.memory_reserve_gb
            )
            if need > have + 1e-9:
                problems.append(f"{name}: needs {need:.1f} GB per device, has {have:.1f} GB")
        if where != model.layers:
            problems.append(
                f"pipeline {p.dp_rank}: layers end at {where}, model has {model.layers}"
            )
        if p.microbatches < 1:
            problems.append(f"pipeline {p.dp_rank}: {p.microbatches} micro-batches")
        elif p.tokens is not None and -(-p.tokens // p.microbatches) < model.max_seq_len:
            problems.append(
                f"pipeline {p.dp_rank}: micro-batch budget "
                f"{-(-p.tokens // p.microbatches)} tokens is below max_seq_len "
                f"{model.max_seq_len}"
            )
    dps = sorted(p.dp_rank for p in plan.pipelines)
    if dps != list(range(len(dps))):
        problems.append(f"data-parallel ranks {dps} are not 0..{len(dps) - 1}")
    excluded = set(plan.excluded)
    for r in range(len(cluster)):
        if r in seen and r in excluded:
            problems.append(f"rank {r} is both placed and excluded")
        elif r not in seen and r not in excluded:
            problems.append(f"rank {r} is neither placed nor excluded")
    total = sum(p.share(model) for p in plan.pipelines)
    if total != model.global_batch_tokens:
        problems.append(
            f"replica shares sum to {total} tokens, the global batch is {model.global_batch_tokens}"
        )
    return problems
