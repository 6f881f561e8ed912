"""The live planner plans around a slow device at what its slowdown costs the rank's step: a
slower optimizer step of a millisecond is reported (a fail-slow naming the phase) but moves no
work; the same rank slow in its forward and backward compute is planned around, planned around
again when its slowdown grows after that, and given its work back when it runs at speed again."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from resihp.detect.config import DetectorConfig
from resihp.launch.live import LiveLoop
from resihp.train.config import RunConfig
from resihp.train.recorder import rows_frame

ONSET = 15


def _rows(
    step: int,
    rng: np.random.Generator,
    slow: tuple[str, ...],
    factor: Callable[[int], float] = lambda step: 2.0 if step >= ONSET else 1.0,
) -> list[dict]:
    """One step of a DP 4 job, each rank's ops back to back from the step's start, with 1%
    lognormal noise per op; rank 1 runs the ``slow`` optypes ``factor(step)`` times slower
    (2x from ``ONSET`` unless told)."""
    out = []
    for rank in range(4):
        clock = float(step)
        ops = [
            (optype, work, {"mb_id": mb, "seq_id": mb, "seq_lens": [200, 56], "tokens": 256})
            for mb in range(2)
            for optype, work in (("forward-compute", 0.1), ("backward-compute", 0.2))
        ]
        for optype, work, fields in ops + [("optimizer", 0.001, {})]:
            f = factor(step) if rank == 1 and optype in slow else 1.0
            d = work * f * float(np.exp(rng.normal(0.0, 0.01)))
            out.append(
                {
                    "step": step,
                    "rank": rank,
                    "dp_rank": rank,
                    "stage": 0,
                    "tp_rank": 0,
                    "optype": optype,
                    "start_ts": clock,
                    "duration": d,
                    **fields,
                }
            )
            clock += d
        out.append(
            {
                "step": step,
                "rank": rank,
                "dp_rank": rank,
                "stage": 0,
                "tp_rank": 0,
                "optype": "step",
                "start_ts": float(step),
                "duration": clock - step,
            }
        )
    return out


def _loop(microbatches: int = 8) -> LiveLoop:
    """The live loop of a DP 4 job of ``microbatches`` micro-batches a step. With 16, a rank 2x
    slow keeps a smaller share (a step of 5 micro-batches' time against 6 with it left out); with
    8 the two tie (3 against 3), and which one the planner takes depends on this machine's measured
    device and the solver under load; a rank left out is no longer observed."""
    return LiveLoop(
        RunConfig.from_flags(layers=4, dp=4, pp=1, tp=1, global_tokens=1024 * microbatches),
        detector_config=DetectorConfig(calibration_steps=8, fit_cost=False),
    )


def _run(slow: tuple[str, ...], steps: int = 40, microbatches: int = 8, **factor) -> LiveLoop:
    loop = _loop(microbatches)
    loop._post = lambda change: None  # the job's side of a change is not under test here
    rng = np.random.default_rng(0)
    for step in range(steps):
        loop._observe(step, rows_frame(_rows(step, rng, slow, **factor)))
    assert loop.error is None
    return loop


def test_a_slower_optimizer_step_of_a_millisecond_is_reported_but_moves_no_work():
    loop = _run(("optimizer",))
    slow = [e for e in loop.events if e["kind"] == "fail-slow"]
    assert [(e["rank"], e["phase"]) for e in slow] == [(1, "optimizer")]
    # the phase 2x slower; 1 ms of a 0.6 s step: the rank about 0.17% slower
    assert slow[0]["slowdown"] == pytest.approx(2.0, rel=0.15)
    assert slow[0]["rank_slowdown"] == pytest.approx(1.0 + 0.001 / 0.601, abs=5e-4)
    assert loop.changes == [] and loop.speeds[1] == 1.0


def test_the_same_rank_slow_in_its_compute_is_planned_around_at_its_cost():
    loop = _run(("forward-compute", "backward-compute"))
    slow = [e for e in loop.events if e["kind"] == "fail-slow"]
    assert [e["rank"] for e in slow] == [1]
    assert len(loop.changes) == 1 and loop.changes[0]["reason"]["rank"] == 1
    # the rank's whole compute is 2x: the planner sees it about half as fast
    assert 1.0 / loop.speeds[1] == pytest.approx(2.0, rel=0.15)


COMPUTE = ("forward-compute", "backward-compute")


def test_a_slowdown_that_grows_after_it_was_planned_around_is_planned_around_again():
    """1.5x from step 15, 3x from step 25: priced at 1.5x when found, at 3x once it grew (a CI dry
    run found a 3x slowdown one step after its onset at 1.5x, and nothing planned it again)."""
    loop = _run(
        COMPUTE,
        microbatches=16,
        factor=lambda step: 1.0 if step < ONSET else 1.5 if step < 25 else 3.0,
    )
    reasons = [c["reason"] for c in loop.changes]
    assert [r["rank"] for r in reasons] == [1, 1], reasons
    assert reasons[0]["slowdown"] == pytest.approx(1.5, rel=0.1) and "priced_at" not in reasons[0]
    assert reasons[1]["slowdown"] == pytest.approx(3.0, rel=0.1), reasons
    assert (
        reasons[1]["priced_at"] == reasons[0]["slowdown"]
        and 25 <= loop.changes[1]["decided_step"] < 32
    )
    assert 1.0 / loop.speeds[1] == pytest.approx(3.0, rel=0.1)
    # priced at 3x, rank 1 trains less than at 1.5x: a smaller share, or none (left out as a hot
    # spare)
    first, second = loop.changes
    before = first.get("dp_weights", [4.0] * 4)[1] if "layout" not in first else 0.0
    placed = [
        r for p in second.get("layout", {}).get("pipelines", []) for stage in p for r in stage
    ]
    assert second["applied"] is True, second
    assert (
        (1 not in placed) if "layout" in second else second["dp_weights"][1] < min(before, 4.0)
    ), loop.changes


def test_a_slow_rank_that_runs_at_speed_again_gets_its_share_back():
    """2x from step 15 to 24: planned around, then, once its finding closes, planned at full
    speed."""
    loop = _run(
        COMPUTE, steps=50, microbatches=16, factor=lambda step: 2.0 if ONSET <= step < 25 else 1.0
    )
    reasons = [c["reason"] for c in loop.changes]
    assert [(r["kind"], r["rank"]) for r in reasons] == [("fail-slow", 1), ("recovered", 1)], (
        reasons
    )
    assert loop.speeds[1] == 1.0 and 1 not in loop.handled
    assert loop.changes[1]["dp_weights"] == [4.0, 4.0, 4.0, 4.0], loop.changes[1]


def test_a_steady_slowdown_is_planned_around_once():
    loop = _run(COMPUTE, steps=60)
    assert len(loop.changes) == 1 and loop.changes[0]["reason"]["rank"] == 1


def test_a_rank_slow_again_after_a_fresh_baseline_is_followed_by_the_new_detector():
    """2x from step 15; a re-plan that moves work gives the live loop a fresh detector (as one
    moving layers does, ``LiveLoop._post_in_place``), which finds rank 1 slow against its peers
    from the start (no second change: the plan in force prices it so) and follows it: 4x from
    step 45 is re-planned at 4x."""
    loop = _loop(16)
    loop._post = lambda change: None
    rng = np.random.default_rng(0)
    for step in range(60):
        if step == 25:
            loop.detector = loop._make_detector()
        rows = _rows(
            step, rng, COMPUTE, factor=lambda s: 1.0 if s < ONSET else 2.0 if s < 45 else 4.0
        )
        loop._observe(step, rows_frame(rows))
    assert loop.error is None
    assert [e["rank"] for e in loop.events if e.get("from_start")] == [1]
    reasons = [c["reason"] for c in loop.changes]
    assert [(r["kind"], r["rank"]) for r in reasons] == [("fail-slow", 1), ("fail-slow", 1)], (
        reasons
    )
    assert (
        reasons[1]["slowdown"] == pytest.approx(4.0, rel=0.1)
        and loop.changes[1]["decided_step"] >= 45
    )
    assert reasons[1]["priced_at"] == reasons[0]["slowdown"]
    assert 1.0 / loop.speeds[1] == pytest.approx(4.0, rel=0.1)


def test_a_slowdown_that_grows_after_a_fresh_baseline_without_peers_to_compare_is_followed():
    """DP 2: two ranks a stage (as at pp 2 of the last stop's real runs), so a fresh detector
    cannot find rank 1 slow against its peers; it calibrates on rank 1 already 2x slow (priced
    so), and its finding that rank 1 got 2x slower than that baseline at step 45 is priced at 4x,
    not at 2x (the last stop's real runs: a 3x slowdown after a layer move stayed priced at 2.3x).
    Back at 2x, it is priced at 2x again."""
    cfg = RunConfig.from_flags(layers=4, dp=2, pp=1, tp=1, global_tokens=1024 * 16)
    loop = LiveLoop(cfg, detector_config=DetectorConfig(calibration_steps=8, fit_cost=False))
    loop._post = lambda change: None
    rng = np.random.default_rng(0)
    factor = lambda s: 1.0 if s < ONSET else 2.0 if s < 45 or s >= 60 else 4.0  # noqa: E731
    for step in range(75):
        if step == 25:
            loop.detector = loop._make_detector()  # as a re-plan that moved layers does
        rows = [r for r in _rows(step, rng, COMPUTE, factor=factor) if r["rank"] < 2]  # rank 1 slow
        loop._observe(step, rows_frame(rows))
    assert loop.error is None
    assert not any(e.get("from_start") for e in loop.events)
    reasons = [c["reason"] for c in loop.changes]
    assert [r["rank"] for r in reasons] == [1] * 3, reasons
    assert reasons[0]["slowdown"] == pytest.approx(2.0, rel=0.15)
    assert (
        reasons[1]["slowdown"] == pytest.approx(4.0, rel=0.15)
        and loop.changes[1]["decided_step"] >= 45
    )
    assert reasons[1]["priced_at"] == pytest.approx(reasons[0]["slowdown"])
    assert (
        reasons[2]["slowdown"] == pytest.approx(2.0, rel=0.15)
        and loop.changes[2]["decided_step"] >= 60
    )
    assert 1.0 / loop.speeds[1] == pytest.approx(2.0, rel=0.15)


@pytest.mark.parametrize("after", [1.0, 1.5])
def test_a_rank_that_recovers_after_a_fresh_baseline_is_given_its_work_back(after: float):
    """DP 2 x PP 2 (two ranks a stage: no peer-based finding can name a rank): rank 1 is 3x slow
    from ``ONSET`` and priced so; a re-plan that moved work gives the loop a fresh detector at step
    25, whose baseline for rank 1 is the slow level. From step 45 the device runs at ``after``:
    faster than that baseline, which the detector's findings (rises only) never report, so on the
    landed code rank 1 stayed priced at 3x for the rest of the run. Now it is re-planned at full
    speed (``recovered``), or at 1.5x."""
    cfg = RunConfig.from_flags(layers=4, dp=2, pp=2, tp=1, global_tokens=1024 * 16)
    dims = cfg.dims()
    loop = LiveLoop(cfg, detector_config=DetectorConfig(calibration_steps=8, fit_cost=False))
    loop._post = lambda change: None
    rng = np.random.default_rng(0)
    factor = lambda s: 1.0 if s < ONSET else 3.0 if s < 45 else after  # noqa: E731
    for step in range(70):
        if step == 25:
            loop.detector = loop._make_detector()  # as a re-plan that moved layers does
        rows = _rows(step, rng, COMPUTE, factor=factor)
        for row in rows:
            at = dims.coords(row["rank"])
            row["dp_rank"], row["stage"] = at.dp_rank, at.stage
            row.pop(
                "mb_id", None
            )  # no pipeline waits to take out: the stages' ops are not a schedule
        loop._observe(step, rows_frame(rows))
    assert loop.error is None
    reasons = [c["reason"] for c in loop.changes]
    assert [r["rank"] for r in reasons] == [1, 1], reasons
    assert reasons[0]["slowdown"] == pytest.approx(3.0, rel=0.15)
    assert 45 <= loop.changes[1]["decided_step"] <= 45 + 8
    assert reasons[1]["priced_at"] == pytest.approx(reasons[0]["slowdown"])
    if after == 1.0:
        assert reasons[1]["kind"] == "recovered" and loop.speeds[1] == 1.0 and 1 not in loop.handled
    else:
        assert reasons[1]["kind"] == "fail-slow"
        assert reasons[1]["slowdown"] == pytest.approx(1.5, rel=0.15)
        assert 1.0 / loop.speeds[1] == pytest.approx(1.5, rel=0.15)
