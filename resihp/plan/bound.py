"""A tight upper bound on the throughput of any plan.

It holds with integral layers per stage, whole devices per tensor-parallel group, every live device
at its current speed.

The bound holds for every plan the planner's evaluator (``timing.evaluate``) can score, whatever its
layout: pipelines of any length, each stage a group of ``t`` devices (``t`` a power of two up to
the largest node that divides the heads) holding at least one whole layer, the last stage also the
LM head, each pipeline ``m >= 1`` micro-batches of at least the model's token budget, model state
and one micro-batch of activations in each device's memory; the step is the slowest pipeline's
critical path plus the gradient all-reduce (``StageCoster.dp_sync_s``).

Why it is an upper bound (the tests check it against exhaustive search on small clusters and
against the planner on random faults):

1. A pipeline with per-micro-batch stage times ``t_s`` (``c_t / speed`` per layer, plus the head)
   and ``x`` micro-batches' worth of tokens (``m`` micro-batches scaled by ``sigma >= 1``) takes at
   least ``(x - 1) * mu + S + comm`` through the schedule, ``mu = max_s t_s``, ``S = sum_s t_s``,
   ``comm`` the activation transfers (1F1B closed form; GPipe is longer). So in a step of ``T``
   it carries at most ``x <= (T - S - comm - sync) / mu + 1`` micro-batches. Not proved for a
   pipeline whose heavier stages come first: stage ``s`` of 1F1B overlaps ``S - 1 - s`` of its
   forwards with the fill, so the step is only at least ``S + comm + (x - 1) t_s - min(x - 1, S - 1
   - s) f_s`` per stage (``tests/test_schedule.py``), up to ``(S - 1) f_mu`` under the closed form
   with the heaviest first. No plan has been found above the bound for it (the exhaustive tests;
   one pipeline of 3-6 devices, every layer split with the heavier stages first, 2-6 micro-batches:
   at most 0.879 of the bound), and at the benchmark's 64 micro-batches moving a layer forward
   gains nothing; pricing it would loosen the bound by up to ``(S - 1) / 3`` micro-batches a
   pipeline.
2. ``mu`` is one of the finitely many stage times ``n * c`` or ``n * c + h``; a pipeline whose
   stages all take at most ``mu`` needs enough groups that their layer capacities at ``mu``
   (``floor(mu / c)``, within memory) cover the ``L`` layers with one of them also holding the
   head: the fewest devices that do so (a small covering DP) is what the pipeline costs at least.
   ``S >= L * c_min + h_min``; ``comm`` counts at least the fewest stages of such a cover.
3. The gradient all-reduce waits for the largest per-device shard, at least ``L / devices`` of a
   pipeline, at the ring cost of at least ``d_min`` replicas (no pipeline carries more than the
   largest ``x`` above, so a plan needs at least ``M / x_max`` of them).
4. Each pipeline design is a knapsack item (cost: devices, value: ``x``); a step ``T`` is feasible
   only if the best packing of the live devices carries the global batch's ``M`` micro-batches.
   Slow devices: a group is as slow as its slowest member, so a pipeline holding slow devices is an
   item with one group at the speed of its slowest device, every other group at full speed (no
   faster than the pipeline); the other slow devices it holds are at least as fast as that one
   (items of speed >= s hold at most the slow devices of speed >= s), and groups made only of
   full-speed devices use only full-speed devices.
   The bound is ``B / T*`` with ``T*`` the least feasible ``T`` (bisection; the knapsack is
   unbounded and solved exactly per residue class with NumPy).
5. What 4. prices at full speed is held to the work its devices can do. A group of ``t`` devices
   limited by speed ``s`` takes ``(f + b) / s`` per layer and micro-batch, so over ``x``
   micro-batches of its ``n`` layers ``x n (f + b) <= s T``, i.e. ``x n t (f + b) <= T`` times the
   sum of its devices' speeds (each ``>= s``). Summed over a pipeline's groups: ``x W <= T`` times
   the sum of its devices' speeds, ``W`` the least full-speed device-seconds of a micro-batch (each
   layer at the group size that takes the fewest, ``t (f + b)``, and the head). A pipeline holding
   ``k`` slow devices, its slowest of speed ``s``, is held to that with the ``k - 1`` fastest other
   slow devices of speed ``>= s`` beside ``s``; each item chooses its ``k`` (a pipeline need not
   hold more slow devices than its slowest). Without it a pipeline made of slow devices was priced
   as if all its groups but one ran at full speed.
   Fill and drain count too: each stage ``i`` (``t_i`` devices at speed ``s_i``, full-speed time
   ``a_i``) has ``(x - 1) a_i / s_i + S <= T`` and ``S >= A = sum a_i``, so ``(x - 1) t_i a_i <=
   t_i s_i (T - A)``; summed, ``x <= 1 + P (T - A) / B`` with ``B = sum t_i a_i`` and ``P`` the
   sum of the pipeline's speeds. ``(T - A) / B`` over the layers placed at each group size is
   linear-fractional, so it is largest at a vertex: every layer at one size, the head at one.
   Each slow pipeline's caps count the fastest other slow devices as its own; summed over the
   slow pipelines, the ``a`` slow devices they hold are distinct, of speeds at most the ``a``
   fastest, which caps their total (with ``x - 1`` summed, at most ``a`` pipelines).
6. 5.'s caps count two more costs of a pipeline holding slow devices. Its slowest group (``t``
   devices limited by speed ``s``, full-speed stage time ``a_g``) adds ``a_g (1/s - 1)`` to ``S``
   beyond ``A``: with ``u = (x - 1) a_g / (s z)`` in ``[0, 1]`` (``z = T - S``; ``u = 1`` when that
   stage is the bottleneck), ``z <= (T - A) K / (K + u (1 - s))`` and ``K B <= z (P' + t s u)``
   (``K = x - 1``, ``P'`` the other groups' speeds), so ``K <= r (P' + t s u) - u (1 - s)`` with
   ``r = (T - A) / B`` at its best vertex: ``x <= 1 + r P - min(1 - s, r s)``, ``P`` the sum of
   its speeds. It costs about a micro-batch: a slow stage lengthens the fill as much as a
   bottleneck stage does. And the all-reduce: the step is also ``sync`` longer, at least
   ``2 (1 - 1/d) w L / D`` for a pipeline of ``D`` devices (``w`` the two-replica all-reduce
   seconds per layer of shard; its largest shard is at least the mean), ``d`` the fewest
   pipelines the step needs, so ``r`` is taken at ``T - sync``. Summed over the slow pipelines
   the caps are ``r(T)`` times the sum of their speeds (as 5.) plus each pipeline's ``1 - min(1
   - s, r' s) - P_lo (r(T) - r')`` (``r'`` at ``T - sync``, ``P_lo = (D - k) + k s`` the least
   its ``k`` slow devices and the rest make), a second table beside the first.
7. The other slow devices a pipeline holds (4.: beside its slowest, at least as fast) sit in
   groups limited by their own speeds. A group lies inside one node, so it holds at most as many
   slow devices as a node has (``per_node``); a pipeline holding ``k`` holds the ``k - 1``
   besides its slowest in at least ``ceil((k - per_node) / per_node)`` groups, and the ``j``-th
   fastest of those groups, of ``t`` devices, is no faster than the ``j``-th fastest slow device
   besides, so it holds at most ``floor(mu / c_t(v_j))`` layers. The rest of its stages hold the
   other layers: at least the covering DP's fewest devices for that many (2.; the DP gives them
   the places nearest the head's stage, where memory holds the most, which no arrangement
   beats). So an item holding ``k`` slow devices costs at least that many plus those groups'
   devices (``_fewest_with_absorbed``). Before, the slow devices it absorbed counted as members
   of full-speed groups, held only by 5.'s speed sums: at 1,024 devices 15 full-speed devices
   and 7 slow ones passed as a 22-device design, where no full-speed design of fewer than 16
   devices holds the model.

8. 1F1B pays the activation transfers in its steady state too, not only in the fill: stage ``s``
   runs ``F_{n+w}`` before ``B_n`` (``w = P - s - 1`` for ``P`` stages), so ``B_n`` on stage ``s``
   waits for ``F_{n+w}`` to cross stages ``s..P-1`` and its backward to come back: ``P - s``
   micro-batches' way through the suffix, at the suffix's stage times plus ``2 (P - 1 - s) p``.
   Chaining such windows (whole pipelines on stage 0, one suffix for the rest) gives, with
   ``nu = (S + comm) / P``:

       step >= S + (x - 1) nu          whenever nu >= mu

   (``tests/test_schedule.py`` checks it against the schedule's graph; where ``nu < mu`` it can
   fail, but 1.'s closed form is then the larger). So a pipeline of ``P`` stages carries at most
   ``x <= 1 + (T' - S) P / (S + comm)`` (``T'``: the step left beside the all-reduce), which
   falls as ``S + comm`` grows at a fixed ``P`` (``comm = (P - 1) q``), so the least ``S + comm``
   of ``P`` stages under ``mu`` on at most ``D`` devices (an exact DP, ``stage_table``) prices
   every pipeline of the item. An item carries the least of 1.'s value and the most of this over
   ``P`` (floored at 1): where ``nu < mu`` the closed form lies below this one (and a pipeline
   left less than ``S + comm`` by the all-reduce's ring share carries at most 1 and that share,
   which ``feasible``'s slack holds, as for 1.).
   Micro-batches of ``sigma`` budgets scale ``S`` and ``comm`` alike, and ``x = sigma m`` then
   falls with ``sigma`` (``S >= q``). Priced lazily, full-speed items only: after a coarse
   bisection, the ``mu`` of the full-speed items within ``CYCLE_WINDOW`` of the most
   micro-batches per device get tables and the bisection runs again from the step found
   infeasible (capping only lengthens the step), at most ``CYCLE_ROUNDS`` times; the other items
   keep 1.'s value, which is no lower. Tables are kept with the items (re-plans of one job share
   them), so a later call may price more designs than a first one: both bounds are valid. At
   1,024 devices the best designs are 54-device TP4 chains of 14 stages whose ``mu`` is 0.150 s
   but whose graph slope is 0.155 s: this took the healthy bound from 915,468 to 910,458 tok/s.

Relaxations (the bound may be above what any plan reaches, never below): groups are not packed
into nodes (beyond 7.'s count of slow devices per group), memory holds one micro-batch in
flight and no embedding, micro-batch counts need not be whole, the all-reduce shard is counted
per pipeline, p2p transfers at the fewest stages, and in the steady state (8.) only for the
full-speed designs nearest the best.
The older ``planner.capacity_bound`` (the best healthy layout with fractional layers, scaled by the
compute that remains) is kept as ``loose`` beside it: it is no upper bound (integrality aside, a
plan that shortens pipelines can pass it by its bubble), which is why this one exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from resihp.plan.cost import AnalyticCost, CostModel, cost_key
from resihp.plan.knapsack import unbounded_knapsack
from resihp.plan.layout import powers_of_two_upto
from resihp.plan.specs import ClusterSpec, ModelSpec, stage_memory_gb
from resihp.plan.timing import StageCoster

_EPS = 1e-9
BIG = 1e30


@dataclass(frozen=True)
class TightBound:
    """The tight bound of a cluster and model: the most tokens/s and shortest step of any plan.

    ``tokens_per_s``: no plan of ``cluster`` and ``model`` predicts more; ``step_s``: no plan's
    step is shorter; ``pipelines``: the fewest pipelines a step that short needs; ``devices``:
    live devices."""

    tokens_per_s: float
    step_s: float
    pipelines: int
    devices: int


@dataclass(frozen=True)
class _Type:
    """A group kind: ``t`` devices limited by a device of ``speed``; ``caps[k]``: the layers its
    memory holds with ``k`` micro-batches in flight (``caps[0]`` unused); ``cap(v)`` for any
    ``v >= 1`` micro-batches' worth of activations."""

    t: int
    c: float  # seconds per layer per micro-batch (fwd + bwd)
    h: float  # LM head seconds per micro-batch
    caps: tuple[int, ...]
    mem: tuple[float, float, float] = (0.0, 0.0, 0.0)  # free GB, state and activations per layer

    def cap(self, in_flight: float) -> int:
        free, state, act = self.mem
        return min(len(self.caps) - 1, int(math.floor(free / (state + in_flight * act) + _EPS)))


def _group_types(
    cluster: ClusterSpec, model: ModelSpec, coster: StageCoster, speed: float
) -> list[_Type]:
    tflops = float(max(d.tflops for d in cluster.devices))
    uniform = len({d.tflops for d in cluster.devices if d.speed > 0}) <= 1
    node = max(len(r) for r in cluster.node_ranks)
    free = max(d.memory_gb for d in cluster.devices) - cluster.memory_reserve_gb
    L = model.layers
    out = []
    for t in powers_of_two_upto(node):
        if model.heads % t:
            continue
        f, b = coster.layer_fb(t, tflops)
        hf, hb = coster.head_fb(t, tflops)
        c, h = (f + b) / speed, (hf + hb) / speed
        if not uniform and speed < 1.0:
            # a group holding a device of this speed is limited by a member whose speed x FLOP
            # rate is at most this speed x the largest rate: its compute takes at least
            # compute / speed, its links' time at least the links' time
            f2, b2 = coster.layer_fb(t, 2.0 * tflops)
            compute = 2.0 * ((f + b) - (f2 + b2))
            c = compute / speed + (f + b - compute)
        state = stage_memory_gb(model, 1, t, 0, False, False)
        act = stage_memory_gb(model, 1, t, 1, False, False) - state
        caps = [0] + [
            min(L, int(math.floor(free / (state + k * act) + _EPS))) for k in range(1, L + 1)
        ]
        if caps[1]:
            out.append(_Type(t, c, h, tuple(caps), (free, state, act)))
    return out


# in-flight floors: a pipeline carrying x micro-batches (x in [f, next f)) is priced with family f
# (its k-th stage from the end holds at least min(f, k) micro-batches' activations); fine steps
# where pipelines carry few (thousands of devices share a global batch)
FAMILIES = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)


def _designs(
    healthy: list[_Type],
    special: list[_Type] | None,
    layers: int,
    family: float,
    cover: dict[float, np.ndarray] | None = None,
) -> list[tuple[float, int, int]]:
    """(mu, fewest devices, fewest stages) of a pipeline whose stages all take at most ``mu``,
    per candidate ``mu``, for pipelines that carry at least ``family`` micro-batches (1F1B: the
    ``k``-th stage from the end holds at least ``min(family, k)`` micro-batches' activations).
    ``special``: the kinds of the one slow group the pipeline holds; None: full-speed groups
    only. Built from the last stage (the LM head) backwards, vectorised over ``mu``. ``cover``,
    if given, receives per ``mu`` the fewest devices of such a pipeline holding each layer count
    ``0..L`` (7.)."""
    L = layers
    kinds = healthy + (special or [])
    mus = np.array(
        sorted(
            {
                v
                for ty in kinds
                for n in range(1, ty.caps[1] + 1)
                for v in (n * ty.c, n * ty.c + ty.h)
            }
        )
    )
    if not len(mus):
        return []
    big = np.iinfo(np.int64).max // 4
    need = np.arange(L + 1)

    def k_of(ty: _Type, k: int, last: bool) -> np.ndarray:
        room = (mus - ty.h) if last else mus
        return np.minimum(ty.cap(min(family, k)), np.floor(room / ty.c + _EPS)).astype(np.int64)

    def step(prev: np.ndarray, ty: _Type, k: int) -> np.ndarray:
        kk = k_of(ty, k, False)
        idx = np.maximum(0, need[None, :] - kk[:, None])
        out = np.take_along_axis(prev, idx, axis=1) + ty.t
        out[kk < 1] = big
        return np.minimum(out, big)

    def first(ty: _Type) -> np.ndarray:
        kk = k_of(ty, 1, True)
        out = np.where(need[None, :] <= kk[:, None], ty.t, big)
        out[kk < 1] = big
        return out

    n_mu = len(mus)
    plain = np.full((n_mu, L + 1), big, dtype=np.int64)
    for ty in healthy:
        plain = np.minimum(plain, first(ty))
    with_special = np.full((n_mu, L + 1), big, dtype=np.int64)
    for ty in special or []:
        with_special = np.minimum(with_special, first(ty))
    target = with_special if special else plain
    best_dev = target[:, L].copy()
    best_all = target.copy()
    stages = np.where(best_dev < big, 1, big)
    for k in range(2, L + 1):
        new_plain = np.full_like(plain, big)
        for ty in healthy:
            new_plain = np.minimum(new_plain, step(plain, ty, k))
        if special:
            new_sp = np.full_like(plain, big)
            for ty in healthy:
                new_sp = np.minimum(new_sp, step(with_special, ty, k))
            for ty in special:
                new_sp = np.minimum(new_sp, step(plain, ty, k))
            with_special = new_sp
        plain = new_plain
        target = with_special if special else plain
        best_dev = np.minimum(best_dev, target[:, L])
        np.minimum(best_all, target, out=best_all)
        stages = np.where((stages >= big) & (target[:, L] < big), k, stages)
        if (target[:, L] >= big).all() and (plain[:, 1:] >= big).all():
            break
    if cover is not None:
        # holding l layers, a pipeline holds any fewer too
        fewest = np.minimum.accumulate(best_all[:, ::-1], axis=1)[:, ::-1]
        for mu, row, d in zip(mus, fewest, best_dev):
            if d < big:
                cover[float(mu)] = np.where(row < big, row, np.inf).astype(np.float64)
    # every mu stays: a design with a larger mu can have a smaller S (fewer, wider stages)
    return [(float(mu), int(d), int(p)) for mu, d, p in zip(mus, best_dev, stages) if d < big]


def _front_by_cost(
    v: np.ndarray, costs: np.ndarray, starts: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Of items sorted by cost (``costs``/``starts`` as ``np.unique`` gives them), the best value
    of each device count of at least ``k``, and of those only the ones beating every cheaper."""
    best = np.maximum.reduceat(v, starts)
    keep = (costs >= k) & (
        best
        > np.concatenate(
            [[-np.inf], np.maximum.accumulate(np.where(costs >= k, best, -np.inf))[:-1]]
        )
    )
    return costs[keep], best[keep]


def _add_item(
    table: np.ndarray, by_k: list[tuple[int, np.ndarray, np.ndarray]], rows: int, cap: int
) -> np.ndarray:
    """``table[D, a]`` (best value of selections of ``D`` devices, ``a`` slow) with one more
    pipeline, optional, of any of ``by_k``'s (slow devices, costs, values)."""
    new = np.full((rows, table.shape[1]), -np.inf)
    new[: len(table)] = table
    for k, ws, vs in by_k:
        for w, v in zip(ws.tolist(), vs.tolist()):
            n = min(len(table), rows - w)
            if n <= 0:
                continue
            dst = new[w : w + n, k : cap + 1]
            np.maximum(dst, table[:n, : cap + 1 - k] + v, out=dst)
    return new


def _fewest_with_absorbed(
    items: tuple[np.ndarray, ...],
    s: float,
    cap: int,
    per_node: int,
    speeds: np.ndarray,
    kinds_at: dict[float, list[_Type]],
    layers: int,
) -> np.ndarray:
    """7.: per slow item (``family_items``' last three arrays: its design's row, and per row its
    ``mu`` and the fewest devices it needs to hold each layer count) and ``k <= cap`` slow devices,
    its slowest of speed ``s``: the fewest devices a
    pipeline of that design holding ``k`` of them needs. The groups holding the other slow
    devices (at least ``ceil((k - per_node) / per_node)`` of them, a group inside one node) each
    hold at most ``floor(mu / c_t(v))`` layers at speed ``v``, the ``j``-th at most the
    ``j``-th fastest other slow speed; the rest of the design holds what they leave (in the
    places nearest the head's, where memory holds the most, so no more devices than the table
    says). Column 0 unused; infinite: no such pipeline."""
    row, mu, cover = items[7], items[8], items[9]
    n = len(mu)
    out = np.full((n, cap + 1), np.inf)
    if not n:
        return out[row]
    others = sorted((float(v) for v in speeds if s <= v < 1.0), reverse=True)[:-1]
    idx = np.arange(layers + 1)[None, :]
    fewest = [cover]  # fewest[j][:, l]: with j groups of other slow devices, l layers
    for j in range(1, cap):
        prev, nxt = fewest[-1], np.full((n, layers + 1), np.inf)
        for ty in kinds_at.get(others[j - 1], []):
            held = np.minimum(ty.caps[1], np.floor(mu / ty.c + _EPS)).astype(np.int64)
            rest = np.maximum(idx - held[:, None], 0)
            np.minimum(nxt, np.take_along_axis(prev, rest, axis=1) + ty.t, out=nxt)
        fewest.append(nxt)
    for k in range(1, cap + 1):
        lo = max(0, -(-(k - per_node) // per_node))
        out[:, k] = np.min([fewest[j][:, layers] for j in range(lo, k)], axis=0)
    return out[row]


SLOW_FAMILIES = (1, 1.5, 2, 3, 4, 8, 16)
# pipelines of up to this many devices: S + comm by exact DP; above, a Lagrangian bound. The 70B
# class's best designs at 1,024-4,096 devices are 20-stage TP4 pipelines of 80-82 devices: at 64
# the Lagrangian priced their S + comm at 1.37 s where 1.98 s is least, a step 3.7% too short
D_EXACT = 192
# 8. is priced lazily: after each bisection, on the ``mu`` of the full-speed designs within this
# share of the most micro-batches per device, at most ``CYCLE_BATCH`` new ones a round
CYCLE_ROUNDS, CYCLE_WINDOW, CYCLE_BATCH, CYCLE_TOLERANCE = 8, 0.01, 4, 1e-4
LAMBDAS = np.concatenate([[0.0], 0.05 * 1.5 ** np.arange(16)])  # device prices, in units of c_min


# knapsack items per (hardware, model, cost model), per speed (None: full speed); they depend on
# nothing else, so re-plans of one job and the benchmark's scenarios build each once
_ITEMS: dict[tuple, dict[object, tuple[np.ndarray, ...]]] = {}


def _cat(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(len(parts[0])))


def tight_bound(
    cluster: ClusterSpec,
    model: ModelSpec,
    cost: CostModel | None = None,
    coster: StageCoster | None = None,
) -> TightBound:
    """The tight capacity bound of ``cluster`` (devices at their current speeds) for ``model``.

    Args:
        cluster: the cluster at its current device speeds.
        model: the model.
        cost: the cost model (default: ``AnalyticCost``), when no ``coster`` is given.
        coster: the stage coster of the healthy cluster (default: one made from ``cost``).
    """
    coster = coster or StageCoster(cluster.healthy(), model, cost or AnalyticCost())
    speeds = np.array([d.speed for d in cluster.devices])
    live = int((speeds > 0).sum())
    n_full = int((speeds >= 1.0).sum())
    slow = sorted({float(s) for s in speeds if 0 < s < 1.0}, reverse=True)
    L = model.layers
    M = model.global_batch_tokens / model.microbatch_tokens
    healthy = _group_types(cluster, model, coster, 1.0)
    if not healthy or not live:
        return TightBound(0.0, np.inf, 0, live)
    c_min = min(ty.c for ty in healthy)
    h_min = min(ty.h for ty in healthy)
    s_min = L * c_min + h_min  # no pipeline's stage times sum to less
    p2p = coster.p2p_s
    sync_unit = coster.sync_s_per_shard_layer(2) / 1.0  # 2 (d - 1) / d = 1 at d = 2
    t_max = max(ty.t for ty in healthy)

    q = 2.0 * p2p  # activation transfers per stage boundary (forward and backward)

    def fixed_parts(mus: np.ndarray, kinds: list[_Type]) -> tuple[np.ndarray, np.ndarray]:
        """Per ``mu``: ``Phi(lam) = min (S + comm + lam * devices)`` over pipelines whose stages
        all take at most ``mu`` (whole layers per stage, one stage with the head; memory with one
        micro-batch in flight), for each ``lam`` of ``LAMBDAS * c_min``: exact by a DP over
        layers, vectorised over ``mu``, ``lam`` and a stage's layer count. A pipeline with
        ``devices <= D`` then has ``S + comm >= Phi(lam) - lam * D`` for every ``lam``."""
        lams = LAMBDAS * c_min
        big = 1e30
        plain = np.full((len(mus), len(lams), L + 1), big)
        plain[:, :, 0] = 0.0
        head = np.full_like(plain, big)  # the head's stage among them
        ks = [
            (
                np.minimum(ty.caps[1], np.floor(mus / ty.c + _EPS)),
                np.minimum(ty.caps[1], np.floor((mus - ty.h) / ty.c + _EPS)),
            )
            for ty in kinds
        ]
        for n_l in range(1, L + 1):
            for ty, (k, kh) in zip(kinds, ks):
                ns = np.arange(1, min(n_l, ty.caps[1]) + 1)
                stage = ns[None, :] * ty.c + q + lams[:, None] * ty.t  # [lam, n]
                ok = (ns[None, :] <= k[:, None])[:, None, :]  # [mu, 1, n]
                ok_h = (ns[None, :] <= kh[:, None])[:, None, :]
                cand = np.where(ok, plain[:, :, n_l - ns] + stage, big).min(axis=2)
                plain[:, :, n_l] = np.minimum(plain[:, :, n_l], cand)
                cand = np.minimum(
                    np.where(ok, head[:, :, n_l - ns] + stage, big).min(axis=2),
                    np.where(ok_h, plain[:, :, n_l - ns] + stage + ty.h, big).min(axis=2),
                )
                head[:, :, n_l] = np.minimum(head[:, :, n_l], cand)
        return head[:, :, L] - q, lams

    def exact_tables(mus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per ``mu``, layer count ``l <= L`` and ``D <= D_EXACT``: the least ``S + comm`` (with
        one ``q`` too many) of stages of full-speed groups, at most ``mu`` each (whole layers,
        memory with one micro-batch in flight), holding ``l`` layers on exactly ``D`` devices;
        without (``plain``) and with (``head``) one of them running the LM head. A DP over layers
        and devices, vectorised over ``mu`` and a stage's layer count."""
        big = 1e30
        Dc = D_EXACT
        plain = np.full((len(mus), L + 1, Dc + 1), big)
        plain[:, 0, 0] = 0.0
        head = np.full_like(plain, big)
        ks = [
            (
                np.minimum(ty.caps[1], np.floor(mus / ty.c + _EPS)),
                np.minimum(ty.caps[1], np.floor((mus - ty.h) / ty.c + _EPS)),
            )
            for ty in healthy
        ]
        for n_l in range(1, L + 1):
            for ty, (k, kh) in zip(healthy, ks):
                if ty.t > Dc:
                    continue
                ns = np.arange(1, min(n_l, ty.caps[1]) + 1)
                stage = (ns * ty.c + q)[None, :, None]
                ok = (ns[None, :] <= k[:, None])[:, :, None]  # [mu, n, 1]
                ok_h = (ns[None, :] <= kh[:, None])[:, :, None]
                width = Dc + 1 - ty.t
                src = plain[:, n_l - ns, :width] + stage  # [mu, n, D]
                cand = np.where(ok, src, big).min(axis=1)
                dst = plain[:, n_l, ty.t :]
                np.minimum(dst, cand, out=dst)
                cand = np.minimum(
                    np.where(ok, head[:, n_l - ns, :width] + stage, big).min(axis=1),
                    np.where(ok_h, src + ty.h, big).min(axis=1),
                )
                dst = head[:, n_l, ty.t :]
                np.minimum(dst, cand, out=dst)
        return plain, head

    def exact_parts(mus: np.ndarray, special: list[_Type] | None) -> np.ndarray:
        """Per ``mu`` and ``D <= D_EXACT``: the least ``S + comm`` of a pipeline of at most ``D``
        devices whose stages all take at most ``mu``; with ``special``, exactly one stage is of
        those kinds: that stage, and the full-speed rest from ``exact_tables`` at the largest
        full-speed stage time not above ``mu`` (the same stages fit under both)."""
        if "exact" not in cache:
            hmus = np.array(
                sorted(
                    {
                        v
                        for ty in healthy
                        for n in range(1, ty.caps[1] + 1)
                        for v in (n * ty.c, n * ty.c + ty.h)
                    }
                )
            )
            cache["exact"] = (hmus, *exact_tables(hmus))
        hmus, plain, head = cache["exact"]
        row = np.searchsorted(hmus, mus + _EPS * np.maximum(mus, 1.0), side="right") - 1
        if special is None:
            return np.minimum.accumulate(head[row, L, :] - q, axis=1)
        big = 1e30
        Dc = D_EXACT
        none_p = np.full((1, L + 1, Dc + 1), big)
        none_p[0, 0, 0] = 0.0
        none_h = np.full((1, L + 1, Dc + 1), big)
        plain_x = np.concatenate([none_p, plain])[row + 1]
        head_x = np.concatenate([none_h, head])[row + 1]
        out = np.full((len(mus), Dc + 1), big)
        for ty in special:
            if ty.t > Dc:
                continue
            k = np.minimum(ty.caps[1], np.floor(mus / ty.c + _EPS))
            kh = np.minimum(ty.caps[1], np.floor((mus - ty.h) / ty.c + _EPS))
            ns = np.arange(1, min(L, ty.caps[1]) + 1)
            stage = (ns * ty.c + q)[None, :, None]
            width = Dc + 1 - ty.t
            rest_h = head_x[:, L - ns, :width] + stage  # the head elsewhere
            rest_p = plain_x[:, L - ns, :width] + stage + ty.h  # the slow stage runs it
            cand = np.minimum(
                np.where((ns[None, :] <= k[:, None])[:, :, None], rest_h, big).min(axis=1),
                np.where((ns[None, :] <= kh[:, None])[:, :, None], rest_p, big).min(axis=1),
            )
            out[:, ty.t :] = np.minimum(out[:, ty.t :], cand)
        return np.minimum.accumulate(out - q, axis=1)

    def stage_table(mu: float) -> np.ndarray:
        """8.: ``[D, P]``: the least ``S + comm`` of full-speed pipelines of at most ``D <=
        D_EXACT`` devices in exactly ``P`` stages, each taking at most ``mu`` (whole layers, one
        stage with the head, memory with one micro-batch in flight); ``BIG``: none. A DP over
        layers, devices and stages, vectorised over the last two and a stage's layer count."""
        Dc = D_EXACT
        plain = np.full((L + 1, Dc + 1, L + 1), BIG)
        plain[0, 0, 0] = 0.0
        head = np.full_like(plain, BIG)
        for n_l in range(1, L + 1):
            for ty in healthy:
                k = min(ty.caps[1], n_l, int(math.floor(mu / ty.c + _EPS)))
                kh = min(ty.caps[1], n_l, int(math.floor((mu - ty.h) / ty.c + _EPS)))
                if ty.t > Dc or max(k, kh) < 1:
                    continue
                ns = np.arange(1, max(k, kh) + 1)
                stage = (ns * ty.c + q)[:, None, None]
                width = Dc + 1 - ty.t
                src = plain[n_l - ns, :width, :L] + stage  # [n, D, P]
                if k >= 1:
                    dst = plain[n_l, ty.t :, 1:]
                    np.minimum(dst, src[:k].min(axis=0), out=dst)
                cand = (
                    (head[n_l - ns[:k], :width, :L] + stage[:k]).min(axis=0)
                    if k >= 1
                    else np.full((width, L), BIG)
                )
                if kh >= 1:
                    cand = np.minimum(cand, src[:kh].min(axis=0) + ty.h)
                dst = head[n_l, ty.t :, 1:]
                np.minimum(dst, cand, out=dst)
        return np.minimum.accumulate(np.minimum(head[L] - q, BIG), axis=0)

    def items(
        rows: list[tuple[float, int, int]],
        phi: dict[float, np.ndarray],
        lams: np.ndarray,
        exact: dict[float, np.ndarray],
        family: float,
        top: float,
    ) -> tuple[np.ndarray, ...]:
        """Per design and device count ``D`` in a geometric grid from its fewest devices: cost
        ``D``, mu, the fixed part of the step and the all-reduce shard ``L / (D_next - 1)`` of
        every pipeline of this design with ``D <= devices < D_next`` (whole devices: at most
        ``D_next - 1`` of them share its ``L`` layers), and that most, ``D_next - 1``."""
        cost_, mu_, fixed_, shard_, most_ = [], [], [], [], []
        for mu, dev_n, _stages in rows:
            grid = [dev_n]
            while grid[-1] < L * t_max:
                step = 1 if grid[-1] < D_EXACT else max(1, int(grid[-1] * 0.1))
                grid.append(min(L * t_max, grid[-1] + step))
            nxt = np.array(grid[1:] + [np.inf], dtype=np.float64)
            cost_.append(np.array(grid, dtype=np.float64))
            mu_.append(np.full(len(grid), mu))
            bound = phi[mu][None, :] - lams[None, :] * np.where(np.isfinite(nxt), nxt, 0.0)[:, None]
            bound[~np.isfinite(nxt)] = phi[mu][0]  # unbounded devices: lam = 0
            fixed = np.maximum(bound.max(axis=1), s_min)
            small = np.isfinite(nxt) & (nxt - 1 <= D_EXACT)
            idx = np.where(small, nxt - 1, 0).astype(np.int64)
            fixed_.append(np.where(small, np.maximum(fixed, exact[mu][idx]), fixed))
            shard_.append(np.where(np.isfinite(nxt), L / (nxt - 1), 1.0 / t_max))
            most_.append(nxt - 1)
        if not cost_:
            return tuple(np.zeros(0) for _ in range(7))
        cost_, mu_, fixed_, shard_, most_ = (
            np.concatenate(x) for x in (cost_, mu_, fixed_, shard_, most_)
        )
        return (
            cost_,
            mu_,
            fixed_,
            shard_,
            np.full(len(cost_), float(family)),
            np.full(len(cost_), top),
            most_,
        )

    def family_items(special: list[_Type] | None, families: tuple[float, ...]):
        """The items of ``_designs``' rows; with ``special`` also (7.) per item its design's
        row, and per row its ``mu`` and the fewest devices it needs to hold each layer count."""
        tops = list(families[1:]) + [np.inf]
        kinds = healthy + (special or [])
        covers: dict[float, dict[float, np.ndarray]] = {f: {} for f in families}
        rows = {
            f: _designs(healthy, special, L, f, covers[f] if special else None) for f in families
        }
        mus = np.array(sorted({r[0] for rs in rows.values() for r in rs}))
        if not len(mus):
            return tuple(np.zeros(0) for _ in range(7)) + (
                (np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros((0, L + 1))) if special else ()
            )
        table, lams = fixed_parts(mus, kinds)
        phi = dict(zip(mus.tolist(), table))
        exact = dict(zip(mus.tolist(), exact_parts(mus, special)))
        # a family whose design has as few devices as the previous one's adds nothing: widen the
        # previous one's range instead
        merged: dict[float, list[tuple[int, int, float]]] = {}  # mu -> [(devices, family, top)]
        for f, top in zip(families, tops):
            for mu, dev_n, _p in rows[f]:
                ranges = merged.setdefault(mu, [])
                if ranges and ranges[-1][0] == dev_n and ranges[-1][2] == f:
                    ranges[-1] = (dev_n, ranges[-1][1], top)
                else:
                    ranges.append((dev_n, f, top))
        parts, row_mu, row_cover = [], [], []
        for mu, ranges in merged.items():
            for dev_n, f, top in ranges:
                part = items([(mu, dev_n, 0)], phi, lams, exact, f, top)
                if special:
                    part = part + (np.full(len(part[0]), len(row_mu), dtype=np.int64),)
                    row_mu.append(mu)
                    row_cover.append(covers[f][mu])
                parts.append(part)
        if not special:
            return _cat(parts)
        return _cat(parts) + (np.array(row_mu), np.array(row_cover))

    key = (cluster.hardware_key, model, cost_key(coster.cost))
    if key not in _ITEMS:
        if len(_ITEMS) > 64:
            _ITEMS.clear()
        _ITEMS[key] = {}
    cache = _ITEMS[key]
    if None not in cache:
        cache[None] = family_items(None, FAMILIES)
    full = cache[None]
    per_slow = {}
    for s in slow:
        special = _group_types(cluster, model, coster, s)
        if special:
            if s not in cache:
                cache[s] = family_items(special, SLOW_FAMILIES)
            per_slow[s] = cache[s]
    slow_counts = {s: int((speeds == s).sum()) for s in slow}
    n_slow = sum(slow_counts.values())
    at_least = {s: int(((speeds >= s) & (speeds < 1.0)).sum()) for s in slow}
    # 5.: the full-speed device-seconds a micro-batch needs (every layer at the group size that
    # takes the fewest, and the head), and per speed s the most that k slow devices of speed >= s
    # do in a second, one of them of speed s (``held[s][k]``)
    work = L * min(ty.t * ty.c for ty in healthy) + min(ty.t * ty.h for ty in healthy)
    # every layer at one group size and the head at one (the vertices of 5.'s fractional
    # program): full-speed stage seconds ``A`` and device-seconds ``B`` of a micro-batch
    a_b = np.array(
        [(L * ty.c + th.h, L * ty.t * ty.c + th.t * th.h) for ty in healthy for th in healthy]
    )
    held = {}
    for s in slow:
        faster = sorted((float(v) for v in speeds if s <= v < 1.0), reverse=True)[:-1]
        held[s] = np.concatenate([[0.0], s + np.concatenate([[0.0], np.cumsum(faster)])])
    fastest = np.concatenate(
        [[0.0], np.cumsum(sorted((float(v) for v in speeds if 0 < v < 1.0), reverse=True))]
    )
    all_items = [full] + list(per_slow.values())
    # 7.: a TP group sits inside one node, so it holds at most this many slow devices
    per_node = max(
        [1] + [sum(1 for r in ranks if 0 < speeds[r] < 1.0) for ranks in cluster.node_ranks]
    )
    kinds_at = {s: _group_types(cluster, model, coster, s) for s in slow}
    need = {
        s: _fewest_with_absorbed(it, s, at_least[s], per_node, speeds, kinds_at, L)
        for s, it in per_slow.items()
    }

    # 8.: per ``mu`` whose items are held to their cycles, the least ``S + comm`` by devices and
    # stages (``stage_table``); kept with the items, as re-plans of one job share them
    tables: dict[float, np.ndarray] = cache.setdefault("stages", {})
    one_f_one_b = model.schedule == "1f1b"
    stage_counts = np.arange(1, L + 1, dtype=np.float64)
    capped: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}  # per item set: its rows held to 8.

    def carries(it: tuple[np.ndarray, ...], T: float, sync: float) -> np.ndarray:
        """The most micro-batches each item's pipelines carry in a step of ``T`` when the
        all-reduce costs ``sync`` per unit of shard: the closed form (1.), and for the items of
        the ``mu`` in ``tables`` their cycles (8.), over their stage counts ``P``:
        ``1 + (T' - S) P / (S + comm)``, ``S + comm`` at least the table's for ``P``."""
        cost_, mu_, fixed_, shard_ = it[:4]
        x = (T - fixed_ - sync * shard_) / mu_ + 1.0
        if not (one_f_one_b and tables and len(cost_)):
            return x
        got = capped.get(id(it))
        if got is None or got[0] != len(tables):
            rows = np.flatnonzero(np.isin(mu_, list(tables)) & (it[6] <= D_EXACT))
            by_p = np.array(
                [tables[float(m)][int(d), 1:] for m, d in zip(mu_[rows], it[6][rows])]
            ).reshape(len(rows), L)
            by_p = np.maximum(by_p, fixed_[rows, None])
            by_p = np.maximum(by_p, s_min + (stage_counts[None, :] - 1) * q)
            capped[id(it)] = got = (len(tables), rows, by_p)
        _, rows, by_p = got
        if len(rows):
            room = T - sync * shard_[rows]
            s = by_p - (stage_counts[None, :] - 1) * q
            cyc = 1.0 + ((room[:, None] - s) * stage_counts[None, :] / by_p).max(axis=1)
            x[rows] = np.minimum(x[rows], np.maximum(cyc, 1.0))
        return x

    def rate(T: float | np.ndarray) -> float | np.ndarray:
        """5.'s ``(T - A) / B`` at its best vertex: micro-batches a unit of speed adds."""
        out = np.max((np.asarray(T, dtype=np.float64)[..., None] - a_b[:, 0]) / a_b[:, 1], axis=-1)
        return float(out) if np.ndim(out) == 0 else out

    def x_max(T: float, sync: float) -> float:
        """The most micro-batches one pipeline of at most ``live`` devices carries."""
        best = 0.0
        for it in all_items:
            ok = it[0] <= live
            if ok.any():
                best = max(
                    best, float(np.max((T - it[2][ok] - sync * it[3][ok]) / it[1][ok]) + 1.0)
                )
        return best

    def feasible(T: float) -> tuple[bool, int]:
        """Whether some plan could carry the ``M`` micro-batches in a step of ``T``, and the
        fewest pipelines that needs. A plan of ``d`` pipelines waits for a ring all-reduce of
        ``2 (1 - 1/d)`` per shard unit: pipeline ``r`` carries at most
        ``(T - a_r - 2 u s_r) / mu_r + 1 + (2 u s_r / mu_r) / d``, so all of them at most the
        knapsack of the first terms plus the largest ``2 u s / mu`` (the last terms' mean)."""
        sync = 2.0 * sync_unit
        extra = 0.0
        for it in all_items:
            ok = it[0] <= live
            if ok.any():
                extra = max(extra, float(np.max(sync * it[3][ok] / it[1][ok])))
        most = x_max(T, 0.0)
        fewest = max(1, math.ceil(M / most - _EPS)) if most > 0 else 0
        ring = 2.0 * (1.0 - 1.0 / max(1, fewest))
        return carried(T, sync, extra, ring) + extra >= M - _EPS, fewest

    def front(cost_: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The items worth having: of items with the same or more devices only those carrying
        more are kept."""
        order = np.lexsort((-x, cost_))
        cost_, x = cost_[order], x[order]
        keep = x > np.concatenate([[-np.inf], np.maximum.accumulate(x)[:-1]])
        return cost_[keep], x[keep]

    def carried(T: float, sync: float, slack: float, ring: float) -> float:
        """The most micro-batches the live devices carry in a step of ``T`` when the gradient
        all-reduce costs ``sync`` per unit of shard (layers per device); ``ring``: the ring
        factor ``2 (1 - 1/d)`` of the fewest pipelines ``d`` a plan needs (6.)."""

        def value(it: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            """Costs, values and the step left beside each item's fixed part (``T - fixed``) of
            the items a pipeline could be at this ``T``: one that cannot finish a micro-batch
            carries nothing."""
            cost_, mu_, fixed_, shard_, fam_, top_ = it[:6]
            x = carries(it, T, sync)
            keep = (x + slack >= fam_) & (x > 0)
            x = np.minimum(x, top_)
            return cost_[keep].astype(np.int64), x[keep], (T - fixed_)[keep], shard_[keep], keep

        best_full = unbounded_knapsack(*front(*value(full)[:2]), n_full)
        # slow pipelines, by speed from the fastest: each is an item with one group limited by
        # its slowest device (so at most as many of speed s as there are devices of speed s);
        # its other devices are full-speed or slow ones at least as fast, which it absorbs:
        # extra[D, a] = their best value using D devices of which a are slow. Items of speed
        # >= s absorb at most ``at_least[s]`` slow devices (those of speed >= s); taking as many
        # as that allows is best, as only the count of full-speed devices left matters
        extra = np.full((1, n_slow + 1), -np.inf)
        extra[0, 0] = 0.0
        fill = extra.copy()  # 6.: the same selections valued by what the global cap leaves out
        per_speed = rate(T)
        for s, it in per_slow.items():
            cost0, val, rest, shard, keep = value(it)
            if not len(cost0):
                continue
            cap = at_least[s]
            needs = need[s][keep]
            # 6.: the speed rate left beside the all-reduce of its smallest shard, and what its
            # slowest group's own stage time costs
            synced = rate(T - ring * sync_unit * shard)
            pen = np.minimum(1.0 - s, synced * s)
            by_k, by_k_fill = [], []
            most = 0
            for k in range(1, cap + 1):
                # it holds k >= 1 slow devices, its slowest of speed s among them; each one more
                # caps what it carries (5.), and the groups holding them hold fewer layers (7.):
                # its design needs at least needs[:, k] devices. Dominated items are dropped
                # once capped (and those of fewer than k devices, which cannot hold k slow ones)
                ok = np.isfinite(needs[:, k])
                cost_ = np.maximum(cost0[ok], needs[ok, k]).astype(np.int64)
                order = np.argsort(cost_, kind="stable")
                cost_ = cost_[order]
                v, r, syn, pn = val[ok][order], rest[ok][order], synced[ok][order], pen[ok][order]
                if not len(cost_):
                    continue
                most = max(most, int(cost_.max()))
                costs, starts = np.unique(cost_, return_index=True)
                speed_sum = np.maximum(cost_ - k, 0) + held[s][k]
                vk = np.minimum(v, np.minimum(T, r + work / speed_sum) * speed_sum / work)
                vk = np.minimum(vk, 1.0 + speed_sum * syn - pn)
                by_k.append((k, *_front_by_cost(vk, costs, starts, k)))
                # its speeds are at least (D - k) + k s
                wk = 1.0 - pn - (np.maximum(cost_ - k, 0) + k * s) * (per_speed - syn)
                by_k_fill.append((k, *_front_by_cost(wk, costs, starts, k)))
            if not by_k:
                continue
            for _ in range(slow_counts[s]):
                rows = min(live + 1, len(extra) + most)
                extra = _add_item(extra, by_k, rows, cap)
                fill = _add_item(fill, by_k_fill, rows, cap)
        # a table's cells hold selections of exactly D devices; one of fewer leaves devices
        # idle, which the tables' dominance filters assume (at least as good with more devices)
        extra = np.maximum.accumulate(extra, axis=0)
        fill = np.maximum.accumulate(fill, axis=0)
        # the caps above, summed over the slow pipelines, count a slow device in every pipeline
        # that absorbs it: the a absorbed are a distinct a, of speeds at most the a fastest
        used = np.arange(len(extra))[:, None]
        absorbed = np.arange(n_slow + 1)[None, :]
        speed_sum = np.maximum(used - absorbed, 0) + fastest[None, :]
        extra = np.minimum(extra, np.minimum(fill + speed_sum * per_speed, T * speed_sum / work))
        # full-speed devices left for pipelines of full-speed groups
        full_used = used - np.arange(n_slow + 1)[None, :]
        ok = (full_used <= n_full) & np.isfinite(extra)
        left = np.clip(n_full - full_used, 0, n_full)
        total = np.where(ok, extra + best_full[left], -np.inf)
        return float(np.max(total))

    # bisection on T for the least step that carries M micro-batches. No step is shorter than
    # one micro-batch's way through the cheapest pipeline (s_min); the bound is taken at the
    # longest step found infeasible, so the bisection's tolerance can only raise it
    def least(test, lo: float, tolerance: float) -> tuple[float, float] | None:
        """The longest step found infeasible and the shortest found feasible (bisection up
        from ``lo``, infeasible); None if none is."""
        hi = lo * (1.0 + 1e-3)
        while not test(hi):
            lo, hi = hi, hi + 2.0 * (hi - lo)
            if hi > 1e12:
                return None
        for _ in range(80):
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if test(mid) else (mid, hi)
            if hi - lo <= tolerance * hi:
                break
        return lo, hi

    def hold_to_cycles(T: float) -> bool:
        """8. on the full-speed designs carrying the most per device at ``T`` (the rest stay
        at 1.'s value, which is no lower): whether any was not yet."""
        x = carries(full, T, 2.0 * sync_unit)
        ok = (full[6] <= D_EXACT) & (x > 0)
        if not one_f_one_b or not ok.any():
            return False
        per = np.where(ok, x / full[0], -np.inf)
        near = np.flatnonzero(per >= (1.0 - CYCLE_WINDOW) * per.max())
        new = [float(m) for m in full[1][near[np.argsort(-per[near])]] if float(m) not in tables]
        for m in list(dict.fromkeys(new))[:CYCLE_BATCH]:
            tables[m] = stage_table(m)
        return bool(new)

    lo = max(s_min, 1e-9)
    if feasible(lo)[0]:
        return TightBound(model.global_batch_tokens / lo, lo, feasible(lo)[1], live)
    # the least step, coarsely while 8. prices the designs best at it (capping only lengthens
    # the step, so a step found infeasible stays so), then to the full tolerance
    hi, tolerance = lo, CYCLE_TOLERANCE if one_f_one_b else 1e-9
    for round_ in range(CYCLE_ROUNDS + 1):
        got = least(lambda T: feasible(T)[0], lo, tolerance)
        if got is None:
            return TightBound(0.0, np.inf, 0, live)
        lo, hi = got
        if tolerance == 1e-9:
            break
        if round_ == CYCLE_ROUNDS or not hold_to_cycles(lo):
            tolerance = 1e-9
    return TightBound(model.global_batch_tokens / lo, lo, feasible(hi)[1], live)
