"""The CP-SAT solver every model of the planner is solved with (``pipeline_solver``,
``allocation``).

The limit is on CP-SAT's deterministic time: the same search whatever the machine's load, so a
replay with the same seed gives the same plans; wall time only as a backstop. One worker: the
planner runs its solves in its own thread pool.

One presolve iteration (``max_presolve_iterations = 1``, the default 3): on the planner's models (a
pipeline's re-formation and layer split, 80-110 variables; the micro-batch allocation) the presolve
passes were most of each solve's wall time (``log_search_progress``: 3-10 ms per fix-point pass,
repeated, for a search of about 0.001 deterministic seconds). The 283 pipeline solves of the
16,384-GPU replay (``benchmarks/replay.py --speed-only``) took 12.4 s in all with the default
(median 37 ms; 282 proven optimal, one stopped at the time limit after 1.35 s) and 8.2 s with one
iteration (median 27 ms; 283 optimal), the replay's outcomes and all 30 plans of
``benchmarks/planner.py`` the same; on a sample of 58 of those models and 108 allocation models
every objective and status was the same. With none (0) they took 7.2 s, but planner.py's
1024/slow4+dead2 plan reached 0.9591 of its bound instead of 0.9596.
"""

from __future__ import annotations

from ortools.sat.python import cp_model


def deterministic_solver(time_limit_s: float) -> cp_model.CpSolver:
    """A CP-SAT solver limited to ``time_limit_s`` of deterministic time (at least 0.01).

    One worker, one presolve iteration."""
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = max(0.01, time_limit_s)
    solver.parameters.max_time_in_seconds = max(30.0, 20 * time_limit_s)
    solver.parameters.num_workers = 1
    solver.parameters.max_presolve_iterations = 1
    return solver
