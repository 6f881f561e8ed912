"""The live planner plans around a slow device at what its slowdown costs the rank's step: a
slower optimizer step of a millisecond is reported (a fail-slow naming the phase) but moves no
work; the same rank slow in its forward and backward compute is planned around."""

from __future__ import annotations

import numpy as np
import pytest

from resihp.detect.config import DetectorConfig
from resihp.runtime.config import RunConfig
from resihp.runtime.live import LiveLoop
from resihp.runtime.recorder import rows_frame

ONSET = 15


def _rows(step: int, rng: np.random.Generator, slow: tuple[str, ...]) -> list[dict]:
    """One step of a DP 4 job, each rank's ops back to back from the step's start, with 1%
    lognormal noise per op; rank 1 runs the ``slow`` optypes 2x slower from ``ONSET``."""
    out = []
    for rank in range(4):
        clock = float(step)
        ops = [(optype, work, {"mb_id": mb, "seq_id": mb, "seq_lens": [200, 56], "tokens": 256})
               for mb in range(2)
               for optype, work in (("forward-compute", 0.1), ("backward-compute", 0.2))]
        for optype, work, fields in ops + [("optimizer", 0.001, {})]:
            factor = 2.0 if rank == 1 and step >= ONSET and optype in slow else 1.0
            d = work * factor * float(np.exp(rng.normal(0.0, 0.01)))
            out.append({"step": step, "rank": rank, "dp_rank": rank, "stage": 0, "tp_rank": 0,
                        "optype": optype, "start_ts": clock, "duration": d, **fields})
            clock += d
        out.append({"step": step, "rank": rank, "dp_rank": rank, "stage": 0, "tp_rank": 0,
                    "optype": "step", "start_ts": float(step), "duration": clock - step})
    return out


def _run(slow: tuple[str, ...]) -> LiveLoop:
    loop = LiveLoop(RunConfig.from_flags(layers=4, dp=4, pp=1, tp=1),
                    detector_config=DetectorConfig(calibration_steps=8, fit_cost=False))
    loop._post = lambda change: None  # the job's side of a change is not under test here
    rng = np.random.default_rng(0)
    for step in range(40):
        loop._observe(step, rows_frame(_rows(step, rng, slow)))
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
