"""Hot spares in the live loop: a re-plan that keeps the pipelines in force (spares included)
re-forms nothing, and a spare's probe brings back only a device left out for its own slowness."""

from __future__ import annotations

from resihp.detect.config import DetectorConfig
from resihp.launch.live import LiveLoop
from resihp.train.config import RunConfig


def _loop_with_rank_1_left_out(dp: int, pp: int) -> LiveLoop:
    loop = LiveLoop(
        RunConfig.from_flags(layers=4, dp=dp, pp=pp, tp=1),
        detector_config=DetectorConfig(calibration_steps=8),
    )
    loop._post = lambda change: None  # the job's side of a change is not under test here
    loop.speeds[1] = 0.02  # 50x slower: the planner leaves it out
    loop._replan(10, {"kind": "fail-slow", "rank": 1, "slowdown": 50.0, "detected_step": 10})
    assert all(1 not in stage for pipe in loop.groups for stage in pipe)
    return loop


def test_a_re_plan_that_keeps_the_pipelines_and_spares_in_force_re_forms_nothing():
    for dp, pp in ((4, 1), (2, 2)):
        loop = _loop_with_rank_1_left_out(dp, pp)
        groups = loop.groups
        loop._replan(11, {"kind": "fail-slow", "rank": 1, "slowdown": 50.0, "detected_step": 11})
        first, second = loop.changes
        assert first["applied"] is True and "layout" in first
        assert (
            second["applied"] == "none: the planner keeps the plan in force"
            and "layout" not in second
        )
        assert loop.groups == groups


def test_a_healthy_probe_brings_back_a_spare_left_out_for_its_slowness_only():
    loop = _loop_with_rank_1_left_out(4, 1)
    placed = {r for pipe in loop.groups for stage in pipe for r in stage}
    loop._probe(12, 1, 0.010, placed)  # its reference
    loop._probe(13, 1, 0.011, placed)  # within RECOVERED of it
    assert loop.changes[-1]["reason"]["kind"] == "recovered" and loop.speeds[1] == 1.0
    assert any(1 in stage for pipe in loop.groups for stage in pipe)

    loop = _loop_with_rank_1_left_out(4, 1)
    loop.speeds[1] = 1.0  # left out for something its probe does not time (a slow link)
    placed = {r for pipe in loop.groups for stage in pipe for r in stage}
    loop._probe(12, 1, 0.010, placed)
    loop._probe(13, 1, 0.010, placed)
    assert len(loop.changes) == 1 and loop.probes == [{"step": 13, "rank": 1, "slowdown": 1.0}]


def test_a_ranks_reference_is_its_fastest_probe_while_it_trains():
    """A rank probes in its first steps while it trains: the fastest is its reference (a CI run's
    rank timed its first probe at 2.8x its peers', and as a spare at a third of its speed it then
    read 1.06x: taken back while still slow). A spare's probe is compared with it."""
    loop = LiveLoop(
        RunConfig.from_flags(layers=4, dp=4, pp=1, tp=1),
        detector_config=DetectorConfig(calibration_steps=8),
    )
    loop._post = lambda change: None
    for step, seconds in enumerate((0.0116, 0.0042, 0.0045)):
        loop._probe(step, 1, seconds, {0, 1, 2, 3})
    assert loop.probe_ref[1] == 0.0042 and loop.probes == []
    loop.speeds[1] = 0.02  # 50x slower: the planner leaves it out
    loop._replan(22, {"kind": "fail-slow", "rank": 1, "slowdown": 50.0, "detected_step": 22})
    placed = {r for pipe in loop.groups for stage in pipe for r in stage}
    assert 1 not in placed
    loop._probe(24, 1, 0.0123, placed)  # at a third of its speed: still slow, re-priced
    assert loop.probes == [{"step": 24, "rank": 1, "slowdown": round(0.0123 / 0.0042, 4)}]
    assert len(loop.changes) == 2 and loop.changes[-1]["reason"]["kind"] == "fail-slow"
    assert loop.speeds[1] == 0.0042 / 0.0123
    loop._probe(24, 1, 0.0121, placed)  # within the revise factor of that price: nothing
    assert len(loop.changes) == 2
    loop._probe(25, 1, 0.0045, placed)  # healthy again: taken back
    assert loop.changes[-1]["reason"]["kind"] == "recovered" and loop.speeds[1] == 1.0
