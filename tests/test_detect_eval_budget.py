"""``detect-eval``'s false alarms per 10k rank-steps and per day at a stated step time, and its
delays against Lorden's bound, for resihp and the baselines."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from resihp.detect.evaluate import Score, fault_sigma, score_events
from resihp.detect.events import Event
from resihp.detect.synth import Injection
from resihp.parallel import ParallelDims
from tests.test_detect_cli import resihp


def test_rates_per_rank_step_and_day_and_the_delay_against_lordens_bound():
    dims = ParallelDims(2, 2)
    steps = np.arange(100)
    inj = Injection("fail-slow", 3, 50, 99, 2.0)
    found = Event("fail-slow", 3, 1, 1, None, 50, 54, 2.0, 1.0)
    false = [Event("fail-slow", 0, 0, 0, None, s, s, 1.5, 1.0) for s in (20, 30)]
    budget = {"series": {"compute": {"3": {"sigma": 0.1}}, "pipeline": {"1": {"sigma": 0.3}}}}
    sc = score_events(
        [found, *false],
        [inj],
        steps,
        dims,
        skip_first=10,
        sigma_of=lambda i: fault_sigma(budget, i),
    )
    assert (sc.tp, sc.fp, sc.healthy_steps, sc.healthy_rank_steps) == (1, 2, 40, 160)
    out = sc.summary(step_time_s=2.0)
    assert out["false_alarms_per_10k_rank_steps"] == pytest.approx(1e4 * 2 / 160)
    assert out["false_alarms_per_day"] == pytest.approx(2 / 40 * 86400 / 2.0)
    assert (
        out["false_alarm_interval_rank_steps"] == 80
        and not out["false_alarm_interval_is_lower_bound"]
    )
    bound = 2 * 0.1**2 * math.log(80) / math.log(2.0) ** 2
    assert out["lorden_steps_median"] == pytest.approx(bound, abs=1e-3)
    assert out["delay_over_lorden_median"] == pytest.approx((4 + 1) / max(bound, 1.0), abs=1e-3)
    # a link's series is its lower end's; no calibrated series, no bound
    assert fault_sigma(budget, Injection("link-slow", 1, 0, 9, 2.0, "pipeline")) == 0.3
    assert fault_sigma(budget, Injection("link-slow", 1, 0, 9, 2.0, "gradient-sync")) is None
    quiet = Score(healthy_steps=40, healthy_rank_steps=160)
    assert quiet.summary()["false_alarm_interval_is_lower_bound"]
    assert quiet.summary()["delay_over_lorden_median"] is None


def test_detect_eval_states_the_rates_at_its_step_time_and_the_bound_for_every_method():
    proc = resihp("detect-eval", "--quick", "--json", "--step-time", "10")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["step_time_s"] == 10
    ranks = doc["ranks_per_trace"]
    for name, s in doc["methods"].items():
        per_step = s["false_alarms_per_10k_healthy_steps"] / 1e4
        assert s["false_alarms_per_10k_rank_steps"] == pytest.approx(
            1e4 * per_step / ranks, rel=1e-2, abs=1e-3
        ), name
        assert s["false_alarms_per_day"] == pytest.approx(per_step * 8640, rel=1e-2, abs=0.1), name
        assert s["delay_over_lorden_median"] is not None and s["lorden_steps_median"] > 0, name
    assert doc["methods"]["raw-threshold"]["false_alarms_per_day"] > 0
    text = resihp("detect-eval", "--quick", "--step-time", "10")
    assert "10 s a step" in text.stdout and "FA/day" in text.stdout
    bad = resihp("detect-eval", "--quick", "--step-time", "0")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].count("--step-time") == 1
