"""Designed pipelines (mixed TP sizes and depths, ``resihp.plan.designs``): the knapsack that
packs them is exact, their placement respects nodes and faults, their step model is the
evaluator's where priced, and the plans they make are valid and beat the uniform layout where the
tight bound said it leaves throughput behind (64 devices, 13B)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resihp.plan.bound import tight_bound
from resihp.plan.cost import AnalyticCost
from resihp.plan.designs import (
    Designer,
    _joined_stages,
    design_plan,
    design_plans,
    first_pool,
    free_devices,
    pack,
    place,
    slow_packing,
)
from resihp.plan.knapsack import choose, unbounded_knapsack
from resihp.plan.layout import layer_ranges
from resihp.plan.plan import Stage, Stages, plan_problems
from resihp.plan.planner import Planner, healthy_plan
from resihp.plan.timing import StageCoster, evaluate
from resihp.plan.tokens import balanced
from tests.test_plan_planner import load


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 9), st.floats(0.0, 5.0)), min_size=1, max_size=4),
    st.integers(0, 30),
)
def test_knapsack_packing_is_the_best_by_exhaustive_search(items, capacity):
    cost = np.array([c for c, _ in items])
    value = np.array([v for _, v in items])
    best = max(
        sum(k * v for k, v in zip(ks, value))
        for ks in itertools.product(*[range(capacity // c + 1) for c in cost])
        if sum(k * c for k, c in zip(ks, cost)) <= capacity
    )
    total, counts = choose(cost, value, capacity)
    assert total == pytest.approx(best, abs=1e-9)
    assert sum(k * v for k, v in zip(counts, value)) == pytest.approx(best, abs=1e-9)
    assert sum(k * c for k, c in zip(counts, cost)) <= capacity
    assert unbounded_knapsack(cost, value, capacity)[-1] == pytest.approx(best, abs=1e-9)


@pytest.fixture(scope="module")
def h100_64():
    c, m = load("h100-64", "gpt-13b")
    coster = StageCoster(c, m, AnalyticCost())
    return c, m, coster, Designer(coster)


def test_priced_designs_step_as_the_evaluator_does(h100_64):
    c, m, coster, designer = h100_64
    plan = design_plan(coster, healthy_plan(c, m).layout, designer)
    assert len({tuple(s.tp for s in p.stages) for p in plan.pipelines}) >= 1
    for p in plan.pipelines:
        d = next(
            x
            for x in designer.designs(10**6, len(c))
            if x.tps == tuple(s.tp for s in p.stages)
            and x.counts == tuple(s.n_layers for s in p.stages)
        )
        priced = designer.priced(d, p.microbatches)
        assert priced.step(p.microbatches) == pytest.approx(
            coster.pipeline_step(p.stages, p.microbatches)
        )


def test_designed_plan_beats_the_uniform_layout_within_the_tight_bound(h100_64):
    c, m, coster, designer = h100_64
    uniform = healthy_plan(c, m)
    plan = evaluate(design_plan(coster, uniform.layout, designer), coster)
    assert plan_problems(plan, c, m) == []
    assert sum(p.microbatches for p in plan.pipelines) == m.microbatches
    # mixed TP sizes inside a pipeline: what the uniform layout cannot do
    assert any(len({s.tp for s in p.stages}) > 1 for p in plan.pipelines)
    assert plan.step_time_s < uniform.step_time_s
    assert plan.tokens_per_s <= tight_bound(c, m).tokens_per_s * (1 + 1e-9)


def test_placement_keeps_groups_in_nodes_and_away_from_faults(h100_64):
    c, m, coster, designer = h100_64
    faulty = c.with_speeds({3: 0.0, 9: 0.0, 10: 0.5, 33: 0.0})
    plan = design_plan(
        coster.at_speeds(faulty), uniform_layout := healthy_plan(c, m).layout, designer
    )
    assert plan.layout == uniform_layout
    assert plan_problems(plan, faulty, m) == []
    used = [r for p in plan.pipelines for r in p.ranks]
    assert len(used) == len(set(used)) and not {3, 9, 33} & set(used)
    for p in plan.pipelines:
        for s in p.stages:
            assert len({c.devices[r].node for r in s.ranks}) == 1
            assert 10 not in s.ranks or s.ranks == (
                10,
            )  # the slow device slows no full-speed group
    # a pipeline whose group finds no node is left out, never split across nodes
    d = next(x for x in designer.designs(10**6, 8) if 8 in x.tps)
    assert place([(d, 1)], range(7), {r: 0 for r in range(8)}) == []


def test_first_rounds_that_design_for_the_same_devices_build_the_same_plans(h100_64):
    """The planner skips a first round whose devices another round already designed for: its
    plans are the same, as the first round's pool is all the choice makes."""
    c, m, coster, designer = h100_64
    faulty = c.with_speeds({3: 0.0, 9: 0.0, 10: 0.5})  # nodes 0 and 1 broken, 6 whole
    free = free_devices(faulty)
    assert free == {d.rank for d in faulty.devices if d.speed >= 1.0}
    whole, chunks = first_pool(faulty, free, "whole"), first_pool(faulty, free, "chunks")
    assert first_pool(faulty, free, "all") == free and whole == set(range(16, 64))
    assert chunks == whole | {0, 1, 2, 4, 8, 11, 12, 13}  # the first 4 of nodes 0 and 1's free
    layout = healthy_plan(c, m).layout
    # no node whole: "whole" designs for every free device, as "all" does
    broken = c.with_speeds({8 * n: 0.0 for n in range(8)})
    assert first_pool(broken, free_devices(broken), "whole") == free_devices(broken)
    plans = {
        f: design_plans(coster.at_speeds(broken), layout, designer, first_round=f)
        for f in ("all", "whole")
    }
    assert plans["all"] and [p.pipelines for p in plans["all"]] == [
        p.pipelines for p in plans["whole"]
    ]


def test_slow_devices_too_slow_for_stretched_designs_chain_into_a_pipeline_split_by_speed(h100_64):
    """Eight devices from 1.2x to 5x slower, spread over the nodes: designs stretched to the
    slowest of them carry too little, so the packing leaves them all out; one pipeline of them,
    each a stage whose layers follow its speed, carries its share and the plan is faster."""
    c, m, coster, designer = h100_64
    speeds = {r: 1 / f for r, f in zip((2, 14, 27, 29, 32, 47, 50, 53), np.linspace(5.0, 1.2, 8))}
    slow = c.with_speeds(speeds)
    at = coster.at_speeds(slow)
    plans = [
        evaluate(p, at)
        for p in design_plans(at, healthy_plan(c, m).layout, designer, variants=(False,))
    ]
    packed, chained, _joined = plans
    assert not set(speeds) & {r for p in packed.pipelines for r in p.ranks}
    assert plan_problems(chained, slow, m) == []
    assert chained.tokens_per_s > 1.01 * packed.tokens_per_s
    chain = next(p for p in chained.pipelines if set(p.ranks) <= set(speeds))
    assert len(chain.stages) >= 6 and all(s.tp == 1 for s in chain.stages)
    # the layers follow the speeds: its slowest stage near the proportional split's (an even
    # split of 40 layers over these 8 would be 2x it)
    ideal = sum(s.n_layers for s in chain.stages) / sum(speeds[s.ranks[0]] for s in chain.stages)
    assert max(s.n_layers / speeds[s.ranks[0]] for s in chain.stages) <= 1.25 * ideal


def test_slow_devices_join_pipelines_packed_for_them(h100_64):
    """The same eight slow devices: packed with the designs (``slow_packing``), each heads a
    pipeline sized for it with the few layers its speed carries there (the slower, the fewer);
    the plan is faster than the one that leaves them out and than the chain of them."""
    c, m, coster, designer = h100_64
    speeds = {r: 1 / f for r, f in zip((2, 14, 27, 29, 32, 47, 50, 53), np.linspace(5.0, 1.2, 8))}
    slow = c.with_speeds(speeds)
    at = coster.at_speeds(slow)
    packed, chained, joined = [
        evaluate(p, at)
        for p in design_plans(
            at, healthy_plan(c, m).layout, designer, variants=(False,), token_budgets=True
        )
    ]
    assert plan_problems(joined, slow, m) == []
    heads = {p.stages[0].ranks[0]: p for p in joined.pipelines if p.stages[0].ranks[0] in speeds}
    assert set(heads) == set(speeds)
    for r, p in heads.items():
        assert p.stages[0].ranks == (r,) and not set(speeds) & set(p.ranks[1:])

    # with token shares by speed (``tokens.balanced``), as the planner runs them
    def best(p):
        return min(evaluate(x, at).step_time_s for x in [p, *balanced(p, at)])

    assert best(joined) < min(best(packed), best(chained))
    layers = sorted((speeds[r], p.stages[0].n_layers) for r, p in heads.items())
    assert [n for _, n in layers] == sorted(n for _, n in layers)
    full = len(c) - len(speeds)
    packing, joins = slow_packing(designer, full, speeds, m.microbatches, replicas_hint=8)
    assert set(joins) == set(speeds)
    assert all(j.tps[0] == 1 for j in joins.values())
    assert (
        sum(d.devices * k for d, k in zip(packing.designs, packing.counts))
        + sum(j.devices - 1 for j in joins.values())
        <= full
    )


def test_slow_devices_carry_less_work_and_slow_no_full_speed_group(h100_64):
    """A node at half speed: its devices work (a stage of their own in a full-speed
    pipeline, or pipelines of slow devices), each less than a full-speed device, and the plan is
    faster than one without them."""
    c, m, coster, designer = h100_64
    layout = healthy_plan(c, m).layout
    node0 = set(c.node_ranks[0])
    slow = c.with_speeds({r: 0.5 for r in node0})
    dead = c.with_speeds({r: 0.0 for r in node0})
    with_slow = evaluate(
        design_plan(coster.at_speeds(slow), layout, designer), coster.at_speeds(slow)
    )
    without = evaluate(
        design_plan(coster.at_speeds(dead), layout, designer), coster.at_speeds(dead)
    )
    assert plan_problems(with_slow, slow, m) == []
    groups = [set(g.ranks) for p in with_slow.pipelines for g in p.stages]
    assert all(g <= node0 or not g & node0 for g in groups)  # never a group of both speeds
    work = {
        r: g.n_layers * p.microbatches / g.tp
        for p in with_slow.pipelines
        for g in p.stages
        for r in g.ranks
    }
    on_slow = [w for r, w in work.items() if r in node0]
    assert on_slow and max(on_slow) < min(w for r, w in work.items() if r not in node0)
    assert with_slow.step_time_s < without.step_time_s


def test_a_slow_device_joins_a_full_speed_pipeline_as_a_short_stage(h100_64):
    """The bound's answer for one slow device: a stage of its own with few layers ahead of a
    full-speed pipeline, which is then faster than the same pipeline without it."""
    c, m, coster, designer = h100_64
    slow = c.with_speeds({5: 0.5})
    at = coster.at_speeds(slow)
    plan = design_plan(at, healthy_plan(c, m).layout, designer)
    pipe = next(p for p in plan.pipelines if 5 in p.ranks)
    assert pipe.stages[0].ranks == (5,) and all(5 not in g.ranks for g in pipe.stages[1:])
    assert pipe.stages[0].n_layers < min(g.n_layers for g in pipe.stages[1:])
    rest = pipe.stages[1:]
    alone = Stages(
        Stage(g.ranks, r)
        for g, r in zip(
            rest,
            layer_ranges(
                designer.fit_slowed(tuple(g.tp for g in rest), (1.0,) * len(rest), 8).counts
            ),
        )
    )
    assert at.pipeline_step(pipe.stages, 8) < at.pipeline_step(alone, 8)


def test_a_repair_keeps_the_untouched_pipelines_and_the_planner_does_no_worse(h100_64):
    c, m, coster, designer = h100_64
    layout = healthy_plan(c, m).layout
    first = evaluate(design_plan(coster, layout, designer), coster)
    dead = c.with_speeds({20: 0.0})
    at = coster.at_speeds(dead)
    untouched = [p for p in first.pipelines if 20 not in p.ranks]
    repair = design_plan(at, layout, designer, untouched)
    assert plan_problems(repair, dead, m) == []
    assert {p.stages for p in untouched} <= {p.stages for p in repair.pipelines}
    evaluate(repair, at, current=first)
    # the planner weighs it against its other plans, migration amortised over its horizon
    planner = Planner()
    chosen = planner.plan(dead, m, first)
    h = planner.horizon_steps
    assert (
        chosen.step_time_s + chosen.migration_s / h
        <= repair.step_time_s + repair.migration_s / h + 1e-9
    )


def test_pack_needs_no_design_when_kept_pipelines_carry_the_batch(h100_64):
    c, m, coster, designer = h100_64
    uniform = healthy_plan(c, m)
    rates = [
        (
            coster.pipeline_step(p.stages, 1),
            coster.pipeline_step(p.stages, 2) - coster.pipeline_step(p.stages, 1),
        )
        for p in uniform.pipelines
    ]
    packing = pack(designer, 0, m.microbatches, rates, 0.0, replicas_hint=len(rates))
    assert packing is not None and sum(packing.counts) == 0


def test_a_nodes_leftover_devices_join_designed_pipelines_as_stages():
    """256 devices, three dead in nodes 0-2: the designs placed leave each of those nodes a few
    devices no design's groups took (the knapsack counts devices, not nodes); they join designed
    pipelines as short stages of their own, so no full-speed device is left idle (4 were)."""
    c, m = load("h100-256", "gpt-13b")
    coster = StageCoster(c, m, AnalyticCost())
    dead = c.with_speeds({2: 0.0, 13: 0.0, 22: 0.0})
    at = coster.at_speeds(dead)
    plan = evaluate(design_plan(at, healthy_plan(c, m).layout, Designer(coster)), at)
    assert plan_problems(plan, dead, m) == []
    used = [r for p in plan.pipelines for r in p.ranks]
    assert len(used) == len(set(used)) == len(c) - 3
    for p in plan.pipelines:
        assert all(len({c.devices[r].node for r in s.ranks}) == 1 for s in p.stages)


def test_a_leftover_group_joins_a_pipeline_just_before_the_lm_heads_stage():
    """The 70B model's TP 8 x 1 + TP 4 x 5 pipeline (28 devices) and the TP 2 and TP 1 groups a
    node has left beside a dead device. At the head (the most micro-batches in flight) the TP 2
    group held one layer, which left the slowest stage's time as it was; just before the LM head's
    stage (two in flight) it holds six, one off each TP 4 and TP 8 stage, and the pipeline steps
    6% faster. The TP 1 group then shortens it no more and is left out."""
    c, m = load("h100-1024", "gpt-70b")
    coster = StageCoster(c, m, AnalyticCost())
    groups = [tuple(range(8, 16))] + [tuple(range(16 + 4 * i, 20 + 4 * i)) for i in range(5)]
    pipe = Stages(Stage(g, r) for g, r in zip(groups, layer_ranges((21, 12, 12, 12, 12, 11))))
    once = _joined_stages(coster, Designer(coster), [pipe], [(0, 1), (2,)], 56)[0]
    both = _joined_stages(coster, Designer(coster), [pipe], [(0, 1), (2,)], 56, again=True)[0]
    assert [s.ranks for s in once] == [*groups[:5], (0, 1), groups[5]], once
    assert [s.n_layers for s in once] == [20, 11, 11, 11, 11, 6, 10]
    assert both == once and sum(s.n_layers for s in both) == m.layers
    step = {k: coster.pipeline_step(p, 56) for k, p in (("alone", pipe), ("once", once))}
    assert step["once"] < 0.95 * step["alone"]
