"""A job's own compute cost, learned from its calibration window.

The cost model of a job with no trained predictor and no pipeline peers (an attached user job, a
data-parallel run).

Analytic FLOPs miss what dominates a small model's step on a CPU or a launch-bound GPU: a fixed cost
per step and per sequence (kernel launches, Python, a per-document attention loop). Per phase
(forward, backward), the fit is ``seconds = a + b * sequences + c * FLOPs`` (without the model's
shape: ``c * tokens + d * sum of squared lengths``), every coefficient non-negative (a cost never
falls as the work grows), reweighted towards least log error (the detector works on log ratios),
refitted once without the ops beyond three robust sigmas (a CPU hiccup in the window must not bend
the model). It is kept only where, out of fold, it explains the window better than FLOPs alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import combinations

import numpy as np
import pandas as pd

from resihp.workload.flops import TransformerShape, stage_flops

_PHASES = ("fwd", "bwd")
# the fit needs a few ops per coefficient; below this a phase falls back to the analytic model
MIN_OPS = 12
_TRIM_SIGMAS = 3.0
# the window's steps fall into this many folds, each costed by a fit on the others
FOLDS = 5
# reweighting rounds: each weighs an op by its predicted cost, which approaches log error
_IRLS = 3


def _spread(resid: np.ndarray) -> float:
    """A robust standard deviation: the median absolute deviation, scaled for Gaussian noise."""
    return float(1.4826 * np.median(np.abs(resid - np.median(resid))))


def _features(seq_lens: Sequence[Sequence[int]], shape: TransformerShape | None) -> np.ndarray:
    """Per micro-batch: 1, sequences, and its FLOPs where the model's shape is known (one
    coefficient for the compute, whose split between dense and attention work the shape fixes),
    else tokens and the sum of squared lengths."""
    # per call a few micro-batches (one step, live): plain loops beat building a frame
    n = np.array([len(s) for s in seq_lens], dtype=np.float64)
    tokens = np.array([sum(s) for s in seq_lens], dtype=np.float64)
    sum_sq = np.array([sum(v * v for v in s) for s in seq_lens], dtype=np.float64)
    if shape is None:
        return np.column_stack([np.ones(len(n)), n, tokens, sum_sq])
    dense, attention = stage_flops(shape, tokens, sum_sq, "fwd")
    return np.column_stack([np.ones(len(n)), n, dense + attention])


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares by trying every subset of free coefficients (at most four columns:
    15 small solves): exact, and it keeps scipy and scikit-learn (seconds of import) out of a user's
    training process, where the in-process detector runs."""
    k = x.shape[1]
    scale = np.maximum(np.abs(x).max(axis=0), 1e-300)
    xs = x / scale
    best, best_err = np.zeros(k), float(np.sum(y * y))
    for size in range(1, k + 1):
        for cols in combinations(range(k), size):
            c, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
            if np.any(c < 0):
                continue
            err = float(np.sum((xs[:, cols] @ c - y) ** 2))
            if err < best_err:
                best, best_err = np.zeros(k), err
                best[list(cols)] = c
    return best / scale


def _fit_phase(x: np.ndarray, seconds: np.ndarray) -> np.ndarray | None:
    y = np.asarray(seconds, dtype=np.float64)
    keep = np.isfinite(y) & (y > 0)
    if keep.sum() < MIN_OPS:
        return None
    for _ in range(2):
        xk, yk = x[keep], y[keep]
        coef = _nnls(xk / yk[:, None], np.ones(len(yk)))  # relative error: each row over its value
        for _ in range(_IRLS):
            pk = xk @ coef
            if not np.all(pk > 0):
                break
            coef = _nnls(xk / pk[:, None], yk / pk)
        pred = x @ coef
        if not np.all(pred[keep] > 0):
            return None
        resid = np.log(y / np.where(pred > 0, pred, np.nan))
        centre = np.median(resid[keep])
        inliers = keep & (np.abs(resid - centre) <= _TRIM_SIGMAS * max(_spread(resid[keep]), 1e-9))
        if inliers.sum() < MIN_OPS or inliers.sum() == keep.sum():
            break
        keep = inliers
    return coef


def _fit_phases(
    x: np.ndarray, phase: np.ndarray, seconds: np.ndarray
) -> dict[str, np.ndarray] | None:
    coef = {}
    for p in _PHASES:
        sel = np.flatnonzero(phase == p)
        c = _fit_phase(x[sel], seconds[sel])
        if c is None:
            return None
        coef[p] = c
    return coef


@dataclass(frozen=True)
class FittedCost:
    """Per phase the fitted coefficients; called as an ``ExpectedCompute``.

    Coefficients of ``_features`` (with the model's ``shape``: intercept, per sequence, per FLOP);
    a call gives the seconds of each micro-batch.

    The ops the fit was made on would look quieter through it than any later op (it has bent
    towards their noise), and the detector learns each rank's noise on those very steps. So an op
    of the window is costed by a fit without its own step (``costs`` with its step): ``folds[k]``
    was fitted without the steps of fold ``k``, and ``fold_of_step`` says where each step fell."""

    coef: dict[str, np.ndarray]
    shape: TransformerShape | None = None
    folds: tuple[dict[str, np.ndarray], ...] = ()
    fold_of_step: dict[int, int] = field(default_factory=dict)

    @classmethod
    def fit(
        cls,
        seq_lens: Sequence[Sequence[int]],
        phase: Sequence[str],
        seconds: np.ndarray,
        steps: Sequence[int] | None = None,
        shape: TransformerShape | None = None,
    ) -> FittedCost | None:
        """The fit of compute ops of healthy steps; None when a phase has too few ops or no fit.

        Args:
            seq_lens: each op's packed sequence lengths.
            phase: each op's phase (``fwd``/``bwd``).
            seconds: each op's own seconds.
            steps: each op's step, for the out-of-fold costs of those steps (None: no folds).
            shape: the model's (stage's) shape, for its FLOPs (None: lengths only).
        """
        phase = np.asarray(phase)
        seconds = np.asarray(seconds, dtype=np.float64)
        x = _features(seq_lens, shape)
        coef = _fit_phases(x, phase, seconds)
        if coef is None or steps is None:
            return None if coef is None else cls(coef, shape)
        steps = np.asarray(steps, dtype=np.int64)
        distinct = np.unique(steps)
        fold_of_step = {int(s): i % FOLDS for i, s in enumerate(distinct)}
        fold = np.array([fold_of_step[int(s)] for s in steps])
        folds = []
        for k in range(FOLDS):
            out = np.flatnonzero(fold != k)
            c = _fit_phases(x[out], phase[out], seconds[out])
            if c is None:  # too few ops to leave a fold out: the window is costed in-sample
                return cls(coef, shape)
            folds.append(c)
        return cls(coef, shape, tuple(folds), fold_of_step)

    def __call__(self, seq_lens: Sequence[Sequence[int]], phase: str) -> np.ndarray:
        return np.maximum(_features(seq_lens, self.shape) @ self.coef[phase], 1e-12)

    def costs(self, seq_lens: Sequence[Sequence[int]], phase: str, steps: np.ndarray) -> np.ndarray:
        """Seconds of each micro-batch, run at ``steps``: out of fold for the fitted window.

        Args:
            seq_lens: each micro-batch's packed sequence lengths.
            phase: ``fwd`` or ``bwd``.
            steps: each micro-batch's step.
        """
        x = _features(seq_lens, self.shape)
        out = x @ self.coef[phase]
        fold = np.array([self.fold_of_step.get(int(s), -1) for s in steps], dtype=np.int64)
        for k, c in enumerate(self.folds):
            at = fold == k
            out[at] = x[at] @ c[phase]
        return np.maximum(out, 1e-12)


_OPTYPE_PHASE = {"forward-compute": "fwd", "backward-compute": "bwd"}


def fit_trace(
    df: pd.DataFrame, calibration_steps: int, shape: TransformerShape | None = None
) -> FittedCost | None:
    """The fit over the compute ops of a trace's first steps, or None where it does not help.

    Their own seconds, tensor-parallel waits taken out; None without lengths on every one of them,
    or where it does not explain them better than the analytic cost.

    Args:
        df: the ops trace.
        calibration_steps: the first steps fitted on.
        shape: the model's (stage's) shape (None: lengths only).
    """
    if "seq_lens" not in df.columns:
        return None
    steps = np.unique(df["step"].to_numpy())[:calibration_steps]
    rows = df[df["optype"].isin(list(_OPTYPE_PHASE)) & df["step"].isin(steps)]
    if rows.empty or rows["seq_lens"].isna().any():
        return None
    seconds = rows["duration"].to_numpy(np.float64)
    if "wait_s" in rows.columns:
        seconds = seconds - np.nan_to_num(rows["wait_s"].to_numpy(np.float64, na_value=np.nan))
    lens, steps = rows["seq_lens"].tolist(), rows["step"].to_numpy()
    phase = rows["optype"].map(_OPTYPE_PHASE).to_numpy()
    fit = FittedCost.fit(lens, phase, seconds, steps, shape)
    if fit is None or not _explains_better(fit, lens, phase, seconds, steps):
        return None
    return fit


def _explains_better(
    fit: FittedCost, lens: list, phase: np.ndarray, seconds: np.ndarray, steps: np.ndarray
) -> bool:
    """Whether the fit, out of fold, leaves less spread in the window than the analytic cost (FLOPs,
    or tokens without the shape) scaled per phase: a job whose cost is its FLOPs keeps them,
    without the noise a fit's extra freedom would add."""
    ok = np.isfinite(seconds) & (seconds > 0)
    fitted, analytic = [], []
    for p in _PHASES:
        sel = np.flatnonzero((phase == p) & ok)
        sub = [lens[i] for i in sel]
        for out, cost in (
            (fitted, fit.costs(sub, p, steps[sel])),
            (analytic, _features(sub, fit.shape)[:, 2]),
        ):  # FLOPs, or tokens
            r = np.log(seconds[sel] / cost)
            out.append(r - np.median(r))
    return _spread(np.concatenate(fitted)) < _spread(np.concatenate(analytic))
