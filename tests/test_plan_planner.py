import heapq
import json

import numpy as np
import pytest

from resihp.errors import InputError
from resihp.parallel import ParallelDims
from resihp.paths import TRACES
from resihp.perf.schedule import pipeline_step_time
from resihp.plan.allocation import allocate_microbatches, greedy_allocation
from resihp.plan.baselines import POLICIES, make_policy
from resihp.plan.bound import tight_bound
from resihp.plan.cost import AnalyticCost
from resihp.plan.layout import (
    binary_chunks,
    group_options,
    home_pipelines,
    layer_ranges,
    touched_replicas,
    uniform_layer_counts,
)
from resihp.plan.plan import Pipeline, Plan, Stage, plan_problems, unplaced
from resihp.plan.planner import WITHIN_REPLICAS, Planner, capacity_bound, healthy_plan
from resihp.plan.specs import ClusterSpec, ModelSpec
from resihp.plan.timing import StageCoster, closed_form_step, evaluate
from resihp.plan.tokens import balance_tokens, proportional_counts

CLUSTERS = TRACES / "clusters"
MODELS = TRACES / "models"


def load(cluster: str, model: str) -> tuple[ClusterSpec, ModelSpec]:
    return ClusterSpec.from_yaml(CLUSTERS / f"{cluster}.yaml"), ModelSpec.from_yaml(
        MODELS / f"{model}.yaml"
    )


@pytest.fixture(scope="module", params=[False, True], ids=["microbatches", "token-budgets"])
def planner(request) -> Planner:
    return Planner(token_budgets=request.param)


def test_default_planner_moves_whole_microbatches_only():
    c, m = load("h100-256", "gpt-13b")
    plan = Planner().plan(c.with_speeds({3: 0.5, 100: 0.0}), m)
    assert all(p.tokens is None for p in plan.pipelines)
    assert sum(p.microbatches for p in plan.pipelines) == m.microbatches
    budgets = Planner(token_budgets=True).plan(c.with_speeds({3: 0.5, 100: 0.0}), m)
    assert any(p.tokens is not None for p in budgets.pipelines)
    assert budgets.step_time_s < plan.step_time_s


@pytest.mark.parametrize(
    "cluster,model",
    [
        ("h100-8", "gpt-7b"),
        ("h100-64", "gpt-13b"),
        ("h100-8-degraded", "gpt-7b"),
        ("cpu-4", "cpu-small"),
        ("h100-256", "gpt-13b"),
    ],
)
def test_example_plans_are_valid(planner, cluster, model):
    c, m = load(cluster, model)
    plan = planner.plan(c, m)
    assert plan_problems(plan, c, m) == []
    # the loose bound (``bound_ratio``) a plan of designed pipelines can pass; never the tight one
    assert plan.bound_ratio > 0
    assert plan.tokens_per_s <= tight_bound(c, m).tokens_per_s * (1 + 1e-9)
    assert plan.solver["status"] in ("optimal", "time-limit")


def test_degraded_example_routes_around_the_faults(planner):
    c, m = load("h100-8-degraded", "gpt-7b")
    plan = planner.plan(c, m)
    place = plan.coords()
    assert 6 not in place and 6 in plan.excluded
    # the 40%-speed device holds fewer layers than any full-speed stage of its pipeline
    pipe = next(p for p in plan.pipelines if 3 in p.ranks)
    slow = next(s for s in pipe.stages if 3 in s.ranks)
    assert all(slow.n_layers < s.n_layers for s in pipe.stages if s is not slow)


def test_slow_replica_gets_less_work_and_the_plan_beats_no_adaptation(planner):
    c, m = load("h100-64", "gpt-13b")
    slow = c.with_speeds({5: 0.5})
    plan = planner.plan(slow, m)
    uniform = make_policy("uniform").plan(slow, m)
    assert plan.step_time_s < 0.6 * uniform.step_time_s
    assert plan.layout.dp == 8 and plan.layout.tp == 2  # the home layout stays
    # the slow device is left out, or does less work than every full-speed device (its
    # pipeline may do more: a slow stage with few layers ahead of full-speed ones)
    work = {
        r: st.n_layers * p.share(m) / st.tp
        for p in plan.pipelines
        for st in p.stages
        for r in st.ranks
    }
    if 5 in work:
        assert work[5] < min(w for r, w in work.items() if r != 5)


def test_dead_devices_are_excluded_everywhere(planner):
    c, m = load("h100-64", "gpt-13b")
    dead = c.with_speeds({0: 0.0, 17: 0.0, 40: 0.0, 63: 0.0})
    plan = planner.plan(dead, m)
    assert plan_problems(plan, dead, m) == []
    assert {0, 17, 40, 63} <= set(plan.excluded)


def test_capacity_bound_scales_with_remaining_compute():
    c, m = load("h100-64", "gpt-13b")
    healthy = capacity_bound(c, m)
    degraded = capacity_bound(c.with_speeds({1: 0.5, 2: 0.0}), m)
    assert degraded.capacity_fraction == pytest.approx(62.5 / 64)
    assert degraded.tokens_per_s == pytest.approx(healthy.tokens_per_s * 62.5 / 64)
    plan = healthy_plan(c, m)
    assert plan.tokens_per_s <= healthy.tokens_per_s * (1 + 1e-9)


def test_closed_form_is_the_schedule_critical_path_for_equal_stages():
    rng = np.random.default_rng(0)
    for p, m in [(1, 1), (2, 5), (4, 8), (6, 3), (8, 32)]:
        f, b = rng.uniform(0.1, 1), rng.uniform(0.2, 2)
        fwd, bwd = np.full(p, f), np.full(p, b)
        exact = pipeline_step_time(np.full((p, m), f), np.full((p, m), b), "1f1b")
        assert closed_form_step(fwd, bwd, m, "1f1b") == pytest.approx(float(exact))
        exact_g = pipeline_step_time(np.full((p, m), f), np.full((p, m), b), "gpipe")
        assert closed_form_step(fwd, bwd, m, "gpipe") == pytest.approx(float(exact_g))


def test_plan_step_time_is_the_schedule_critical_path(planner):
    c, m = load("h100-8", "gpt-7b")
    c = c.with_speeds({2: 0.6})
    plan = planner.plan(c, m)
    coster = StageCoster(c, m, AnalyticCost())
    worst = 0.0
    for p in plan.pipelines:
        scale = p.budget(m) / m.microbatch_tokens
        fb = np.array(
            [coster.stage_fb(s, i == len(p.stages) - 1, scale) for i, s in enumerate(p.stages)]
        )
        k = p.microbatches
        t = pipeline_step_time(
            np.repeat(fb[:, :1], k, 1),
            np.repeat(fb[:, 1:], k, 1),
            "1f1b",
            p2p_s=coster.p2p_s * scale,
        )
        worst = max(worst, float(t))
    assert plan.step_time_s == pytest.approx(worst + coster.dp_sync_s(plan))


def test_small_imbalance_moves_work_not_layers():
    """With a long amortisation horizon a 3% slowdown is answered without moving layers; a 3x
    slowdown moves layers even when migration is priced."""
    c, m = load("h100-64", "gpt-13b")
    planner = Planner(horizon_steps=1)
    current = planner.plan(c, m)
    mild = planner.plan(c.with_speeds({18: 0.97}), m, current)
    before = {s.ranks: s.layers for p in current.pipelines for s in p.stages}
    after = {s.ranks: s.layers for p in mild.pipelines for s in p.stages}
    assert after == before
    assert mild.migration_s == 0.0
    severe = Planner(horizon_steps=100).plan(c.with_speeds({18: 0.3}), m, current)
    old = next(p for p in current.pipelines if 18 in p.ranks)
    pipe = next((p for p in severe.pipelines if 18 in p.ranks), None)  # None: 18 left out
    assert pipe is None or [(s.ranks, s.layers) for s in pipe.stages] != [
        (s.ranks, s.layers) for s in old.stages
    ]
    assert severe.migration_s > 0


def test_without_regroup_a_slow_device_keeps_its_group_and_its_stage_sheds_layers():
    """``regroup=False`` (replica-level fault tolerance): every group of the plan in force stays,
    the slow stage holds fewer layers than before, and the plan beats keeping the plan in force."""
    c, m = load("h100-64", "gpt-13b")
    current = Planner().plan(c, m)
    slow = c.with_speeds({18: 0.3})
    planner = Planner(regroup=False)
    plan = planner.plan(slow, m, current)
    groups = lambda p: [q.groups for q in sorted(p.pipelines, key=lambda q: q.dp_rank)]  # noqa: E731
    assert groups(plan) == groups(current)
    assert plan_problems(plan, slow, m) == []
    old = next(p for p in current.pipelines if 18 in p.ranks)
    new = next(p for p in plan.pipelines if 18 in p.ranks)
    before, after = (next(s.n_layers for s in q.stages if 18 in s.ranks) for q in (old, new))
    assert after < before
    kept = evaluate(
        Plan(current.world_size, current.layout, current.pipelines, current.excluded),
        planner.coster(slow, m),
    )
    assert plan.step_time_s < kept.step_time_s
    # the same fault, regrouping allowed, may leave the slow device out
    assert groups(Planner().plan(slow, m, current)) != groups(current)


def test_devices_left_over_by_dead_ones_in_four_nodes_all_train():
    """Four dead devices in four nodes of h100-256 (13B at TP 4): each node keeps 3 live devices
    that no TP 4 group can use. They go into spare pipelines of TP 2 and TP 1 stages across nodes,
    every one of them (the chaining used to leave the groups it could not close a pipeline with
    idle, 6 of the 12), and the plan gets nearer the tight bound than without them."""
    c, m = load("h100-256", "gpt-13b")
    dead = {57: 0.0, 108: 0.0, 176: 0.0, 248: 0.0}
    assert len({c.devices[r].node for r in dead}) == 4
    degraded = c.with_speeds(dead)
    planner = Planner(token_budgets=True)
    plan = planner.plan(degraded, m, planner.healthy(c, m))
    assert plan_problems(plan, degraded, m) == []
    assert sorted(plan.excluded) == sorted(dead)
    assert any(st.tp < 4 for p in plan.pipelines for st in p.stages)
    assert plan.tokens_per_s >= 0.97 * tight_bound(degraded, m).tokens_per_s


def test_replan_from_current_plan_and_recovery(planner):
    c, m = load("h100-64", "gpt-13b")
    first = planner.plan(c, m)
    degraded = c.with_speeds({9: 0.0, 30: 0.4})
    second = planner.plan(degraded, m, first)
    assert plan_problems(second, degraded, m) == []
    assert second.layout == first.layout
    recovered = planner.plan(c, m, second)
    assert plan_problems(recovered, c, m) == []
    assert recovered.step_time_s == pytest.approx(first.step_time_s)
    assert recovered.migration_s > 0  # state moves back onto the recovered devices


def test_warm_planner_plans_as_a_fresh_one(planner):
    """The caches a planner keeps between re-plans (hardware memo, pipeline solves) never change
    a plan: every step of a fault sequence comes out as from a new Planner. A step where some
    solve stopped at its time limit short of optimal is not deterministic, so it is not compared
    (one here: a replica re-formed around a dead and a slow device, whose re-split CP-SAT leaves
    1.6% from its bound even in 20 s); every other step is."""
    c, m = load("h100-64", "gpt-13b")
    warm = Planner(token_budgets=planner.token_budgets)
    steps = [
        {9: 0.5},
        {9: 0.5, 30: 0.0},
        {9: 0.5, 30: 0.0, 41: 0.3},
        {9: 0.5, 41: 0.3},
        {9: 0.5},
        {},
        {9: 0.5, 30: 0.0},
    ]
    current = warm.plan(c, m)
    compared = 0
    for speeds in steps:
        cluster = c.with_speeds(np.array([speeds.get(r, 1.0) for r in range(len(c))]))
        fresh = Planner(token_budgets=planner.token_budgets).plan(cluster, m, current)
        expect = {**fresh.to_dict(), "solver": None}
        for _ in range(2):  # the second time every solve comes from the cache
            got = warm.plan(cluster, m, current)
            if fresh.solver["status"] == "optimal":
                assert {**got.to_dict(), "solver": None} == expect
                assert got.solver["pipelines_solved"] == fresh.solver["pipelines_solved"]
        compared += fresh.solver["status"] == "optimal"
        current = got
    assert compared >= len(steps) - 1


def test_planner_is_ahead_of_every_baseline():
    c, m = load("h100-64", "gpt-13b")
    rng = np.random.default_rng(3)
    devices = rng.choice(64, 6, replace=False).tolist()
    degraded = c.with_speeds(
        {
            devices[0]: 0.25,
            devices[1]: 0.5,
            devices[2]: 0.8,
            devices[3]: 0.0,
            devices[4]: 0.0,
            devices[5]: 0.7,
        }
    )
    results = {name: make_policy(name).plan(degraded, m) for name in POLICIES}
    for name, plan in results.items():
        if np.isfinite(plan.step_time_s):
            assert plan_problems(plan, degraded, m) == [], name
    assert results["uniform"].tokens_per_s == 0.0  # a dead rank stops an unadapted job
    best = results["resihp"].tokens_per_s
    assert all(best >= p.tokens_per_s for p in results.values())
    assert results["resihp"].bound_ratio > results["drop-replica"].bound_ratio


def test_timeout_still_returns_a_valid_plan_with_its_gap():
    c, m = load("h100-256", "gpt-13b")
    degraded = c.with_speeds({i: 0.5 + 0.05 * (i % 8) for i in range(0, 256, 7)})
    plan = Planner().plan(degraded, m, time_limit_s=0.001)
    assert plan_problems(plan, degraded, m) == []
    assert "gap" in plan.solver and plan.solver["gap"] >= 0


def test_plan_json_round_trip(planner, tmp_path):
    c, m = load("h100-8-degraded", "gpt-7b")
    plan = planner.plan(c, m)
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert {
        "ranks",
        "pipelines",
        "microbatches",
        "step_time_s",
        "capacity_tokens_per_s",
        "bound_ratio",
        "migration_s",
    } <= set(data)
    assert data["ranks"][6] == {"rank": 6, "excluded": True}
    again = Plan.load(path)
    assert again.coords() == plan.coords()
    assert again.microbatches == plan.microbatches
    assert [p.tokens for p in again.pipelines] == [p.tokens for p in plan.pipelines]
    assert plan_problems(again, c, m) == []


def test_current_plan_naming_unknown_devices_is_an_input_error(planner, tmp_path):
    c, m = load("h100-64", "gpt-13b")
    plan = planner.plan(c, m)
    small, _ = load("h100-8", "gpt-7b")
    with pytest.raises(InputError, match="world_size 64 does not match the cluster's 8"):
        planner.plan(small, m, plan)
    data = plan.to_dict()
    data["world_size"] = 8
    with pytest.raises(
        InputError, match=r"unknown device rank \d+ in pipeline 0 \(cluster has ranks 0..7\)"
    ):
        planner.plan(small, m, Plan.from_dict(data))
    with pytest.raises(InputError, match="field 'layout' is missing"):
        Plan.from_dict({"world_size": 8, "pipelines": []})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        Plan.load(bad)


def test_infeasible_cluster_says_what_is_missing(planner):
    c, m = load("h100-8", "gpt-70b")
    with pytest.raises(InputError, match="no TP x PP layout fits model gpt-70b"):
        planner.plan(c, m)
    c64, m13 = load("h100-8", "gpt-7b")
    with pytest.raises(InputError, match="no replica"):
        planner.plan(c64.with_speeds(dict.fromkeys(range(8), 0.0)), m13)


def test_group_options_keep_power_of_two_groups():
    c, _ = load("h100-64", "gpt-13b")
    c = c.with_speeds({2: 0.0, 5: 0.3})
    options = group_options(tuple(range(8)), c, heads=40)
    assert [] in options  # dropping the group is always an option
    for opt in options:
        for g in opt:
            assert len(g) & (len(g) - 1) == 0 and 40 % len(g) == 0 and 2 not in g
    assert group_options(tuple(range(8, 16)), c, heads=40) == [[tuple(range(8, 16))]]
    assert [len(x) for x in binary_chunks(list(range(7)))] == [4, 2, 1]


def test_allocation_keeps_the_batch_and_matches_greedy_optimum():
    rng = np.random.default_rng(1)
    for _ in range(5):
        first = rng.uniform(1, 3, 12).tolist()
        each = rng.uniform(0.1, 1, 12).tolist()
        alloc, status, _ = allocate_microbatches(first, each, 100, 2.0)
        assert sum(alloc) == 100 and status == "optimal"

        def span(a, first=first, each=each):
            return max(f + (k - 1) * e for f, e, k in zip(first, each, a) if k)

        assert span(alloc) == pytest.approx(span(greedy_allocation(first, each, 100)), rel=1e-5)


def test_a_cached_allocation_follows_each_replica_to_its_class():
    """Allocations are cached by their classes: a second call whose replicas come in another
    order (the same classes, so the same model) gives every replica its own class's share."""
    fast, slow = (1.0, 0.25), (1.7, 0.6)
    order_a = [fast, slow, fast, slow, slow]
    order_b = [fast, fast, slow, slow, slow]
    got = []
    for order in (order_a, order_b):
        first, each = zip(*order)
        alloc, status, _ = allocate_microbatches(list(first), list(each), 23, 2.0)
        assert status == "optimal" and sum(alloc) == 23
        got.append(
            {
                kind: sorted(m for (f, e), m in zip(order, alloc) if (f, e) == kind)
                for kind in (fast, slow)
            }
        )
    assert got[0] == got[1]
    assert max(got[0][fast]) > max(got[0][slow])  # the fast replicas take more


def test_greedy_allocation_is_the_one_at_a_time_greedy():
    def one_at_a_time(first, each, total, caps):
        m = [0] * len(first)
        heap = [(first[r], r) for r in range(len(first)) if caps[r] is None or caps[r] > 0]
        heapq.heapify(heap)
        for _ in range(total):
            finish, r = heapq.heappop(heap)
            m[r] += 1
            if caps[r] is None or m[r] < caps[r]:
                heapq.heappush(heap, (finish + each[r], r))
        return m

    rng = np.random.default_rng(2)
    for _ in range(300):
        n = int(rng.integers(1, 40))
        kinds = rng.integers(1, 4)  # few distinct replicas, as in a large healthy cluster
        first = rng.choice(np.round(rng.uniform(1, 3, kinds), 1), n).tolist()
        each = rng.choice(
            [0.0, 0.25, 0.5, 1e-17, *np.round(rng.uniform(0, 1, kinds), 1)], n
        ).tolist()
        caps = rng.choice([None, 0, 1, 3, 8, 1000], n).tolist()
        total = int(rng.integers(0, 200))
        if sum(total if c is None else c for c in caps) < total:
            with pytest.raises(ValueError, match="memory holds only"):
                greedy_allocation(first, each, total, caps)
        else:
            assert greedy_allocation(first, each, total, caps) == one_at_a_time(
                first, each, total, caps
            )


def test_token_budgets_balance_and_keep_the_global_batch():
    c, m = load("h100-256", "gpt-13b")
    slow = c.with_speeds({3: 0.5})
    coster = StageCoster(slow, m, AnalyticCost())
    base = make_policy("uniform").plan(slow, m)
    assert balance_tokens(base, coster).pipelines == base.pipelines  # budgets never shrink
    balanced = balance_tokens(proportional_counts(base, coster), coster)
    assert sum(p.share(m) for p in balanced.pipelines) == m.global_batch_tokens
    assert plan_problems(balanced, slow, m) == []
    assert all(p.budget(m) >= m.microbatch_tokens for p in balanced.pipelines)
    slow_pipe = next(p for p in balanced.pipelines if 3 in p.ranks)
    assert slow_pipe.microbatches < base.pipelines[0].microbatches
    evaluate(balanced, coster)
    assert balanced.step_time_s < 0.7 * base.step_time_s


def test_predictor_cost_plans_with_a_trained_predictor(tiny_profile, tmp_path):
    from resihp.perf.training import train_predictor
    from resihp.plan.cost import PredictorCost

    train_predictor([tiny_profile], tmp_path / "pred", holdout=0.25)
    cost = PredictorCost.load(str(tmp_path / "pred"))
    cluster = ClusterSpec.from_yaml(CLUSTERS / "cpu-4.yaml").with_speeds({1: 0.5})
    model = ModelSpec.from_dict(
        {
            "name": "tiny",
            "layers": 4,
            "hidden": 64,
            "heads": 2,
            "ffn_hidden": 128,
            "vocab": 512,
            "max_seq_len": 256,
            "global_batch_tokens": 256 * 32,
            "microbatch_tokens": 256,
            "workload": "code",
        }
    )
    f, b = cost.layer_seconds(model, cluster, 1, 1.0)
    assert 0 < f < b  # backward costs more than forward on the measured device
    plan = Planner(cost).plan(cluster, model)
    assert plan_problems(plan, cluster, model) == []
    uniform = make_policy("uniform", cost).plan(cluster, model)
    assert plan.step_time_s < uniform.step_time_s
    coster = StageCoster(cluster, model, cost)
    assert coster.layer_fb(1, 1.0) == (f, b)


def test_with_token_budgets_the_healthy_plan_shares_the_tokens_evenly():
    """At 4,096 devices whole micro-batches leave some replicas one more than the others (2,048
    over 170 of TP 8 x PP 3, or 16 each over the 128 of PP 4); with token budgets each of the
    layout's replicas runs floor(M / dp) micro-batches a little over the budget, and the step is
    shorter than the whole-micro-batch plan's."""
    c, m = load("h100-4096", "gpt-70b")
    whole = Planner().healthy(c, m)
    even = Planner(token_budgets=True).healthy(c, m)
    dp = even.layout.dp
    assert len(even.pipelines) == dp and {p.microbatches for p in even.pipelines} == {
        m.microbatches // dp
    }
    assert sum(p.share(m) for p in even.pipelines) == m.global_batch_tokens
    assert plan_problems(even, c, m) == []
    assert even.step_time_s < whole.step_time_s
    # re-planning from it keeps its layout
    assert Planner(token_budgets=True).plan(c.with_speeds({5: 0.5}), m, even).layout == even.layout


def test_within_replicas_a_slow_device_is_left_out_of_its_own_replica_only():
    """``regroup=WITHIN_REPLICAS`` (replica-level fault tolerance): a replica's groups may be
    re-formed around its slow device from that replica's own launch ranks, no rank moves to
    another replica, every replica keeps a pipeline, and the plan beats keeping every group."""
    c, m = load("h100-64", "gpt-13b")
    current = Planner().plan(c, m)
    layout = current.layout
    homes = [
        [tuple(layout.tp_group_ranks(d, s)) for s in range(layout.pp)] for d in range(layout.dp)
    ]
    counts = uniform_layer_counts(m.layers, layout.pp)
    ordered = sorted(current.pipelines, key=lambda p: p.dp_rank)[: layout.dp]
    pipes = [
        Pipeline(
            d,
            tuple(Stage(g, r) for g, r in zip(homes[d], layer_ranges(counts))),
            p.microbatches,
            home=d,
        )
        for d, p in enumerate(ordered)
    ]  # the runtime's plan in force: each replica on its home groups
    current = Plan(current.world_size, layout, pipes, unplaced(current.world_size, pipes))
    victim = homes[1][0][1]
    slow = c.with_speeds({victim: 0.25})
    fixed = Planner(regroup=False).plan(slow, m, current)
    plan = Planner(regroup=WITHIN_REPLICAS).plan(slow, m, current)
    assert plan_problems(plan, slow, m) == []
    pipes = sorted(plan.pipelines, key=lambda p: p.dp_rank)
    assert len(pipes) == layout.dp
    for d, p in enumerate(pipes):
        assert set(p.ranks) <= {r for g in homes[d] for r in g}
    assert victim not in pipes[1].ranks or any(len(s.ranks) != layout.tp for s in pipes[1].stages)
    assert [q.groups for q in pipes[:1] + pipes[2:]] == [
        tuple(homes[d]) for d in [0, *range(2, layout.dp)]
    ]
    assert plan.step_time_s < fixed.step_time_s
    with pytest.raises(ValueError, match="regroup"):
        Planner(regroup="sometimes")


def test_allocation_with_a_floor_gives_every_replica_its_floor_at_the_least_span():
    """``floor``: every replica keeps at least that many micro-batches (replica mode's replicas
    all keep training); the greedy and the CP-SAT allocation reach the brute-force optimum."""
    rng = np.random.default_rng(3)

    def span(a, first, each):
        return max(f + (k - 1) * e for f, e, k in zip(first, each, a) if k)

    for _ in range(40):
        n, total, floor = int(rng.integers(1, 4)), int(rng.integers(3, 9)), int(rng.integers(1, 3))
        first = np.round(rng.uniform(1, 9, n), 2).tolist()
        each = np.round(rng.uniform(0.1, 6, n), 2).tolist()
        if floor * n > total:
            with pytest.raises(ValueError, match="cannot give each"):
                greedy_allocation(first, each, total, floor=floor)
            continue
        best = min(
            span(a, first, each)
            for a in np.ndindex(*[total + 1] * n)
            if sum(a) == total and min(a) >= floor
        )
        greedy = greedy_allocation(first, each, total, floor=floor)
        alloc, _, _ = allocate_microbatches(first, each, total, 2.0, floor=floor)
        for a in (greedy, alloc):
            assert sum(a) == total and min(a) >= floor
            assert span(a, first, each) == pytest.approx(best)


def test_within_replicas_keeps_a_replica_the_allocation_would_leave_idle():
    """A live re-plan of the runtime's own run (``resihp run --dp 2 --tp 2``, rank 1 about 7x
    slow, the cluster paced as the live loop paced it on a CI machine): the fastest split of the
    global batch gives the slow replica nothing, which in replica mode is no plan (every replica
    trains on), and the re-plan once failed with "no plan ... fits in memory". Every replica now
    keeps at least one micro-batch."""
    cluster = ClusterSpec.from_dict(
        {
            "name": "local",
            "nodes": [{"name": "local", "devices": 4}],
            "device": {"memory_gb": 5.735, "tflops": 0.0861},
            "memory_reserve_gb": 0.0,
        }
    ).paced(0.1313)
    model = ModelSpec(
        layers=4,
        hidden=128,
        heads=4,
        ffn_hidden=512,
        vocab=1024,
        max_seq_len=1024,
        global_batch_tokens=4096,
        microbatch_tokens=1024,
        name="resihp-run",
        tp=2,
        pp=1,
    )
    layout = Planner().plan(cluster, model).layout
    pipes = [
        Pipeline(d, (Stage(tuple(layout.tp_group_ranks(d, 0)), (0, 4)),), 2, home=d)
        for d in range(2)
    ]
    current = Plan(4, layout, pipes, [])
    slow = cluster.with_speeds({1: 0.1459})
    plan = Planner(regroup=WITHIN_REPLICAS).plan(slow, model, current)
    assert plan_problems(plan, slow, model) == []
    assert [p.home for p in sorted(plan.pipelines, key=lambda p: p.dp_rank)] == [0, 1]
    assert all(p.microbatches >= 1 for p in plan.pipelines)
    assert sum(p.microbatches for p in plan.pipelines) == model.microbatches


@pytest.mark.parametrize("regroup", [True, WITHIN_REPLICAS])
def test_a_pipeline_re_formed_in_force_is_solved_again(regroup):
    """A replica running re-formed (here (4, 5) and (6,) of its home group (4, 5, 6, 7), the
    last device the slower kind) is re-planned: its CP-SAT model once hinted one option twice (a
    model CP-SAT refuses, read as "does not fit") and bounded the overlap of an inactive option
    below zero. Fails on the old model: "no plan ... fits in memory"."""
    cluster = ClusterSpec.from_dict(
        {
            "name": "h",
            "device": {"memory_gb": 24, "tflops": 300},
            "bandwidth": {"intra_node_gbs": 300, "inter_node_gbs": 25},
            "memory_reserve_gb": 2,
            "nodes": [{"devices": [{} for _ in range(7)] + [{"tflops": 150.0}]}],
        }
    )
    model = ModelSpec.from_dict(
        {
            "name": "m",
            "layers": 4,
            "hidden": 2048,
            "heads": 16,
            "ffn_hidden": 8192,
            "vocab": 32000,
            "max_seq_len": 4096,
            "microbatch_tokens": 4096,
            "global_batch_tokens": 40960,
        }
    )
    layout = ParallelDims(dp=2, pp=1, tp=4)
    pipes = [
        Pipeline(0, (Stage((0, 1, 2, 3), (0, 4)),), 6, home=0),
        Pipeline(1, (Stage((4, 5), (0, 3)), Stage((6,), (3, 4))), 4, home=1),
    ]
    current = Plan(8, layout, pipes, unplaced(8, pipes))
    plan = Planner(threads=1, regroup=regroup).plan(cluster, model, current, time_limit_s=1.0)
    assert plan_problems(plan, cluster, model) == []
    assert plan.tokens_per_s >= evaluate(current, Planner().coster(cluster, model)).tokens_per_s * (
        1 - 1e-9
    )


def test_touched_replicas_are_the_home_replicas_holding_a_degraded_device():
    # 4 nodes of 4: 8 home groups of 2; a 2-stage, 3-replica layout leaves groups 6 and 7 unused
    cluster = ClusterSpec.uniform(4, 4, 80.0, 400.0)
    layout = ParallelDims(tp=2, pp=2, dp=3)
    homes = home_pipelines(cluster, layout)
    rng = np.random.default_rng(0)
    for _ in range(50):
        slow = rng.choice(16, size=rng.integers(0, 4), replace=False).tolist()
        degraded = cluster.with_speeds({r: 0.5 for r in slow})
        expected = {
            r for r, groups in enumerate(homes) if set(slow) & {x for g in groups for x in g}
        }
        assert touched_replicas(degraded, layout) == expected, slow
    # device 5 sits in replica 2's first stage, device 7 in replica 0's second, 13 in no replica
    assert touched_replicas(cluster.with_speeds({5: 0.5, 7: 0.0, 13: 0.5}), layout) == {0, 2}
    # the ends of a slow link count as degraded
    assert touched_replicas(cluster.with_link_speeds({(2, 3): 0.5}), layout) == {1}
