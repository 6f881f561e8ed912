"""The planner's expected step (``timing.expected_step``): variable micro-batch costs on the
critical path and the slowest replica, against brute-force sampling and against the replay."""

from __future__ import annotations

import numpy as np
import pytest

from resihp.paths import TRACES
from resihp.perf.schedule import pipeline_step_time
from resihp.plan.cost import AnalyticCost
from resihp.plan.plan import Plan
from resihp.plan.planner import Planner, healthy_plan
from resihp.plan.specs import ClusterSpec, ModelSpec
from resihp.plan.timing import StageCoster, critical_path_step, expected_step
from resihp.replay.layout import compile_layout
from resihp.replay.policies.resihp import layout_of, model_spec
from resihp.replay.scenario import load_scenario
from resihp.replay.simulator import Simulator, shared_pool


class MeanOnly:
    """A cost model that cannot tell micro-batches apart (no ``microbatch_factors``)."""

    def __init__(self) -> None:
        self.inner = AnalyticCost()

    def layer_seconds(self, *args):
        return self.inner.layer_seconds(*args)

    def head_seconds(self, *args):
        return self.inner.head_seconds(*args)


@pytest.fixture(scope="module")
def setting():
    cluster = ClusterSpec.from_yaml(TRACES / "clusters" / "h100-64.yaml")
    model = ModelSpec.from_yaml(TRACES / "models" / "gpt-13b.yaml")
    return cluster, model


def test_without_cost_variation_it_is_the_mean_step(setting):
    cluster, model = setting
    coster = StageCoster(cluster, model, MeanOnly())
    plan = healthy_plan(cluster, model, MeanOnly())
    assert expected_step(plan, coster) == pytest.approx(critical_path_step(plan, coster), rel=1e-12)


def test_variable_microbatches_lengthen_the_step(setting):
    cluster, model = setting
    coster = StageCoster(cluster, model, AnalyticCost())
    factors = coster.microbatch_factors_for(2, 400.0)
    assert factors.mean() == pytest.approx(1.0) and factors.std() > 0.01
    plan = healthy_plan(cluster, model)
    assert plan.expected_step_time_s == pytest.approx(expected_step(plan, coster))
    assert plan.expected_step_time_s > plan.step_time_s  # a max of sums is convex (Jensen)


def test_matches_brute_force_sampling(setting):
    """Per step: every replica draws its own micro-batches; the slowest one sets the step."""
    cluster, model = setting
    coster = StageCoster(cluster, model, AnalyticCost())
    plan = Planner(token_budgets=True).plan(
        cluster.with_speeds({3: 0.5, 17: 0.0}), model, healthy_plan(cluster, model)
    )
    degraded = coster.at_speeds(cluster.with_speeds({3: 0.5, 17: 0.0}))
    rng = np.random.default_rng(7)
    steps = np.zeros(4000)
    for p in plan.pipelines:
        scale = p.budget(model) / model.microbatch_tokens
        fb = np.array(degraded.pipeline_fb(p.stages, scale))
        table = degraded.microbatch_factors_for(max(s.tp for s in p.stages), 400.0)
        f = table[rng.integers(len(table), size=(len(steps), p.microbatches))]
        step = pipeline_step_time(
            fb[None, :, :1] * f[:, None, :],
            fb[None, :, 1:] * f[:, None, :],
            model.schedule,
            p2p_s=degraded.p2p_s * scale,
        )
        steps = np.maximum(steps, step)
    brute = steps.mean() + degraded.dp_sync_s(plan)
    assert expected_step(plan, degraded) == pytest.approx(brute, rel=0.01)


def test_plan_json_keeps_the_expected_step(setting):
    cluster, model = setting
    plan = healthy_plan(cluster, model)
    again = Plan.from_json(plan.to_json())
    assert again.expected_step_time_s == pytest.approx(plan.expected_step_time_s)


def test_within_five_percent_of_the_replayed_step():
    """The planner's expected step for its plan against the replay's simulated steps (packed
    micro-batches of the real workload, measured noise, the same schedule); the mean-cost step
    is about a tenth short."""
    scenario = load_scenario(TRACES / "scenarios" / "failstop-7b-256.yaml")
    cluster, model = scenario.cluster, model_spec(scenario)
    planner = Planner(AnalyticCost())
    plan = planner.plan(cluster, model, None, 5.0)
    sim = Simulator(scenario, shared_pool(scenario), np.random.default_rng(1))
    window = sim.window(
        compile_layout(layout_of(plan, model)), np.ones(len(scenario.cluster)), 100, 0, 0.0
    )
    replayed = float(np.mean(window.step_time))
    assert abs(plan.expected_step_time_s / replayed - 1) <= 0.05
    assert plan.step_time_s < 0.95 * replayed
