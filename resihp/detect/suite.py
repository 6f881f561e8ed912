"""The labelled evaluation suite behind ``resihp detect-eval`` and ``benchmarks/detector.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from resihp.detect.alibaba import alibaba_path
from resihp.detect.config import DEFAULT_STEP_TIME_S, DetectorConfig
from resihp.detect.evaluate import METHODS, Score, fault_sigma, run_methods, score_events
from resihp.detect.observe import ExpectedCompute
from resihp.detect.synth import CostPool, Injection, SimJob, alibaba_residuals, simulate
from resihp.parallel import ParallelDims
from resihp.paths import TRACES

DEFAULT_PROFILE = TRACES / "detect" / "profile_cpu.parquet"
FACTORS = (1.1, 1.2, 1.3, 1.5, 2.0, 3.0, 5.0)
LINK_FACTORS = (1.5, 2.0, 3.0, 4.0)
LINK_TRAFFIC = ("pipeline", "gradient-sync")
KINDS = ("fail-slow", "link-slow")


def make_suite(
    quick: bool = False, seed: int = 0, steps: int = 300, dp: int = 4, pp: int = 4
) -> list[tuple[str, SimJob]]:
    """The suite's labelled jobs, by name: healthy ones, fail-slows and link-slows.

    Healthy jobs, fail-slows of each factor at a random rank/onset/duration, and with a pipeline
    link-slows and a job with a heavier last stage (stage imbalance that must not be blamed on a
    device).

    Args:
        quick: a small suite (a few shorter traces) for a fast check.
        seed: the suite's seed.
        steps: steps per trace (a quick suite's are fewer).
        dp: data-parallel replicas of each job.
        pp: pipeline stages of each job.
    """
    rng = np.random.default_rng(seed)
    reps = 1 if quick else 4
    steps = 160 if quick else steps
    healthy = 2 if quick else 16
    jobs: list[tuple[str, SimJob]] = []
    sources = ("code", "text")
    dims = ParallelDims(dp, pp)
    world = dims.world_size

    def at(draw: int) -> int:
        """The rank of the ``draw``-th (replica, stage) pair, replica-major."""
        d, s = divmod(int(draw), pp)
        return dims.rank_of(d, s)

    def job(n: int, **kw: object) -> SimJob:
        return SimJob(dp=dp, pp=pp, steps=steps, seed=seed * 1000 + n, **kw)

    for h in range(healthy):
        jobs.append((f"healthy-{h}", job(h, source=sources[h % 2])))
    n = 0
    for factor in FACTORS:
        for _ in range(reps):
            onset = int(rng.integers(30, steps - 40))
            length = int(rng.choice([10, 25, 60, steps]))
            inj = Injection(
                "fail-slow", at(rng.integers(world)), onset, min(onset + length, steps) - 1, factor
            )
            jobs.append(
                (f"fail-slow-{factor}x-{n}", job(100 + n, source=sources[n % 2], injections=[inj]))
            )
            n += 1
    if pp > 1:
        for k, factor in enumerate((2.0, 4.0)):
            d, s = int(rng.integers(dp)), int(rng.integers(pp - 1))
            inj = Injection("link-slow", dims.rank_of(d, s), 50, steps - 1, factor)
            jobs.append((f"link-slow-{factor}x", job(300 + k, source="code", injections=[inj])))
    # slow links of both kinds of traffic, at a random place, onset and length
    for k, (traffic, factor) in enumerate((t, f) for t in LINK_TRAFFIC for f in LINK_FACTORS):
        if (traffic == "pipeline" and pp < 2) or (traffic == "gradient-sync" and dp < 2):
            continue
        for r in range(reps // 2 or 1):
            d, s = int(rng.integers(dp)), int(rng.integers(pp - 1 if traffic == "pipeline" else pp))
            onset = int(rng.integers(30, steps - 40))
            length = int(rng.choice([25, 60, steps]))
            inj = Injection(
                "link-slow",
                dims.rank_of(d, s),
                onset,
                min(onset + length, steps) - 1,
                factor,
                traffic,
            )
            jobs.append(
                (
                    f"link-slow-{traffic}-{factor}x-{r}",
                    job(500 + 10 * k + r, source=sources[(k + r) % 2], injections=[inj]),
                )
            )
        inj = Injection("fail-slow", at(rng.integers(world)), steps // 2, steps - 1, 1.5)
        heavy = (2,) * (pp - 1) + (3,)
        jobs.append(
            (
                "stage-imbalance+fail-slow",
                job(400, source="text", stage_layers=heavy, injections=[inj]),
            )
        )
    return jobs


def evaluate_suite(
    quick: bool = False,
    seed: int = 0,
    expected: ExpectedCompute | None = None,
    profile: str | Path = DEFAULT_PROFILE,
    methods: list[str] | None = None,
    config: DetectorConfig | None = None,
    drop: tuple[str, ...] = (),
    on_progress: Callable[[int], None] | None = None,
    dp: int = 4,
    pp: int = 4,
    step_time_s: float = DEFAULT_STEP_TIME_S,
) -> dict:
    """Every method on every suite trace: totals, by slowdown factor, and the imbalance check.

    ``drop`` removes optional trace columns (``seq_lens``, ``start_ts``) to score the detector on
    the less informative traces many real jobs record. False alarms per day are of one job at
    ``step_time_s`` seconds a step; delays are against Lorden's bound at the noise resihp
    calibrated on each trace (``evaluate`` module doc).

    Args:
        quick: a small suite for a fast check.
        seed: the suite's seed.
        expected: resihp's cost model (None: ``trace_cost`` decides).
        profile: the profiling log of measured micro-batch costs.
        methods: the methods scored (None: all of ``METHODS``).
        config: resihp's detector config (default: ``DetectorConfig()``).
        drop: trace columns removed before detection.
        on_progress: called with the traces done.
        dp: data-parallel replicas of each job.
        pp: pipeline stages of each job.
        step_time_s: seconds a step, at which false alarms per day are stated.
    """
    pool = CostPool.from_profile(profile)
    noise = alibaba_residuals(alibaba_path(2))
    cfg = config or DetectorConfig()
    methods = methods or METHODS
    meta_dict = {
        "layers": pool.layers,
        "hidden": pool.hidden,
        "heads": 4,
        "ffn_hidden": 4 * pool.hidden,
    }
    totals = {m: Score() for m in methods}
    by_kind = {m: {k: Score() for k in KINDS} for m in methods}
    by_factor = {m: {f: Score() for f in FACTORS} for m in methods}
    strong = {m: Score() for m in methods}
    imbalance: dict[str, object] = {}
    cost_model = None
    suite = make_suite(quick, seed, dp=dp, pp=pp)
    for k, (_name, job) in enumerate(suite):
        df = simulate(job, pool, noise)
        df = df.drop(columns=list(drop))
        detectors: dict = {}
        found, obs = run_methods(
            df, job.meta(), methods, expected, meta_dict, cfg, detectors=detectors
        )
        cost_model = obs.cost_model
        budget = detectors["resihp"].budget() if "resihp" in detectors else {}

        def sigma_of(inj: Injection, budget: dict = budget) -> float | None:
            return fault_sigma(budget, inj)

        for m in methods:
            sc = score_events(
                found[m],
                job.injections,
                obs.steps,
                job.dims,
                skip_first=cfg.calibration_steps,
                sigma_of=sigma_of,
            )
            totals[m].add(sc)
            for kind in KINDS:  # each kind scored on its own: its events against its faults
                by_kind[m][kind].add(
                    score_events(
                        [e for e in found[m] if e.kind == kind],
                        [i for i in job.injections if i.kind == kind],
                        obs.steps,
                        job.dims,
                        skip_first=cfg.calibration_steps,
                        sigma_of=sigma_of,
                    )
                )
            if job.injections and all(i.kind == "fail-slow" for i in job.injections):
                f = job.injections[0].factor
                if f in by_factor[m]:
                    by_factor[m][f].add(sc)
                if f >= 1.2:
                    strong[m].add(sc)
            elif not job.injections:
                strong[m].add(sc)
        if job.stage_layers:
            imbalance = {m: sorted({e.kind for e in found[m]}) for m in methods}
            imbalance["resihp_stage_imbalance_stages"] = sorted(
                e.stage for e in found.get("resihp", []) if e.kind == "stage-imbalance"
            )
        if on_progress:
            on_progress(k + 1)
    return {
        "traces": len(suite),
        "dp": dp,
        "pp": pp,
        "seed": seed,
        "dropped_columns": list(drop),
        "steps": int(sum(j.steps for _, j in suite)),
        "ranks_per_trace": suite[0][1].world_size,
        "cost_model": cost_model,
        "noise": {
            "op_sigma_from_profile_spread": round(pool.op_sigma, 4),
            "host_residual_mad_alibaba_job2": round(float(np.median(np.abs(noise))), 4),
        },
        "step_time_s": step_time_s,
        "methods": {m: totals[m].summary(step_time_s) for m in methods},
        "by_kind": {
            m: {k: sc.summary(step_time_s) for k, sc in by_kind[m].items()} for m in methods
        },
        "fail_slow_ge_1_2x_and_healthy": {m: strong[m].summary(step_time_s) for m in methods},
        "by_factor": {
            m: {str(f): _factor_summary(s) for f, s in by_factor[m].items()} for m in methods
        },
        "stage_imbalance_trace": imbalance,
    }


def _factor_summary(sc: Score) -> dict:
    s = sc.summary()
    return {
        k: s[k]
        for k in (
            "tp",
            "fn",
            "fp",
            "recall",
            "delay_steps_median",
            "delay_steps_max",
            "slowdown_error_median",
        )
    }
