"""Pipelines designed for the devices at hand, not cut from the healthy layout.

They have stages of mixed tensor-parallel sizes and depths, as many of each design as the devices
allow.

The healthy layout gives every replica the same TP x PP shape; the capacity bound
(``resihp.plan.bound``) showed where that leaves throughput behind: at 1,024 devices its best
pipelines are 13 TP 4 stages with a TP 2 stage for the LM head, at 64 a mix of TP 2 and TP 1
stages, and after a fault the devices left over rarely make whole replicas of the old shape.

1. **Designs** (``Design``): ``a`` stages of TP ``t1``, then ``b`` of TP ``t2 < t1``, then the LM
   head's stage of TP ``th``; layers per stage from the shortest cap ``mu`` on a stage's time that
   covers the model's layers (memory at each stage's micro-batches in flight), the layers a cap
   leaves over taken from the stages slowest per layer.
2. **Packing**: for a step ``T``, design ``g`` carries ``x_g(T) = floor((T - S_g - comm_g - sync_g)
   / mu_g) + 1`` micro-batches (1F1B closed form; with token budgets that many stretched to fill
   ``T``); an unbounded knapsack over the devices (``resihp.plan.knapsack``) finds the most
   micro-batches the designs carry, and a bisection the least ``T`` that carries the global
   batch. A second pass prices the designs worth having there on the schedule's dependency graph
   (``perf.schedule``; the closed form misses the transfers in a balanced pipeline's steady
   state, 2-3% on deep ones) and packs again.
3. **Placement**: every tensor-parallel group inside one node, widest first, into the node with
   the fewest free devices that holds it. The knapsack counts devices, not nodes: a pipeline whose
   group finds no room is dropped, and the next round designs for the devices left (groups no
   wider than the most any node has free). Devices a node still has left (beside a fault, the
   groups placed leave it 1-3 devices no design of the rounds could use) join designed pipelines
   as short stages of their own, at the head or just before the LM head's stage (``_joined_stages``,
   as slow devices do below; both ways of joining them are candidates). The
   micro-batches are then allocated by CP-SAT (``allocate_microbatches``) across the pipelines
   placed, as in every other plan.

``design_plans`` may keep pipelines of the plan in force (a re-plan: only the pipelines a fault
touched are designed anew, from their full-speed devices and the ones no pipeline used). Slow
devices come last, in one of two ways (a variant each, sharing the packing above): each may join
a designed pipeline as a short stage of its own (``_joined_stages``: the layers its
speed carries in that pipeline's slowest stage's time), and the rest get pipelines of their own:
the ``k`` fastest of them, each design stretched to the slowest of those ``k`` speeds, for the
``k`` that carries the batch in the least step; where those leave slow devices out (designs
stretched to the slowest of ``k`` carry little when the speeds spread), a variant chains them
instead into one pipeline, a stage each, the layers split by speed (``_slow_chain``, CP-SAT). The
planner scores the results with the same evaluator as its other candidates and keeps one only if
it is better. A third way packs the slow devices with the designs (``slow_packing``): each may
head a pipeline sized for it (a 0/1 knapsack over the slow devices beside the unbounded one over
the full-speed designs, per step of the bisection), where joining one to a pipeline packed
without it adds only what the layers it takes off that pipeline's slowest stage shorten.
"""

from __future__ import annotations

import heapq
import itertools
import math
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from resihp.parallel import ParallelDims
from resihp.perf.schedule import pipeline_step_time
from resihp.plan.allocation import allocate_microbatches
from resihp.plan.cost import cost_key
from resihp.plan.knapsack import choose, unbounded_knapsack
from resihp.plan.layout import layer_ranges, powers_of_two_upto
from resihp.plan.pipeline_solver import solve_pipeline
from resihp.plan.plan import Pipeline, Plan, Stage, Stages, unplaced
from resihp.plan.specs import ClusterSpec, in_flight_microbatches, stage_memory_gb
from resihp.plan.timing import StageCoster

_EPS = 1e-9
MAX_SECOND_KIND = 4  # stages of the narrower body TP size per design
FIRST_ROUNDS = ("all", "chunks", "whole")  # what the first round of packing designs for
ROUNDS = 4  # of packing and placement, while groups find no node
PRICED = 16  # designs priced on the schedule's graph besides the ones the first pass chose
JOIN_PER_COUNT = 2  # designs per device count a slow device may join (``slow_packing``)
JOIN_PRICED = 8  # of those per slow device, priced on the schedule's graph


@dataclass(frozen=True)
class Design:
    """A pipeline shape: TP size and layer count per stage, in pipeline order.

    The last stage runs the LM head; ``mu`` is its slowest stage, ``fixed`` the rest of one
    micro-batch's way through it (stage times' sum and activation transfers, ``S + comm``), at full
    speed; ``inflight``: the most micro-batches in flight its memory was checked for."""

    tps: tuple[int, ...]
    counts: tuple[int, ...]
    mu: float
    fixed: float
    inflight: int
    # the step as ``first + (m - 1) * each``: the closed form, or (``priced``) the schedule's
    # dependency graph at some micro-batch count and the next
    first: float = float("nan")
    each: float = float("nan")

    devices: int = field(init=False)
    shard: float = field(init=False)  # its largest per-device gradient shard, in layers
    # the most micro-batches it may carry: those its memory was checked for, or any number
    # once every stage holds as many in flight as the schedule ever puts there
    limit: float = field(init=False)

    def __post_init__(self) -> None:
        if self.first != self.first:  # nan: the closed form
            object.__setattr__(self, "first", self.fixed)
            object.__setattr__(self, "each", self.mu)
        object.__setattr__(self, "devices", sum(self.tps))
        object.__setattr__(self, "shard", max(n / t for n, t in zip(self.counts, self.tps)))
        object.__setattr__(
            self, "limit", math.inf if len(self.tps) <= self.inflight else self.inflight
        )

    def step(self, m: int) -> float:
        """Its step over ``m`` micro-batches, no gradient sync."""
        return (m - 1) * self.each + self.first


class Designer:
    """Designs for one (healthy hardware, model, cost model) at full speed."""

    def __init__(self, coster: StageCoster) -> None:
        self.coster = coster
        self.model = model = coster.model
        cluster = coster.cluster
        tflops = float(max(d.tflops for d in cluster.devices))
        node = min(len(r) for r in cluster.node_ranks)
        self.tps = [t for t in powers_of_two_upto(node) if model.heads % t == 0]
        self.free = max(d.memory_gb for d in cluster.devices) - cluster.memory_reserve_gb
        self.fb = {t: coster.layer_fb(t, tflops) for t in self.tps}
        self.head_fb = {t: coster.head_fb(t, tflops) for t in self.tps}
        self.c = {t: sum(self.fb[t]) for t in self.tps}
        self.h = {t: sum(self.head_fb[t]) for t in self.tps}
        self.q = 2.0 * coster.p2p_s
        self._designs: dict[int, list[Design]] = {}
        self._caps: dict[tuple[int, int, bool, bool], int] = {}
        self._priced: dict[tuple, Design] = {}
        self._slowed: dict[tuple, Design | None] = {}
        self._pools: dict[tuple, list[Design]] = {}

    def _mem_cap(self, t: int, in_flight: int, first: bool, last: bool) -> int:
        """Layers a stage of TP ``t`` holds with ``in_flight`` micro-batches' activations."""
        key = (t, in_flight, first, last)
        if key not in self._caps:
            self._caps[key] = self._layers_that_fit(t, in_flight, first, last)
        return self._caps[key]

    def _layers_that_fit(self, t: int, in_flight: int, first: bool, last: bool) -> int:
        lo, hi = 0, self.model.layers
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if stage_memory_gb(self.model, mid, t, in_flight, first, last) <= self.free + _EPS:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def priced(self, d: Design, m: int, stretch: tuple[float, ...] | None = None) -> Design:
        """``d`` with its step priced on the schedule's dependency graph, not the closed form.

        The step at ``m`` micro-batches and the slope to ``m + 1`` (the closed form misses a few
        percent on uneven stages).

        Args:
            d: the design to price.
            m: the micro-batches it carries.
            stretch: per stage, how many times slower it runs (1 / its speed), as in
                ``fit_slowed``; None: all at full speed."""
        key = (d.tps, d.counts, d.inflight, m, stretch)
        if key not in self._priced:
            self._priced[key] = self._price(d, m, stretch)
        return self._priced[key]

    def _price(self, d: Design, m: int, stretch: tuple[float, ...] | None) -> Design:
        p = len(d.tps)
        slower = np.ones(p) if stretch is None else np.array(stretch, dtype=np.float64)
        f = np.array([self.fb[t][0] * n for t, n in zip(d.tps, d.counts)])
        b = np.array([self.fb[t][1] * n for t, n in zip(d.tps, d.counts)])
        f[-1] += self.head_fb[d.tps[-1]][0]
        b[-1] += self.head_fb[d.tps[-1]][1]
        f, b = f * slower, b * slower
        m = max(1, m)
        steps = [
            float(
                pipeline_step_time(
                    np.broadcast_to(f[:, None], (p, k)),
                    np.broadcast_to(b[:, None], (p, k)),
                    self.model.schedule,
                    p2p_s=self.coster.p2p_s,
                )
            )
            for k in (m, m + 1)
        ]
        each = max(steps[1] - steps[0], _EPS)
        return replace(d, first=steps[0] - (m - 1) * each, each=each)

    def designs(self, m: int, devices: int) -> list[Design]:
        """The designs of at most ``devices`` devices whose memory holds ``m`` micro-batches.

        ``m`` counts the micro-batches in flight (1F1B: at most the depth)."""
        if m not in self._designs:
            self._designs[m] = self._build(m, len(self.coster.cluster))
        built = self._designs[m]  # by device count
        return built[: bisect_right(built, devices, key=lambda d: d.devices)]

    def pool(self, m_guess: int, devices: int, max_tp: int | None) -> list[Design]:
        """The designs a packing for about ``m_guess`` micro-batches per pipeline draws from.

        They have memory for one, two, ``m_guess`` and any number of micro-batches in flight.

        Args:
            m_guess: about how many micro-batches each pipeline carries.
            devices: the most devices a design may have.
            max_tp: the widest tensor-parallel group a design may have (None: no limit)."""
        key = (m_guess, devices, max_tp)
        if key not in self._pools:
            pool: dict[tuple, Design] = {}
            for m in sorted({1, 2, m_guess, 10**6}):
                for d in self.designs(m, devices):
                    if max_tp is None or max(d.tps) <= max_tp:
                        pool.setdefault((d.tps, d.counts, d.inflight), d)
            if len(self._pools) > 256:
                self._pools.clear()
            self._pools[key] = list(pool.values())
        return self._pools[key]

    def _build(self, m: int, devices: int) -> list[Design]:
        L, schedule = self.model.layers, self.model.schedule
        out: dict[tuple, Design] = {}
        for t1 in self.tps:
            for t2 in [None] + [t for t in self.tps if t < t1]:
                for b in [0] if t2 is None else range(1, MAX_SECOND_KIND + 1):
                    for th in self.tps:
                        for a in range(L):
                            tps = (t1,) * a + (t2,) * b + (th,)
                            if len(tps) > L or sum(tps) > devices:
                                break
                            d = self._fit(tps, m, schedule)
                            if d is not None:
                                out.setdefault((d.tps, d.counts), d)
        return sorted(out.values(), key=lambda d: (d.devices, d.step(m)))

    def fit_slowed(self, tps: tuple[int, ...], stretch: tuple[float, ...], m: int) -> Design | None:
        """``_fit`` for stages some of which run slower; the design's times are at those speeds.

        Args:
            tps: the tensor-parallel size of each stage, in pipeline order.
            stretch: per stage, how many times slower it runs (1 / its speed).
            m: the micro-batches in flight its memory must hold."""
        key = (tps, stretch, m)
        if key not in self._slowed:
            self._slowed[key] = self._fit(tps, m, self.model.schedule, stretch)
        return self._slowed[key]

    def _fit(
        self, tps: tuple[int, ...], m: int, schedule: str, stretch: tuple[float, ...] | None = None
    ) -> Design | None:
        """Layer counts for stages of these TP sizes: the least cap on a stage's time under which
        they hold every layer, then the layers over the model's taken from the slowest per layer.
        ``stretch``: per stage, how much slower it runs than full speed (default: none)."""
        L, p = self.model.layers, len(tps)
        caps = [
            self._mem_cap(t, in_flight_microbatches(schedule, p, s, m), s == 0, s == p - 1)
            for s, t in enumerate(tps)
        ]
        if min(caps) < 1 or sum(caps) < L:
            return None
        k = np.ones(p) if stretch is None else np.array(stretch, dtype=np.float64)
        c = np.array([self.c[t] for t in tps]) * k
        h = np.zeros(p)
        h[-1] = self.h[tps[-1]] * k[-1]
        cap = np.array(caps)
        # candidate caps on a stage's time: n layers (and the head) on some stage
        kinds = {(float(c[s]), 0.0) for s in range(p - 1)} | {(float(c[-1]), float(h[-1]))}
        n_all = np.arange(1, L + 1)
        mus = np.unique(np.concatenate([n_all * ck + hk for ck, hk in kinds]))
        held = np.minimum(cap[None, :], np.floor((mus[:, None] - h[None, :]) / c[None, :] + _EPS))
        ok = (held >= 1).all(axis=1) & (held.sum(axis=1) >= L)
        if not ok.any():
            return None
        n = held[int(np.argmax(ok))].astype(int)
        extra = int(n.sum()) - L
        for s in np.argsort(-c, kind="stable"):  # the extra layers off the slowest per layer
            cut = min(extra, int(n[s]) - 1)
            n[s] -= cut
            extra -= cut
        times = n * c + h
        inflight = m if schedule == "1f1b" and m < p else (10**9 if schedule == "1f1b" else m)
        return Design(
            tps,
            tuple(int(x) for x in n),
            float(times.max()),
            float(times.sum()) + self.q * (p - 1),
            inflight,
        )


# designers per (hardware, model, cost model): they depend on nothing else, so the planners of
# one process (a fresh one per re-plan in some callers, the benchmark's scenarios) build each once
_DESIGNERS: dict[tuple, Designer] = {}


def designer_for(coster: StageCoster) -> Designer:
    """The designer of ``coster``'s hardware, model and cost model (``coster`` at full speed)."""
    key = (coster.cluster.hardware_key, coster.model, cost_key(coster.cost))
    if key not in _DESIGNERS:
        if len(_DESIGNERS) > 16:
            _DESIGNERS.clear()
        _DESIGNERS[key] = Designer(coster)
    return _DESIGNERS[key]


@dataclass(frozen=True)
class Packing:
    """Designs and how many pipelines of each, and the step the bisection found."""

    designs: tuple[Design, ...]
    counts: tuple[int, ...]
    step_s: float


def pack(
    designer: Designer,
    devices: int,
    microbatches: int,
    kept: Sequence[tuple[float, float]] = (),
    kept_shard: float = 0.0,
    replicas_hint: int = 2,
    max_tp: int | None = None,
    target_s: float | None = None,
    token_budgets: bool = False,
    speed: float = 1.0,
) -> Packing | None:
    """The designs, and how many of each, that carry the micro-batches in the least step.

    None if none can carry them in a step of ``target_s``.

    Args:
        designer: the designer whose designs are packed.
        devices: the number of devices to pack onto.
        microbatches: the micro-batches to carry.
        kept: the pipelines already placed, each one's (first micro-batch's step, each further
            one's), in seconds.
        kept_shard: the kept pipelines' largest per-device gradient shard, in layers.
        replicas_hint: about how many pipelines there will be (at least 2 counted), for the
            micro-batches each carries and the gradient sync's ring.
        max_tp: the widest tensor-parallel group a design may have (None: no limit).
        target_s: a step to beat, in seconds (None: none).
        token_budgets: a pipeline's micro-batches may be larger than the model's budget
            (``resihp.plan.tokens``), so it carries ``m * room / step(m)`` budgets' worth, not
            ``m``.
        speed: the devices' speed (1.0: full speed)."""
    coster = designer.coster
    m_guess = max(1, -(-microbatches // max(1, replicas_hint)))
    base = designer.pool(m_guess, devices, max_tp)
    designs = [_slowed(d, speed) for d in base]
    if not designs and not kept:
        return None
    replicas = max(2, replicas_hint)
    # a coarse first answer: it only prices the designs for the second pass
    packing = _bisect(
        coster,
        designs,
        devices,
        microbatches,
        kept,
        kept_shard,
        replicas,
        target_s,
        token_budgets,
        tolerance=1e-3,
    )
    if packing is None or not designs:
        return packing
    # the second pass on the schedule's graph: the designs worth having at that step, each
    # priced at the micro-batches it would carry there
    replicas = max(2, len(kept) + sum(packing.counts))
    room = packing.step_s - coster.sync_s_per_shard_layer(replicas) * np.array(
        [max(d.shard, kept_shard) for d in designs]
    )
    vals = (
        _carried(
            room,
            np.array([d.first for d in designs]),
            np.array([d.each for d in designs]),
            np.array([d.limit for d in designs]),
            False,
        )
        .astype(int)
        .tolist()
    )
    front = _front(
        np.array([d.devices for d in designs]), np.array(vals, dtype=np.float64)
    ).tolist()
    # the designs chosen and the most micro-batches per device among the rest
    chosen = {i for i, k in enumerate(packing.counts) if k}
    front = sorted(set(front) - chosen, key=lambda i: (-vals[i] / designs[i].devices, i))[
        :PRICED
    ] + sorted(chosen)
    priced = [_slowed(designer.priced(base[i], vals[i]), speed) for i in front]
    return (
        _bisect(
            coster,
            priced,
            devices,
            microbatches,
            kept,
            kept_shard,
            replicas,
            target_s,
            token_budgets,
        )
        or packing
    )


def _bisect(
    coster: StageCoster,
    designs: list[Design],
    devices: int,
    microbatches: int,
    kept: Sequence[tuple[float, float]],
    kept_shard: float,
    replicas: int,
    target_s: float | None = None,
    token_budgets: bool = False,
    tolerance: float = 1e-5,
) -> Packing | None:
    """The least step at which the designs (and the kept pipelines) carry the micro-batches
    (within ``tolerance``, relative), and the packing there; the all-reduce's ring length taken
    from the answer, once more. None if it is longer than ``target_s``."""
    cost = np.array([d.devices for d in designs], dtype=np.int64)
    first = np.array([d.first for d in designs])
    each = np.array([d.each for d in designs])
    shard = np.maximum(np.array([d.shard for d in designs]), kept_shard)
    limit = np.array([d.limit for d in designs])
    k_first = np.array([f for f, _ in kept])
    k_each = np.array([e for _, e in kept])
    # the designs by device count, for the front of each feasibility test (one per count)
    by_cost = np.argsort(cost, kind="stable")
    costs, starts = np.unique(cost[by_cost], return_index=True)
    result = None
    for _ in range(2):
        unit = coster.sync_s_per_shard_layer(replicas)

        def carried(T: float, unit: float = unit) -> tuple[float, np.ndarray]:
            vals = _carried(T - unit * shard, first, each, limit, token_budgets)
            base = float(
                _carried(T - unit * kept_shard, k_first, k_each, np.inf, token_budgets).sum()
            )
            return base, vals

        def feasible(T: float) -> bool:
            base, vals = carried(T)
            if not len(vals):
                return base >= microbatches - _EPS
            best = np.maximum.reduceat(
                vals[by_cost], starts
            )  # the most any design of a count carries
            keep = best > np.concatenate([[0.0], np.maximum.accumulate(best)[:-1]])
            return (
                base
                + (unbounded_knapsack(costs[keep], best[keep], devices)[-1] if keep.any() else 0.0)
                >= microbatches - _EPS
            )

        lo = float(min(first.min(initial=np.inf), k_first.min(initial=np.inf)))
        if target_s is not None:
            if not feasible(target_s):
                return None
            hi = target_s
        else:
            hi = max(lo, 1e-6) * 2
        while not feasible(hi):
            lo, hi = hi, hi * 2
            if hi > 1e9:
                return None
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
            if hi - lo <= tolerance * hi:
                break
        _, vals = carried(hi)
        counts = [0] * len(designs)
        if len(designs):
            keep = _front(cost, vals)
            for i, k in zip(keep, choose(cost[keep], vals[keep], devices)[1]):
                counts[i] = k
        result = Packing(tuple(designs), tuple(counts), hi)
        if max(2, len(kept) + sum(counts)) == replicas:
            break
        replicas = max(2, len(kept) + sum(counts))
    return result


def slow_packing(
    designer: Designer,
    devices: int,
    slow: dict[int, float],
    microbatches: int,
    kept: Sequence[tuple[float, float]] = (),
    kept_shard: float = 0.0,
    replicas_hint: int = 2,
    max_tp: int | None = None,
    token_budgets: bool = False,
    plain: Packing | None = None,
) -> tuple[Packing, dict[int, Design]] | None:
    """``pack`` with the slow devices each joining at most one pipeline as a stage ahead of it.

    The joins are chosen with the designs (the bound's answer for a slow device: a few layers of a
    pipeline sized for it, not a stage added to a pipeline sized without it). Per step ``T``: every
    design of the packing with a slow stage ahead (``fit_slowed``, priced at its speed), a 0/1
    knapsack over the slow devices (what each adds with the full-speed devices its pipeline takes)
    beside the unbounded one over the full-speed designs; a bisection finds the least ``T`` that
    carries the micro-batches. Returns the packing of the full-speed designs and, per slow device
    joined, its design (the slow stage first); None where ``pack`` finds none.

    Args:
        designer: the designer whose designs are packed.
        devices: the number of full-speed devices to pack onto.
        slow: the slow devices, rank -> speed.
        microbatches: the micro-batches to carry.
        kept: as in ``pack``.
        kept_shard: as in ``pack``.
        replicas_hint: as in ``pack``.
        max_tp: as in ``pack``.
        token_budgets: as in ``pack``.
        plain: ``pack``'s answer for these arguments, where the caller has it (None: computed)."""
    coster = designer.coster
    plain = plain or pack(
        designer,
        devices,
        microbatches,
        kept,
        kept_shard,
        replicas_hint,
        max_tp,
        token_budgets=token_budgets,
    )
    if plain is None or not plain.designs:
        return None if plain is None else (plain, {})
    designs = list(plain.designs)
    replicas = max(2, len(kept) + sum(plain.counts))
    m = max(1, -(-microbatches // replicas))
    unit = coster.sync_s_per_shard_layer(replicas)

    def arrays(ds: Sequence[Design]) -> tuple[np.ndarray, ...]:
        return (
            np.array([d.first for d in ds]),
            np.array([d.each for d in ds]),
            np.array([d.limit for d in ds]),
            np.array([d.shard for d in ds]),
        )

    def carries(
        a: tuple[np.ndarray, ...], T: float, budgets: bool = False, floor: float = 0.0
    ) -> np.ndarray:
        """What designs (``arrays``) carry in a step of ``T``, their shards at least ``floor``."""
        first, each, limit, shard = a
        return _carried(T - unit * np.maximum(shard, floor), first, each, limit, budgets)

    # the pipelines a slow device may join: the packing's designs, and of the pool's designs up
    # to twice their size the ``JOIN_PER_COUNT`` per device count that carry the most at that step
    # (a pipeline sized for the slow stage is often not one the full-speed packing wants)
    widest = 2 * max(d.devices for d in designs)
    pool = [
        d
        for d in designer.pool(max(1, -(-microbatches // max(1, replicas_hint))), devices, max_tp)
        if d.devices <= widest
    ]
    carried = carries(arrays(pool), plain.step_s)
    by_count: dict[int, list[tuple[float, int]]] = {}
    for i, d in enumerate(pool):
        by_count.setdefault(d.devices, []).append((-float(carried[i]), i))
    hosts = {(d.tps, d.counts): d for d in designs}
    for ranked in by_count.values():
        for _, i in sorted(ranked)[:JOIN_PER_COUNT]:
            hosts.setdefault((pool[i].tps, pool[i].counts), pool[i])
    full = arrays(designs)
    cost = np.array([d.devices for d in designs], dtype=np.int64)
    # what a full-speed device carries at that step at best: a join is worth what it adds
    per_device = float(np.max(carries(full, plain.step_s) / cost))
    options: dict[int, list[tuple[int, Design]]] = {}
    for r, speed in sorted(slow.items(), key=lambda kv: (-kv[1], kv[0])):
        cands = []
        for d in hosts.values():
            stretch = (1.0 / speed,) + (1.0,) * len(d.tps)
            j = designer.fit_slowed((1,) + d.tps, stretch, m)
            if j is not None:
                adds = float(carries(arrays([j]), plain.step_s)[0]) - d.devices * per_device
                cands.append((adds, d.devices, j, stretch))
        # priced on the schedule's graph: the ones that add most in the closed form
        cands.sort(key=lambda x: -x[0])
        if cands:
            options[r] = [
                (c, designer.priced(j, m, stretch)) for _, c, j, stretch in cands[:JOIN_PRICED]
            ]
    if not options:
        return plain, {}
    k_first = np.array([f for f, _ in kept])
    k_each = np.array([e for _, e in kept])
    joined = {
        r: (np.array([c for c, _ in opts], dtype=np.int64), arrays([j for _, j in opts]))
        for r, opts in options.items()
    }

    def solve(T: float) -> tuple[float, int, list[np.ndarray], np.ndarray, np.ndarray]:
        """The most micro-batches carried in ``T``, the full-speed devices the joined pipelines
        take, each slow device's pick per device count, the full-speed designs' values and
        front."""
        base = float(_carried(T - unit * kept_shard, k_first, k_each, np.inf, token_budgets).sum())
        vals = carries(full, T, token_budgets, kept_shard)
        front = _front(cost, vals)
        best_full = unbounded_knapsack(cost[front], vals[front], devices)
        extra = np.full(devices + 1, -np.inf)
        extra[0] = 0.0
        picks = []
        for c_j, a_j in joined.values():
            v_j = carries(a_j, T, token_budgets, kept_shard)
            new = extra.copy()
            pick = np.full(devices + 1, -1)
            for i, (c, v) in enumerate(zip(c_j.tolist(), v_j.tolist())):
                if v <= 0 or c > devices:
                    continue
                cand = np.full(devices + 1, -np.inf)
                cand[c:] = extra[: devices + 1 - c] + v
                better = cand > new
                new[better] = cand[better]
                pick[better] = i
            extra = new
            picks.append(pick)
        total = extra + best_full[::-1]
        used = int(np.argmax(total))
        return base + float(total[used]), used, picks, vals, front

    lo, hi = 0.0, plain.step_s
    if solve(hi)[0] < microbatches - _EPS:
        return plain, {}
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if solve(mid)[0] >= microbatches - _EPS else (mid, hi)
        if hi - lo <= 1e-5 * hi:
            break
    _, used, picks, vals, front = solve(hi)
    joins: dict[int, Design] = {}
    for (r, (c_j, _)), pick in reversed(list(zip(joined.items(), picks))):
        i = int(pick[used])
        if i >= 0:
            joins[r] = options[r][i][1]
            used -= int(c_j[i])
    counts = [0] * len(designs)
    left = devices - sum(d.devices - 1 for d in joins.values())  # beside the joined pipelines
    for i, k in zip(front, choose(cost[front], vals[front], left)[1]):
        counts[i] = k
    return Packing(tuple(designs), tuple(counts), hi), joins


def _slowed(d: Design, speed: float) -> Design:
    """``d`` on devices of ``speed`` (a fraction of full speed): every time stretched, transfers
    included (so never faster than it is)."""
    if speed >= 1.0:
        return d
    return replace(
        d, mu=d.mu / speed, fixed=d.fixed / speed, first=d.first / speed, each=d.each / speed
    )


def _carried(
    room: np.ndarray | float,
    first: np.ndarray,
    each: np.ndarray,
    limit: np.ndarray | float,
    token_budgets: bool,
) -> np.ndarray:
    """Micro-batches (model budgets' worth) pipelines of step ``first + (m - 1) * each`` carry in
    ``room`` seconds: the most whole ones that fit; with token budgets, that many stretched
    to fill the room (each at least the budget)."""
    room = np.broadcast_to(np.asarray(room, dtype=np.float64), first.shape)
    m = np.where(
        room >= first - _EPS,
        np.minimum(np.floor(np.maximum(room - first, 0.0) / each + _EPS) + 1, limit),
        0.0,
    )
    if not token_budgets:
        return m
    step = first + np.maximum(m - 1, 0) * each
    return np.where(m > 0, m * room / np.where(step > 0, step, 1.0), 0.0)


def _front(cost: np.ndarray, vals: np.ndarray) -> np.ndarray:
    """The designs worth packing: of those with the same or more devices, only the ones that
    carry more."""
    order = np.lexsort((-vals, cost))
    front = vals[order] > np.concatenate([[0.0], np.maximum.accumulate(vals[order])[:-1]])
    return order[front]


def place(
    counts: Iterable[tuple[Design, int]],
    free: Iterable[int],
    node_of: dict[int, int],
) -> list[tuple[Stage, ...]]:
    """Ranks for the pipelines: each TP group inside one node, the widest groups first.

    Each group goes into the node with the fewest free devices that holds it (so whole nodes stay
    whole for wide groups). A pipeline some group of which finds no node is left out.

    Args:
        counts: each design and how many pipelines of it to place.
        free: the ranks free to place them on.
        node_of: each rank's node."""
    nodes: dict[int, list[int]] = {}
    for r in sorted(free):
        nodes.setdefault(node_of[r], []).append(r)
    wanted = [(d, i) for d, k in counts for i in range(k)]
    groups = sorted(
        ((t, j, s) for j, (d, _) in enumerate(wanted) for s, t in enumerate(d.tps)),
        key=lambda g: (-g[0], g[1], g[2]),
    )
    # nodes by how many devices they have free (heaps of node ids; an entry whose node's count
    # has since changed is skipped): the fullest node that fits found in a few steps
    by_free: dict[int, list[int]] = {}
    for n, ranks in nodes.items():
        heapq.heappush(by_free.setdefault(len(ranks), []), n)
    most = max(by_free, default=0)

    def lowest(c: int) -> int | None:
        heap = by_free.get(c, [])
        while heap and len(nodes[heap[0]]) != c:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def moved(n: int) -> None:
        heapq.heappush(by_free.setdefault(len(nodes[n]), []), n)

    def take(n: int, t: int) -> tuple[int, ...]:
        got_ranks = tuple(nodes[n][:t])
        del nodes[n][:t]
        moved(n)
        return got_ranks

    def give(g: tuple[int, ...]) -> None:
        n = node_of[g[0]]
        nodes[n] = sorted(nodes[n] + list(g))
        moved(n)

    got: dict[int, dict[int, tuple[int, ...]]] = {}
    failed: set[int] = set()
    for t, j, s in groups:
        if j in failed:
            continue
        n = next((x for c in range(t, most + 1) if (x := lowest(c)) is not None), None)
        if n is None:
            failed.add(j)
            for g in got.pop(j, {}).values():  # its groups go back
                give(g)
            continue
        got.setdefault(j, {})[s] = take(n, t)
    out = []
    for j, (d, _) in enumerate(wanted):
        if j in failed or j not in got:
            continue
        ranges = layer_ranges(d.counts)
        out.append(Stages(Stage(got[j][s], ranges[s]) for s in range(len(d.tps))))
    return out


def design_plan(
    coster: StageCoster,
    layout: ParallelDims,
    designer: Designer,
    keep: Sequence[Pipeline] = (),
    policy: str = "resihp",
    time_limit_s: float = 0.5,
    first_round: str = "all",
    target_s: float | None = None,
    token_budgets: bool = False,
    slow_stages: bool = True,
) -> Plan | None:
    """``design_plans`` with one variant: its first plan, or None.

    Args:
        coster: prices stages and pipelines on the cluster and model.
        layout: the plan's home layout.
        designer: the designer of ``coster``'s hardware and model.
        keep: whole pipelines of the plan in force, kept as they are.
        policy: the name the plan carries.
        time_limit_s: CP-SAT's time limit per solve, in seconds.
        first_round: as in ``design_plans``.
        target_s: as in ``design_plans``.
        token_budgets: as in ``design_plans``.
        slow_stages: slow devices may join designed pipelines as short stages (else they get
            pipelines of their own only)."""
    plans = design_plans(
        coster,
        layout,
        designer,
        keep,
        policy,
        time_limit_s,
        first_round,
        target_s,
        token_budgets,
        (slow_stages,),
    )
    return plans[0] if plans else None


def design_plans(
    coster: StageCoster,
    layout: ParallelDims,
    designer: Designer,
    keep: Sequence[Pipeline] = (),
    policy: str = "resihp",
    time_limit_s: float = 0.5,
    first_round: str = "all",
    target_s: float | None = None,
    token_budgets: bool = False,
    variants: Sequence[bool] = (True,),
) -> list[Plan]:
    """Plans of designed pipelines on the full-speed live devices ``keep`` does not use.

    One plan per variant; a variant that carries nothing is left out. A variant whose own pipelines
    leave slow devices out gives a second plan, those devices chained into one pipeline split by
    speed (``_slow_chain``), where it could carry a micro-batch. With slow devices and the first
    round ``all``, one more plan: them packed with the designs, each heading a pipeline sized for
    it (``_slow_joined_plan``).

    Args:
        coster: prices stages and pipelines on the cluster and model.
        layout: the plan's home layout (what later re-plans start from); it stays.
        designer: the designer of ``coster``'s hardware and model.
        keep: whole pipelines of the plan in force, kept as they are.
        policy: the name the plans carry.
        time_limit_s: CP-SAT's time limit per solve, in seconds.
        first_round: what the first round of packing designs for: ``all`` free devices, the
            ``whole`` nodes (every device free), or every node's largest power-of-two ``chunks``
            of free devices (the knapsack counts devices, not nodes: where faults broke nodes
            up, the devices beside a chunk hold only narrow groups; which is best depends on how
            they broke).
        target_s: a step to beat (a plan at hand), in seconds: no plan when the designs cannot
            (None: none).
        token_budgets: packed for plans whose replicas share the tokens by speed
            (``resihp.plan.tokens``); the plans returned have whole micro-batches, which the
            caller balances.
        variants: per plan returned (they share the packing of the full-speed devices), whether
            slow devices may join designed pipelines as stages of their own (``_joined_stages``;
            which is better depends on the micro-batches each pipeline carries), else they get
            pipelines of their own only."""
    cluster, model = coster.cluster, coster.model
    used = {r for p in keep for r in p.ranks}
    free = free_devices(cluster, keep)
    node_of = {d.rank: d.node for d in cluster.devices}
    kept_stages = [p.stages for p in keep]
    new: list[tuple[Stage, ...]] = []
    m_ref = max(2, -(-model.microbatches // max(1, layout.dp)))
    first_packing: Packing | None = None
    # rounds, while pipelines find room: the knapsack counts devices, not which node they sit
    # in (power-of-two groups, widest first, always fill whole nodes); a later round designs
    # for the devices left, with groups no wider than the most any node has free
    for rnd in range(ROUNDS):
        pool = first_pool(cluster, free, first_round) if rnd == 0 else free
        widest = max((len(rs) for rs in _per_node(free, node_of).values()), default=0)
        if not pool or widest < 1:
            break
        placed = kept_stages + new
        rates = _rates(coster, placed, m_ref)
        shard = max((coster.largest_shard(s) for s in placed), default=0.0)
        packing = pack(
            designer,
            len(pool),
            model.microbatches,
            rates,
            shard,
            replicas_hint=max(2, layout.dp),
            max_tp=1 << (widest.bit_length() - 1),
            target_s=target_s if rnd == 0 else None,
            token_budgets=token_budgets,
        )
        if packing is None and rnd == 0 and target_s is not None:
            return []
        if packing is None:
            break
        if rnd == 0:
            first_packing = packing
        more = place(zip(packing.designs, packing.counts), pool, node_of)
        new += more
        free -= {r for st in more for g in st for r in g.ranks}
        if not more and pool is free:
            break
    slow = [d.rank for d in cluster.devices if 0 < d.speed < 1.0 and d.rank not in used]
    # each pipeline's micro-batches about what it will carry: the stages' times weigh against
    # the fill and drain a slow stage adds at that count, not at the home layout's
    carried = max(1, -(-model.microbatches // max(1, len(kept_stages) + len(new))))
    # a node's leftovers joined where each shortens its pipeline most, or at the heads only: the
    # greedy's best joins do not always allocate best (1,024 devices, four dead: 0.975 of the
    # bound against 0.970; 16,384, four slow and two dead: 0.987 against 0.991), so both are
    # candidates and the evaluator picks
    options = [
        _with_leftovers(coster, designer, new, free, node_of, carried, before_head=b)
        for b in (True, False)
    ]
    plans = []
    for pipes, joined in itertools.product(
        options[:1] if options[0] == options[1] else options, variants
    ):
        more = (
            _joined_stages(coster, designer, pipes, [(r,) for r in slow], carried)
            if joined and slow
            else list(pipes)
        )
        taken = used | {r for st in more for g in st for r in g.ranks}
        own = _slow_pipelines(
            coster, designer, layout, kept_stages + more, taken, node_of, m_ref, token_budgets
        )
        left = [r for r in slow if r not in taken]
        # where designs stretched to their slowest device leave slow devices out, one pipeline
        # of all of them with the layers split by speed may carry more: both are candidates
        chain = []
        if len(left) - len({r for st in own for g in st for r in g.ranks}) > 1:
            # none carries a micro-batch in the step of the others (at about their share) if one
            # micro-batch running every layer on the fastest of them takes longer
            fastest = max(left, key=lambda r: (cluster.devices[r].speed, -r))
            alone = coster.pipeline_step((Stage((fastest,), (0, model.layers)),), 1)
            if any(coster.pipeline_step(st, carried) > alone for st in pipes or kept_stages):
                chain = _slow_chain(coster, left, carried)
        for extra in [own] + ([chain] if chain else []):
            plan = _allocated(
                coster, layout, keep, kept_stages + more + extra, policy, time_limit_s
            )
            if plan is not None:
                plans.append(plan)
    if slow and first_round == "all":
        # the pipelines packed with the slow devices joining them, not around them
        plan = _slow_joined_plan(
            coster,
            designer,
            layout,
            keep,
            slow,
            m_ref,
            token_budgets,
            policy,
            time_limit_s,
            first_packing,
        )
        if plan is not None:
            plans.append(plan)
    return plans


def _slow_joined_plan(
    coster: StageCoster,
    designer: Designer,
    layout: ParallelDims,
    keep: Sequence[Pipeline],
    slow: Sequence[int],
    m_ref: int,
    token_budgets: bool,
    policy: str,
    time_limit_s: float,
    plain: Packing | None = None,
) -> Plan | None:
    """A plan of pipelines packed with the ``slow`` devices joining them (``slow_packing``) on
    the full-speed devices ``keep`` does not use: each joined pipeline's groups placed first,
    then the others; a node's leftovers join as short stages; slow devices no pipeline took are
    left out. None where no slow device joins one. ``plain``: the packing of those full-speed
    devices without the slow ones, where the caller has it."""
    cluster, model = coster.cluster, coster.model
    free = free_devices(cluster, keep)
    if not free:
        return None
    node_of = {d.rank: d.node for d in cluster.devices}
    widest = max(len(rs) for rs in _per_node(free, node_of).values())
    kept_stages = [p.stages for p in keep]
    got = slow_packing(
        designer,
        len(free),
        {r: cluster.devices[r].speed for r in slow},
        model.microbatches,
        _rates(coster, kept_stages, m_ref),
        max((coster.largest_shard(s) for s in kept_stages), default=0.0),
        max(2, layout.dp),
        1 << (widest.bit_length() - 1),
        token_budgets,
        plain,
    )
    if got is None or not got[1]:
        return None
    packing, joins = got
    new: list[tuple[Stage, ...]] = []
    for r, j in joins.items():
        body = place([(replace(j, tps=j.tps[1:], counts=j.counts[1:]), 1)], free, node_of)
        if not body:
            continue
        ranges = layer_ranges(j.counts)
        new.append(
            Stages(
                (Stage((r,), ranges[0]),)
                + tuple(Stage(g.ranks, ranges[i + 1]) for i, g in enumerate(body[0]))
            )
        )
        free -= {x for g in body[0] for x in g.ranks}
    more = place(zip(packing.designs, packing.counts), free, node_of)
    new += more
    free -= {r for st in more for g in st for r in g.ranks}
    carried = max(1, -(-model.microbatches // max(1, len(kept_stages) + len(new))))
    new = _with_leftovers(coster, designer, new, free, node_of, carried)
    return _allocated(coster, layout, keep, kept_stages + new, policy, time_limit_s)


def free_devices(cluster: ClusterSpec, keep: Sequence[Pipeline] = ()) -> set[int]:
    """The full-speed live devices no pipeline of ``keep`` uses: what ``design_plans`` designs
    for."""
    used = {r for p in keep for r in p.ranks}
    return {d.rank for d in cluster.devices if d.speed >= 1.0 and d.rank not in used}


def first_pool(cluster: ClusterSpec, free: set[int], first_round: str) -> set[int]:
    """The devices ``design_plans``' first round designs for.

    The later rounds, and so the plan, follow from it.

    Args:
        cluster: the cluster (its nodes).
        free: the ranks free for designed pipelines.
        first_round: ``all``, ``whole`` or ``chunks``, as in ``design_plans``."""
    per_node = _per_node(free, {d.rank: d.node for d in cluster.devices})
    if first_round == "whole":
        sizes = {n: len(ranks) for n, ranks in enumerate(cluster.node_ranks)}
        whole = {r for n, rs in per_node.items() if len(rs) == sizes.get(n, -1) for r in rs}
        return whole or free
    if first_round == "chunks":
        # a node that faults broke up counts with its largest power-of-two chunk only: the
        # devices beside it hold only narrow groups, which the next round designs for
        return {
            r for rs in per_node.values() for r in sorted(rs)[: 1 << (len(rs).bit_length() - 1)]
        }
    return free


def _per_node(ranks: Iterable[int], node_of: dict[int, int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in ranks:
        out.setdefault(node_of[r], []).append(r)
    return out


def _allocated(
    coster: StageCoster,
    layout: ParallelDims,
    keep: Sequence[Pipeline],
    stages: list[tuple[Stage, ...]],
    policy: str,
    time_limit_s: float,
) -> Plan | None:
    """The plan of these pipelines (``keep``'s first, with their homes), the micro-batches
    allocated by CP-SAT; None if there are none or they cannot carry the batch."""
    cluster, model = coster.cluster, coster.model
    if not stages:
        return None
    first, each = zip(*_rates(coster, stages, max(2, -(-model.microbatches // len(stages)))))
    caps = [coster.max_microbatches(s) for s in stages]
    try:
        alloc, _, _ = allocate_microbatches(first, each, model.microbatches, time_limit_s, caps)
    except ValueError:
        return None
    homes = [p.home for p in keep] + [None] * (len(stages) - len(keep))
    pipelines = []
    for s, m, home in zip(stages, alloc, homes):
        if m > 0:
            pipelines.append(Pipeline(len(pipelines), s, m, home=home))
    return Plan(len(cluster), layout, pipelines, unplaced(len(cluster), pipelines), policy=policy)


def _rates(
    coster: StageCoster,
    pipelines: Sequence[tuple[Stage, ...]],
    m_ref: int,
) -> list[tuple[float, float]]:
    """Each pipeline's step as ``T(1) + (m - 1) * slope`` on the schedule's graph, the slope
    taken up to ``m_ref`` micro-batches (about what each carries)."""
    return [
        (first, max(0.0, each))
        for first, each in (coster.pipeline_slope(s, m_ref) for s in pipelines)
    ]


def _joined_stages(
    coster: StageCoster,
    designer: Designer,
    designed: list[tuple[Stage, ...]],
    groups: Sequence[tuple[int, ...]],
    m: int,
    again: bool = False,
    before_head: bool = True,
) -> list[tuple[Stage, ...]]:
    """Groups no designed pipeline holds (slow devices, or the full-speed devices a node has left
    beside the groups placed) as one more stage of a designed pipeline, at its head or (with
    ``before_head``) just before its LM head's stage where that shortens it more, each with the
    layers it carries within the pipeline's slowest stage's time, taken off the others (the
    bound's answer for a slow device: it keeps a few layers of a full-speed pipeline). Just
    before the LM head's stage a stage holds two micro-batches in flight, at the head as many as
    the pipeline has stages: a narrow group's memory holds more layers there. The
    fastest groups first, the widest of one speed first, each into the pipeline whose step (at
    ``m`` micro-batches, about what each pipeline carries) it shortens most; one per pipeline,
    or (``again``) more, each re-splitting the pipeline's layers (one group alone often takes a
    layer without lowering the slowest stage's time, two together do); a group that shortens
    none, or whose devices would hold more layers than the largest per-device shard (the
    gradient all-reduce waits for that one), is left out of here."""
    out = list(designed)

    def shape_of(stages: tuple[Stage, ...]) -> tuple:
        return tuple((s.tp, s.n_layers, coster.group_speed(s.ranks)[0]) for s in stages)

    by_shape: dict[tuple, list[int]] = {}  # pipelines of one shape and speeds step alike
    for j, stages in enumerate(out):
        by_shape.setdefault(shape_of(stages), []).append(j)
    before: dict[tuple, float] = {}
    # the gradient all-reduce waits for the largest per-device shard: a joined stage holds no more
    shard = max((coster.largest_shard(stages) for stages in out), default=0.0)
    for g in sorted(groups, key=lambda g: (-coster.group_speed(g)[0], -len(g), g)):
        speed, t = coster.group_speed(g)[0], len(g)
        best: tuple[float, tuple, tuple[Stage, ...]] | None = None
        for shape, free in by_shape.items():
            if not free:
                continue
            stages = out[free[0]]
            tps = tuple(x[0] for x in shape)
            stretch = tuple(1.0 / x[2] for x in shape)
            # at the head (where a slow device's few layers belong), or just before the LM head's
            # stage, where fewer micro-batches in flight leave a narrow group room for more layers
            for at in (0, len(stages) - 1) if before_head and len(stages) > 1 else (0,):
                d = designer.fit_slowed(
                    tps[:at] + (t,) + tps[at:], stretch[:at] + (1.0 / speed,) + stretch[at:], m
                )
                if d is None or d.counts[at] / t > shard:
                    continue
                ranks = [s.ranks for s in stages]
                ranks.insert(at, g)
                new = tuple(Stage(r, lr) for r, lr in zip(ranks, layer_ranges(d.counts)))
                # the stages ahead of it now hold one more micro-batch in flight: it must fit at
                # the most the schedule puts there, whatever the pipeline comes to carry
                if at and not coster.stages_fit(new, max(m, len(new))):
                    continue
                if shape not in before:
                    before[shape] = coster.pipeline_step(stages, m)
                gain = before[shape] / coster.pipeline_step(new, m)
                if gain > 1.0 + _EPS and (best is None or gain > best[0]):
                    best = (gain, shape, new)
        if best is not None:
            _, shape, new = best
            j = by_shape[shape].pop(0)
            out[j] = new
            if again:
                by_shape.setdefault(shape_of(new), []).append(j)
    return out


def _with_leftovers(
    coster: StageCoster,
    designer: Designer,
    new: list[tuple[Stage, ...]],
    free: Iterable[int],
    node_of: dict[int, int],
    m: int,
    before_head: bool = True,
) -> list[tuple[Stage, ...]]:
    """``new`` with the full-speed devices no design took (a node's leftovers beside the groups
    placed) joining its pipelines as short stages of their own (several to one pipeline)."""
    spare = _fragments(free, node_of, designer.tps)
    return (
        _joined_stages(coster, designer, new, spare, m, again=True, before_head=before_head)
        if spare and new
        else new
    )


def _fragments(
    free: Iterable[int],
    node_of: dict[int, int],
    sizes: Sequence[int],
) -> list[tuple[int, ...]]:
    """The devices left free, as groups inside their nodes: each node's widest group of a size in
    ``sizes`` first, then the widest of what is left."""
    out = []
    for ranks in _per_node(free, node_of).values():
        ranks = sorted(ranks)
        while ranks:
            t = max((t for t in sizes if t <= len(ranks)), default=0)
            if not t:
                break
            out.append(tuple(ranks[:t]))
            del ranks[:t]
    return out


def _slow_chain(coster: StageCoster, slow: Sequence[int], m: int) -> list[tuple[Stage, ...]]:
    """One pipeline of the ``slow`` devices, each a stage of its own, slowest first (it holds
    the fewest layers, and the first stage the most micro-batches in flight), its layers split by
    their speeds (CP-SAT, ``solve_pipeline``) for about ``m`` micro-batches; the slowest left
    out while the model does not fit. Empty if no two of them hold it."""
    cluster = coster.cluster
    chain = sorted(slow, key=lambda r: (cluster.devices[r].speed, r))
    while len(chain) > 1:
        sol = solve_pipeline(coster, [(r,) for r in chain], m, time_limit_s=0.5, regroup=False)
        if sol is not None and sol.stages:
            return [tuple(sol.stages)]
        chain = chain[1:]
    return []


def _slow_pipelines(
    coster: StageCoster,
    designer: Designer,
    layout: ParallelDims,
    placed: list[tuple[Stage, ...]],
    used: set[int],
    node_of: dict[int, int],
    m_ref: int,
    token_budgets: bool,
) -> list[tuple[Stage, ...]]:
    """Pipelines of slow live devices beside the ones placed: the ``k`` fastest of them, each
    design priced at the slowest of those ``k`` speeds; the ``k`` whose packing carries the
    batch in the least step, if any of its pipelines carries something."""
    cluster, model = coster.cluster, coster.model
    slow = sorted(
        (d.rank for d in cluster.devices if 0 < d.speed < 1.0 and d.rank not in used),
        key=lambda r: (-cluster.devices[r].speed, r),
    )
    if not slow:
        return []
    rates = _rates(coster, placed, m_ref)
    shard = max((coster.largest_shard(s) for s in placed), default=0.0)
    best: tuple[float, Packing, list[int]] | None = None
    for k in range(1, len(slow) + 1):
        if k < len(slow) and cluster.devices[slow[k]].speed == cluster.devices[slow[k - 1]].speed:
            continue  # the next device is as fast: more devices at the same price
        if not designer.designs(10**6, k) and not designer.designs(1, k):
            continue  # no design fits on so few devices
        pool = slow[:k]
        per_node: dict[int, int] = {}
        for r in pool:
            per_node[node_of[r]] = per_node.get(node_of[r], 0) + 1
        widest = max(per_node.values())
        packing = pack(
            designer,
            k,
            model.microbatches,
            rates,
            shard,
            max(2, layout.dp),
            max_tp=1 << (widest.bit_length() - 1),
            token_budgets=token_budgets,
            speed=cluster.devices[pool[-1]].speed,
        )
        if (
            packing is not None
            and sum(packing.counts)
            and (best is None or packing.step_s < best[0] - _EPS)
        ):
            best = (packing.step_s, packing, pool)
    if best is None:
        return []
    _, packing, pool = best
    return place(zip(packing.designs, packing.counts), pool, node_of)
