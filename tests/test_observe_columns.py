"""The array path of the detector's trace analysis: the numpy group statistics against pandas, and
the replay handing its records to the detector as columns (the same analysis as its ops frame)."""

import numpy as np
import pandas as pd
import pytest

from resihp.detect.alibaba import alibaba_path
from resihp.detect.observe import (
    StructureMemo,
    _dense_layout,
    _distinct_steps,
    _first_of_each,
    _group_quantile,
    _Ops,
    _optype_codes,
    _pivot_lower_median,
    _sort_rows,
    _unblocked_durations,
    observe_columns,
    observe_ops,
)
from resihp.detect.suite import DEFAULT_PROFILE
from resihp.detect.synth import CostPool, Injection, SimJob, alibaba_residuals, simulate
from resihp.replay.engine import Replay
from resihp.replay.layout import compile_layout
from resihp.replay.policies import make_policies
from resihp.replay.scenario import load_scenario
from resihp.workload.features import PooledLengths
from resihp.workload.flops import TransformerShape
from tests.replay_fixtures import write


@pytest.mark.parametrize("q,lower", [(0.5, True), (0.1, False), (0.5, False), (0.9, False)])
def test_group_quantile_matches_pandas(q, lower):
    rng = np.random.default_rng(0)
    code = rng.integers(0, 300, size=5000) * 7  # groups of 1..~30 rows, codes with gaps
    values = rng.lognormal(size=5000)
    values[rng.random(5000) < 0.05] = np.nan
    codes, got, inverse = _group_quantile(code, values, q, lower=lower)
    want = pd.Series(values).groupby(code).quantile(q, interpolation="lower" if lower else "linear")
    np.testing.assert_array_equal(codes, want.index.to_numpy())
    np.testing.assert_allclose(got, want.to_numpy(), rtol=1e-12, equal_nan=True)
    np.testing.assert_array_equal(codes[inverse], code)


@pytest.mark.parametrize("nan", [True, False])  # without: every group whole (one position for all)
@pytest.mark.parametrize("size", [1, 2, 3, 4, 8, 12])
def test_group_quantile_on_groups_of_one_size_matches_pandas(size, nan):
    # a full trace: every (step, rank) cell has the same number of ops, codes mostly in order
    rng = np.random.default_rng(size)
    code = np.repeat(np.arange(500) * 3, size)
    code[: 40 * size] = np.repeat(rng.permutation(40) * 3, size)
    values = rng.lognormal(size=code.size)
    if nan:
        values[rng.random(code.size) < 0.05] = np.nan
    for q, lower in ((0.5, True), (0.1, False), (0.5, False), (0.9, False)):
        codes, got, inverse = _group_quantile(code, values, q, lower=lower)
        want = (
            pd.Series(values)
            .groupby(code)
            .quantile(q, interpolation="lower" if lower else "linear")
        )
        np.testing.assert_array_equal(codes, want.index.to_numpy())
        np.testing.assert_allclose(got, want.to_numpy(), rtol=1e-12, equal_nan=True)
        np.testing.assert_array_equal(codes[inverse], code)


@pytest.mark.parametrize("k", range(1, 11))
def test_sort_rows_matches_numpy_with_nan_last(k):
    rng = np.random.default_rng(k)
    table = rng.random((300, k))
    table[rng.random(table.shape) < 0.2] = np.nan
    table[:3] = np.nan
    np.testing.assert_array_equal(_sort_rows(table), np.sort(table, axis=1))


@pytest.mark.parametrize("spread", [1, 1000])
def test_counting_paths_match_numpy_unique(spread):
    rng = np.random.default_rng(spread)
    code = rng.integers(0, 400, size=2000) * spread  # dense, then sparse codes
    first, inverse = _first_of_each(code)
    _, want_first, want_inverse = np.unique(code, return_index=True, return_inverse=True)
    np.testing.assert_array_equal(first, want_first)
    np.testing.assert_array_equal(inverse, want_inverse)
    np.testing.assert_array_equal(_distinct_steps(code + 17), np.unique(code + 17))


def test_pivot_lower_median_matches_the_sorted_groups():
    rng = np.random.default_rng(4)
    code = np.repeat(np.arange(300), 6)
    member = np.tile(np.arange(6), 300) + 2
    keep = rng.random(code.size) > 0.1  # some members missing
    code, member = code[keep], member[keep]
    values = rng.lognormal(size=code.size)
    values[rng.random(code.size) < 0.05] = np.nan
    _, ref, inverse = _group_quantile(code, values, 0.5, lower=True)
    layout = _dense_layout(code, member - member.min())
    np.testing.assert_array_equal(_pivot_lower_median(code, values, layout), ref[inverse])
    assert (
        _dense_layout(np.r_[code, code[:1]], np.r_[member, member[:1]]) is None
    )  # two rows of one member
    assert _dense_layout(code * 100, member) is None  # sparse codes


@pytest.mark.parametrize("full", [True, False])
def test_unblocked_durations_match_a_row_by_row_lookup(full):
    # each op waits for the first record of the same micro-batch on the stage before it (forward)
    # or after it (backward); a full trace (one record per op, a few missing) takes the table
    # lookup, duplicated records and stages out of order the sorted one
    rng = np.random.default_rng(3)
    if full:
        grid = np.indices((3, 2, 4, 4, 2, 2)).reshape(6, -1)
        grid = grid[:, rng.random(grid.shape[1]) > 0.05]
    else:
        grid = rng.integers(0, [3, 2, 4, 4, 2, 2], size=(3000, 6)).T
    n = grid.shape[1]
    df = pd.DataFrame(
        {
            "step": grid[0],
            "dp_rank": grid[1],
            "mb_id": grid[2].astype(float),
            "stage": grid[3],
            "tp_rank": grid[4].astype(float),
            "optype": np.array(["forward-compute", "backward-compute"])[grid[5]],
            "start_ts": rng.random(n) * 10,
            "duration": rng.random(n) * 3,
        }
    )
    df["rank"] = df["dp_rank"] * 8 + df["stage"] * 2 + df["tp_rank"].astype(int)
    cols = {c: df[c].to_numpy() for c in df.columns}
    op = _optype_codes(cols["optype"])
    got = _unblocked_durations(_Ops(cols, np.arange(n), op))
    keys = ["step", "dp_rank", "mb_id", "optype", "tp_rank"]
    first = {}
    for _, row in df.iterrows():
        first.setdefault((*row[keys], row["stage"]), row["start_ts"] + row["duration"])
    want = []
    for _, row in df.iterrows():
        step = 1 if row["optype"] == "backward-compute" else -1
        dep = first.get((*row[keys], row["stage"] + step), np.nan)
        start, end = row["start_ts"], row["start_ts"] + row["duration"]
        want.append(end - dep if start < dep < end else row["duration"])
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_replay_columns_give_the_ops_frame_analysis(tmp_path):
    sc = load_scenario(write(tmp_path))
    rp = Replay(sc, make_policies("resihp")[0], events=[])
    speeds = np.ones(len(sc.cluster))
    speeds[3] = 0.6  # one slow device, so the matrices are not uniform
    win = rp.sim.window(compile_layout(rp.ctx.uniform_layout(set())), speeds, 8, 0, 0.0)
    df = win.ops()
    cols = win.columns()
    assert len(cols["step"]) == len(df)
    # the lengths as codes into the workload's pool (each micro-batch's stored once), the frame's
    # as the sequences themselves
    assert isinstance(cols["seq_lens"], PooledLengths)
    assert [list(s) for s in cols["seq_lens"].objects()] == [list(s) for s in df["seq_lens"]]
    for shape in (None, TransformerShape(2, 256, 4, 1024)):
        from_frame = observe_ops(df, win.meta, shape=shape)
        from_cols = observe_columns(cols, win.meta, shape=shape)
        _same_observations(from_cols, from_frame)
    # the slow device's rank is the slowest in its own compute, in every step
    rank = int(np.flatnonzero(win.rank_device == 3)[0])
    assert (np.nanargmax(from_cols.own / win.rank_work[None, :], axis=1) == rank).all()


def _same_observations(a, b) -> None:
    assert a.cost_model == b.cost_model
    np.testing.assert_array_equal(a.steps, b.steps)
    for name in ("own", "raw", "expected", "comm", "sync"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(x, y)


def test_a_structure_memo_gives_what_each_call_derives_afresh(tmp_path):
    """Chunks of a window share their structure columns (the replay's records of a layout): with
    one ``StructureMemo`` over them every chunk's observations equal a memo-less call's, the
    structure derived once; rows of another structure (new arrays, other relative steps) are
    derived afresh, never taken for the remembered one."""
    sc = load_scenario(write(tmp_path))
    rp = Replay(sc, make_policies("resihp")[0], events=[])
    speeds = np.ones(len(sc.cluster))
    speeds[3] = 0.6
    win = rp.sim.window(compile_layout(rp.ctx.uniform_layout(set())), speeds, 12, 0, 0.0)
    memo = StructureMemo()
    shape = TransformerShape(2, 256, 4, 1024)
    for i in (0, 4, 8, 8, 0):
        cols = win.step_columns(i, i + 4)
        _same_observations(
            observe_columns(cols, win.meta, shape=shape, structure=memo),
            observe_columns(cols, win.meta, shape=shape),
        )
    assert len(memo._entries) == 1  # one structure: every chunk's rows in the same places
    # the same rows in another order, as new arrays: another structure
    cols = dict(win.step_columns(0, 4))
    order = np.random.default_rng(0).permutation(len(cols["step"]))
    shuffled = {
        c: (v.take(order) if isinstance(v, pd.Categorical) else v[order]) for c, v in cols.items()
    }
    _same_observations(
        observe_columns(shuffled, win.meta, shape=shape, structure=memo),
        observe_columns(shuffled, win.meta, shape=shape),
    )
    # the same arrays with other relative steps (two steps swapped between chunks): afresh too
    swapped = dict(cols)
    swapped["step"] = np.where(cols["step"] == 0, 1, np.where(cols["step"] == 1, 0, cols["step"]))
    _same_observations(
        observe_columns(swapped, win.meta, shape=shape, structure=memo),
        observe_columns(swapped, win.meta, shape=shape),
    )
    assert len(memo._entries) == 3


def test_optype_as_strings_or_categorical(tmp_path):
    sc = load_scenario(write(tmp_path))
    rp = Replay(sc, make_policies("resihp")[0], events=[])
    win = rp.sim.window(
        compile_layout(rp.ctx.uniform_layout(set())), np.ones(len(sc.cluster)), 4, 0, 0.0
    )
    cols = dict(win.columns())
    assert isinstance(cols["optype"], pd.Categorical)
    a = observe_columns(cols, win.meta)
    cols["optype"] = np.asarray(cols["optype"], dtype=object)
    b = observe_columns(cols, win.meta)
    assert a.cost_model == b.cost_model == "tokens+peers+timestamps"
    np.testing.assert_array_equal(a.own, b.own)
    np.testing.assert_array_equal(a.raw, b.raw)
    cols.pop("start_ts")  # no clock: issue times from the running sum of each rank's durations
    c = observe_columns(cols, win.meta)
    assert c.cost_model == "tokens+peers+cumulative-times"
    assert np.isfinite(c.own).all()


def _phase_alone(df: pd.DataFrame, meta, phase_optype: str, **kw) -> np.ndarray:
    """The definition of one phase's own work: the whole analysis on that phase's rows alone (with
    the transfers, where the waits come from)."""
    keep = df["optype"].isin([phase_optype, "forward-send", "backward-recv"])
    obs = observe_ops(df[keep], meta, **kw)
    steps = observe_ops(df, meta, **kw).steps
    out = np.full((len(steps), meta.world_size), np.nan)
    out[np.searchsorted(steps, obs.steps)] = obs.own
    return out


@pytest.mark.parametrize(
    "dp,pp,drop", [(4, 4, ()), (8, 1, ()), (8, 1, ("seq_lens",)), (2, 2, ("seq_lens",))]
)
def test_each_phase_from_one_pass_equals_the_analysis_of_its_rows_alone(dp, pp, drop):
    job = SimJob(
        dp=dp,
        pp=pp,
        steps=40,
        source="code",
        seed=3,
        injections=[Injection("fail-slow", SimJob(dp=dp, pp=pp).rank(1, pp - 1), 20, 39, 2.0)],
    )
    df = simulate(job, CostPool.from_profile(DEFAULT_PROFILE), alibaba_residuals(alibaba_path(2)))
    df = df.drop(columns=list(drop))
    shape = TransformerShape(2, 256, 4, 1024)
    obs = observe_ops(df, job.meta(), shape=shape, phases=True)
    assert set(obs.phase_own) == {"forward", "backward"}
    for name, optype in (("forward", "forward-compute"), ("backward", "backward-compute")):
        np.testing.assert_allclose(
            obs.phase_own[name],
            _phase_alone(df, job.meta(), optype, shape=shape),
            rtol=1e-12,
            equal_nan=True,
        )


def test_a_pipeline_without_clocks_gives_no_phase_alone():
    job = SimJob(dp=2, pp=2, steps=25, source="code", seed=1)
    df = simulate(job, CostPool.from_profile(DEFAULT_PROFILE), alibaba_residuals(alibaba_path(2)))
    assert observe_ops(df.drop(columns="start_ts"), job.meta(), phases=True).phase_own is None
    assert observe_ops(df, job.meta()).phase_own is None  # not asked for
