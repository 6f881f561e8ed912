"""The effect-size floor on device and link alarms, links that began together as one cause, and
the error budget of each series (issue 66)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resihp.detect.budget import run_length, series_budget
from resihp.detect.changepoint import _cusum_h_for
from resihp.detect.config import DetectorConfig
from resihp.detect.online import OnlineDetector
from resihp.detect.suite import DEFAULT_PROFILE
from resihp.detect.synth import CostPool, Injection, SimJob, alibaba_residuals, simulate
from resihp.errors import InputError
from resihp.opstrace import JobMeta, write_ops_trace
from tests.frame_steps import FrameSteps

from .test_detect_cli import resihp


def _run(
    factor: float,
    floor: float = 1.25,
    world: int = 8,
    onset: int = 40,
    steps: int = 90,
    sigma: float = 0.01,
    seed: int = 0,
) -> list:
    """A job of ``world`` quiet ranks, rank 3 ``factor`` times slower from ``onset`` on."""
    rng = np.random.default_rng(seed)
    det = OnlineDetector(
        JobMeta(dp_size=world, pp_size=1, tp_size=1, world_size=world),
        config=DetectorConfig(alarm_floor=floor, phases=False),
    )
    for t in range(steps):
        own = np.exp(rng.normal(0, sigma, world))
        if t >= onset:
            own[3] *= factor
        det.observe_arrays(t, own, own)
    return [e for e in det.finish() if e.is_device_fault]


@pytest.mark.parametrize("factor", [1.12, 1.2])
def test_a_slowdown_below_the_floor_raises_nothing(factor):
    assert _run(factor, floor=1.0), "the test itself finds it without a floor"
    assert _run(factor) == []


@pytest.mark.parametrize("factor", [1.3, 2.0])
def test_a_slowdown_above_the_floor_is_raised_with_its_factor_beside_the_floor(factor):
    (ev,) = _run(factor)
    assert ev.kind == "fail-slow" and ev.rank == 3
    assert ev.alarm_floor == 1.25 and ev.alarm_factor >= 1.25
    assert ev.to_dict()["alarm_factor"] == ev.alarm_factor


def test_a_held_alarm_is_raised_once_its_slowdown_grows_past_the_floor():
    rng = np.random.default_rng(1)
    det = OnlineDetector(
        JobMeta(dp_size=8, pp_size=1, tp_size=1, world_size=8), config=DetectorConfig(phases=False)
    )
    for t in range(100):
        own = np.exp(rng.normal(0, 0.01, 8))
        own[3] *= 1.15 if 40 <= t < 70 else 2.0 if t >= 70 else 1.0
        det.observe_arrays(t, own, own)
    (ev,) = [e for e in det.finish() if e.is_device_fault]
    assert ev.rank == 3 and ev.onset_step <= 41 and 70 <= ev.detected_step <= 76
    assert ev.alarm_factor >= 1.25


@pytest.mark.parametrize("bad", [0.5, 0.999, math.nan, math.inf, -2, "x", True, None])
def test_a_bad_floor_is_one_line_naming_the_field(bad):
    with pytest.raises(InputError, match="alarm_floor") as exc:
        DetectorConfig(alarm_floor=bad)
    assert "\n" not in str(exc.value) and "1.25" in str(exc.value)


def test_the_cli_takes_the_floor_and_rejects_a_bad_one_in_one_line(tmp_path):
    job = SimJob(dp=2, pp=1, steps=40, source="code", seed=3)
    trace = tmp_path / "ops.parquet"
    write_ops_trace(simulate(job, CostPool.from_profile(DEFAULT_PROFILE), _noise()), trace)
    bad = resihp("detect", trace, "--alarm-floor", "0.5")
    assert bad.returncode != 0
    lines = [ln for ln in (bad.stderr + bad.stdout).splitlines() if "alarm_floor" in ln]
    assert len(lines) == 1, bad.stderr + bad.stdout
    ok = resihp("detect", trace, "--alarm-floor", "1.5", "--json")
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["budget"]["alarm_floor"] == 1.5
    comp = doc["budget"]["series"]["compute"]
    assert set(comp) == {str(r) for r in range(job.world_size)}
    for b in comp.values():
        assert b["sigma"] > 0 and b["k"] > 0 and b["h"] > 0 and b["arl0_steps"] > 1
        assert b["delay_x2_steps"] <= b["delay_x1_5_steps"]
    assert "error budget" in resihp("detect", trace).stdout


def _noise() -> np.ndarray:
    from resihp.detect.alibaba import alibaba_path

    return alibaba_residuals(alibaba_path(2))


def test_links_that_began_together_are_one_shared_finding_not_n_link_faults():
    pool = CostPool.from_profile(DEFAULT_PROFILE)
    base = SimJob(steps=100, source="code", seed=7)
    injections = [Injection("link-slow", base.rank(d, 1), 50, 99, 3.0) for d in (0, 1, 2)]
    job = SimJob(steps=100, source="code", seed=7, injections=injections)
    from resihp.detect.online import detect_trace

    doc = detect_trace(
        simulate(job, pool, _noise()),
        job.meta(),
        meta_dict={"layers": 2, "hidden": 256, "heads": 4, "ffn_hidden": 1024},
    )
    kinds = [e["kind"] for e in doc["events"]]
    assert "link-slow" not in kinds, doc["events"]
    (shared,) = [e for e in doc["events"] if e["kind"] == "shared-link-slow"]
    ends = {tuple(sorted(i.link_ends(job.dims))) for i in injections}
    assert {tuple(sorted(link)) for link in shared["links"]} == ends
    assert shared["traffic"] == "pipeline" and shared["stage"] == 1
    assert shared["replicas"] == [0, 1, 2] and shared["alarm_factor"] >= shared["alarm_floor"]
    assert 50 <= shared["onset_step"] <= 51


def test_a_lone_slow_link_stays_a_link_slow():
    pool = CostPool.from_profile(DEFAULT_PROFILE)
    base = SimJob(steps=100, source="code", seed=7)
    inj = Injection("link-slow", base.rank(1, 2), 50, 99, 3.0)
    job = SimJob(steps=100, source="code", seed=7, injections=[inj])
    from resihp.detect.online import detect_trace

    doc = detect_trace(
        simulate(job, pool, _noise()),
        job.meta(),
        meta_dict={"layers": 2, "hidden": 256, "heads": 4, "ffn_hidden": 1024},
    )
    (ev,) = [e for e in doc["events"] if e["kind"] in ("link-slow", "shared-link-slow")]
    assert ev["kind"] == "link-slow" and ev["alarm_factor"] >= 1.25


# -- the error budget ------------------------------------------------------------------------


def test_arl0_matches_the_threshold_the_detector_solved_for():
    """Unclipped, the budget's ARL0 at ``_cusum_h_for(k, L)`` is ``L`` (the same Siegmund)."""
    for k, target in ((0.5, 1e4), (1.0, 1e7)):
        h = float(_cusum_h_for(np.array([k]), target)[0])
        assert run_length(0.0, k, h, 1e6) == pytest.approx(target, rel=1e-3)


@settings(max_examples=60, deadline=None)
@given(
    k=st.floats(0.3, 3.0),
    h=st.floats(2.0, 20.0),
    dh=st.floats(0.5, 10.0),
    sigma=st.floats(0.005, 0.3),
)
def test_arl0_grows_with_h_and_delays_shrink_with_the_shift(k, h, dh, sigma):
    a = series_budget(sigma, k, h, max(8.0, k + 1))
    b = series_budget(sigma, k, h + dh, max(8.0, k + 1))
    if a["arl0_steps"] and b["arl0_steps"]:
        assert b["arl0_steps"] >= a["arl0_steps"]
    if a["delay_x2_steps"] is not None and a["delay_x1_5_steps"] is not None:
        assert a["delay_x2_steps"] <= a["delay_x1_5_steps"]


@settings(max_examples=60, deadline=None)
@given(sigma=st.floats(0.005, 0.1))
def test_the_default_thresholds_are_no_faster_than_lordens_bound(sigma):
    cfg = DetectorConfig()
    b = series_budget(sigma, cfg.cusum_k, cfg.cusum_h, cfg.z_clip, 1.0, cfg.min_persist)
    for tag in ("x1_5", "x2"):
        assert b[f"delay_{tag}_steps"] >= b[f"lorden_{tag}_steps"]
        assert b[f"delay_over_lorden_{tag}"] == pytest.approx(
            b[f"delay_{tag}_steps"] / b[f"lorden_{tag}_steps"], rel=1e-2
        )
        assert b[f"delay_{tag}_steps"] >= cfg.min_persist


def test_a_factor_below_the_floor_has_no_delay():
    b = series_budget(0.01, 3.0, 14.0, 8.0, floor=1.6)
    assert b["delay_x1_5_steps"] is None and b["delay_x2_steps"] is not None


def test_the_detector_budget_is_its_fitted_noise_and_thresholds():
    rng = np.random.default_rng(0)
    det = OnlineDetector(
        JobMeta(dp_size=4, pp_size=1, tp_size=1, world_size=4), config=DetectorConfig(phases=False)
    )
    scale = np.array([0.01, 0.01, 0.01, 0.2])  # rank 3: noisy, thresholds of its own
    for t in range(30):
        own = np.exp(rng.normal(0, scale))
        det.observe_arrays(t, own, own)
    comp = det.budget()["series"]["compute"]
    bank = det.compute
    for r in range(4):
        assert comp[str(r)]["sigma"] == pytest.approx(bank.calibrated_sigma[r], rel=1e-4)
        assert comp[str(r)]["h"] == pytest.approx(bank.h[r], rel=1e-3)
    assert comp["3"]["sigma"] > comp["0"]["sigma"] and comp["3"]["k"] != comp["0"]["k"]
    assert det.budget()["job_arl0_steps"] <= min(b["arl0_steps"] for b in comp.values())


@pytest.mark.parametrize(
    "value, message",
    [
        ("0.5", "live.alarm_floor (--alarm-floor): expected a number >= 1, got 0.5"),
        ("inf", "live.alarm_floor (--alarm-floor): expected a finite number, got inf"),
    ],
)
def test_resihp_run_rejects_a_bad_floor_in_one_line(value, message, monkeypatch, capsys):
    import sys

    from resihp.cli import main

    monkeypatch.setattr(sys, "argv", ["resihp", "run", "--alarm-floor", value])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_the_live_config_carries_the_floor_to_the_detector():
    from resihp.train.config import LiveConfig

    assert LiveConfig().alarm_floor == DetectorConfig().alarm_floor == 1.25


def test_follow_reports_the_same_budget_as_detect():
    """``resihp follow`` (``LiveDetection.report``) over a trace's records as they arrive gives the
    budget ``detect_trace`` gives on the whole trace."""
    from resihp.detect.online import detect_trace
    from resihp.train.follow import LiveDetection

    job = SimJob(dp=2, pp=2, steps=40, source="code", seed=5)
    df = simulate(job, CostPool.from_profile(DEFAULT_PROFILE), _noise())

    follow = LiveDetection(None, source=FrameSteps(df, job.meta()))
    while not follow.steps.finished():
        follow.poll()
    live = follow.report()["budget"]
    whole = detect_trace(df, job.meta())["budget"]
    assert set(live["series"]["compute"]) == {str(r) for r in range(job.world_size)}
    assert live["series"]["compute"] == whole["series"]["compute"]
    assert live["job_arl0_steps"] is not None
