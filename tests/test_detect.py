"""The workload-aware detector on labelled traces built from real measurements, and its
baselines."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resihp.detect.alibaba import alibaba_path, read_alibaba_job
from resihp.detect.baselines import BASELINES
from resihp.detect.changepoint import CusumBank
from resihp.detect.config import DetectorConfig
from resihp.detect.evaluate import run_methods, score_events
from resihp.detect.observe import RankPlacement
from resihp.detect.online import OnlineDetector, _others_log, detect_trace
from resihp.detect.suite import DEFAULT_PROFILE
from resihp.detect.synth import CostPool, Injection, SimJob, alibaba_residuals, simulate
from resihp.errors import InputError
from resihp.opstrace import JobMeta
from resihp.workload.flops import TransformerShape, stage_flops

META = {"layers": 2, "hidden": 256, "heads": 4, "ffn_hidden": 1024}


@pytest.fixture(scope="module")
def pool() -> CostPool:
    return CostPool.from_profile(DEFAULT_PROFILE)


@pytest.fixture(scope="module")
def noise() -> np.ndarray:
    return alibaba_residuals(alibaba_path(2))


def _device_faults(doc: dict) -> list[dict]:
    return [e for e in doc["events"] if e["kind"] in ("fail-slow", "fail-stop", "link-slow")]


@pytest.mark.parametrize(
    "dp_rank,stage,factor,seed", [(1, 1, 2.0, 5), (0, 2, 1.3, 2), (3, 0, 1.5, 12)]
)
def test_fail_slow_is_found_on_the_slow_rank_not_its_waiting_neighbours(
    pool, noise, dp_rank, stage, factor, seed
):
    rank = SimJob().rank(dp_rank, stage)
    job = SimJob(
        steps=120,
        source="code",
        seed=seed,
        injections=[Injection("fail-slow", rank, 60, 119, factor)],
    )
    doc = detect_trace(simulate(job, pool, noise), job.meta(), meta_dict=META)
    faults = _device_faults(doc)
    assert [(e["kind"], e["rank"]) for e in faults] == [("fail-slow", rank)]
    ev = faults[0]
    assert 57 <= ev["onset_step"] <= 62
    assert 60 <= ev["detected_step"] <= 65
    assert abs(ev["slowdown"] - factor) / factor < 0.1
    assert ev["dp_rank"] == dp_rank and ev["stage"] == stage


def test_waiting_inflates_neighbours_host_compute_times(pool, noise):
    """The traces really carry the confounder: neighbours' raw compute rises with the slow rank."""
    job = SimJob(
        steps=60,
        source="text",
        injections=[Injection("fail-slow", SimJob().rank(1, 1), 30, 59, 2.0)],
    )
    df = simulate(job, pool, noise)
    comp = df[df["optype"].isin(["forward-compute", "backward-compute"])]
    per = comp.groupby(["step", "rank"])["duration"].sum().unstack()
    rise = per.iloc[35:].median() / per.iloc[:30].median()
    slow = job.rank(1, 1)
    # the slow rank's own waits shrink as it slows, so in raw times it does not stand out from the
    # ranks of its pipeline that now wait for it
    assert rise[slow] > 1.1
    assert max(rise[job.rank(1, s)] for s in (0, 2, 3)) > 0.9 * rise[slow]
    assert all(rise[job.rank(d, 0)] < rise[slow] for d in (0, 2, 3))


def test_healthy_variable_lengths_raise_no_device_fault_but_raw_threshold_does(pool, noise):
    job = SimJob(steps=200, source="code", seed=3)
    df = simulate(job, pool, noise)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        found, obs = run_methods(df, job.meta(), None, None, META)
    assert [e for e in found["resihp"] if e.is_device_fault] == []
    assert score_events(found["raw-threshold"], [], obs.steps, job.dims).fp > 0


def test_heavier_stage_is_stage_imbalance_not_a_device_fault(pool, noise):
    job = SimJob(steps=80, source="text", stage_layers=(2, 2, 2, 3), seed=4)
    doc = detect_trace(simulate(job, pool, noise), job.meta(), meta_dict=META)
    assert _device_faults(doc) == []
    assert [(e["kind"], e["stage"]) for e in doc["events"]] == [("stage-imbalance", 3)]
    assert 1.3 < doc["events"][0]["slowdown"] < 1.7


def test_slow_link_is_link_slow_on_that_link(pool, noise):
    ends = (SimJob().rank(2, 1), SimJob().rank(2, 2))
    job = SimJob(
        steps=100, source="code", injections=[Injection("link-slow", ends[0], 50, 99, 4.0)]
    )
    doc = detect_trace(simulate(job, pool, noise), job.meta(), meta_dict=META)
    faults = _device_faults(doc)
    assert faults and all(e["kind"] == "link-slow" and e["rank"] in ends for e in faults)
    assert 50 <= faults[0]["detected_step"] <= 55


def test_without_sequence_lengths_peers_normalise(pool, noise):
    slow = SimJob().rank(1, 2)
    job = SimJob(steps=120, source="code", injections=[Injection("fail-slow", slow, 60, 119, 2.0)])
    df = simulate(job, pool, noise).drop(columns=["seq_lens"])
    doc = detect_trace(df, job.meta())
    assert doc["cost_model"].startswith("peers")
    assert [(e["kind"], e["rank"]) for e in _device_faults(doc)] == [("fail-slow", slow)]


def test_predictor_expectation_and_workload_imbalance(pool, noise):
    """With an expected-cost callable, a replica that drew costlier data is workload-imbalance."""
    shape = TransformerShape(2, 256, 4, 1024)

    def expected(seq_lens, phase):
        tok = np.array([sum(s) for s in seq_lens], float)
        sq = np.array([sum(x * x for x in s) for s in seq_lens], float)
        d, a = stage_flops(shape, tok, sq, phase)
        return (d + a) * 1e-10

    slow = SimJob().rank(0, 3)
    job = SimJob(steps=60, source="code", injections=[Injection("fail-slow", slow, 30, 59, 1.5)])
    df = simulate(job, pool, noise).drop(columns=["start_ts"])
    # replica 2 ran twice the data from step 40 on: every op of its four ranks takes twice as long
    heavy = (df["dp_rank"] == 2) & (df["step"] >= 40) & df["optype"].str.endswith("compute")
    df.loc[heavy, "duration"] *= 2
    df.loc[heavy, "seq_lens"] = pd.Series(
        [s + s for s in df.loc[heavy, "seq_lens"]], index=df.index[heavy]
    )
    doc = detect_trace(df, job.meta(), expected=expected)
    assert doc["cost_model"].startswith("predictor")
    assert [(e["kind"], e["rank"]) for e in _device_faults(doc)] == [("fail-slow", slow)]
    wl = [e for e in doc["events"] if e["kind"] == "workload-imbalance"]
    # replica 2's doubled data is one stretch; other replicas appear only on steps whose real data
    # was costlier than their peers' (that is what the kind is for)
    assert [(e["onset_step"], e["end_step"]) for e in wl if e["dp_rank"] == 2] == [(40, 59)]
    assert all(e["rank"] is None for e in wl)


def test_online_step_by_step_equals_offline_and_tolerates_gaps(pool, noise):
    job = SimJob(steps=90, source="text", injections=[Injection("fail-slow", 10, 50, 89, 2.5)])
    df = simulate(job, pool, noise)
    # only some ranks recorded, and only every other step
    df = df[(df["rank"] != 0) & (df["step"] % 2 == 0)]
    offline = detect_trace(df, job.meta(), meta_dict=META)
    det = OnlineDetector(job.meta(), meta_dict=META)
    online = []
    for _, part in df.groupby("step"):
        online += det.observe(part)
    det.finish()
    assert [(e.kind, e.rank, e.onset_step, e.detected_step) for e in online] == [
        (e["kind"], e["rank"], e["onset_step"], e["detected_step"]) for e in offline["events"]
    ]
    assert [(e["kind"], e["rank"]) for e in offline["events"]] == [("fail-slow", 10)]
    with pytest.raises(InputError, match="arrives after"):
        det.observe(df[df["step"] == 10])


def test_rank_slow_from_the_start_is_found_at_calibration():
    meta = JobMeta(dp_size=4, pp_size=1, tp_size=1, world_size=4)
    det = OnlineDetector(
        meta, layout=RankPlacement(np.arange(4), np.zeros(4, int), np.zeros(4, int))
    )
    rng = np.random.default_rng(0)
    events = []
    for t in range(20):
        own = np.exp(rng.normal(0, 0.01, 4)) * np.array([1, 1, 1.4, 1])
        events += det.observe_arrays(t, own, own)
    assert [(e.kind, e.rank, e.onset_step) for e in events] == [("fail-slow", 2, 0)]
    assert events[0].from_start


def test_alibaba_job1_worker6_straggler_found_by_resihp():
    df, meta = read_alibaba_job(alibaba_path(1))
    doc = detect_trace(df, meta)
    w6 = [e for e in doc["events"] if e["rank"] == 6 and e["kind"] == "fail-slow"]
    assert len(w6) == 1
    assert 1790 <= w6[0]["onset_step"] <= 1830 and w6[0]["detected_step"] <= 1850
    assert w6[0]["slowdown"] > 1.3


def test_baselines_see_a_large_slowdown(pool, noise):
    job = SimJob(
        steps=100, dp=4, pp=1, source="text", injections=[Injection("fail-slow", 1, 50, 99, 5.0)]
    )
    df = simulate(job, pool, noise)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        found, obs = run_methods(df, job.meta(), list(BASELINES))
    for name in BASELINES:
        sc = score_events(found[name], job.injections, obs.steps, job.dims)
        assert sc.tp == 1, name


def test_config_rejects_nonsense():
    with pytest.raises(InputError, match="cusum_h"):
        DetectorConfig(cusum_h=0)
    with pytest.raises(InputError, match="own_quantile"):
        DetectorConfig(own_quantile=2)


def test_alibaba_job2_stable_spread_and_lone_reporter_raise_nothing():
    """Job 2's workers differ persistently but steadily, and at the end only worker 0 reports."""
    df, meta = read_alibaba_job(alibaba_path(2))
    assert df.groupby("step")["rank"].nunique().min() == 1
    doc = detect_trace(df, meta)
    assert _device_faults(doc) == []


def test_carried_detector_keeps_moved_ranks_and_recalibrates_new_ones():
    meta = JobMeta(dp_size=6, pp_size=1, tp_size=1, world_size=6)
    flat = RankPlacement(np.arange(6), np.zeros(6, int), np.zeros(6, int))
    det = OnlineDetector(meta, layout=flat)
    rng = np.random.default_rng(1)

    def step(d: OnlineDetector, t: int, slow: np.ndarray) -> list:
        own = np.exp(rng.normal(0, 0.01, 6)) * slow
        return d.observe_arrays(t, own, own)

    events = []
    for t in range(40):
        events += step(det, t, np.where(np.arange(6) == 2, 1.5 if t >= 30 else 1.0, 1.0))
    assert [(e.kind, e.rank) for e in events] == [("fail-slow", 2)]
    # a re-plan: old rank 2 (still slow) is now rank 4, old 4 is rank 2, rank 5 is a new device
    moved = det.carried(meta, flat, np.array([0, 1, 4, 3, 2, -1]))
    later = []
    for t in range(40, 80):
        slow = np.ones(6)
        slow[4] = 1.5 if t < 50 else 1.0  # the moved device recovers at step 50
        slow[5] = 1.4 if t < 70 else 1.0  # the new device was slow from its first step until 70
        later += step(moved, t, slow)
    assert events[0].end_step is not None and 49 <= events[0].end_step <= 53
    assert [(e.kind, e.rank, e.from_start) for e in later] == [("fail-slow", 5, True)]
    assert later[0].end_step is not None and 69 <= later[0].end_step <= 73


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(st.just(0.0), st.sampled_from([0.5, 1.0, 2.0]), st.floats(0.01, 100.0)),
        min_size=1,
        max_size=40,
    )
)
def test_each_ranks_reference_is_the_median_of_the_others(values):
    # _others_log reads each leave-one-out median off a partition (O(n)); by definition it is the
    # median of the other ranks' logs (ties and ranks without a value included)
    v = np.array(values)
    out = _others_log(v)
    ok = np.flatnonzero(v > 0)
    for i in range(len(v)):
        others = np.log(v[[j for j in ok if j != i]])
        if v[i] <= 0 or (len(ok) < 2 and not (len(v) == 1 and len(ok) == 1)):
            assert np.isnan(out[i])
        elif len(v) == 1:
            assert out[i] == np.log(v[i])
        else:
            assert out[i] == pytest.approx(np.log(v[i]) - np.median(others), abs=1e-12)


def test_a_carried_bank_that_keeps_its_ranks_resets_only_the_fresh_ones_in_place():
    cfg = DetectorConfig(calibration_steps=5)
    rng = np.random.default_rng(3)
    bank = CusumBank(8, cfg)
    for t in range(12):
        bank.update(t, rng.normal(0, 0.01, 8) + np.where(np.arange(8) == 2, 0.4 * (t > 8), 0.0))
    before = {k: v.copy() for k, v in vars(bank).items() if isinstance(v, np.ndarray)}
    source = np.array([0, 1, 2, 3, -1, 5, -1, 7])
    moved = bank.carried(source)
    fresh = CusumBank(8, cfg)
    for name, old in before.items():
        now = getattr(moved, name)
        if name == "_hist_step" or old.shape[-1:] != (8,):
            assert np.array_equal(now, old, equal_nan=True), name
            continue
        expect = old.copy()
        expect[..., [4, 6]] = getattr(fresh, name)[..., [4, 6]]
        assert np.array_equal(now, expect, equal_nan=True), name
    assert (
        moved.alarmed[2] and not moved.calibrated[[4, 6]].any() and moved.calibrated[[0, 7]].all()
    )


def test_fresh_series_of_a_carried_bank_calibrate_and_alarm_after_every_other_one_had():
    # the bank skips calibration work once every series is calibrated: a carry that brings in
    # fresh series (or a recalibration) must start it again
    cfg = DetectorConfig(calibration_steps=5)
    rng = np.random.default_rng(4)
    bank = CusumBank(6, cfg)
    for t in range(8):
        bank.update(t, rng.normal(0, 0.01, 6))
    assert bank.calibrated.all()
    bank = bank.carried(np.array([0, 1, 2, -1, 4, 5]))
    alarms = []
    for t in range(8, 30):
        alarms += bank.update(
            t, rng.normal(0, 0.01, 6) + np.where(np.arange(6) == 3, 0.5 * (t >= 20), 0.0)
        )[0]
    assert bank.calibrated.all()
    assert [a.index for a in alarms] == [3] and alarms[0].onset_step == 20
    bank.recalibrate()
    for t in range(30, 40):
        bank.update(t, rng.normal(0, 0.01, 6))
    assert bank.calibrated.all()
