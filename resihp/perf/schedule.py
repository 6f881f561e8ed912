"""Pipeline schedules as data, and the time of a step through them.

A schedule is, per pipeline rank, the ordered list of operations it runs: (phase, model chunk,
micro-batch). Model chunk ``g = c * stages + s`` is chunk ``c`` of rank ``s`` (interleaved schedules
have ``chunks > 1``). Each operation waits for the previous operation on its rank and for its data
dependency: forward of chunk g-1 (activations) or backward of chunk g+1 (gradients), plus a
point-to-point transfer time.

``compile_schedule`` turns this into index arrays grouped by dependency level once; evaluating a
step is then a loop over levels (a few times the number of micro-batches) of numpy operations
vectorised over the nodes of a level and over any leading batch dimensions (replicas, steps,
Monte-Carlo draws): no Python per node.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from resihp.errors import InputError
from resihp.parallel import MODELLED_SCHEDULES

FWD, BWD = 0, 1


@dataclass(frozen=True)
class Op:
    phase: int  # FWD or BWD
    chunk: int  # global model chunk g
    mb: int


def rank_order(name: str, stages: int, microbatches: int, chunks: int, s: int) -> list[Op]:
    """The ordered operations pipeline rank ``s`` runs in one step of schedule ``name``.

    Args:
        name: the schedule (``gpipe``, ``1f1b`` or ``interleaved``).
        stages: pipeline ranks.
        microbatches: micro-batches a step.
        chunks: model chunks per rank (interleaved 1F1B; 1 otherwise).
        s: the pipeline rank.
    """
    p, m, v = stages, microbatches, chunks
    if name == "gpipe":
        return [Op(FWD, s, j) for j in range(m)] + [Op(BWD, s, j) for j in range(m)]
    if name == "1f1b":
        warm = min(p - s - 1, m)
        ops = [Op(FWD, s, j) for j in range(warm)]
        for j in range(m - warm):
            ops += [Op(FWD, s, warm + j), Op(BWD, s, j)]
        return ops + [Op(BWD, s, j) for j in range(m - warm, m)]

    # Megatron's interleaved 1F1B: micro-batches in groups of p, each group through every chunk
    def fwd_op(k: int) -> Op:
        c = (k // p) % v
        return Op(FWD, c * p + s, (k // (p * v)) * p + k % p)

    def bwd_op(k: int) -> Op:
        c = v - 1 - (k // p) % v
        return Op(BWD, c * p + s, (k // (p * v)) * p + k % p)

    total = m * v
    warm = min((p - s - 1) * 2 + (v - 1) * p, total)
    ops = [fwd_op(k) for k in range(warm)]
    for k in range(total - warm):
        ops += [fwd_op(warm + k), bwd_op(k)]
    return ops + [bwd_op(k) for k in range(total - warm, total)]


@dataclass(frozen=True)
class CompiledSchedule:
    name: str
    stages: int
    microbatches: int
    chunks: int
    phase: np.ndarray  # [N] FWD/BWD
    chunk: np.ndarray  # [N] global model chunk
    mb: np.ndarray  # [N]
    rank: np.ndarray  # [N] pipeline rank that runs the op
    prev_same: np.ndarray  # [N] previous op on the same rank, or N (a sentinel that ended at 0)
    prev_dep: np.ndarray  # [N] data dependency, or N
    dep_is_p2p: np.ndarray  # [N] the dependency crosses ranks (pays a transfer)
    levels: tuple[np.ndarray, ...]  # node ids grouped so each level only depends on earlier ones
    last_on_rank: np.ndarray  # [stages] id of the last op of each rank

    @property
    def nodes(self) -> int:
        return len(self.phase)


@lru_cache(maxsize=256)
def compile_schedule(
    name: str, stages: int, microbatches: int, chunks: int = 1
) -> CompiledSchedule:
    """Schedule ``name`` compiled to the arrays the vectorised step-time functions walk.

    Args:
        name: the schedule (one of ``MODELLED_SCHEDULES``).
        stages: pipeline ranks.
        microbatches: micro-batches a step.
        chunks: model chunks per rank (interleaved 1F1B).
    """
    if name not in MODELLED_SCHEDULES:
        raise InputError(
            f"pipeline schedule must be one of {', '.join(MODELLED_SCHEDULES)}, got {name!r}"
        )
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise InputError(
            f"stages, micro-batches and chunks must be positive, got {stages}, "
            f"{microbatches}, {chunks}"
        )
    if name == "interleaved":
        if microbatches % stages:
            raise InputError(
                f"interleaved schedule needs micro-batches ({microbatches}) divisible "
                f"by pipeline stages ({stages})"
            )
    elif chunks != 1:
        raise InputError(f"schedule {name!r} has one model chunk per rank, got chunks={chunks}")
    p, v = stages, chunks
    orders = [rank_order(name, p, microbatches, v, s) for s in range(p)]
    ops = [op for order in orders for op in order]
    index = {op: i for i, op in enumerate(ops)}
    n = len(ops)
    rank = np.array([s for s, order in enumerate(orders) for _ in order], dtype=np.int64)
    prev_same = np.full(n, n, dtype=np.int64)
    prev_dep = np.full(n, n, dtype=np.int64)
    last_chunk = p * v - 1
    for i, op in enumerate(ops):
        if i > 0 and rank[i - 1] == rank[i]:
            prev_same[i] = i - 1
        if op.phase == FWD and op.chunk > 0:
            prev_dep[i] = index[Op(FWD, op.chunk - 1, op.mb)]
        elif op.phase == BWD:
            prev_dep[i] = index[
                Op(FWD, op.chunk, op.mb) if op.chunk == last_chunk else Op(BWD, op.chunk + 1, op.mb)
            ]
    dep_is_p2p = (prev_dep < n) & (rank[np.minimum(prev_dep, n - 1)] != rank)
    # level = longest chain of predecessors; ops are listed rank by rank, so iterate to a fixpoint
    level = np.zeros(n + 1, dtype=np.int64)
    for _ in range(n + 1):
        new = np.maximum(level[prev_same], level[prev_dep]) + 1
        new = np.where((prev_same == n) & (prev_dep == n), 0, new)
        if np.array_equal(new, level[:n]):
            break
        level[:n] = new
    else:
        raise AssertionError(f"schedule {name} has a dependency cycle")
    order = np.argsort(level[:n], kind="stable")
    bounds = np.flatnonzero(np.diff(level[:n][order])) + 1
    last_on_rank = np.array([max(i for i in range(n) if rank[i] == s) for s in range(p)])
    return CompiledSchedule(
        name,
        p,
        microbatches,
        v,
        np.array([op.phase for op in ops]),
        np.array([op.chunk for op in ops]),
        np.array([op.mb for op in ops]),
        rank,
        prev_same,
        prev_dep,
        dep_is_p2p,
        tuple(np.split(order, bounds)),
        last_on_rank,
    )


def node_durations(sched: CompiledSchedule, fwd: np.ndarray, bwd: np.ndarray) -> np.ndarray:
    """Each op's duration, [..., nodes] in ``sched``'s node order.

    Args:
        sched: the compiled schedule.
        fwd: forward seconds, [..., model chunks, micro-batches].
        bwd: backward seconds, the same shape.
    """
    shape = (sched.stages * sched.chunks, sched.microbatches)
    if fwd.shape[-2:] != shape or bwd.shape[-2:] != shape:
        raise InputError(
            f"durations must have trailing shape (model chunks, micro-batches) = "
            f"{shape}, got {fwd.shape[-2:]} and {bwd.shape[-2:]}"
        )
    stacked = np.stack(np.broadcast_arrays(fwd, bwd), axis=-3)  # [..., 2, G, M]
    # one flat index into each row's (phase, chunk, micro-batch) table: np.take on a 2-D view is
    # about three times faster than three index arrays over the last three axes (a replay
    # window's [20 steps, 256 replicas] batch)
    flat = (sched.phase * shape[0] + sched.chunk) * shape[1] + sched.mb
    rows = np.take(stacked.reshape(-1, 2 * shape[0] * shape[1]), flat, axis=1)
    return rows.reshape(stacked.shape[:-3] + (len(flat),))


def op_end_times(
    sched: CompiledSchedule, fwd: np.ndarray, bwd: np.ndarray, p2p_s: float | np.ndarray = 0.0
) -> np.ndarray:
    """End time of every op of the schedule, [..., nodes] in ``sched``'s node order.

    Args:
        sched: the compiled schedule.
        fwd: forward seconds, [..., model chunks, micro-batches] (model chunk g = chunk * stages
            + rank).
        bwd: backward seconds, the same shape.
        p2p_s: seconds of each transfer between pipeline ranks (scalar or [...]).
    """
    dur = node_durations(sched, np.asarray(fwd, np.float64), np.asarray(bwd, np.float64))
    batch = dur.shape[:-1]
    end = np.zeros(batch + (sched.nodes + 1,))  # the last slot is the sentinel "no predecessor"
    comm = np.where(sched.dep_is_p2p, 1.0, 0.0) * np.asarray(p2p_s, np.float64)[..., None]
    comm = np.broadcast_to(comm, batch + (sched.nodes,))
    for nodes in sched.levels:
        start = np.maximum(
            end[..., sched.prev_same[nodes]], end[..., sched.prev_dep[nodes]] + comm[..., nodes]
        )
        end[..., nodes] = start + dur[..., nodes]
    return end[..., :-1]


def rank_finish_times(
    sched: CompiledSchedule, fwd: np.ndarray, bwd: np.ndarray, p2p_s: float | np.ndarray = 0.0
) -> np.ndarray:
    """End time of each pipeline rank's last op, [..., stages].

    Args:
        sched: the compiled schedule.
        fwd: forward seconds, as in ``op_end_times``.
        bwd: backward seconds, as in ``op_end_times``.
        p2p_s: seconds of each transfer between pipeline ranks.
    """
    return op_end_times(sched, fwd, bwd, p2p_s)[..., sched.last_on_rank]


def pipeline_step_time(
    fwd: np.ndarray,
    bwd: np.ndarray,
    schedule: str = "1f1b",
    p2p_s: float | np.ndarray = 0.0,
    dp_sync_s: float | np.ndarray = 0.0,
    optimizer_s: float | np.ndarray = 0.0,
    chunks: int = 1,
) -> np.ndarray:
    """Predicted step time: the schedule's critical path, gradient sync, then the optimizer.

    For data parallelism pass replicas as a leading dimension and take the max over it (replicas
    wait for each other at the gradient sync).

    Args:
        fwd: forward seconds, [..., stages * chunks, micro-batches].
        bwd: backward seconds, the same shape.
        schedule: the pipeline schedule (one of ``MODELLED_SCHEDULES``).
        p2p_s: seconds of each transfer between pipeline ranks.
        dp_sync_s: each rank's data-parallel gradient synchronisation, scalar or [..., stages].
        optimizer_s: the optimizer step's seconds.
        chunks: model chunks per rank (interleaved 1F1B).
    """
    fwd = np.asarray(fwd, np.float64)
    groups, m = fwd.shape[-2:]
    if groups % chunks:
        raise InputError(f"{groups} model chunks do not split into {chunks} chunks per rank")
    sched = compile_schedule(schedule, groups // chunks, m, chunks)
    finish = rank_finish_times(sched, fwd, bwd, p2p_s) + np.asarray(dp_sync_s, np.float64)
    return finish.max(axis=-1) + np.asarray(optimizer_s, np.float64)


def one_f_one_b_uniform(
    stage_fwd: np.ndarray, stage_bwd: np.ndarray, microbatches: int
) -> np.ndarray:
    """Closed form of 1F1B with equal micro-batches and free transfers.

    ``sum_s (f_s + b_s) + (m - 1) * max_s (f_s + b_s)``, over arrays of [..., stages].

    Exact when the stage times do not fall along the pipeline and the forward/backward ratio is
    the same everywhere (the test checks this); otherwise the critical path can be a few percent
    longer, or shorter where heavier stages come first (stage ``s`` overlaps ``S - 1 - s`` of its
    forwards with the fill: the step is only at least ``sum (f + b) + (x - 1) b_s + max(0, x - (S -
    s)) f_s`` for each stage, ``tests/test_schedule.py``): use ``pipeline_step_time`` for the
    exact value and this inside optimisers that need a closed form.

    Args:
        stage_fwd: each stage's forward seconds of one micro-batch, [..., stages].
        stage_bwd: each stage's backward seconds, the same shape.
        microbatches: micro-batches a step (m).
    """
    per = np.asarray(stage_fwd, np.float64) + np.asarray(stage_bwd, np.float64)
    return per.sum(axis=-1) + (microbatches - 1) * per.max(axis=-1)
