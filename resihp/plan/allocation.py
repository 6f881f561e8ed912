"""Micro-batches per data-parallel replica: keep the global batch, finish together.

Replica r with ``m`` micro-batches takes ``T_r(m) = a_r + (m - 1) * b_r`` (1F1B closed form,
``a_r`` = fill plus drain plus one micro-batch, ``b_r`` = slowest stage); ``m = 0`` leaves it idle
(dropped). CP-SAT minimises ``max_r T_r(m_r)`` subject to ``sum_r m_r = M``, hinted with the greedy
allocation (next micro-batch to the replica that would finish it first), which also stands in if
the solver runs out of time before it proves anything better.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from functools import lru_cache
from itertools import accumulate

import numpy as np
from ortools.sat.python import cp_model

from resihp.plan.sat import deterministic_solver

TICKS_PER_S = 1e7


def greedy_allocation(
    first: Sequence[float],
    each: Sequence[float],
    total: int,
    caps: Sequence[int | None] | None = None,
    floor: int = 0,
) -> list[int]:
    """Each micro-batch to the replica that would finish it first, ties to the lower index.

    Optimal for min-max of increasing per-replica times (``each`` must not be negative); replicas
    at their cap take no more; every replica takes at least ``floor`` (a replica that must keep
    training). Raises ValueError when the caps hold fewer than ``total``, or the floors more.

    Handing them out one at a time places the ``total`` smallest (finish time, replica) pairs,
    replica r's finish times being ``first[r]``, ``first[r] + each[r]``, ... up to its cap.
    So they are found at once: the smallest finish time ``v`` with ``total`` pairs at or below
    it; every pair below ``v`` is placed, and the pairs at ``v`` go to the lowest replicas.
    Replicas with the same (first, each, cap) share one sequence: thousands of healthy replicas
    cost as much as one.

    Args:
        first: per replica, its time with one micro-batch.
        each: per replica, the time each further micro-batch adds.
        total: the micro-batches to hand out.
        caps: per replica the most it can hold (None: no limit).
        floor: the least every replica takes.
    """
    caps = caps or [None] * len(first)
    limits = [total if c is None else min(c, total) for c in caps]
    if sum(limits) < total:
        raise ValueError(f"memory holds only {sum(limits)} of {total} micro-batches")
    if floor > 0:
        # the floors placed first; the rest continue each replica's finish times from there
        if floor * len(first) > total or min(limits) < floor:
            raise ValueError(
                f"{total} micro-batches cannot give each of {len(first)} replicas "
                f"{floor} within memory"
            )
        rest = greedy_allocation(
            [a + floor * b for a, b in zip(first, each)],
            each,
            total - floor * len(first),
            [c - floor for c in limits],
        )
        return [floor + m for m in rest]
    if total < 1:
        return [0] * len(first)
    classes: dict[tuple[float, float, int], list[int]] = {}
    for r, limit in enumerate(limits):
        if limit > 0:
            classes.setdefault((first[r], each[r], limit), []).append(r)
    # the same float sums as adding one micro-batch at a time
    finish = {c: np.array(list(accumulate([c[0]] + [c[1]] * (c[2] - 1)))) for c in classes}

    def pairs(v: float, side: str) -> int:
        """(finish time, replica) pairs below ``v`` (side "left") or at or below it ("right")."""
        return sum(
            len(members) * int(np.searchsorted(finish[c], v, side))
            for c, members in classes.items()
        )

    values = np.unique(np.concatenate(list(finish.values())))
    v = values[bisect_left(values, total, key=lambda x: pairs(x, "right"))]
    out = [0] * len(first)
    ties: list[tuple[int, int]] = []
    for c, members in classes.items():
        below = int(np.searchsorted(finish[c], v, "left"))
        at = int(np.searchsorted(finish[c], v, "right")) - below
        for r in members:
            out[r] = below
            if at:
                ties.append((r, at))
    need = total - pairs(v, "left")
    for r, at in sorted(ties):
        out[r] += min(at, need)
        need -= min(at, need)
    return out


def allocate_microbatches(
    first: Sequence[float],
    each: Sequence[float],
    total: int,
    time_limit_s: float = 1.0,
    caps: Sequence[int | None] | None = None,
    floor: int = 0,
) -> tuple[list[int], str, float]:
    """CP-SAT's split of ``total`` micro-batches over replicas: (counts, solver status, gap).

    Replicas with the same (first, each) form one class whose share is spread evenly, so the model
    has one variable pair per class: thousands of healthy replicas cost the same as one.

    Args:
        first: per replica ``r``, T_r(1): its time with one micro-batch.
        each: per replica, the time each further micro-batch adds.
        total: the micro-batches to hand out.
        time_limit_s: the solver's time limit.
        caps: per replica the most it can hold in memory (None: no limit).
        floor: the least every replica takes (none dropped).
    """
    n = len(first)
    if n == 0:
        raise ValueError("no replica to allocate micro-batches to")
    caps = list(caps) if caps is not None else [None] * n
    hint = greedy_allocation(first, each, total, caps, floor)
    tick = lambda s: max(1, int(round(s * TICKS_PER_S)))  # noqa: E731
    classes: dict[tuple[int, int, int], list[int]] = {}
    for r in range(n):
        cap = total if caps[r] is None else min(total, caps[r])
        classes.setdefault((tick(first[r]), tick(each[r]), cap), []).append(r)
    key = tuple(
        (c, len(members), sum(hint[r] for r in members), max(hint[r] for r in members))
        for c, members in classes.items()
    )
    per_class, status, gap = _solve_classes(key, total, floor, time_limit_s)
    if per_class is None:
        return hint, status, gap
    out = [0] * n
    for k, members in zip(per_class, classes.values()):
        for r, m in zip(members, even_shares(k, len(members))):
            out[r] = m
    return out, status, gap


@lru_cache(maxsize=4096)
def _solve_classes(
    classes: tuple[tuple[tuple[int, int, int], int, int, int], ...],
    total: int,
    floor: int,
    time_limit_s: float,
) -> tuple[tuple[int, ...] | None, str, float]:
    """Micro-batches per class of ``classes`` ((first ticks, each ticks, cap), members, hinted
    sum, hinted max), status and gap; None where the solver found nothing (the hint stands).
    Cached: the model is a function of these arguments alone and its search deterministic
    (``deterministic_solver``), and re-plans of a long run meet the same classes again (the
    16,384-GPU replay's 545 allocations are 276 models)."""
    mdl = cp_model.CpModel()
    horizon = max(a + (total - 1) * b for (a, b, _), *_ in classes)
    span = mdl.new_int_var(0, horizon, "span")
    shares = []
    for c, ((a, b, cap), members, hinted_sum, hinted_max) in enumerate(classes):
        k = mdl.new_int_var(0, total, f"k{c}")  # micro-batches of the class
        top = mdl.new_int_var(0, cap, f"top{c}")  # the most any replica of the class gets
        used = mdl.new_bool_var(f"u{c}")
        mdl.add(k <= members * top)
        mdl.add(top <= total * used)
        mdl.add(top >= used)
        if floor > 0:
            mdl.add(k >= members * floor)  # spread evenly: each member gets the floor
        mdl.add(span >= (a - b) * used + b * top)
        mdl.add_hint(k, hinted_sum)
        mdl.add_hint(top, hinted_max)
        mdl.add_hint(used, hinted_max > 0)
        shares.append(k)
    mdl.add(sum(shares) == total)
    mdl.minimize(span)
    solver = deterministic_solver(time_limit_s)
    status = solver.solve(mdl)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, "timeout-greedy", float("nan")
    obj, bound = solver.objective_value, solver.best_objective_bound
    gap = 0.0 if status == cp_model.OPTIMAL or obj <= 0 else (obj - bound) / obj
    return (
        tuple(int(solver.value(k)) for k in shares),
        "optimal" if status == cp_model.OPTIMAL else "feasible",
        gap,
    )


def even_shares(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]
