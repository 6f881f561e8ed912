"""The tight capacity bound (``resihp.plan.bound``) is an upper bound: no plan beats it.

Exhaustive search on small clusters: every plan the evaluator can score (every set of disjoint
tensor-parallel groups of power-of-two sizes inside a node, chained in any order into any number of
pipelines, every whole-layer split, every micro-batch allocation that fits in memory), with
devices slow, dead or heterogeneous. On larger random clusters the planner (with token budgets)
and the baselines never beat it either."""

from __future__ import annotations

import itertools
from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resihp.errors import InputError
from resihp.parallel import ParallelDims
from resihp.paths import TRACES
from resihp.plan.baselines import make_policy
from resihp.plan.bound import tight_bound
from resihp.plan.cost import AnalyticCost
from resihp.plan.layout import layer_ranges
from resihp.plan.plan import Pipeline, Plan, Stage, Stages, unplaced
from resihp.plan.planner import Planner
from resihp.plan.specs import ClusterSpec, ModelSpec
from resihp.plan.timing import StageCoster, evaluate


def cluster_of(nodes: list[list[float]], memory: float = 80, tflops=None) -> ClusterSpec:
    devices = [
        [{"speed": s, **({"tflops": tflops[i][j]} if tflops else {})} for j, s in enumerate(node)]
        for i, node in enumerate(nodes)
    ]
    return ClusterSpec.from_dict(
        {
            "name": "small",
            "device": {"memory_gb": memory, "tflops": 300},
            "bandwidth": {"intra_node_gbs": 300, "inter_node_gbs": 25},
            "memory_reserve_gb": 2,
            "nodes": [{"devices": d} for d in devices],
        }
    )


def model_of(
    layers: int = 4,
    microbatches: int = 4,
    hidden: int = 4096,
    schedule: str = "1f1b",
    heads: int = 16,
    vocab: int = 32000,
) -> ModelSpec:
    return ModelSpec.from_dict(
        {
            "name": "m",
            "layers": layers,
            "hidden": hidden,
            "heads": heads,
            "ffn_hidden": 4 * hidden,
            "vocab": vocab,
            "max_seq_len": 4096,
            "microbatch_tokens": 8192,
            "global_batch_tokens": 8192 * microbatches,
            "schedule": schedule,
        }
    )


def compositions(total: int, parts: int):
    """Every way to write ``total`` as ``parts`` positive integers, in order."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [b - a for a, b in itertools.pairwise(bounds)]


def candidate_groups(cluster: ClusterSpec, heads: int) -> list[tuple[int, ...]]:
    out = []
    for node in cluster.node_ranks:
        alive = [r for r in node if cluster.devices[r].speed > 0]
        for size in (1, 2, 4, 8):
            if size <= len(alive) and heads % size == 0:
                out += list(itertools.combinations(alive, size))
    return out


def pipeline_sets(groups: list[tuple[int, ...]], max_pipelines: int):
    """Every set of pipelines (ordered chains of disjoint groups), each set once."""
    chains = []

    def grow(chain: tuple, used: frozenset[int]) -> None:
        if chain:
            chains.append(chain)
        for g in groups:
            if used.isdisjoint(g):
                grow((*chain, g), used | set(g))

    grow((), frozenset())

    def sets(start: int, used: frozenset[int], chosen: tuple):
        if chosen:
            yield chosen
        if len(chosen) == max_pipelines:
            return
        for i in range(start, len(chains)):
            ranks = {r for g in chains[i] for r in g}
            if used.isdisjoint(ranks):
                yield from sets(i + 1, used | ranks, (*chosen, chains[i]))

    yield from sets(0, frozenset(), ())


def best_plan(cluster: ClusterSpec, model: ModelSpec) -> float:
    """The most tokens/s of any plan, by exhaustive search."""
    coster = StageCoster(cluster, model, AnalyticCost())
    groups = candidate_groups(cluster, model.heads)
    best = 0.0
    for pipes in pipeline_sets(groups, model.microbatches):
        splits = [
            list(compositions(model.layers, len(p))) if len(p) <= model.layers else []
            for p in pipes
        ]
        if any(not s for s in splits):
            continue
        for choice in itertools.product(*splits):
            stages = [
                Stages(Stage(g, r) for g, r in zip(p, layer_ranges(c)))
                for p, c in zip(pipes, choice)
            ]
            for alloc in compositions(model.microbatches, len(pipes)):
                if not all(coster.stages_fit(s, m) for s, m in zip(stages, alloc)):
                    continue
                pipelines = [Pipeline(i, s, m) for i, (s, m) in enumerate(zip(stages, alloc))]
                plan = Plan(
                    len(cluster),
                    ParallelDims(1, 1, 1),
                    pipelines,
                    unplaced(len(cluster), pipelines),
                )
                best = max(best, evaluate(plan, coster).tokens_per_s)
    return best


SMALL = [
    ([[1.0, 1.0], [1.0, 1.0]], 80, 4, 4),
    ([[1.0, 1.0], [1.0, 1.0]], 80, 3, 5),
    ([[1.0, 0.5], [1.0, 1.0]], 80, 4, 4),
    ([[0.2, 1.0], [0.0, 1.0]], 80, 4, 3),
    ([[1.0, 1.0, 1.0, 1.0]], 80, 5, 4),
    ([[1.0, 0.8, 1.0, 0.0]], 80, 4, 4),
    ([[1.0, 1.0], [1.0, 1.0]], 14, 4, 4),  # memory: a device holds few layers
    ([[1.0, 1.0], [0.5, 1.0]], 10, 6, 4),
    ([[1.0], [1.0], [1.0]], 12, 4, 4),
    # several slow devices: a pipeline is priced at its slowest one, holding faster ones
    ([[1.0, 0.5], [0.8, 1.0]], 80, 4, 4),
    ([[0.5, 0.7, 1.0, 1.0]], 80, 4, 4),
    ([[0.6, 0.6], [1.0, 1.0]], 14, 4, 4),
    ([[0.3, 0.9, 0.6, 1.0]], 80, 4, 3),
    # a pipeline of two slow devices and one at speed: held to the work its devices do
    ([[0.2, 0.25, 1.0]], 80, 4, 4),
]


@cache
def _case(i: int, schedule: str) -> tuple[float, float]:
    nodes, memory, layers, mbs = SMALL[i]
    cluster = cluster_of(nodes, memory)
    model = model_of(layers, mbs, schedule=schedule)
    return best_plan(cluster, model), tight_bound(cluster, model).tokens_per_s


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("i", range(len(SMALL)))
def test_no_plan_beats_the_tight_bound_exhaustive(i, schedule):
    best, bound = _case(i, schedule)
    assert best <= bound * (1 + 1e-9)
    if best > 0:  # and it is not vacuous: with several slow devices it prices a pipeline's
        # groups but its slowest at full speed, so it is looser there (1.51 at most here)
        slow = {s for node in SMALL[i][0] for s in node if 0 < s < 1}
        assert bound <= (1.6 if len(slow) > 1 else 1.5) * best


def test_a_pipeline_of_slow_devices_is_held_to_the_work_they_do():
    """Three devices at 0.2, 0.25 and full speed: a pipeline holding both slow ones was priced with
    only its slowest group slow (the bound 1.35x the best plan); held to the work its devices can
    do in a step (module doc, 5.), 1.28x."""
    best, bound = _case(len(SMALL) - 1, "1f1b")
    assert best <= bound * (1 + 1e-9)
    assert bound <= 1.3 * best


def test_slow_devices_are_counted_once_across_the_pipelines_that_absorb_them():
    """Devices at 0.3, 0.6 and 0.9 beside one at full speed: each pipeline's work cap counted
    the fastest other slow device as its own, so two pipelines both counted the one at 0.9 (the
    bound 1.45x the best plan); summed over the pipelines, the slow devices they absorb are
    distinct (1.36x)."""
    best, bound = _case(SMALL.index(([[0.3, 0.9, 0.6, 1.0]], 80, 4, 3)), "1f1b")
    assert best <= bound * (1 + 1e-9)
    assert bound <= 1.4 * best


def test_a_slow_stage_lengthens_the_fill_and_the_all_reduce_the_step():
    """Devices at 0.2 and 0.5 beside two at full speed, 8 layers, 12 micro-batches: the caps of
    5. gave a pipeline holding a slow device all its speed, its fill as short as at full speed
    and no all-reduce (the bound 1.184x the best plan); priced (module doc, 6.), 1.160x."""
    cluster = cluster_of([[0.2, 0.5, 1.0, 1.0]], 80)
    model = model_of(8, 12)
    best, bound = best_plan(cluster, model), tight_bound(cluster, model).tokens_per_s
    assert best <= bound * (1 + 1e-9)
    assert bound <= 1.17 * best


def test_the_slow_devices_a_pipeline_absorbs_hold_the_layers_their_speed_allows():
    """Devices at 0.3 and 0.5, each beside one at full speed, 6 layers, 6 micro-batches: a
    pipeline holding both slow devices counted the faster one as a full-speed member of its
    covering (the bound 1.444x the best plan); held to the layers its own group's speed fits
    under the stage time (module doc, 7.), 1.397x."""
    cluster = cluster_of([[0.3, 1.0], [0.5, 1.0]], 80)
    model = model_of(6, 6)
    best, bound = best_plan(cluster, model), tight_bound(cluster, model).tokens_per_s
    assert best <= bound * (1 + 1e-9)
    assert bound <= 1.42 * best


def test_a_1f1b_pipeline_pays_its_transfers_in_every_cycle():
    """Four devices on four nodes, each holding two layers of a small model with a small head,
    24 micro-batches: balanced stages pay the activation transfers in 1F1B's steady state, not
    only in the fill. 1.'s closed form alone put the bound 1.128x above the best plan; with the
    cycle priced (module doc, 8.), 1.026x."""
    cluster = cluster_of([[1.0], [1.0], [1.0], [1.0]], 5)
    model = model_of(8, 24, hidden=1024, vocab=1024)
    best, bound = best_plan(cluster, model), tight_bound(cluster, model).tokens_per_s
    assert best <= bound * (1 + 1e-9)
    assert bound <= 1.05 * best


def test_heterogeneous_flop_rates_exhaustive():
    cluster = cluster_of([[1.0, 0.7], [1.0, 1.0]], 80, tflops=[[300, 150], [150, 300]])
    model = model_of(4, 4)
    assert best_plan(cluster, model) <= tight_bound(cluster, model).tokens_per_s * (1 + 1e-9)


def test_a_plan_at_the_bound_does_not_pass_it():
    """One live device, one micro-batch: the planner's plan is the bound's own step (the
    bisection's tolerance must not put the bound under it)."""
    cluster = cluster_of([[1.0, 0.0]], 24)
    model = model_of(layers=2, microbatches=1, hidden=1024)
    plan = Planner(threads=1).plan(cluster, model, time_limit_s=1.0)
    assert plan.tokens_per_s <= tight_bound(cluster, model).tokens_per_s * (1 + 1e-12)


def test_bound_falls_with_capacity():
    cluster = cluster_of([[1.0] * 8] * 4)
    model = model_of(layers=16, microbatches=32)
    healthy = tight_bound(cluster, model).tokens_per_s
    slow = tight_bound(cluster.with_speeds({3: 0.5}), model).tokens_per_s
    dead = tight_bound(cluster.with_speeds({3: 0.0}), model).tokens_per_s
    assert dead <= slow <= healthy


SPEEDS = st.sampled_from([1.0, 1.0, 1.0, 0.8, 0.5, 0.2, 0.0])


@st.composite
def medium(draw):
    sizes = draw(st.lists(st.sampled_from([2, 4, 8]), min_size=1, max_size=4))
    memory = draw(st.sampled_from([24, 40, 80]))
    nodes = [[draw(SPEEDS) for _ in range(size)] for size in sizes]
    cluster = cluster_of(nodes, memory)
    hidden = draw(st.sampled_from([1024, 2048, 4096]))
    model = model_of(
        draw(st.integers(2, 24)),
        draw(st.integers(1, 48)),
        hidden,
        draw(st.sampled_from(["1f1b", "1f1b", "gpipe"])),
    )
    return cluster, model


PLANNERS = {
    "resihp+tokens": Planner(threads=2, token_budgets=True),
    "resihp": Planner(threads=2),
    "resihp-heuristic": make_policy("resihp-heuristic"),
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(medium(), st.sampled_from(sorted(PLANNERS)))
def test_no_planner_plan_beats_the_tight_bound(case, name):
    cluster, model = case
    try:
        plan = PLANNERS[name].plan(cluster, model, time_limit_s=1.0)
    except InputError:
        return
    assert plan.tokens_per_s <= tight_bound(cluster, model).tokens_per_s * (1 + 1e-9)


def test_the_all_reduce_is_priced_at_the_pipelines_own_shard():
    """256 H100s, the 13B model: the healthy plan (64 pipelines of one TP 4 stage) reaches the
    bound within 0.1%. The bound priced a pipeline of ``D`` devices with the gradient shard of
    one of ``D + 1`` (``L / 5`` layers for a TP 4 group, not ``L / 4``): 0.983 of it."""
    cluster = ClusterSpec.from_yaml(TRACES / "clusters" / "h100-256.yaml")
    model = ModelSpec.from_yaml(TRACES / "models" / "gpt-13b.yaml")
    plan = make_policy("resihp", token_budgets=True).healthy(cluster, model)
    bound = tight_bound(cluster, model).tokens_per_s
    assert plan.tokens_per_s <= bound * (1 + 1e-9)
    assert plan.tokens_per_s >= 0.999 * bound
