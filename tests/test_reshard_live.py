"""Live layout changes without restarting processes: a broadcast plan change with a ``layout``
makes every rank build a new generation of process groups and reshard parameters and AdamW state
into it from memory. (2, 1, 2) -> rank 1 excluded as a hot spare, its replica re-formed at tp 1 on
rank 0 beside a tp-2 replica (the planner's plan for a slow rank 1) -> the spare taken back into
re-formed tensor-parallel groups of another depth, (1, 2, 2) on ranks 3, 2, 1, 0 (inside a
tensor-parallel group world ranks ascend with the tp rank: 2, 3, 0, 1) -> replicas of different
depths (two tp-1 stages beside one tp-2 stage) -> a replica whose stages differ in tensor-parallel
size (a tp-2 stage feeding a tp-1 stage) beside a one-rank replica; the losses stay the
uninterrupted run's. Four
ranks spawned on gloo; the model has fused QKV and SwiGLU, a padded vocabulary and tied
embeddings (``tests.test_reshard.BASE``)."""

from pathlib import Path

import pytest
import torch

from tests.gloo_ranks import spawn_ranks
from tests.replica_replay import ISSUE_RUN
from tests.test_reshard import BASE

STEPS = 10
CHANGES = {  # what the planner gives for a slow rank 1: its replica re-formed at tp 1 without it
    2: {
        "version": 1,
        "layout": {"pipelines": [[[0]], [[2, 3]]]},
        "dp_weights": [3, 5],
        "reason": "exclude 1",
    },
    4: {
        "version": 2,
        "layout": {"dp": 1, "pp": 2, "tp": 2, "ranks": [3, 2, 1, 0]},
        "layer_split": [3, 1],
        "reason": "take rank 1 back",
    },
    6: {
        "version": 3,
        "layout": {"pipelines": [[[0], [1]], [[2, 3]]]},
        "layer_splits": [[3, 1], [4]],
        "reason": "replicas of different depths",
    },
    8: {
        "version": 4,
        "layout": {"pipelines": [[[2, 3], [1]], [[0]]]},
        "layer_splits": [[1, 3], [4]],
        "dp_weights": [5, 3],
        "reason": "stages of different tensor-parallel sizes",
    },
}


def _rank(rank: int, world: int, tmp: str) -> dict:
    from resihp.ckpt.universal import save
    from resihp.train.config import RunConfig
    from resihp.train.engine import Engine

    result: dict = {}
    cfg = RunConfig.from_flags(**{**BASE, "steps": STEPS}, dp=2, pp=1, tp=2, out=tmp)
    reference = Engine(cfg, torch.device("cpu"))
    result["reference"] = [reference.train_step(s).loss for s in range(STEPS)]
    save(
        Path(tmp) / "reference",
        reference.model,
        reference.optimizer,
        STEPS - 1,
        {},
        reference.tp,
        reference.model_cfg,
        write=reference.dp_rank == 0,
    )
    del reference
    engine = Engine(cfg, torch.device("cpu"))
    losses, seen = [], []
    for step in range(STEPS):
        change = engine.sync_plan(step, CHANGES.get(step) if rank == 0 else None)
        if change is not None:
            seen.append({"active": list(engine.active), "spare": engine.coords is None})
        losses.append(engine.train_step(step).loss)
    # the last layout mixes depths and tp sizes: one replica writes a whole, non-overlapping
    # checkpoint (replica 0: layer 0 and the embeddings at tp 2, the rest and the head at tp 1)
    save(
        Path(tmp) / "after",
        engine.model,
        engine.optimizer,
        STEPS - 1,
        {},
        engine.tp,
        engine.model_cfg,
        write=engine.dp_rank == 0,
    )
    result.update(
        losses=losses,
        seen=seen,
        changes=engine.plan_changes,
        probes=[r["step"] for r in engine.rec.rows if r["optype"] == "probe"],
    )
    return result


@pytest.fixture(scope="module")
def live_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("live")


@pytest.fixture(scope="module")
def live(live_dir) -> list[dict]:
    tmp = live_dir
    out = spawn_ranks(_rank, 4, tmp)
    return out


@pytest.mark.slow
def test_layout_changes_live_keep_the_uninterrupted_losses(live):
    reference = live[0]["reference"]
    for step in range(STEPS):  # the global loss, from whichever rank holds the last stage then
        got = [r["losses"][step] for r in live if r["losses"][step] is not None]
        assert got, f"no rank trained step {step}"
        assert abs(got[0] - reference[step]) <= 1e-5 * abs(reference[step]), (
            step,
            got[0],
            reference[step],
        )


@pytest.mark.slow
def test_the_excluded_rank_is_a_spare_then_taken_back(live):
    assert live[1]["seen"] == [
        {"active": [0, 2, 3], "spare": True},
        {"active": [2, 3, 0, 1], "spare": False},
        {"active": [0, 1, 2, 3], "spare": False},
        {"active": [2, 3, 1, 0], "spare": False},
    ]
    assert [s["spare"] for s in live[0]["seen"]] == [False, False, False, False]
    first, second, third, fourth = live[0]["changes"]
    assert (
        first["generation"] == 1
        and first["spares"] == [1]
        and second["generation"] == 2
        and second["spares"] == []
    )
    assert third["spares"] == [] and fourth["spares"] == []
    # every rank's first three steps record its probe where it trains (the fastest is its
    # reference: steps 0 and 1 for rank 1); the spare re-checks itself with backoff while it is one
    # (steps 2 and 3, then it is taken back)
    assert live[1]["probes"] == [0, 1, 2, 3] and live[0]["probes"] == [0, 1, 2]
    for change in (
        first,
        second,
        third,
        fourth,
    ):  # what moved, against the least the two layouts need
        assert 0 < change["minimum_bytes"] <= change["read_bytes"] <= change["moved_bytes"]
        assert change["relayout_s"] > 0


@pytest.mark.slow
def test_a_layout_of_mixed_replicas_saves_the_model_the_uninterrupted_run_has(live, live_dir):
    from resihp.ckpt.universal import read_full

    reference, after = read_full(live_dir / "reference"), read_full(live_dir / "after")
    assert sorted(reference) == sorted(after)
    for key, value in reference.items():
        if key.startswith("model.layers.") and key.endswith(".qkv.bias"):
            # the key bias has no true gradient (softmax ignores a shift): AdamW turns the ~1e-10
            # rounding noise into lr-sized steps that differ by layout, so Q and V biases only
            value, got = value[[0, 2]], after[key][[0, 2]]
        else:
            got = after[key]
        torch.testing.assert_close(got, value, rtol=1e-4, atol=1e-6, msg=key)


def test_a_spare_that_runs_at_its_reference_speed_again_is_taken_back():
    from resihp.launch.live import LiveLoop
    from resihp.train.config import RunConfig
    from resihp.train.recorder import rows_frame

    loop = LiveLoop(RunConfig.from_flags(layers=4, dp=2, pp=1, tp=2))
    posted = []
    loop._post = posted.append

    def probe(step, rank, s):
        return {
            "step": step,
            "rank": rank,
            "dp_rank": 0,
            "stage": 0,
            "tp_rank": 0,
            "optype": "probe",
            "start_ts": 0.0,
            "duration": s,
        }

    loop._observe(0, rows_frame([probe(0, r, 0.01) for r in range(4)]))  # each rank's reference
    # the planner's plan for a slow rank 1, in force: rank 1 a hot spare
    loop.groups, loop.weights, loop.ranges = [[(0,)], [(2, 3)]], [3.0, 5.0], [[(0, 4)], [(0, 4)]]
    loop.speeds[1], loop.handled = 0.25, {1}
    loop._observe(5, rows_frame([probe(5, 1, 0.04)]))  # still four times slower: stays a spare
    assert posted == [] and loop.probes == [{"step": 5, "rank": 1, "slowdown": 4.0}]
    loop._observe(9, rows_frame([probe(9, 1, 0.011)]))  # healthy again
    (change,) = posted
    assert change["reason"]["kind"] == "recovered" and change["applied"] is True
    assert sorted(r for p in change["layout"]["pipelines"] for s in p for r in s) == [0, 1, 2, 3]


def test_the_live_loop_takes_a_scheduled_layout_change_as_the_plan_in_force():
    """A change scheduled in the run config (``live.replan``; the re-formed restart's) is applied by
    the job before its step; the live loop plans from it afterwards, not from the launch layout."""
    from resihp.launch.live import LiveLoop
    from resihp.train.config import RunConfig
    from resihp.train.recorder import rows_frame

    change = {
        "step": 2,
        "layout": {"pipelines": [[[0], [1]], [[2]]]},
        "layer_splits": [[1, 3], [4]],
        "dp_weights": [3, 1],
    }
    loop = LiveLoop(RunConfig.from_flags(layers=4, dp=1, pp=3, tp=1, replan=[change]))

    def row(step, rank):
        return {
            "step": step,
            "rank": rank,
            "dp_rank": 0,
            "stage": 0,
            "tp_rank": 0,
            "optype": "probe",
            "start_ts": 0.0,
            "duration": 0.01,
        }

    loop._observe(1, rows_frame([row(1, r) for r in range(3)]))
    assert loop.groups == [[(0,), (1,), (2,)]] and loop.weights == [1.0]  # the launch layout
    before = loop.detector
    loop._observe(2, rows_frame([row(2, r) for r in range(3)]))
    assert loop.groups == [[(0,), (1,)], [(2,)]] and loop.weights == [3, 1]
    assert (
        loop.ranges == [[(0, 1), (1, 4)], [(0, 4)]] and loop.detector is not before
    )  # a fresh baseline


FACTOR, ONSET, LIVE_STEPS = 6, 10, 20


def _tp_job(out: Path, inject: list[str]):
    """DP 2 x TP 2 (the issue's run, ``ISSUE_RUN``) with the live detector and planner; returns the
    live loop, the job's record of the changes it applied, and the trace."""
    import json

    from resihp.detect.config import DetectorConfig
    from resihp.launch.live import LiveLoop
    from resihp.launch.supervisor import supervise
    from resihp.opstrace import read_ops_trace
    from resihp.train.config import RunConfig
    from resihp.train.worker import write_job_files

    cfg = RunConfig.from_flags(**ISSUE_RUN, steps=LIVE_STEPS, inject=inject, out=str(out))
    # the detector calibrates on 8 steps (as in the demo test), so the fault comes after its
    # baseline
    loop = LiveLoop(cfg, detector_config=DetectorConfig(calibration_steps=8))
    # recovery "none": a process that exits ends the job, so a run that finishes restarted nothing;
    # a slow rank's op can outlast the default hang timeout on a loaded machine: not this test's
    # subject
    outcome = supervise(cfg, on_steps=loop.on_steps, hang_timeout_s=300.0)
    assert outcome.error is None, outcome.error
    assert loop.error is None, loop.error
    loop.save()
    write_job_files(cfg, out)
    applied = json.loads((out / "plan_changes.json").read_text())
    return loop, applied, read_ops_trace(out / "ops.parquet")


@pytest.mark.slow
def test_a_slow_tensor_parallel_rank_is_excluded_live_with_the_same_losses(
    tmp_path, monkeypatch, issue_run_losses
):
    """The issue's run: DP 2 x TP 2, rank 1 slow from step 10. Its TP peer waits for it inside the
    tensor-parallel all-reduces, but that wait is recorded apart (``wait_s``) and taken out, so rank
    1 is found and its peer is not; the planner's plan excludes it (rank 0 alone at tp 1 beside the
    tp-2 replica), which the job applies live: the same processes form a new generation of process
    groups, rank 1 becomes a hot spare that trains nothing more, and the losses are the fault-free
    run's.

    Why it was load-sensitive: with the CLI's 20-step calibration the fault at step 10 fell inside
    the detector's baseline, so the slowdown measured low (4x as 2.0-2.4x, 10x as 3.7x on 2 busy
    cores) and the planner, which excludes from about 2.2x, only shifted shares. A baseline of the 8
    steps before the fault measures it whole (10x as 11.9x at a load of 12); 6x leaves a margin."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    loop, applied, trace = _tp_job(tmp_path / "slow", [f"slow:rank=1,factor={FACTOR},step={ONSET}"])
    # the change that re-forms the layout, as the job applied it (a share-only change may come
    # first)
    change = next((c for c in applied if "layout" in c), None)
    assert change is not None, (loop.events, loop.changes)
    assert change["reason"]["rank"] == 1 and ONSET <= change["step"] < LIVE_STEPS
    # found up to then: rank 1, never its waiting TP peer (another rank's false alarm on a busy
    # machine is not this test's subject: the planner keeps the plan in force for a small one)
    found = [
        e["rank"]
        for e in loop.events
        if e["kind"] == "fail-slow" and e["detected_step"] <= change["decided_step"]
    ]
    assert 1 in found and 0 not in found, loop.events
    stages = [stage for p in change["layout"]["pipelines"] for stage in p]
    assert sorted(stages) == [[0], [2, 3]] and change["spares"] == [1], change
    assert change["generation"] == 1 and 0 < change["minimum_bytes"] <= change["moved_bytes"]
    # from that step on, rank 1 computes nothing; the others train every step
    compute = trace[trace.optype.isin(["forward-compute", "backward-compute"])]
    assert compute[(compute["rank"] == 1) & (compute.step >= change["step"])].empty
    for rank in (0, 2, 3):
        assert sorted(set(compute[compute["rank"] == rank].step)) == list(range(LIVE_STEPS)), rank

    # the fault-free run's losses: one process training the same batches (``tests/conftest.py``)
    got, want = trace[trace.optype == "step"].groupby("step").loss.max(), issue_run_losses
    assert list(got.index) == list(range(LIVE_STEPS)) and len(want) >= LIVE_STEPS
    for step in range(LIVE_STEPS):
        assert abs(got[step] - want[step]) <= 1e-4 * abs(want[step]), (step, got[step], want[step])
