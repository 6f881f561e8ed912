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
which a plan can pass. ``healthy_ratio`` = tokens/s / (healthy plan's tokens/s x remaining compute fraction),
i.e. how much of the healthy plan's own efficiency survives the faults. ``solve_s``: median wall time
(``solve_cpu_s``: CPU time of the process, which a loaded machine does not inflate)
of ``Planner.plan`` over repeats (the healthy plan of the cluster cached, as in a running job).
The planner runs with token budgets (``Planner(token_budgets=True)``); ``whole_microbatches``
gives the default planner's figures (whole micro-batches only), one run.

Usage: ``python benchmarks/planner.py [--quick] [--repeats N]``; prints one JSON document.
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
from resihp.plan.plan import plan_problems  # noqa: E402
from resihp.plan.specs import ClusterSpec, ModelSpec  # noqa: E402

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
        "slow4+dead2": {**{d[i]: float(1 / (1.5 + 0.5 * i)) for i in range(4)},
                        **{d[i]: 0.0 for i in range(4, 6)}},
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
                / sum(d.tflops for d in degraded.devices))
            scenarios.append({
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
                "loose_baselines": {k: v.bound_ratio for k, v in results.items()
                                    if k != "resihp"},
                "whole_microbatches": {
                    "bound_ratio": ratio(whole_plan), "loose_bound_ratio": whole_plan.bound_ratio,
                    "solve_s": whole_s,
                    "valid": not plan_problems(whole_plan, degraded, model),
                    "ahead_of_baselines": all(
                        whole_plan.tokens_per_s >= v.tokens_per_s * (1 - 1e-9)
                        for k, v in results.items() if k != "resihp")},
                "baseline_solve_s": {k: v for k, v in times.items() if k != "resihp"},
                "ahead_of_baselines": all(ours.tokens_per_s >= v.tokens_per_s * (1 - 1e-9)
                                          for v in results.values()),
                "migration_s": ours.migration_s,
                "solver": {k: ours.solver[k] for k in ("status", "gap", "pipelines_solved")},
                "valid": not problems,
                "healthy_bound_ratio": healthy.tokens_per_s / healthy_bound,
                "healthy_loose_bound_ratio": healthy.bound_ratio,
            })
    ratios = [s["bound_ratio"] for s in scenarios]
    return {
        "scenarios": scenarios,
        "summary": {
            "min_bound_ratio": min(ratios),
            "median_bound_ratio": statistics.median(ratios),
            "min_loose_bound_ratio": min(s["loose_bound_ratio"] for s in scenarios),
            "median_loose_bound_ratio": statistics.median(s["loose_bound_ratio"] for s in scenarios),
            "loose_scenarios_at_0.97": sum(s["loose_bound_ratio"] >= 0.97 for s in scenarios),
            "min_healthy_ratio": min(s["healthy_ratio"] for s in scenarios),
            "scenarios_at_0.97": sum(r >= 0.97 for r in ratios),
            "scenarios": len(scenarios),
            "ahead_of_every_baseline": sum(s["ahead_of_baselines"] for s in scenarios),
            "all_valid": all(s["valid"] for s in scenarios),
            "max_solve_s_by_devices": {
                str(n): max(s["solve_s"] for s in scenarios if s["devices"] == n) for n in sizes},
            "max_solve_cpu_s_by_devices": {
                str(n): max(s["solve_cpu_s"] for s in scenarios if s["devices"] == n)
                for n in sizes},
            "max_bound_s_by_devices": {
                str(n): max(s["bound_s"] for s in scenarios if s["devices"] == n) for n in sizes},
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 and 256 devices, one repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=5.0)
    args = parser.parse_args()
    sizes = [64, 256] if args.quick else list(SIZES)
    print(json.dumps(run(sizes, 1 if args.quick else args.repeats, args.time_limit), indent=1))


if __name__ == "__main__":
    main()
