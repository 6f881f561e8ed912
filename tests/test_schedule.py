import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from resihp.errors import InputError
from resihp.perf.critical_path import critical_path, schedule_graph
from resihp.perf.schedule import (
    compile_schedule,
    one_f_one_b_uniform,
    op_end_times,
    pipeline_step_time,
    rank_finish_times,
)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["gpipe", "1f1b", "interleaved"]),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(1, 6),
    st.integers(0, 2**31 - 1),
    st.floats(0, 0.5),
)
def test_vectorised_critical_path_equals_networkx(name, stages, group, chunks, seed, p2p):
    chunks = chunks if name == "interleaved" else 1
    chunks = min(chunks, 3)
    microbatches = stages * group
    sched = compile_schedule(name, stages, microbatches, chunks)
    rng = np.random.default_rng(seed)
    fwd = rng.uniform(0.1, 2.0, (stages * chunks, microbatches))
    bwd = rng.uniform(0.1, 4.0, (stages * chunks, microbatches))
    fast = rank_finish_times(sched, fwd, bwd, p2p).max()
    slow, _ = critical_path(schedule_graph(sched, fwd, bwd, p2p))
    assert fast == pytest.approx(slow, rel=1e-12)


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(["gpipe", "1f1b"]),
    st.integers(1, 4),
    st.integers(1, 6),
    st.integers(0, 2**31 - 1),
    st.floats(0, 0.5),
)
def test_op_end_times_follow_the_dependency_graph(name, stages, microbatches, seed, p2p):
    sched = compile_schedule(name, stages, microbatches)
    rng = np.random.default_rng(seed)
    fwd = rng.uniform(0.1, 2.0, (2, stages, microbatches))  # a leading batch dimension
    bwd = rng.uniform(0.1, 4.0, (2, stages, microbatches))
    end = op_end_times(sched, fwd, bwd, p2p)
    assert end.shape == (2, sched.nodes)
    for b in range(2):
        graph = schedule_graph(sched, fwd[b], bwd[b], p2p)
        names = list(graph.nodes)  # schedule_graph adds nodes in the schedule's node order
        got = dict(zip(names, end[b]))
        for node in names:
            ready = max(
                (got[u] + graph.edges[u, node]["transfer"] for u in graph.predecessors(node)),
                default=0.0,
            )
            assert got[node] == pytest.approx(ready + graph.nodes[node]["duration"], rel=1e-12)
        assert (
            rank_finish_times(sched, fwd[b], bwd[b], p2p).tolist()
            == end[b, sched.last_on_rank].tolist()
        )


@given(st.integers(1, 8), st.integers(1, 16), st.floats(0.1, 3), st.floats(0.1, 3))
def test_1f1b_matches_closed_form_for_uniform_stages(stages, microbatches, f, b):
    speeds = np.linspace(1.0, 2.0, stages)
    fwd = np.repeat((f * speeds)[:, None], microbatches, axis=1)
    bwd = np.repeat((b * speeds)[:, None], microbatches, axis=1)
    expected = one_f_one_b_uniform(f * speeds, b * speeds, microbatches)
    assert pipeline_step_time(fwd, bwd, "1f1b") == pytest.approx(expected)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 7), st.integers(1, 16), st.floats(0, 0.3), st.integers(0, 2**31 - 1))
def test_1f1b_step_is_at_least_each_stages_own_bound(stages, microbatches, p2p, seed):
    """Stage ``s`` of 1F1B runs ``S - s`` forwards before its first backward, which waits for the
    first micro-batch's whole forward and the later stages' backwards; after its last backward the
    gradient crosses the earlier stages. So the step is at least ``sum (f + b) + 2 (S - 1) q +
    (x - 1) b_s + max(0, x - (S - s)) f_s`` for every stage. With the heaviest stage first that is
    below the closed form ``sum (f + b) + (x - 1) max (f + b)``, and so can the step be (next
    test): the closed form is no lower bound there."""
    rng = np.random.default_rng(seed)
    f, b = rng.uniform(0.05, 1.0, stages), rng.uniform(0.05, 2.0, stages)
    step = float(
        pipeline_step_time(
            np.repeat(f[:, None], microbatches, 1),
            np.repeat(b[:, None], microbatches, 1),
            "1f1b",
            p2p_s=p2p,
        )
    )
    fixed = float((f + b).sum()) + 2 * (stages - 1) * p2p
    own = [
        fixed + (microbatches - 1) * b[s] + max(0, microbatches - (stages - s)) * f[s]
        for s in range(stages)
    ]
    assert step >= max(own) - 1e-9


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 12), st.integers(1, 60), st.floats(0.001, 0.2), st.integers(0, 2**31 - 1))
def test_1f1b_pays_the_transfers_in_every_cycle(stages, microbatches, p2p, seed):
    """Stage ``s`` runs ``F_{n+w}`` before ``B_n`` (``w = S - s - 1``), so ``B_n`` waits for that
    forward to cross the later stages and its backward to come back: chained over the pipeline,
    the step is at least ``sum (f + b) + (x - 1) nu`` with ``nu = (sum (f + b) + 2 (S - 1) q) /
    S``, whenever ``nu`` is at least the slowest stage's time (the tight bound's 8.)."""
    rng = np.random.default_rng(seed)
    f = rng.uniform(0.1, 1.0) * rng.uniform(0.9, 1.1, stages) / 3
    b = 2 * f * rng.uniform(0.8, 1.2, stages)
    f[-1] *= rng.uniform(0.5, 1.5)
    work = float((f + b).sum())
    nu = (work + 2 * (stages - 1) * p2p) / stages
    assume(nu >= float((f + b).max()))
    step = float(
        pipeline_step_time(
            np.repeat(f[:, None], microbatches, 1),
            np.repeat(b[:, None], microbatches, 1),
            "1f1b",
            p2p_s=p2p,
        )
    )
    assert step >= work + (microbatches - 1) * nu - 1e-9


def test_equal_stages_pay_the_transfers_beyond_the_closed_form():
    """Four equal stages, 20 micro-batches, transfers a tenth of a stage: the graph's step is
    above the closed form's ``S + comm + (x - 1) mu`` by at least what 8. charges."""
    f, b, p, m = np.full(4, 1 / 3), np.full(4, 2 / 3), 0.1, 20
    step = float(
        pipeline_step_time(
            np.repeat(f[:, None], m, 1), np.repeat(b[:, None], m, 1), "1f1b", p2p_s=p
        )
    )
    closed = 4.0 + 2 * 3 * p + (m - 1) * 1.0
    cycles = 4.0 + (m - 1) * (4.0 + 2 * 3 * p) / 4
    assert cycles > closed + 1.0
    assert step >= cycles - 1e-9


def test_with_the_heavier_stage_first_1f1b_is_shorter_than_its_closed_form():
    heavy_first = pipeline_step_time(
        np.array([[1 / 3] * 4, [1 / 6] * 4]), np.array([[2 / 3] * 4, [1 / 3] * 4])
    )
    assert float(heavy_first) == pytest.approx(25 / 6)  # stage 0 idle only 1/6 s: 4 x 1 + 1/6
    assert float(
        one_f_one_b_uniform(np.array([1 / 3, 1 / 6]), np.array([2 / 3, 1 / 3]), 4)
    ) == pytest.approx(4.5)


def test_every_op_runs_once_and_1f1b_bounds_in_flight_microbatches():
    sched = compile_schedule("1f1b", 4, 8)
    pairs = set(zip(sched.phase.tolist(), sched.chunk.tolist(), sched.mb.tolist()))
    assert len(pairs) == sched.nodes == 2 * 4 * 8
    for rank in range(4):
        phases = sched.phase[sched.rank == rank]
        in_flight = np.cumsum(np.where(phases == 0, 1, -1))
        assert in_flight.max() <= 4 - rank  # activation memory bound of 1F1B


def test_batched_evaluation_and_sync_terms():
    rng = np.random.default_rng(0)
    fwd = rng.uniform(0.5, 1.0, (5, 2, 4))  # 5 replicas
    bwd = 2 * fwd
    per_replica = pipeline_step_time(fwd, bwd, "1f1b", dp_sync_s=0.3, optimizer_s=0.2)
    assert per_replica.shape == (5,)
    assert per_replica[0] == pytest.approx(pipeline_step_time(fwd[0], bwd[0]) + 0.5)


def test_bad_schedule_inputs():
    with pytest.raises(InputError, match="must be one of"):
        compile_schedule("zb-v", 2, 4)
    with pytest.raises(InputError, match="divisible"):
        compile_schedule("interleaved", 4, 6, 2)
    with pytest.raises(InputError, match="trailing shape"):
        pipeline_step_time(np.ones((2, 3)), np.ones((2, 4)))
