"""Slow links in the replay: their own effect (transfer time, not compute), Greyhound's mix of
communication and compute fail-slows in its generator, and the communication fail-slow family where
resihp (link-slow found, the link priced by the planner) is ahead of every other policy."""

from __future__ import annotations

import numpy as np
import pytest

from resihp.errors import InputError
from resihp.paths import resolve
from resihp.plan.cost import grad_sync_s
from resihp.replay.engine import Replay
from resihp.replay.failures import GREYHOUND_COMMUNICATION, scenario_events
from resihp.replay.layout import compile_layout
from resihp.replay.policies.resihp import Resihp
from resihp.replay.policies.restart import CheckpointRestart
from resihp.replay.run import compare
from resihp.replay.scenario import load_scenario
from tests.replay_fixtures import BASE, write

SLOW_LINK = [
    {"at": "1h", "device": 13, "kind": "link", "factor": 8.0},
    {"at": "3h", "device": 13, "kind": "recover"},
]
SLOW_FABRIC = {**BASE["cluster"], "inter_node_gbps": 1.0}


def test_greyhound_generator_draws_the_published_mix(tmp_path):
    gen = {"kind": "greyhound", "per_day": 400, "size_class": "1node", "communication": "greyhound"}
    sc = load_scenario(write(tmp_path, duration="2d", generators=[gen]))
    events = [e for e in scenario_events(sc) if e.kind != "recover"]
    link = [e for e in events if e.kind == "link"]
    assert len(events) > 300
    assert abs(len(link) / len(events) - GREYHOUND_COMMUNICATION) < 0.05
    with pytest.raises(InputError, match="communication"):
        scenario_events(
            load_scenario(write(tmp_path, "bad.yaml", generators=[{**gen, "communication": 2}]))
        )


def test_a_slow_link_slows_transfers_not_compute(tmp_path):
    healthy = Replay(load_scenario(write(tmp_path, cluster=SLOW_FABRIC)), CheckpointRestart()).run()
    sc = load_scenario(write(tmp_path, "l.yaml", events=SLOW_LINK, cluster=SLOW_FABRIC))
    slow = Replay(sc, CheckpointRestart()).run()
    assert slow.tokens < 0.97 * healthy.tokens
    # the capacity bound counts compute only: a slow link leaves it whole
    assert slow.capacity_tokens == pytest.approx(healthy.capacity_tokens, rel=1e-6)


def test_a_slow_link_stretches_its_gradient_ring(tmp_path):
    """One pipeline stage (no boundary to cross): the slow link shows only in the step's gradient
    all-reduce, which runs at the ring's slowest link."""
    sc = load_scenario(write(tmp_path, cluster=SLOW_FABRIC, parallel={"dp": 8, "pp": 1, "tp": 8}))
    replay = Replay(sc, CheckpointRestart())
    compiled = compile_layout(replay.ctx.uniform_layout(set()))
    speeds, links = np.ones(len(sc.cluster)), np.ones(len(sc.cluster))
    links[13] = 1.0 / 4.0
    replay.sim.rng = np.random.default_rng(0)
    healthy = replay.sim.window(compiled, speeds, 4, 0, 0.0, links=np.ones(len(sc.cluster)))
    replay.sim.rng = np.random.default_rng(0)
    slow = replay.sim.window(compiled, speeds, 4, 0, 0.0, links=links)
    ring = grad_sync_s(sc.model, sc.cluster, sc.model.layers / 8, 8)
    assert ring > 0
    np.testing.assert_allclose(slow.step_time - healthy.step_time, 3.0 * ring, rtol=1e-9)


def test_resihp_finds_the_link_and_replans(tmp_path):
    sc = load_scenario(write(tmp_path, events=SLOW_LINK, cluster=SLOW_FABRIC))
    out = Replay(sc, Resihp()).run()
    found = [d for d in out.detections if d["kind"] == "link-slow"]
    assert found and found[0]["true"] and found[0]["delay_s"] < 60
    assert not [d for d in out.detections if d["kind"] == "fail-slow"]
    assert any("re-plan around slow" in a for _, a in out.actions)
    assert out.false_alarms == 0


def test_resihp_ahead_of_every_baseline_on_communication_fail_slows():
    sc = load_scenario(resolve("commslow-7b-64", "scenario"))
    assert sc.family == "comm-fail-slow"
    comparison = compare(sc)
    tokens = {o.policy: o.tokens for o in comparison.outcomes}
    assert len(tokens) >= 5
    others = {k: v for k, v in tokens.items() if k != "resihp"}
    assert all(tokens["resihp"] > v for v in others.values()), tokens
    assert np.isfinite(list(tokens.values())).all()


def test_a_replica_out_for_a_slow_card_comes_back_when_its_link_probes_healthy(tmp_path):
    """8x slow card for 2 h on a congested fabric: resihp lets the replica holding it go (both
    ends are suspect cards, the ring through them stretches every step), probes the idle link every
    ``link_recheck_s`` and plans it back in soon after it recovers."""
    sc = load_scenario(write(tmp_path, events=SLOW_LINK, cluster=SLOW_FABRIC))
    policy = Resihp()
    out = Replay(sc, policy).run()
    actions = [(t, a) for t, a in out.actions]
    around = [t for t, a in actions if "re-plan around slow" in a]
    back = [t for t, a in actions if "slowdown over" in a]
    assert around and 3600 <= around[0] < 3600 + 120
    assert back and 3 * 3600 <= back[0] <= 3 * 3600 + policy.control.config.link_recheck_s + 600, (
        around,
        back,
    )
    restart = Replay(sc, CheckpointRestart()).run()
    assert out.tokens > 1.05 * restart.tokens  # the replica's compute is cheaper than the ring
