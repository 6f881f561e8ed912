"""Training, saving and evaluating predictors from profiling logs (what the CLI verbs call)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from resihp.errors import InputError
from resihp.perf.logs import read_profile_logs
from resihp.perf.predictor import (
    LinearBaseline,
    MicroBatchPredictor,
    evaluate,
    holdout_split,
    sha256_of,
)


def _baseline_to_json(baseline: LinearBaseline) -> list[dict]:
    return [
        {"shape_phase": list(key), "coef": coef.tolist()} for key, coef in baseline.coef_.items()
    ]


def _baseline_from_json(items: list[dict]) -> LinearBaseline:
    baseline = LinearBaseline()
    baseline.coef_ = {tuple(item["shape_phase"]): np.asarray(item["coef"]) for item in items}
    return baseline


TARGETS = ("auto", "time_s", "time_min_s", "cpu_time_s", "cpu_time_min_s", "cost", "cpu_cost")
# a normalised target's reference column: the device's reference time around each measurement
REFERENCE_COLUMNS = {"cost": ("ref_time_s", "wall"), "cpu_cost": ("ref_cpu_time_s", "cpu")}


def resolve_target(log: pd.DataFrame, target: str) -> str:
    """The log column ``target`` names; ``auto`` picks one.

    ``auto``: the normalised cost when the log has it (thread-CPU cost on a CPU device, which also
    leaves out time the OS gave to other processes), else the median wall time."""
    if target not in TARGETS:
        raise InputError(f"--target: expected one of {', '.join(TARGETS)}, got {target!r}")
    if target != "auto":
        return target
    for name in ("cpu_cost", "cost"):
        # a column with some values is the target (a gap in it is an error, not a reason to learn
        # another column: one NaN made auto learn the wall cost, 48% MAPE instead of 4%); an empty
        # one is not measured here (a log from a device without it)
        if name in log.columns and pd.to_numeric(log[name], errors="coerce").notna().any():
            return name
    return "time_s"


def with_target(log: pd.DataFrame, target: str, source: str) -> pd.DataFrame:
    """The log with ``time_s`` replaced by the chosen measured column (validated the same way).

    Args:
        log: the profiling log.
        target: the column to learn (one of ``TARGETS``).
        source: what errors name as the log.
    """
    target = resolve_target(log, target)
    if target == "time_s":
        return log
    if target not in log.columns:
        how = (
            "profiles from `resihp profile` have it"
            if target in REFERENCE_COLUMNS
            else "profiles from `resihp profile` on a CPU device have it"
        )
        raise InputError(f"{source}: no column {target} ({how})")
    values = pd.to_numeric(log[target], errors="coerce")
    bad = values.isna() | ~np.isfinite(values) | (values <= 0)
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise InputError(
            f"{source}: column {target} row {row}: expected a positive finite number, "
            f"got {log[target].iloc[row]!r}"
        )
    return log.assign(time_s=values.astype(np.float64))


def reference_of(log: pd.DataFrame, target: str) -> dict | None:
    """For a normalised target, the reference it is relative to and its median time; else None.

    The median over ``log``: seconds per unit of cost on this device at its typical speed."""
    if target not in REFERENCE_COLUMNS:
        return None
    column, clock = REFERENCE_COLUMNS[target]
    spec = json.loads(log["reference"].iloc[0]) if "reference" in log.columns else None
    return {"spec": spec, "clock": clock, "seconds": float(pd.to_numeric(log[column]).median())}


def _fit(
    train: pd.DataFrame, seed: int, reference: dict | None
) -> tuple[MicroBatchPredictor, LinearBaseline]:
    predictor = MicroBatchPredictor(random_state=seed).fit(train)
    if reference:
        predictor.reference_ = reference
        predictor.reference_s_ = reference["seconds"]
    return predictor, LinearBaseline().fit(train)


def _mean_metrics(runs: list[dict]) -> dict:
    """Metrics of several held-out sets: mean MAPE and p95 over the sets, the worst set's MAPE."""
    return {
        "mape": float(np.mean([r["mape"] for r in runs])),
        "p95": float(np.mean([r["p95"] for r in runs])),
        "n": int(sum(r["n"] for r in runs)),
        "worst_mape": float(max(r["mape"] for r in runs)),
    }


def cross_source(log: pd.DataFrame, seed: int = 0) -> dict | None:
    """Leave one length source out: for each source, train on the others and test on it.

    The per-phase MAPE of the learned and the linear model, per held-out source and their mean; None
    when the log has fewer than two sources."""
    if "source" not in log.columns or log["source"].nunique() < 2:
        return None
    by_source = {}
    for name in sorted(log["source"].unique()):
        held = (log["source"] == name).to_numpy()
        predictor, baseline = _fit(log[~held], seed, None)
        by_source[name] = evaluate(predictor, baseline, log[held])
    out: dict = {"split": "leave one length source out", "by_source": by_source}
    for phase in ("fwd", "bwd"):
        runs = [r[phase] for r in by_source.values() if phase in r]
        out[phase] = _mean_metrics(runs)
        out[phase]["linear_baseline"] = _mean_metrics([r["linear_baseline"] for r in runs])
    return out


def measured_on(log: pd.DataFrame) -> list[dict]:
    """The devices and software the profiles were measured with (the logs' ``env``; older logs
    have none)."""
    if "env" not in log.columns:
        return []
    return [json.loads(e) for e in sorted(log["env"].dropna().unique())]


def train_predictor(
    logs: Sequence[str | Path],
    output: str | Path,
    holdout: float = 0.25,
    seed: int = 0,
    target: str = "auto",
) -> dict:
    """Fit on all but a held-out share of micro-batches and save the model with its card.

    The card reports the held-out metrics of the saved model and of the linear baseline fitted on
    the same training rows, and the leave-one-source-out metrics when the logs hold several length
    sources.

    Args:
        logs: the profiling logs to train on.
        output: the model directory to write.
        holdout: the share of measured micro-batches held out, in (0, 1).
        seed: the split's and the model's seed.
        target: the column to learn (one of ``TARGETS``; ``auto``: ``resolve_target``).
    """
    raw = read_profile_logs(logs)
    target = resolve_target(raw, target)
    log = with_target(raw, target, str(logs[0]))
    reference = reference_of(log, target)
    train_idx, test_idx = holdout_split(log, holdout, seed)
    train, test = log.iloc[train_idx], log.iloc[test_idx]
    predictor, baseline = _fit(train, seed, reference)
    held_out = evaluate(predictor, baseline, test)
    card = {
        "training_data": {
            "logs": [{"file": Path(p).name, "sha256": sha256_of(Path(p))} for p in logs],
            "rows": int(len(train)),
            "held_out_rows": int(len(test)),
            "held_out_fraction": holdout,
            "split": "random by micro-batch (both phases of a micro-batch on one side)",
            "models": sorted(log["model"].unique().tolist()),
            "seed": seed,
            "target": target,
            "sources": sorted(log["source"].unique().tolist()) if "source" in log.columns else [],
        },
        "measured_on": measured_on(log),
        "held_out": held_out,
        "held_out_cross_source": cross_source(log, seed),
        "linear_baseline": _baseline_to_json(baseline),
    }
    predictor.save(output, card)
    return json.loads((Path(output) / "card.json").read_text())


def evaluate_model(model_dir: str | Path, logs: Sequence[str | Path]) -> dict:
    predictor = MicroBatchPredictor.load(model_dir)
    target = predictor.card_.get("training_data", {}).get("target", "time_s")
    log = with_target(read_profile_logs(logs), target, str(logs[0]))
    other = sorted(set(log["device"]) - {predictor.device_})
    if other:
        raise InputError(
            f"{logs[0]}: measured on {', '.join(other)} but {model_dir} predicts "
            f"{predictor.device_}"
        )
    baseline = _baseline_from_json(predictor.card_.get("linear_baseline", []))
    return evaluate(predictor, baseline, log)
