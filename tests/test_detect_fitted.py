"""The job's own cost model (``detect.fitted``): the fit itself, and the detector on a data-parallel
job whose step time a FLOPs model cannot explain (a fixed cost per step and per sequence)."""

from __future__ import annotations

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import nnls

from resihp.detect.config import DetectorConfig
from resihp.detect.fitted import MIN_OPS, FittedCost, _nnls, fit_trace
from resihp.detect.online import OnlineDetector, detect_trace, fits_cost
from resihp.opstrace import JobMeta
from resihp.workload.flops import TransformerShape

SHAPE = {"layers": 2, "hidden": 128, "heads": 4, "ffn_hidden": 512}
# seconds = fixed + per sequence + per token + per squared length, per phase
TRUE = {"fwd": np.array([4e-3, 1.5e-3, 2e-5, 1e-8]), "bwd": np.array([6e-3, 3e-3, 4e-5, 2e-8])}


def _lens(rng: np.random.Generator) -> list[int]:
    return [int(v) for v in rng.integers(16, 160, size=int(rng.integers(1, 5)))]


def _cost(lens: list[int], phase: str) -> float:
    a = np.asarray(lens, dtype=np.float64)
    return float(TRUE[phase] @ [1.0, len(a), a.sum(), (a * a).sum()])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(6, 40))
def test_nnls_by_subsets_is_the_exact_optimum(seed, n):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 5, size=(n, 4))
    y = rng.normal(size=n) + x @ rng.normal(size=4)
    ours = _nnls(x, y)
    ref, _ = nnls(x, y)
    assert np.all(ours >= 0)
    assert np.sum((x @ ours - y) ** 2) <= np.sum((x @ ref - y) ** 2) + 1e-9


def test_fit_recovers_the_cost_and_a_hiccup_does_not_bend_it():
    rng = np.random.default_rng(1)
    lens = [_lens(rng) for _ in range(60)]
    phase = np.array(["fwd", "bwd"] * 30)
    seconds = np.array([_cost(s, p) for s, p in zip(lens, phase)]) * rng.lognormal(0, 0.05, 60)
    seconds[7] *= 10  # one op caught a CPU hiccup
    fit = FittedCost.fit(lens, phase, seconds)
    new = [_lens(rng) for _ in range(200)]
    for p in ("fwd", "bwd"):
        truth = np.array([_cost(s, p) for s in new])
        assert np.max(np.abs(fit(new, p) / truth - 1)) < 0.08


def test_fit_refuses_too_few_ops_or_missing_lengths():
    rng = np.random.default_rng(2)
    lens = [_lens(rng) for _ in range(MIN_OPS)]
    phase = np.array(["fwd"] * (MIN_OPS - 1) + ["bwd"])
    assert FittedCost.fit(lens, phase, np.full(MIN_OPS, 0.01)) is None
    df = _trace(slow_rank=None, seed=0)
    assert fit_trace(df.drop(columns="seq_lens"), 20) is None
    assert fit_trace(df, 20) is not None


def _trace(
    slow_rank: int | None, seed: int, steps: int = 80, factor: float = 2.0, noise: float = 0.15
) -> pd.DataFrame:
    """A 2-rank data-parallel job's ops: variable lengths, lognormal noise per op, and from step 30
    ``slow_rank`` doing its forward and backward ``factor`` times slower (the other rank's backward
    then waits for it in the gradient all-reduce)."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(steps):
        done = {}
        for rank in (0, 1):
            lens = _lens(rng)
            slow = factor if rank == slow_rank and step >= 30 else 1.0
            fwd = _cost(lens, "fwd") * slow * rng.lognormal(0, noise)
            bwd = _cost(lens, "bwd") * slow * rng.lognormal(0, noise)
            done[rank] = (lens, fwd, bwd)
        finish = max(f + b for _, f, b in done.values())
        for rank, (lens, fwd, _) in done.items():
            base = dict(step=step, rank=rank, dp_rank=rank, stage=0, tp_rank=0)
            rows += [
                dict(base, optype="forward-compute", duration=fwd, seq_lens=lens, mb_id=0),
                dict(
                    base, optype="backward-compute", duration=finish - fwd, seq_lens=lens, mb_id=0
                ),
                dict(base, optype="optimizer", duration=0.004 * rng.lognormal(0, noise)),
            ]
    return pd.DataFrame(rows)


META = JobMeta(dp_size=2, pp_size=1, tp_size=1, world_size=2)


def _faults(doc: dict) -> list[tuple]:
    return [
        (e["rank"], e["onset_step"], e["detected_step"])
        for e in doc["events"]
        if e["kind"] == "fail-slow"
    ]


def test_a_jobs_own_cost_finds_a_x2_rank_sooner_than_flops_and_nothing_on_the_healthy_job():
    delays, errors, noise = [], [], {}
    for seed in range(10):
        for fit in (True, False):
            cfg = DetectorConfig(fit_cost=fit)
            slow = detect_trace(_trace(1, seed), META, config=cfg, meta_dict=SHAPE)
            noise.setdefault(fit, []).append(slow["noise"][0]["noise"])
            if not fit:
                continue
            assert slow["cost_model"] == "fitted"
            found = _faults(slow)
            assert [r for r, _, _ in found] == [1], seed
            delays.append(found[0][2] - 30)
            errors.append(abs(slow["events"][-1]["slowdown"] - 2.0) / 2.0)
            assert (
                _faults(detect_trace(_trace(None, seed), META, config=cfg, meta_dict=SHAPE)) == []
            )
    assert np.median(delays) <= 10 and max(delays) <= 15, delays
    # a phase's own alarm or the whole rank's (whose estimate the other rank's wait for it in the
    # all-reduce dilutes): the typical one within 10%
    assert np.median(errors) < 0.1, errors
    # the fit explains the fixed costs the FLOPs model cannot: less noise on every trace, typically
    # under half
    ratio = np.array(noise[True]) / np.array(noise[False])
    assert ratio.max() < 1 and np.median(ratio) < 0.5, noise


def test_live_feeding_holds_the_calibration_window_and_finds_the_same_events():
    df = _trace(1, 3)
    offline = detect_trace(df, META, meta_dict=SHAPE)
    det = OnlineDetector(META, meta_dict=SHAPE)
    events = [ev.to_dict() for step in range(80) for ev in det.observe(df[df.step == step])]
    assert det.cost_model == "fitted"
    assert [e["kind"] for e in events] == [e["kind"] for e in offline["events"]]
    assert [(e["rank"], e["onset_step"], e["detected_step"]) for e in events] == _faults(offline)
    # a live follower feeds whatever steps completed since its last poll, in one frame: the same
    # events from batches of uneven size (across the calibration window's end too)
    det = OnlineDetector(META, meta_dict=SHAPE)
    cuts = [0, 1, 4, 11, 19, 23, 30, 31, 45, 52, 60, 77, 80]
    batched = [
        ev.to_dict()
        for a, b in zip(cuts, cuts[1:])
        for ev in det.observe(df[(df.step >= a) & (df.step < b)])
    ]
    assert [(e["kind"], e["rank"], e["onset_step"], e["detected_step"]) for e in batched] == [
        (e["kind"], e["rank"], e["onset_step"], e["detected_step"]) for e in events
    ]


def test_a_pipeline_or_a_predictor_or_the_switch_keeps_the_other_cost_models():
    assert not fits_cost(
        JobMeta(dp_size=1, pp_size=2, tp_size=1, world_size=2), None, DetectorConfig()
    )
    df = _trace(1, 0)
    off = detect_trace(df, META, config=DetectorConfig(fit_cost=False), meta_dict=SHAPE)
    assert off["cost_model"] == "flops"
    given = detect_trace(df, META, expected=lambda lens, phase: np.ones(len(lens)), meta_dict=SHAPE)
    assert given["cost_model"] == "predictor"


def test_the_fit_is_kept_only_where_it_explains_the_window_better_than_flops():
    from tests.test_detect_noisy import noisy_job

    shape = TransformerShape(**SHAPE)
    # a job whose cost is its FLOPs times noise: the fit's extra freedom only adds noise (a window
    # of 20 noisy steps can still favour it now and then)
    kept = [fit_trace(noisy_job(seed=s), 20, shape) is None for s in range(12)]
    assert sum(kept) >= 10, kept
    assert detect_trace(noisy_job(seed=4), META, meta_dict=SHAPE)["cost_model"] == "flops"
    # fixed costs per step and per sequence: the fit explains what FLOPs cannot, with the model's
    # shape or without it
    for s in range(12):
        assert fit_trace(_trace(None, s), 20, shape) is not None
        assert fit_trace(_trace(None, s), 20, None) is not None
