import numpy as np
import pytest

from resihp.replay.engine import Replay
from resihp.replay.layout import compile_layout
from resihp.replay.policies import make_policies
from resihp.replay.policies.oobleck import Oobleck
from resihp.replay.policies.recycle import ReCycle
from resihp.replay.policies.restart import CheckpointRestart
from resihp.replay.run import compare
from resihp.replay.scenario import load_scenario
from tests.replay_fixtures import write


def test_healthy_run_reaches_the_capacity_bound(tmp_path):
    sc = load_scenario(write(tmp_path))
    out = Replay(sc, CheckpointRestart()).run()
    assert out.effective_time == 1.0 and out.lost_s == 0 and len(out.actions) == 1
    assert out.bound_fraction == pytest.approx(1.0, abs=0.02)
    # 7B on 64 A100s at 50% MFU: 6 * params * tokens/s must stay under the cluster's FLOP rate
    flops = 6 * sc.model.params * out.tokens_per_s
    assert 0.2 < flops / (64 * 312e12) < 0.5


def test_cost_per_step_does_not_grow_with_steps(tmp_path):
    short = Replay(
        load_scenario(write(tmp_path, "a.yaml", duration="4h")), CheckpointRestart()
    ).run()
    long = Replay(
        load_scenario(write(tmp_path, "b.yaml", duration="40h")), CheckpointRestart()
    ).run()
    assert long.replayed_steps > 9 * short.replayed_steps
    assert (
        long.simulated_steps / long.replayed_steps <= short.simulated_steps / short.replayed_steps
    )


def test_unhandled_slow_device_drags_the_job(tmp_path):
    events = [
        {"at": "1h", "device": 5, "kind": "slow", "factor": 2.0},
        {"at": "3h", "device": 5, "kind": "recover"},
    ]
    sc = load_scenario(write(tmp_path, events=events))
    out = Replay(sc, CheckpointRestart()).run()
    rate = {round(a): r for a, b, r in out.timeline}
    healthy = np.mean([r for a, b, r in out.timeline if b <= 3600])
    slow = np.mean([r for a, b, r in out.timeline if a >= 3600 and b <= 3 * 3600])
    assert 0.45 < slow / healthy < 0.75  # one stage at half speed, its pipeline and all others wait
    assert rate and out.bound_fraction < 0.9


def test_fail_stop_costs_by_policy(tmp_path):
    events = [
        {"at": "1h30m", "node": 2, "kind": "stop"},
        {"at": "3h30m", "node": 2, "kind": "recover"},
    ]
    sc = load_scenario(write(tmp_path, events=events))
    cr = Replay(sc, CheckpointRestart()).run()
    assert cr.lost_s == pytest.approx(1800.0)  # back to the 1 h checkpoint
    assert cr.downtime_s == pytest.approx(
        600 + 30 + 600
    )  # restart + heartbeat, then planned restart
    for policy in (Oobleck(), ReCycle()):
        out = Replay(sc, policy).run()
        assert out.lost_s == 0.0
        assert out.downtime_s == pytest.approx(2 * 60 + 30)
        assert out.tokens > cr.tokens


def test_dead_device_in_layout_stalls(tmp_path):
    class Ignore(CheckpointRestart):
        def on_stop(self, ctx, devices):
            from resihp.replay.engine import Reaction

            return Reaction()

    sc = load_scenario(write(tmp_path, events=[{"at": "2h", "device": 9, "kind": "stop"}]))
    out = Replay(sc, Ignore()).run()
    assert out.timeline[-1][2] == 0.0 and out.timeline[-1][1] == sc.duration_s


def test_ops_records_follow_the_contract(tmp_path):
    from resihp.opstrace import validate_ops_trace

    sc = load_scenario(write(tmp_path))
    replay = Replay(sc, CheckpointRestart())
    layout = replay.ctx.uniform_layout(set())
    speeds = np.ones(len(sc.cluster))
    speeds[9] = 0.5
    w = replay.sim.window(compile_layout(layout), speeds, 4, 100, 0.0)
    df = validate_ops_trace(w.ops())
    assert set(df["optype"]) == {"forward-compute", "backward-compute"}
    assert df["step"].min() == 100 and df["rank"].max() < w.meta.world_size
    assert (w.rank_device[df["rank"]] == df["device"]).all()
    per_dev = df[df.optype == "forward-compute"].groupby("device")["duration"].mean()
    peers = per_dev[[8, 10, 11]].mean()
    assert per_dev[9] / peers == pytest.approx(2.0, rel=0.15)  # its own kernels, not the wait
    assert (df["seq_lens"].map(sum).to_numpy() == df["tokens"].to_numpy()).all()


def test_every_policy_runs_through_the_one_engine(tmp_path):
    events = [
        {"at": "1h", "device": 5, "kind": "slow", "factor": 2.5},
        {"at": "2h", "node": 6, "kind": "stop"},
        {"at": "3h", "device": 5, "kind": "recover"},
    ]
    sc = load_scenario(write(tmp_path, events=events))
    result = compare(sc)
    names = [o.policy for o in result.outcomes]
    assert names == [p.name for p in make_policies(None)]
    doc = result.summary()
    for p in doc["policies"]:
        assert {"name", "tokens_per_s", "effective_time", "false_alarms", "bound_fraction"} <= set(
            p
        )
        assert 0 < p["bound_fraction"] <= 1.05
    assert doc["capacity_tokens_per_s"] > 0 and set(doc["speedups"]) == set(names) - {"resihp"}


def test_a_windows_records_made_a_few_steps_at_a_time_are_its_records(tmp_path):
    # the detector feed makes a window's records a few steps at a time (Window.step_columns): the
    # parts are the whole window's records, and a window without a maker of its own slices them
    import pandas as pd

    from resihp.replay.interface import Window

    sc = load_scenario(write(tmp_path))
    replay = Replay(sc, CheckpointRestart())
    speeds = np.ones(len(sc.cluster))
    speeds[3] = 0.5
    w = replay.sim.window(compile_layout(replay.ctx.uniform_layout(set())), speeds, 7, 40, 0.0)

    def frame(cols: dict) -> pd.DataFrame:
        df = pd.DataFrame({k: np.asarray(v) for k, v in cols.items() if k != "seq_lens"})
        df["optype"] = df["optype"].astype(str)
        return df.sort_values(list(df.columns)).reset_index(drop=True)

    whole = frame(w.columns())
    parts = [w.step_columns(i, min(i + 3, 7)) for i in range(0, 7, 3)]
    assert [sorted(set(p["step"])) for p in parts] == [[40, 41, 42], [43, 44, 45], [46]]
    pd.testing.assert_frame_equal(
        frame({k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in parts[0]}), whole
    )
    sliced = Window(
        w.steps,
        w.start_s,
        w.step_time,
        w.tokens,
        w.layout,
        w.ops,
        w.meta,
        w.rank_device,
        w.rank_work,
        w.columns,
    )
    pd.testing.assert_frame_equal(frame(sliced.step_columns(3, 6)), frame(parts[1]))


def test_records_of_a_padded_layout_name_each_ranks_device_and_place(tmp_path):
    # a replica with a narrower stage (padded ranks) next to a full one, two shape groups: the
    # records of every window of the layout (their per-step part cached on the layout) sit on the
    # real ranks only, each with its device and (replica, stage, tp rank)
    from resihp.replay.layout import Replica, ReplicaLayout

    sc = load_scenario(write(tmp_path))
    replay = Replay(sc, CheckpointRestart())
    layout = ReplicaLayout(
        (
            Replica(((0, 1), (2, 3)), (16, 16), 8),
            Replica(((4, 5), (6,)), (20, 12), 4),
            Replica(((8, 9),), (32,), 2),
        )
    )
    compiled = compile_layout(layout)
    k = sc.settings.ops_microbatches
    for n, first in ((5, 0), (3, 5), (5, 8)):  # two windows of 5 steps share the cache
        w = replay.sim.window(compiled, np.ones(len(sc.cluster)), n, first, 0.0)
        for cols in (w.columns(), w.step_columns(1, n)):
            rank, step = np.asarray(cols["rank"]), np.asarray(cols["step"])
            assert (w.rank_device[rank] == np.asarray(cols["device"])).all()
            assert (
                w.rank_place[rank]
                == np.stack([np.asarray(cols[c]) for c in ("dp_rank", "stage", "tp_rank")], 1)
            ).all()
            real = np.flatnonzero(w.rank_device >= 0)
            assert len(real) == 9
            pairs, counts = np.unique(np.stack([step, rank]), axis=1, return_counts=True)
            per = {(int(s), int(r)): int(c) for (s, r), c in zip(pairs.T, counts)}
            steps = sorted(set(step.tolist()))
            assert set(per) == {(s, r) for s in steps for r in real}
            mbs = [min(k, m) for m in (8, 4, 2)]  # by replica
            assert all(c == 2 * mbs[w.rank_place[r, 0]] for (s, r), c in per.items())
