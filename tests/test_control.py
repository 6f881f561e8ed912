"""The decision layer alone: findings and probes in, decisions out, one set of thresholds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resihp.control import ControlAction, ControlConfig, Controller
from resihp.detect.config import DetectorConfig
from resihp.launch.live import LiveLoop
from resihp.replay.policies import Resihp
from resihp.train.config import RunConfig


def test_live_and_replay_decide_by_the_same_controller_and_thresholds():
    live = LiveLoop(
        RunConfig.from_flags(layers=4, dp=2, pp=1, tp=1),
        detector_config=DetectorConfig(calibration_steps=8),
    )
    replay = Resihp()
    assert type(live.control) is type(replay.control) is Controller
    assert live.control.config == replay.control.config == ControlConfig()
    assert live.speeds is live.control.speeds  # the planner's speeds are the controller's


def test_a_new_finding_re_plans_and_a_re_report_within_the_revise_factor_does_not():
    c = Controller()
    first = c.found_slow(3, 2.0, step=10)
    assert first.action is ControlAction.REPLAN and c.slowdown(3) == 2.0
    assert c.found_slow(3, 2.3, step=20).action is ControlAction.KEEP and c.slowdown(3) == 2.0
    moved = c.found_slow(3, 2.6, step=30)
    assert moved.replan and moved.reason == "re-priced" and c.slowdown(3) == 2.6
    assert c.found_recovered(3).replan and c.slowdown(3) == 1.0
    assert not c.found_recovered(3).replan  # nothing believed slow: nothing to do


def test_a_re_pricing_waits_out_the_hold_so_shares_do_not_flip():
    c = Controller(ControlConfig(hold_steps=3))
    c.found_slow(1, 2.0, step=10)
    assert c.found_slow(1, 3.0, step=11).reason == "re-priced too recently"
    assert c.found_slow(1, 3.0, step=12).action is ControlAction.KEEP
    assert c.found_slow(1, 3.0, step=13).replan  # the hold is over
    assert c.found_recovered(1).replan  # a recovery is never held


def test_a_benched_device_is_probed_with_backoff_and_taken_back_when_healthy():
    cfg = ControlConfig(recheck_s=100.0, max_backoff=2)
    c = Controller(cfg)
    c.found_slow(5, 50.0, step=1, time_s=0.0)
    used = {0, 1, 2}  # the plan leaves 5 out
    assert c.due_probes(99.0, used, set()) == [] and c.wake_at(used, set()) == 100.0
    assert c.due_probes(100.0, used, set()) == [5]
    assert c.due_probes(100.0, used | {5}, set()) == []  # in the plan: the detector watches it
    assert c.due_probes(100.0, used, {5}) == []  # dead: nothing to probe
    still = c.probed(5, 1 / 45.0, time_s=100.0)
    assert still.action is ControlAction.KEEP and c.recheck_after(5) == 200.0
    c.probed(5, 1 / 45.0, time_s=300.0)
    c.probed(5, 1 / 45.0, time_s=700.0)
    assert c.recheck_after(5) == 400.0  # capped at 2 ** max_backoff
    assert c.probed(5, 1 / 3.0, time_s=1100.0).reason == "still slow, re-priced"
    assert c.slowdown(5) == pytest.approx(3.0)
    back = c.probed(5, 0.9, time_s=1500.0)
    assert back.replan and back.reason == "healthy at its probe" and c.slowdown(5) == 1.0


def test_a_device_found_slow_again_soon_after_its_return_waits_longer():
    c = Controller(ControlConfig(recheck_s=100.0, max_backoff=2))
    c.found_slow(2, 4.0, step=1, time_s=0.0)
    c.probed(2, 1.0, time_s=100.0)  # back
    c.found_slow(2, 4.0, step=50, time_s=200.0)  # within the longest recheck of its return
    assert c.recheck_after(2) == 200.0
    c.probed(2, 1.0, time_s=400.0)
    c.found_slow(2, 4.0, step=900, time_s=5000.0)  # long after: a fresh episode
    assert c.recheck_after(2) == 100.0


def test_a_slow_link_is_priced_probed_when_out_of_use_and_dropped_when_healthy():
    c = Controller(ControlConfig(link_recheck_s=60.0))
    assert c.found_link((4, 2), 5.0, step=3, time_s=10.0).link == (2, 4)
    assert c.found_link([2, 4], 5.5, step=9).action is ControlAction.KEEP
    assert c.due_link_probes(69.0, {0, 1, 2, 3, 4}) == []  # both ends in use: watched in training
    assert c.due_link_probes(69.0, {0, 1, 2}) == [] and c.due_link_probes(70.0, {0, 1, 2}) == [
        (2, 4)
    ]
    assert c.probed_link((2, 4), 0.21, time_s=70.0).action is ControlAction.KEEP
    assert c.probed_link((2, 4), 0.95, time_s=130.0).replan and c.links == {}
    c.found_link((2, 4), 5.0, step=20)
    assert c.link_recovered((4, 2)).replan and not c.link_recovered((4, 2)).replan


def test_dead_devices_are_no_longer_believed_slow():
    c = Controller()
    c.found_slow(7, 3.0, step=1)
    assert c.stopped([7]).replan and c.slow() == {}


@pytest.mark.parametrize(
    "kwargs",
    [{"revise": 1.0}, {"healthy": 0.0}, {"healthy": 1.5}, {"hold_steps": -1}, {"max_backoff": -1}],
)
def test_a_bad_threshold_is_refused(kwargs):
    with pytest.raises(ValueError, match="ControlConfig"):
        ControlConfig(**kwargs)


reports = st.lists(st.tuples(st.floats(1.0, 20.0), st.integers(0, 5)), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(reports=reports, revise=st.floats(1.05, 2.0), hold=st.integers(0, 4))
def test_the_price_follows_the_reports_within_the_revise_factor(reports, revise, hold):
    """After every report a device is priced within ``revise`` of it, or the report came inside
    the hold; a re-plan comes exactly when the price moved, and never twice inside one hold."""
    c = Controller(ControlConfig(revise=revise, hold_steps=hold))
    step, last_replan = 0, None
    for slowdown, gap in reports:
        step += gap
        before = c.slowdown(0)
        decision = c.found_slow(0, slowdown, step)
        after = c.slowdown(0)
        assert decision.replan == (after != before)
        held = before > 1.0 and last_replan is not None and step - last_replan < hold
        if decision.replan:
            assert after == pytest.approx(max(slowdown, 1.0), rel=1e-12) and not held
            if before > 1.0:
                assert max(before, slowdown) >= revise * min(before, slowdown)
            last_replan = step
        elif before > 1.0 and not held:
            assert max(after, slowdown) < revise * min(after, slowdown) * (1 + 1e-12)


def test_a_change_is_applied_only_with_the_step_the_job_applied_it_at():
    loop = LiveLoop(
        RunConfig.from_flags(layers=4, dp=2, pp=1, tp=1),
        detector_config=DetectorConfig(calibration_steps=8),
    )
    loop._post = lambda change: None
    loop.speeds[1] = 0.5
    loop._replan(10, {"kind": "fail-slow", "rank": 1, "slowdown": 2.0, "detected_step": 10})
    loop.speeds[1] = 0.25
    loop._replan(14, {"kind": "fail-slow", "rank": 1, "slowdown": 4.0, "detected_step": 14})
    assert [c["applied"] for c in loop.changes] == [True, True]  # handed to the job
    first, second = loop.as_applied([{"id": 1, "step": 12, "relayout_s": 0.1}], ("relayout_s",))
    assert first["applied"] is True and first["applied_step"] == 12 and first["relayout_s"] == 0.1
    assert second["applied"] is False and second["applied_step"] is None  # the job ended first
