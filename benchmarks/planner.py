"""Planner benchmark: plan quality against the capacity bound, beside the baselines, and solve time.

Scenarios: 1-8 slow devices (1.2x-5x) and 1-4 dead devices, alone and mixed, on 64, 256, 1024,
4096 and 16,384 H100s (``traces/clusters/h100-N.yaml``; 13B-class model up to 256 devices, 70B-class
above). Each scenario re-plans from the healthy plan in force, as at a detection. For every policy:
``bound_ratio`` = predicted tokens/s / capacity bound (``resihp.plan.planner.capacity_bound``); all
predicted by the same evaluator (analytic FLOPs cost model, the schedule's critical path, gradient
all-reduce). ``bound_ratio`` (and each baseline's) is measured against the tight bound
(``resihp.plan.bound.tight_bound``: integral layers per stage, whole devices per group, proved an
upper bound by exhaustive search in the tests); ``loose_bound_ratio`` against the older
``capacity_bound`` (the best healthy layout with fractional layers, scaled by the compute left),
which a plan can pass. ``healthy_ratio`` = tokens/s / (healthy plan's tokens/s x remaining compute
fraction), i.e. how much of the healthy plan's own efficiency survives the faults. ``solve_s``:
median wall time (``solve_cpu_s``: CPU time of the process, which a loaded machine does not inflate)
of ``Planner.plan`` over repeats (the healthy plan of the cluster cached, as in a running job).
The planner runs with token budgets (``Planner(token_budgets=True)``); ``whole_microbatches``
gives the default planner's figures (whole micro-batches only), one run.

Step estimates (``step_estimates``): on the four 256-GPU replay scenarios, the planner's plan
(healthy, one device at 1/3 speed, one dead) replayed for 100 steps by the replay's simulator
(the workload's packed micro-batches, measured noise); ``predicted_vs_replayed_step_error`` is the
largest relative error of the plan's ``expected_step_time_s`` (variable micro-batch costs on the
critical path), ``mean_cost_step_error`` that of ``step_time_s`` (the mean micro-batch).

Usage: ``python benchmarks/planner.py [--quick] [--repeats N] [--steps-only]``; prints one JSON
document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from resihp.paths import TRACES  # noqa: E402
from resihp.plan.baselines import POLICIES, make_policy  # noqa: E402
from resihp.plan.bound import tight_bound  # noqa: E402
from resihp.plan.cost import AnalyticCost  # noqa: E402
from resihp.plan.plan import plan_problems  # noqa: E402
from resihp.plan.planner import Planner  # noqa: E402
from resihp.plan.specs import ClusterSpec, ModelSpec  # noqa: E402
from resihp.replay.layout import compile_layout  # noqa: E402
from resihp.replay.policies.resihp import layout_of, model_spec  # noqa: E402
from resihp.replay.scenario import load_scenario  # noqa: E402
from resihp.replay.simulator import Simulator, shared_pool  # noqa: E402

SIZES = {64: "gpt-13b", 256: "gpt-13b", 1024: "gpt-70b", 4096: "gpt-70b", 16384: "gpt-70b"}


def faults(n: int, seed: int) -> dict[str, dict[int, float]]:
    """Named fault sets: device -> speed (1 / slowdown; 0 dead), devices drawn at random."""
    rng = np.random.default_rng(seed)
    d = rng.choice(n, 12, replace=False).tolist()
    slow8 = np.linspace(1.2, 5.0, 8)
    return {
        "slow1-5x": {d[0]: 1 / 5.0},
        "slow1-1.2x": {d[0]: 1 / 1.2},
        "slow8-1.2x..5x": {d[i]: float(1 / slow8[i]) for i in range(8)},
        "dead1": {d[0]: 0.0},
        "dead4": {d[i]: 0.0 for i in range(4)},
        "slow4+dead2": {
            **{d[i]: float(1 / (1.5 + 0.5 * i)) for i in range(4)},
            **{d[i]: 0.0 for i in range(4, 6)},
        },
    }


def run(sizes: list[int], repeats: int, time_limit_s: float) -> dict:
    policies = {name: make_policy(name) for name in POLICIES}
    policies["resihp"] = make_policy("resihp", token_budgets=True)
    whole = make_policy("resihp")  # whole micro-batches only (the planner's default)
    scenarios = []
    for n in sizes:
        cluster = ClusterSpec.from_yaml(TRACES / "clusters" / f"h100-{n}.yaml")
        model = ModelSpec.from_yaml(TRACES / "models" / f"{SIZES[n]}.yaml")
        healthy = policies["resihp"].healthy(cluster, model)
        healthy_bound = tight_bound(cluster, model).tokens_per_s
        for name, speeds in faults(n, seed=n).items():
            degraded = cluster.with_speeds(speeds)
            results, times, cpu = {}, {}, []
            for policy_name, policy in policies.items():
                runs = []
                for _ in range(repeats if policy_name == "resihp" else 1):
                    t0, c0 = time.perf_counter(), time.process_time()
                    plan = policy.plan(degraded, model, healthy, time_limit_s=time_limit_s)
                    runs.append(time.perf_counter() - t0)
                    if policy_name == "resihp":
                        cpu.append(time.process_time() - c0)
                results[policy_name], times[policy_name] = plan, statistics.median(runs)
            ours = results["resihp"]
            t0 = time.perf_counter()
            whole_plan = whole.plan(degraded, model, healthy, time_limit_s=time_limit_s)
            whole_s = time.perf_counter() - t0
            problems = plan_problems(ours, degraded, model)
            t0 = time.perf_counter()
            bound = tight_bound(degraded, model)
            bound_s = time.perf_counter() - t0

            def ratio(plan, bound=bound) -> float:
                return plan.tokens_per_s / bound.tokens_per_s if bound.tokens_per_s else 0.0

            frac = ours.capacity_tokens_per_s and (
                sum(d.speed * d.tflops for d in degraded.devices)
                / sum(d.tflops for d in degraded.devices)
            )
            scenarios.append(
                {
                    "name": f"{n}/{name}",
                    "devices": n,
                    "model": model.name,
                    "layout": ours.layout.to_dict(),
                    "solve_s": times["resihp"],
                    "solve_cpu_s": statistics.median(cpu),
                    "bound_ratio": ratio(ours),
                    "loose_bound_ratio": ours.bound_ratio,
                    "bound_tokens_per_s": bound.tokens_per_s,
                    "loose_bound_tokens_per_s": ours.capacity_tokens_per_s,
                    "bound_s": bound_s,
                    "healthy_ratio": ours.tokens_per_s / (healthy.tokens_per_s * frac),
                    "baselines": {k: ratio(v) for k, v in results.items() if k != "resihp"},
                    "loose_baselines": {
                        k: v.bound_ratio for k, v in results.items() if k != "resihp"
                    },
                    "whole_microbatches": {
                        "bound_ratio": ratio(whole_plan),
                        "loose_bound_ratio": whole_plan.bound_ratio,
                        "solve_s": whole_s,
                        "valid": not plan_problems(whole_plan, degraded, model),
                        "ahead_of_baselines": all(
                            whole_plan.tokens_per_s >= v.tokens_per_s * (1 - 1e-9)
                            for k, v in results.items()
                            if k != "resihp"
                        ),
                    },
                    "baseline_solve_s": {k: v for k, v in times.items() if k != "resihp"},
                    "ahead_of_baselines": all(
                        ours.tokens_per_s >= v.tokens_per_s * (1 - 1e-9) for v in results.values()
                    ),
                    "migration_s": ours.migration_s,
                    "solver": {k: ours.solver[k] for k in ("status", "gap", "pipelines_solved")},
                    "valid": not problems,
                    "healthy_bound_ratio": healthy.tokens_per_s / healthy_bound,
                    "healthy_loose_bound_ratio": healthy.bound_ratio,
                }
            )
    ratios = [s["bound_ratio"] for s in scenarios]
    return {
        "scenarios": scenarios,
        "summary": {
            "min_bound_ratio": min(ratios),
            "median_bound_ratio": statistics.median(ratios),
            "min_loose_bound_ratio": min(s["loose_bound_ratio"] for s in scenarios),
            "median_loose_bound_ratio": statistics.median(
                s["loose_bound_ratio"] for s in scenarios
            ),
            "loose_scenarios_at_0.97": sum(s["loose_bound_ratio"] >= 0.97 for s in scenarios),
            "min_healthy_ratio": min(s["healthy_ratio"] for s in scenarios),
            "scenarios_at_0.97": sum(r >= 0.97 for r in ratios),
            "scenarios": len(scenarios),
            "ahead_of_every_baseline": sum(s["ahead_of_baselines"] for s in scenarios),
            "all_valid": all(s["valid"] for s in scenarios),
            "max_solve_s_by_devices": {
                str(n): max(s["solve_s"] for s in scenarios if s["devices"] == n) for n in sizes
            },
            "max_solve_cpu_s_by_devices": {
                str(n): max(s["solve_cpu_s"] for s in scenarios if s["devices"] == n) for n in sizes
            },
            "max_bound_s_by_devices": {
                str(n): max(s["bound_s"] for s in scenarios if s["devices"] == n) for n in sizes
            },
        },
    }


STEP_SCENARIOS = ("failstop-7b-256", "failslow-13b-256", "mixed-70b-256", "alibaba-7b-256")


def step_estimates(steps: int = 100) -> dict:
    """The planner's step estimates against the replay's simulated steps for the same plan."""
    cases = []
    for name in STEP_SCENARIOS:
        scenario = load_scenario(TRACES / "scenarios" / f"{name}.yaml")
        cluster, model = scenario.cluster, model_spec(scenario)
        planner = Planner(AnalyticCost())
        healthy = planner.plan(cluster, model, None, 5.0)
        for label, speeds in (("healthy", {}), ("slow1-3x", {5: 1 / 3}), ("dead1", {9: 0.0})):
            degraded = cluster.with_speeds(speeds) if speeds else cluster
            plan = planner.plan(degraded, model, healthy, 5.0) if speeds else healthy
            sim = Simulator(scenario, shared_pool(scenario), np.random.default_rng(1))
            at = np.ones(len(scenario.cluster))
            for device, speed in speeds.items():
                at[device] = speed
            window = sim.window(compile_layout(layout_of(plan, model)), at, steps, 0, 0.0)
            replayed = float(np.mean(window.step_time))
            cases.append(
                {
                    "scenario": name,
                    "faults": label,
                    "replayed_step_s": replayed,
                    "expected_step_s": plan.expected_step_time_s,
                    "mean_cost_step_s": plan.step_time_s,
                    "error": plan.expected_step_time_s / replayed - 1,
                    "mean_cost_error": plan.step_time_s / replayed - 1,
                }
            )
    return {
        "cases": cases,
        "steps": steps,
        "predicted_vs_replayed_step_error": max(abs(c["error"]) for c in cases),
        "mean_cost_step_error": max(abs(c["mean_cost_error"]) for c in cases),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 and 256 devices, one repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=5.0)
    parser.add_argument(
        "--steps-only", action="store_true", help="only the step estimates against the replay"
    )
    args = parser.parse_args()
    sizes = [64, 256] if args.quick else list(SIZES)
    out = {} if args.steps_only else run(sizes, 1 if args.quick else args.repeats, args.time_limit)
    out["step_estimates"] = step_estimates(20 if args.quick else 100)
    out["predicted_vs_replayed_step_error"] = out["step_estimates"][
        "predicted_vs_replayed_step_error"
    ]
    out["load_average"] = os.getloadavg()  # other work on the machine disturbs the times
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
