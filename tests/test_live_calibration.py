"""The live planner's step estimates are paced to the job's measured steps, and every applied plan
change is checked against the steps measured while it was in force."""

from __future__ import annotations

import pytest

from resihp.detect.config import DetectorConfig
from resihp.errors import InputError
from resihp.launch.live import LiveLoop
from resihp.plan.timing import StageCoster, evaluate, expected_step
from resihp.train.config import RunConfig
from resihp.train.planning import current_plan, paced_to, plan_compute_s, predicted_step_s
from resihp.train.recorder import rows_frame


def _loop(calibration_steps: int = 5) -> LiveLoop:
    return LiveLoop(
        RunConfig.from_flags(layers=4, dp=2, pp=2, tp=1),
        detector_config=DetectorConfig(calibration_steps=calibration_steps),
    )


def _predicted(loop: LiveLoop, cluster=None) -> float:
    cluster = cluster or loop.cluster
    plan = current_plan(loop.cfg, cluster, loop.model, loop.weights, loop.ranges, loop.groups)
    return expected_step(plan, loop.planner.coster(cluster, loop.model))


def _rows(step: int, seconds: float) -> list[dict]:
    """One step of a DP 2 x PP 2 job: each rank's step record and two micro-batches' compute."""
    out = []
    for rank in range(4):
        base = {
            "step": step,
            "rank": rank,
            "dp_rank": rank // 2,
            "stage": rank % 2,
            "tp_rank": 0,
            "start_ts": float(step),
        }
        out.append({**base, "optype": "step", "duration": seconds - 0.01 * rank})
        for mb in range(2):
            for op, dur in (("forward-compute", 0.1), ("backward-compute", 0.2)):
                out.append(
                    {
                        **base,
                        "optype": op,
                        "duration": dur,
                        "mb_id": mb,
                        "seq_id": mb,
                        "seq_lens": [200, 56],
                        "tokens": 256,
                    }
                )
    return out


def test_pacing_a_cluster_scales_every_predicted_time_by_its_factor():
    loop = _loop()
    base = _predicted(loop)
    assert _predicted(loop, loop.cluster.paced(7.5)) == pytest.approx(7.5 * base, rel=1e-9)
    with pytest.raises(InputError, match="positive finite factor"):
        loop.cluster.paced(0.0)


def test_the_plan_in_force_predicts_the_median_measured_healthy_step_after_calibration():
    loop = _loop(calibration_steps=5)
    analytic = _predicted(loop)
    seconds = {0: 9.0, 1: 2.0, 2: 2.4, 3: 1.8, 4: 2.2, 5: 2.1, 6: 30.0}  # step 0: the warm-up
    for step in range(5):
        loop._observe(step, rows_frame(_rows(step, seconds[step])))
    assert loop.calibration is None  # four healthy steps so far (step 0 aside)
    for step in (5, 6):
        loop._observe(step, rows_frame(_rows(step, seconds[step])))
    # each step's time is its slowest rank's; the median of steps 1-5, not the warm-up or step 6
    assert loop.step_s == seconds
    assert loop.calibration["steps"] == 5 and loop.calibration["measured_step_s"] == pytest.approx(
        2.1
    )
    # the devices paced on the compute records (four ranks, each 2 x (0.1 + 0.2) s a step), the rest
    # of the step an overhead per stage-boundary transfer
    plan = current_plan(loop.cfg, loop.cluster, loop.model, loop.weights, loop.ranges, loop.groups)
    assert loop.calibration["compute_s"] == pytest.approx(2.4)
    assert loop.cluster.p2p_overhead_s > 0
    assert loop.cluster.p2p_overhead_s == pytest.approx(
        loop.calibration["p2p_overhead_s"], abs=1e-6
    )
    assert plan_compute_s(
        plan, StageCoster(loop.cluster, loop.model, loop.planner.cost)
    ) == pytest.approx(2.4, rel=1e-3)
    assert analytic < _predicted(loop) == pytest.approx(2.1, rel=1e-3)


def test_a_finding_inside_the_calibration_window_paces_on_the_steps_before_its_onset():
    """An event before the calibration window filled: the steps from its onset on are not the
    healthy pace (paced as healthy, the slowdown would be priced twice); the steps before it are,
    or, with too few of them, the slow steps priced with the slowdown found."""

    def slow_rows(step: int) -> list[dict]:
        rows = _rows(step, 6.0)
        for row in rows:
            if row["rank"] == 1 and row["optype"].endswith("compute"):
                row["duration"] *= 3
        return rows

    def fed(slow_from: int) -> LiveLoop:
        loop = _loop(calibration_steps=12)
        for step in range(10):
            loop._observe(
                step, rows_frame(slow_rows(step) if step >= slow_from else _rows(step, 2.0))
            )
        assert loop.calibration is None
        return loop

    loop = fed(slow_from=6)
    loop._calibrate(onset=6)
    assert loop.calibration["steps"] == 5 and loop.calibration["measured_step_s"] == pytest.approx(
        2.0
    )
    assert loop.calibration["onset_step"] == 6
    assert _predicted(loop) == pytest.approx(2.0, rel=1e-3)

    loop = fed(slow_from=2)  # one healthy step before the onset: the slow ones, priced slow
    loop.speeds[1] = 1 / 3
    loop._calibrate(onset=2)
    assert loop.calibration["steps"] == 8 and loop.calibration["measured_step_s"] == pytest.approx(
        6.0
    )
    assert (
        list(loop.cluster.speeds) == [1.0] * 4
    )  # the slowdown stays the loop's, not the cluster's
    assert _predicted(loop, loop.cluster.with_speeds(loop.speeds)) == pytest.approx(6.0, rel=1e-3)


def test_without_compute_records_one_factor_paces_every_time():
    loop = _loop()
    plan = current_plan(loop.cfg, loop.cluster, loop.model, loop.weights, loop.ranges, loop.groups)
    analytic = _predicted(loop)
    cluster, record = paced_to(loop.cluster, loop.model, plan, [2.0, 2.2, 2.1], loop.planner)
    assert (
        record["factor"] == pytest.approx(2.1 / analytic, rel=1e-3)
        and "p2p_overhead_s" not in record
    )
    assert (
        _predicted(loop, cluster) == pytest.approx(2.1, rel=1e-3) and cluster.p2p_overhead_s == 0.0
    )


def test_each_applied_change_is_measured_over_the_steps_it_was_in_force():
    loop = _loop()
    loop.step_s = {s: 1.0 for s in range(10)} | {s: 2.0 for s in range(11, 20)} | {20: 5.0, 21: 4.0}
    loop.changes = [
        {"id": 1, "predicted_step_s": 1.8},
        {"id": 2, "predicted_step_s": 3.0},
        {"id": 3, "predicted_step_s": 1.0},
    ]
    first, second, never = loop.measured_steps([10, 20, None])
    # steps 11-19 (the applied step itself carries the change's own cost; step 20 the next change)
    assert first == {"measured_step_s": 2.0, "measured_steps": 9, "step_error": -0.1}
    assert second == {}  # one step under it: too few to measure
    assert never == {}


def test_a_slow_ranks_peers_that_moved_since_the_pace_re_pace_the_decision():
    """The detector measures a slow rank against its peers; where the fault moved the peers too
    (shared cores: a rank slowed by sleeps frees one), the decision is paced on the peers' level
    since the onset against their level in the pace's steps, so the slow rank is priced at its own
    cost and not at its ratio to peers that run faster now."""

    def rows(step: int, peers: float, slow: float) -> list[dict]:
        """One step of a DP 4 job, rank 1's compute ``slow`` times, the others' ``peers`` times."""
        out = []
        for rank in range(4):
            base = {
                "step": step,
                "rank": rank,
                "dp_rank": rank,
                "stage": 0,
                "tp_rank": 0,
                "start_ts": float(step),
            }
            f = slow if rank == 1 else peers
            out.append({**base, "optype": "step", "duration": 2.0 * max(peers, slow)})
            for mb in range(2):
                lens = [200, 56] if (mb + step) % 2 else [128, 64, 64]
                for op, dur in (("forward-compute", 0.1), ("backward-compute", 0.2)):
                    out.append(
                        {
                            **base,
                            "optype": op,
                            "duration": dur * f,
                            "mb_id": mb,
                            "seq_id": mb,
                            "seq_lens": lens,
                            "tokens": sum(lens),
                        }
                    )
        return out

    loop = LiveLoop(
        RunConfig.from_flags(layers=4, dp=4, pp=1, tp=1),
        detector_config=DetectorConfig(calibration_steps=6),
    )
    posted: list[dict] = []
    loop._post = posted.append
    for step in range(8):
        loop._observe(step, rows_frame(rows(step, 1.0, 1.0)))
    assert loop.calibration is not None and not loop.changes
    event = {"kind": "fail-slow", "rank": 1, "onset_step": 8}
    for step in range(8, 12):
        loop._observe(step, rows_frame(rows(step, 0.8, 2.4)))
        if step == 9 and not loop.changes:
            level, record = loop._present_pace(step, event)
            assert level == pytest.approx(0.8, rel=1e-6)
            assert record == {"level": 0.8, "steps": 2, "ranks": [0, 2, 3]}
    # the loop's own decision: rank 1 found slow against its peers (3x), priced on their pace now
    change = loop.changes[0]
    assert change["reason"]["rank"] == 1 and change["reason"]["slowdown"] == pytest.approx(
        3.0, rel=0.01
    )
    assert change["present_pace"]["level"] == pytest.approx(0.8, rel=1e-6) and posted
    # only on the pace's own plan and detector: after a change, none
    assert loop._present_pace(12, event) is None
    loop.changes = []
    assert loop._present_pace(11, {"kind": "fail-slow", "rank": 1}) is None  # no onset


def test_a_pipelines_levels_against_its_peers_give_no_present_pace():
    """With pipeline stages the detector scales an op's cost by the same micro-batch on the other
    stages: its levels are against peers, so the decision keeps the pace of the calibration."""
    loop = _loop(calibration_steps=6)
    loop._post = lambda change: None
    for step in range(8):
        loop._observe(step, rows_frame(_rows(step, 2.0)))
    assert "peers" in loop.detector.cost_model
    assert loop._present_pace(8, {"kind": "fail-slow", "rank": 1, "onset_step": 6}) is None


def test_a_change_of_shares_is_priced_on_the_expected_step_not_the_mean():
    """Two replicas of equal shares step at the slower of two variable sums of micro-batch costs;
    one holding most of the micro-batches steps at its own sum. A pace taken on the mean-priced
    step would count the launch's slowest-of-two excess as device speed and over-price the skewed
    plan (measured on this project's CPU job: 10% high)."""
    loop = LiveLoop(RunConfig.from_flags(layers=4, dp=2, pp=1, tp=1))
    coster = loop.planner.coster(loop.cluster, loop.model)

    def plan(weights: list[float]):
        return current_plan(loop.cfg, loop.cluster, loop.model, weights, loop.ranges, loop.groups)

    launch, skewed = plan([1.0, 1.0]), plan([7.0, 1.0])
    excess = [expected_step(p, coster) / evaluate(p, coster).step_time_s for p in (launch, skewed)]
    assert excess[0] > excess[1] + 0.02 and excess[1] >= 1.0 - 1e-9
    paced, record = paced_to(loop.cluster, loop.model, launch, [2.0] * 5, loop.planner)
    assert record["analytic_step_s"] == pytest.approx(expected_step(launch, coster), rel=1e-9)
    repaced = loop.planner.coster(paced, loop.model)
    assert expected_step(launch, repaced) == pytest.approx(2.0, rel=1e-6)
    assert expected_step(skewed, repaced) == pytest.approx(
        2.0 * expected_step(skewed, coster) / expected_step(launch, coster), rel=1e-6
    )
    # the loop's estimate for a change is the plan's expected step where the planner filled it
    solved = loop.planner.plan(paced.with_speeds({1: 1 / 3}), loop.model, launch, time_limit_s=2.0)
    assert predicted_step_s(solved) == solved.expected_step_time_s > solved.step_time_s
