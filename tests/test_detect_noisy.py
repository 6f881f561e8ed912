"""The detector on a noisy two-rank data-parallel job (issue 19's user loop, simulated): thresholds
from each rank's measured noise, phase-only slowdowns, the smallest detectable slowdown reported."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest

from resihp.detect.changepoint import CusumBank
from resihp.detect.config import DetectorConfig
from resihp.detect.observe import RankPlacement
from resihp.detect.online import OnlineDetector, detect_trace
from resihp.errors import InputError
from resihp.opstrace import JobMeta
from resihp.workload.flops import TransformerShape, stage_flops

META = JobMeta(dp_size=2, pp_size=1, tp_size=1, world_size=2)
SHAPE = {"layers": 2, "hidden": 128, "heads": 4, "ffn_hidden": 512}
_PH = {"forward": "fwd", "backward": "bwd"}


def noisy_job(
    steps=80,
    noise=0.25,
    slow_rank=None,
    factor=2.0,
    onset=30,
    phases=("forward", "backward"),
    seed=0,
) -> pd.DataFrame:
    """Rows of a 2-rank job whose ops take their FLOPs' time times lognormal noise (sigma
    ``noise`` per op) and, on ``slow_rank`` from ``onset``, ``factor`` in the given phases."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(steps):
        for rank in (0, 1):
            lens = [int(x) for x in rng.integers(16, 160, size=rng.integers(1, 5))]
            tokens, sq = sum(lens), sum(x * x for x in lens)
            shape = TransformerShape(**SHAPE)
            for optype, phase in (
                ("forward-compute", "forward"),
                ("backward-compute", "backward"),
                ("optimizer", "optimizer"),
            ):
                if phase == "optimizer":
                    work = 0.002
                else:  # the job's FLOPs at 10 GFLOP/s
                    d, a = stage_flops(shape, np.array([tokens]), np.array([sq]), _PH[phase])
                    work = float(d[0] + a[0]) / 1e10
                slow = factor if (rank == slow_rank and step >= onset and phase in phases) else 1.0
                rows.append(
                    {
                        "step": step,
                        "rank": rank,
                        "dp_rank": rank,
                        "stage": 0,
                        "tp_rank": 0,
                        "optype": optype,
                        "mb_id": 0 if phase != "optimizer" else None,
                        "seq_lens": lens if phase != "optimizer" else None,
                        "duration": work * slow * float(np.exp(rng.normal(0, noise))),
                    }
                )
    return pd.DataFrame(rows)


def _faults(doc):
    return [e for e in doc["events"] if e["kind"] == "fail-slow"]


def _detect(df, **cfg):
    # this job's cost is its FLOPs exactly: the thresholds are under test here, on the analytic
    # cost model (the fitted one, the default for such a job, in test_detect_fitted)
    cfg.setdefault("fit_cost", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return detect_trace(df, META, config=DetectorConfig(**cfg), meta_dict=SHAPE)


@pytest.mark.parametrize("seed", range(4))
def test_a_2x_slower_rank_in_a_25_percent_noisy_loop_is_found_within_10_steps(seed):
    doc = _detect(noisy_job(slow_rank=1, seed=seed))
    faults = _faults(doc)
    assert [e["rank"] for e in faults] == [1]
    ev = faults[0]
    assert 30 <= ev["detected_step"] <= 40 and ev["end_step"] is None
    assert abs(ev["slowdown"] - 2.0) / 2.0 < 0.15
    assert doc["noise"][1]["adapted"] and doc["noise"][1]["min_detectable_slowdown"] < 2.0


@pytest.mark.parametrize("seed", range(6))
def test_the_same_noisy_loop_without_a_slowdown_raises_nothing(seed):
    assert _faults(_detect(noisy_job(steps=120, seed=100 + seed))) == []


@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer"])
def test_a_slowdown_of_one_phase_alone_is_found_and_named(phase):
    df = noisy_job(noise=0.1, slow_rank=0, phases=(phase,), seed=3)
    faults = _faults(_detect(df))
    assert [e["rank"] for e in faults] == [0]
    assert faults[0]["phase"] == phase and faults[0]["detected_step"] <= 40
    assert abs(faults[0]["slowdown"] - 2.0) / 2.0 < 0.15
    # what it costs the rank: the phase's share of the rank's healthy seconds, times the slowdown
    healthy = df[(df["rank"] == 0) & (df["step"] < 30)]
    share = (
        healthy.loc[
            healthy["optype"] == f"{phase}-compute"
            if phase != "optimizer"
            else healthy["optype"] == "optimizer",
            "duration",
        ].sum()
        / healthy["duration"].sum()
    )
    assert faults[0]["rank_slowdown"] - 1.0 == pytest.approx(share * 1.0, rel=0.2)


def test_quiet_ranks_keep_the_configured_thresholds_and_say_what_they_can_find():
    doc = _detect(noisy_job(noise=0.01, slow_rank=1, factor=1.3, seed=1))
    assert not any(v["adapted"] for v in doc["noise"].values())
    assert all(v["min_detectable_slowdown"] < 1.2 for v in doc["noise"].values())
    assert [e["rank"] for e in _faults(doc)] == [1]


def test_noise_hiding_slowdowns_is_reported_and_sensitivity_moves_it():
    df = noisy_job(noise=0.6, seed=5)
    low, high = (_detect(df, sensitivity=s)["noise"][0]["min_detectable_slowdown"] for s in (1, 2))
    assert low > 2.0 and high < low


def test_detector_config_refuses_bad_noise_settings():
    for bad in ({"sensitivity": 0}, {"target_slowdown": 1.0}, {"false_alarm_steps": -1}):
        with pytest.raises(InputError, match=next(iter(bad))):
            DetectorConfig(**bad)


def test_live_detector_reports_noise_per_rank():
    det = OnlineDetector(META, meta_dict=SHAPE)
    df = noisy_job(steps=25, seed=2)
    for _, rows in df.groupby("step"):
        det.observe(rows)
    assert set(det.noise()) == {0, 1}


def test_onset_is_placed_at_the_change_not_where_noise_first_raised_the_sum():
    """On a noisy series the CUSUM often leaves zero a few healthy steps before the change; the
    alarm's onset is the most likely start of the raised level, and its slowdown is that level's
    (CI once saw an attached job slowed x5 from step 30 reported from step 24 at x3.4)."""
    errors, ratios = [], []
    for seed in range(40):
        rng = np.random.default_rng(seed)
        bank = CusumBank(8, DetectorConfig())
        for step in range(100):
            x = rng.normal(0.0, 0.4, 8)
            x[3] += np.log(5.0) if step >= 50 else 0.0
            alarm = [a for a in bank.update(step, x)[0] if a.index == 3]
            if alarm:
                errors.append(alarm[0].onset_step - 50)
                ratios.append(alarm[0].slowdown / 5.0)
                break
    errors = np.array(errors)
    assert len(errors) == 40 and (errors == 0).mean() >= 0.9 and (abs(errors) <= 3).all()
    assert abs(np.median(ratios) - 1) < 0.15


def test_a_rise_inside_the_calibration_window_is_an_alarm_from_its_step():
    """A fault that begins before a series has its baseline: the series calibrates on its steps
    before the rise (its spread its own, not the two levels'), is in alarm from the rise's step at
    the rise's slowdown, and its recovery is found as any other's (the live run of the issue's
    ``slow:rank=1,factor=4,step=10`` was priced from step 0 at about half its slowdown, its noise
    taken as 220%)."""
    onsets, ratios = [], []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        bank = CusumBank(8, DetectorConfig(), rises=True)  # calibration_steps=20: steps 0..19
        alarms, recoveries = [], []
        for step in range(60):
            x = rng.normal(0.0, 0.05, 8)
            x[3] += np.log(3.0) if 10 <= step < 30 else 0.0
            found, ended, _ = bank.update(step, x)
            alarms += [(step, a) for a in found]
            recoveries += [(step, r) for r in ended]
        assert [(step, a.index) for step, a in alarms] == [(19, 3)]
        onsets.append(alarms[0][1].onset_step)
        ratios.append(alarms[0][1].slowdown / 3.0)
        sigma = bank.calibrated_sigma
        assert sigma[3] < 2 * np.median(np.delete(sigma, 3))
        assert [r.index for _, r in recoveries] == [3] and recoveries[0][1].end_step >= 29
    assert (np.array(onsets) == 10).mean() >= 0.9 and max(abs(o - 10) for o in onsets) <= 2
    assert abs(np.median(ratios) - 1) < 0.05


@pytest.mark.parametrize("noise", [0.05, 0.4])
def test_noise_alone_in_the_calibration_windows_raises_no_alarm(noise):
    """The two-level fit of each window is judged at the configured thresholds: 4,000 series of
    heavy-tailed noise calibrate without an alarm."""
    rng = np.random.default_rng(1)
    for window in (8, 20):
        bank = CusumBank(4000, DetectorConfig(calibration_steps=window), rises=True)
        for step in range(window):
            x = rng.normal(0, noise, 4000) + (rng.random(4000) < 0.05) * rng.exponential(
                3 * noise, 4000
            )
            assert bank.update(step, x)[0] == []
        assert bank.calibrated.all()


def test_peers_are_the_ranks_doing_the_same_work_not_every_rank_of_a_stage():
    """After a live re-plan left rank 0 alone in its tensor-parallel group (twice a pair's work per
    rank, all four at stage 0), rank 0 is no peer of the pairs' ranks: compared with them it was a
    fail-slow from the start (a CI run of the issue's replica-mode test: 1.58x, then 2.34x, and two
    re-plans for nothing). A rank slow among its real peers is still found."""
    meta = JobMeta(dp_size=1, pp_size=1, tp_size=4, world_size=4)
    layout = RankPlacement(np.zeros(4, np.int64), np.zeros(4, np.int64), np.arange(4))

    def findings(peers, own_ratio):
        det = OnlineDetector(
            meta, config=DetectorConfig(calibration_steps=8), layout=layout, peers=peers
        )
        rng = np.random.default_rng(0)
        for step in range(12):
            det.observe_arrays(step, np.asarray(own_ratio) * np.exp(rng.normal(0, 0.02, 4)))
        return [(e.kind, e.rank) for e in det.events if e.kind == "fail-slow"]

    assert findings(None, [2.0, 1, 1, 1]) == [("fail-slow", 0)]  # stage peers: the false finding
    assert findings([0, 1, 1, 1], [2.0, 1, 1, 1]) == []
    assert findings([0, 1, 1, 1], [2.0, 1.6, 1, 1]) == [("fail-slow", 1)]
