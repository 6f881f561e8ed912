"""The cluster spec's slow links, and the planner pricing transfers at their speed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from resihp.errors import InputError
from resihp.parallel import ParallelDims
from resihp.plan.cost import AnalyticCost
from resihp.plan.links import boundary_moves, rank_swaps, replica_drops, with_link_event
from resihp.plan.plan import Pipeline, Plan, Stage
from resihp.plan.planner import Planner
from resihp.plan.specs import ClusterSpec, ModelSpec
from resihp.plan.timing import StageCoster

CLUSTER = {
    "name": "four",
    "nodes": [{"name": "n0", "devices": 4}],
    "device": {"memory_gb": 8.0, "tflops": 0.05},
    "memory_reserve_gb": 0.0,
    "bandwidth": {"intra_node_gbs": 0.005, "inter_node_gbs": 0.005},
}
MODEL = ModelSpec(
    layers=4,
    hidden=64,
    heads=2,
    ffn_hidden=256,
    vocab=512,
    max_seq_len=512,
    global_batch_tokens=8192,
    microbatch_tokens=512,
    schedule="1f1b",
    name="tiny",
    tp=1,
    pp=2,
)


def _plan() -> Plan:
    dims = ParallelDims(2, 2)
    pipes = [
        Pipeline(
            d,
            (Stage((dims.rank_of(d, 0),), (0, 2)), Stage((dims.rank_of(d, 1),), (2, 4))),
            8,
            home=d,
        )
        for d in range(2)
    ]
    return Plan(4, dims, pipes, [], policy="current")


def test_links_read_written_and_checked():
    cluster = ClusterSpec.from_dict({**CLUSTER, "links": [{"ranks": [2, 0], "speed": 0.25}]})
    assert cluster.links == ((0, 2, 0.25),) and cluster.link_speed(2, 0) == 0.25
    assert cluster.link_speed(0, 1) == 1.0 and cluster.degraded == {0, 2}
    assert ClusterSpec.from_dict(cluster.to_dict()).links == cluster.links
    assert not cluster.healthy().links and not cluster.healthy().degraded
    for bad, words in (
        ([{"ranks": [0, 0], "speed": 0.5}], "two different devices"),
        ([{"ranks": [0, 9], "speed": 0.5}], "unknown device rank 9"),
        ([{"ranks": [0, 1], "speed": 1.5}], "must be <= 1.0"),
        ([{"ranks": [0, 1]}], "'speed' is missing"),
        ([{"ranks": [0], "speed": 0.5}], r"expected \{ranks: \[a, b\]"),
    ):
        with pytest.raises(InputError, match=words):
            ClusterSpec.from_dict({**CLUSTER, "links": bad})


def test_transfers_are_charged_at_the_link_speed():
    cluster = ClusterSpec.from_dict(CLUSTER)
    plan = _plan()
    healthy = StageCoster(cluster, MODEL, AnalyticCost())
    slow = healthy.at_speeds(cluster.with_link_speeds({(0, 2): 0.1}))
    fb0, fb1 = (healthy.pipeline_fb(p.stages) for p in plan.pipelines)
    assert fb0 == fb1
    s0, s1 = (slow.pipeline_fb(p.stages) for p in plan.pipelines)
    extra = healthy.p2p_s * 9
    assert s0[0][0] == pytest.approx(fb0[0][0] + extra) and s0[1][1] == pytest.approx(
        fb0[1][1] + extra
    )
    assert s1 == fb1  # the other replica's links are healthy
    sync = healthy.at_speeds(cluster.with_link_speeds({(0, 1): 0.1}))
    assert sync.dp_sync_s(plan) == pytest.approx(10 * healthy.dp_sync_s(plan))


def test_planner_moves_work_away_from_a_slow_link():
    cluster = ClusterSpec.from_dict(CLUSTER)
    planner = Planner()
    current = _plan()
    base = planner.plan(cluster, MODEL, current, time_limit_s=1.0)
    assert [p.microbatches for p in base.pipelines] == [8, 8]
    # a slow pipeline link in replica 0: its micro-batches move to replica 1 (all of them, the
    # replica dropped, when the link is slow enough)
    for speed in (0.3, 0.05):
        piped = planner.plan(
            cluster.with_link_speeds({(0, 2): speed}), MODEL, current, time_limit_s=1.0
        )
        counts = {p.stages[0].ranks: p.microbatches for p in piped.pipelines}
        assert counts.get((0,), 0) < counts[(1,)], (speed, counts)
    # a slow link between the data-parallel peers of stage 0: an end trades places with the other
    # stage of its pipeline, so the link carries neither a reduction nor a pipeline transfer (the
    # healthy step again, for the price of moving two stages' state)
    for speed in (0.5, 0.01):
        synced = planner.plan(
            cluster.with_link_speeds({(0, 1): speed}), MODEL, current, time_limit_s=1.0
        )
        groups = [{p.stages[s].ranks[0] for p in synced.pipelines} for s in range(2)]
        hops = [{p.stages[0].ranks[0], p.stages[1].ranks[0]} for p in synced.pipelines]
        assert {0, 1} not in groups and {0, 1} not in hops, (groups, hops)
        assert synced.step_time_s == pytest.approx(base.step_time_s) and synced.migration_s > 0
    # without the swap, fewer layers on stage 0 is what is left
    moved = boundary_moves(current, cluster.with_link_speeds({(0, 1): 0.01}))
    assert all(p.stages[0].n_layers < p.stages[1].n_layers for m in moved for p in m.pipelines)


def test_rank_swaps_only_around_slow_links():
    cluster = ClusterSpec.from_dict(CLUSTER)
    assert rank_swaps(_plan(), cluster) == []
    swaps = rank_swaps(_plan(), cluster.with_link_speeds({(0, 1): 0.5}))
    placed = {tuple(tuple(s.ranks[0] for s in p.stages) for p in m.pipelines) for m in swaps}
    assert placed == {((2, 0), (1, 3)), ((0, 2), (3, 1))}
    for m in swaps:  # layers stay with their stage position
        assert [[s.layers for s in p.stages] for p in m.pipelines] == [[(0, 2), (2, 4)]] * 2


def test_boundary_moves_only_around_slow_reductions():
    cluster = ClusterSpec.from_dict(CLUSTER)
    assert boundary_moves(_plan(), cluster) == []
    moves = boundary_moves(_plan(), cluster.with_link_speeds({(2, 3): 0.5}))
    assert {tuple(s.n_layers for s in m.pipelines[0].stages) for m in moves} == {(3, 1)}


def test_link_event_prices_the_measured_transfers():
    cluster = ClusterSpec.from_dict(CLUSTER)
    coster = StageCoster(cluster, MODEL, AnalyticCost())
    f, b = coster.stage_fb(Stage((0,), (0, 2)), last=False)
    planned = (f + b) / MODEL.microbatch_tokens
    # measured: transfers take a tenth of compute per token; the planner's p2p then does too
    out = with_link_event(
        cluster, MODEL, (0, 2), 4.0, "pipeline", {"compute": 2e-5, "pipeline": 2e-6}, coster
    )
    assert out.link_speed(0, 2) == 0.25
    p2p = StageCoster(out, MODEL, AnalyticCost()).p2p_s
    assert p2p == pytest.approx(0.1 * planned * MODEL.microbatch_tokens)
    # without measurements: only the link's speed
    assert (
        with_link_event(cluster, MODEL, (0, 2), 4.0, "pipeline").inter_node_gbs
        == cluster.inter_node_gbs
    )


def test_replica_drops_spread_the_micro_batches_and_tokens():
    cluster = ClusterSpec.from_dict(CLUSTER)
    assert replica_drops(_plan(), cluster) == []
    (drop,) = replica_drops(
        _plan(), cluster.with_link_speeds({(0, 2): 0.5})
    )  # both ends: replica 0
    assert [(p.dp_rank, p.microbatches, p.tokens) for p in drop.pipelines] == [(1, 16, None)]
    plan = _plan()
    plan = replace(
        plan,
        pipelines=[
            Pipeline(p.dp_rank, p.stages, p.microbatches, p.home, 4096) for p in plan.pipelines
        ],
    )
    (drop,) = replica_drops(plan, cluster.with_link_speeds({(1, 3): 0.5}))
    assert [(p.dp_rank, p.microbatches, p.tokens) for p in drop.pipelines] == [(0, 16, 8192)]


def test_a_slow_network_card_can_cost_its_replica():
    """Every link of device 0 (its card) at 1% of its bandwidth: its ring and its pipeline hop would
    cost more than the replica's compute, so the plan runs on the other replica alone."""
    cluster = ClusterSpec.from_dict(CLUSTER).with_link_speeds(
        {(0, 1): 0.01, (0, 2): 0.01, (0, 3): 0.01}
    )
    plan = Planner().plan(cluster, MODEL, _plan(), time_limit_s=1.0)
    assert all(0 not in p.ranks for p in plan.pipelines)
    assert sum(p.microbatches for p in plan.pipelines) == 16
