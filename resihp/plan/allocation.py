"""Micro-batches per data-parallel replica: keep the global batch, finish together.

Replica r with ``m`` micro-batches takes ``T_r(m) = a_r + (m - 1) * b_r`` (1F1B closed form,
``a_r`` = fill plus drain plus one micro-batch, ``b_r`` = slowest stage); ``m = 0`` leaves it idle
(dropped). CP-SAT minimises ``max_r T_r(m_r)`` subject to ``sum_r m_r = M``, hinted with the greedy
allocation (next micro-batch to the replica that would finish it first), which also stands in if
the solver runs out of time before it proves anything better.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from ortools.sat.python import cp_model

TICKS_PER_S = 1e7


def greedy_allocation(first: Sequence[float], each: Sequence[float], total: int) -> list[int]:
    m = [0] * len(first)
    heap = [(first[r], r) for r in range(len(first))]
    heapq.heapify(heap)
    for _ in range(total):
        finish, r = heapq.heappop(heap)
        m[r] += 1
        heapq.heappush(heap, (finish + each[r], r))
    return m


def allocate_microbatches(first: Sequence[float], each: Sequence[float], total: int,
                          time_limit_s: float = 1.0) -> tuple[list[int], str, float]:
    """(micro-batches per replica, solver status, relative gap). ``first[r]`` is T_r(1),
    ``each[r]`` the time each further micro-batch adds."""
    n = len(first)
    if n == 0:
        raise ValueError("no replica to allocate micro-batches to")
    hint = greedy_allocation(first, each, total)
    mdl = cp_model.CpModel()
    tick = lambda s: max(1, int(round(s * TICKS_PER_S)))  # noqa: E731
    horizon = max(tick(first[r]) + (total - 1) * tick(each[r]) for r in range(n))
    span = mdl.new_int_var(0, horizon, "span")
    ms = []
    for r in range(n):
        m = mdl.new_int_var(0, total, f"m{r}")
        used = mdl.new_bool_var(f"u{r}")
        mdl.add(m <= total * used)
        mdl.add(m >= used)
        mdl.add(span >= (tick(first[r]) - tick(each[r])) * used + tick(each[r]) * m)
        mdl.add_hint(m, hint[r])
        mdl.add_hint(used, hint[r] > 0)
        ms.append(m)
    mdl.add(sum(ms) == total)
    mdl.minimize(span)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
    solver.parameters.num_workers = 1
    status = solver.solve(mdl)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return hint, "timeout-greedy", float("nan")
    obj, bound = solver.objective_value, solver.best_objective_bound
    gap = 0.0 if status == cp_model.OPTIMAL or obj <= 0 else (obj - bound) / obj
    return ([solver.value(m) for m in ms], "optimal" if status == cp_model.OPTIMAL else "feasible",
            gap)
