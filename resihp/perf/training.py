"""Training, saving and evaluating predictors from profiling logs (what the CLI verbs call)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from resihp.errors import InputError
from resihp.perf.logs import read_profile_logs
from resihp.perf.predictor import LinearBaseline, MicroBatchPredictor, evaluate, holdout_split


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _baseline_to_json(baseline: LinearBaseline) -> list[dict]:
    return [{"shape_phase": list(key), "coef": coef.tolist()} for key, coef in baseline.coef_.items()]


def _baseline_from_json(items: list[dict]) -> LinearBaseline:
    baseline = LinearBaseline()
    baseline.coef_ = {tuple(item["shape_phase"]): np.asarray(item["coef"]) for item in items}
    return baseline


TARGETS = ("time_s", "time_min_s", "cpu_time_s", "cpu_time_min_s")


def with_target(log: pd.DataFrame, target: str, source: str) -> pd.DataFrame:
    """The log with ``time_s`` replaced by the chosen measured column (validated the same way)."""
    if target not in TARGETS:
        raise InputError(f"--target: expected one of {', '.join(TARGETS)}, got {target!r}")
    if target == "time_s":
        return log
    if target not in log.columns:
        raise InputError(f"{source}: no column {target} (profiles from `resihp profile` on a CPU "
                         "device have it)")
    values = pd.to_numeric(log[target], errors="coerce")
    bad = values.isna() | ~np.isfinite(values) | (values <= 0)
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise InputError(f"{source}: column {target} row {row}: expected a positive finite number "
                         f"of seconds, got {log[target].iloc[row]!r}")
    return log.assign(time_s=values.astype(np.float64))


def train_predictor(logs: Sequence[str | Path], output: str | Path, holdout: float = 0.25,
                    seed: int = 0, target: str = "time_s") -> dict:
    """Fit on all but a held-out share of micro-batches; the card reports the held-out metrics of
    the saved model and of the linear baseline fitted on the same training rows."""
    log = with_target(read_profile_logs(logs), target, str(logs[0]))
    train_idx, test_idx = holdout_split(log, holdout, seed)
    train, test = log.iloc[train_idx], log.iloc[test_idx]
    predictor = MicroBatchPredictor(random_state=seed).fit(train)
    baseline = LinearBaseline().fit(train)
    held_out = evaluate(predictor, baseline, test)
    card = {
        "training_data": {
            "logs": [{"file": Path(p).name, "sha256": _sha256(Path(p))} for p in logs],
            "rows": int(len(train)), "held_out_rows": int(len(test)), "held_out_fraction": holdout,
            "split": "random by micro-batch (both phases of a micro-batch on one side)",
            "models": sorted(log["model"].unique().tolist()), "seed": seed,
            "target": target,
        },
        "held_out": held_out,
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
        raise InputError(f"{logs[0]}: measured on {', '.join(other)} but {model_dir} predicts "
                         f"{predictor.device_}")
    baseline = _baseline_from_json(predictor.card_.get("linear_baseline", []))
    return evaluate(predictor, baseline, log)
