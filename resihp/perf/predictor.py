"""Micro-batch time predictors: the paper's two-coefficient linear model and a learned model.

The learned model has two parts, fitted per phase:

1. an *analytic base* ``T0 = c . x`` with non-negative coefficients over cost terms that follow from
   the layer's arithmetic (dense FLOPs, attention FLOPs over sum(l_i^2), element-wise traffic,
   per-sequence and per-layer overheads), fitted for relative error. Non-negative coefficients make
   the base monotone in every cost term, and it extrapolates to sizes outside the training range;
2. a LightGBM model of ``log(T / T0)``: the efficiency effects the base cannot express (small
   matrices running slower, cache effects at some lengths). Predicting the log-ratio keeps the
   learned part a bounded correction of a physically sensible estimate; a tree model predicting
   time directly would be flat beyond the longest micro-batch it saw.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path

import lightgbm as lgb
import numpy as np
import pandas as pd
from sklearn.linear_model import LinearRegression
from sklearn.model_selection import GroupShuffleSplit

from resihp.errors import InputError
from resihp.perf.device import versions
from resihp.perf.logs import SHAPE_COLUMNS, with_features
from resihp.workload.features import flops_features, length_features
from resihp.workload.flops import TransformerShape

FORMAT = "resihp-microbatch-predictor/1"
PHASES = ("fwd", "bwd")
GBM_FEATURES = [
    "tokens",
    "sum_sq",
    "n_seqs",
    "max_len",
    "mean_len",
    "attn_share",
    "layers",
    "hidden",
    "heads",
    "ffn_hidden",
    "tp",
]
GBM_PARAMS = {
    "objective": "regression",
    "learning_rate": 0.08,
    "num_leaves": 15,
    "min_child_samples": 8,
    "subsample": 0.8,
    "subsample_freq": 1,
    "colsample_bytree": 0.9,
    "reg_lambda": 1.0,
    "verbose": -1,
    "num_threads": 1,
}


WIDTH_COLUMNS = ["hidden", "heads", "ffn_hidden", "tp"]
MIN_WIDTH_ROWS = 20  # rows of one width and phase needed to fit that width's own base


def _width_key(phase: str, key: tuple) -> str:
    return ":".join([phase, *(str(int(k)) for k in key)])


def base_terms(feats: pd.DataFrame) -> np.ndarray:
    """Cost terms of the analytic base, one column each, for rows with features and shape."""
    layers = feats["layers"].to_numpy(np.float64)
    tp = feats["tp"].to_numpy(np.float64)
    width = (feats["hidden"].to_numpy(np.float64) + feats["ffn_hidden"].to_numpy(np.float64)) / tp
    return np.column_stack(
        [
            feats["flops_dense"].to_numpy(np.float64),
            feats["flops_attn"].to_numpy(np.float64),
            layers * feats["tokens"].to_numpy(np.float64) * width,
            layers * feats["n_seqs"].to_numpy(np.float64),
            layers,
        ]
    )


def gbm_inputs(feats: pd.DataFrame) -> np.ndarray:
    total = feats["flops_dense"] + feats["flops_attn"]
    return feats.assign(attn_share=feats["flops_attn"] / total)[GBM_FEATURES].to_numpy(np.float64)


def _relative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative error (rows weighted by 1/y^2), columns rescaled."""
    scale = np.maximum(np.abs(x).mean(axis=0), 1e-300)
    reg = LinearRegression(positive=True, fit_intercept=False).fit(
        x / scale, y, sample_weight=1 / y**2
    )
    return reg.coef_ / scale


def ape(pred: np.ndarray, actual: np.ndarray) -> np.ndarray:
    return np.abs(pred - actual) / actual * 100.0


def metrics(pred: np.ndarray, actual: np.ndarray) -> dict[str, float]:
    errors = ape(np.asarray(pred), np.asarray(actual))
    return {
        "mape": float(errors.mean()),
        "p95": float(np.percentile(errors, 95)),
        "n": int(len(errors)),
    }


class LinearBaseline:
    """The published model ``T = a*N + b*sum(l_i^2)``, fitted per model shape and phase."""

    def fit(self, log: pd.DataFrame) -> LinearBaseline:
        feats = log if "sum_sq" in log.columns else with_features(log)
        self.coef_: dict[tuple, np.ndarray] = {}
        for key, rows in feats.groupby([*SHAPE_COLUMNS, "phase"]):
            x = rows[["tokens", "sum_sq"]].to_numpy(np.float64)
            self.coef_[tuple(int(k) if not isinstance(k, str) else k for k in key)] = _relative_fit(
                x, rows["time_s"].to_numpy()
            )
        return self

    def predict(self, log: pd.DataFrame) -> np.ndarray:
        feats = log if "sum_sq" in log.columns else with_features(log)
        out = np.full(len(feats), np.nan)
        for key, idx in feats.groupby([*SHAPE_COLUMNS, "phase"]).indices.items():
            coef = self.coef_.get(tuple(int(k) if not isinstance(k, str) else k for k in key))
            if coef is None:
                raise InputError(f"linear baseline: no fit for model shape/phase {key}")
            out[idx] = feats[["tokens", "sum_sq"]].to_numpy(np.float64)[idx] @ coef
        return out


class MicroBatchPredictor:
    """Predicts forward / backward seconds of a stage's layers on one packed micro-batch.

    ``fit(log)`` learns the log's ``time_s`` column, in whatever unit it holds: seconds, or a cost
    normalised by the device's reference time (``resihp.perf.profiler``; the training code swaps
    the column in). ``reference_s_`` converts that unit to seconds (1.0 for a model of raw
    seconds); :meth:`at_reference` gives the same model for a device measured faster or slower now.
    ``predict(log)`` takes rows with ``seq_lens``, the shape columns and ``phase``;
    ``predict_seq_lens`` takes plain lists of lengths; both return seconds.
    """

    reference_: dict | None = None  # {"spec", "clock", "seconds"} of a model of normalised cost
    reference_s_: float = 1.0

    def __init__(
        self, n_estimators: int = 400, early_stopping_rounds: int = 40, random_state: int = 0
    ) -> None:
        if n_estimators < 1:
            raise InputError(f"n_estimators must be positive, got {n_estimators}")
        self.n_estimators = n_estimators
        self.early_stopping_rounds = early_stopping_rounds
        self.random_state = random_state

    def fit(self, log: pd.DataFrame) -> MicroBatchPredictor:
        feats = with_features(log)
        devices = sorted(feats["device"].unique())
        if len(devices) > 1:
            raise InputError(
                f"profiling logs come from {len(devices)} devices ({', '.join(devices)}); "
                "train one predictor per device"
            )
        self.device_ = devices[0]
        self.base_coef_: dict[str, np.ndarray] = {}
        self.width_coef_: dict[str, np.ndarray] = {}
        self.boosters_: dict[str, lgb.Booster] = {}
        for phase in PHASES:
            rows = feats[feats["phase"] == phase]
            if len(rows) < 20:
                raise InputError(
                    f"profiling logs: {len(rows)} '{phase}' rows; need at least 20 to train"
                )
            y = rows["time_s"].to_numpy()
            self.base_coef_[phase] = _relative_fit(base_terms(rows), y)
            for key, idx in rows.groupby(WIDTH_COLUMNS).indices.items():
                if len(idx) >= MIN_WIDTH_ROWS:
                    self.width_coef_[_width_key(phase, key)] = _relative_fit(
                        base_terms(rows.iloc[idx]), y[idx]
                    )
            target = np.log(y / self._base(rows, phase))
            x = gbm_inputs(rows)
            rng = np.random.default_rng(self.random_state)
            valid = rng.random(len(rows)) < 0.15
            params = {**GBM_PARAMS, "seed": self.random_state}
            train_set = lgb.Dataset(x[~valid], target[~valid], feature_name=GBM_FEATURES)
            valid_set = lgb.Dataset(x[valid], target[valid], reference=train_set)
            self.boosters_[phase] = lgb.train(
                params,
                train_set,
                num_boost_round=self.n_estimators,
                valid_sets=[valid_set],
                callbacks=[lgb.early_stopping(self.early_stopping_rounds, verbose=False)],
            )
        return self

    def _base(self, rows: pd.DataFrame, phase: str) -> np.ndarray:
        """The analytic base of one phase's rows: a width measured in training has its own
        coefficients (each width runs its matrices at its own efficiency); another width uses the
        coefficients fitted over all widths, which extrapolate by the cost terms."""
        terms = base_terms(rows)
        out = terms @ self.base_coef_[phase]
        for key, idx in rows.groupby(WIDTH_COLUMNS).indices.items():
            coef = self.width_coef_.get(_width_key(phase, key))
            if coef is not None:
                out[idx] = terms[idx] @ coef
        return out

    def _predict_features(self, feats: pd.DataFrame) -> np.ndarray:
        out = np.empty(len(feats))
        for phase, idx in feats.groupby("phase").indices.items():
            if phase not in self.boosters_:
                raise InputError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
            rows = feats.iloc[idx]
            base = self._base(rows, phase)
            out[idx] = base * np.exp(self.boosters_[phase].predict(gbm_inputs(rows), num_threads=0))
        return out

    def predict(self, log: pd.DataFrame) -> np.ndarray:
        return self._predict_features(with_features(log)) * self.reference_s_

    def at_reference(self, reference_s: float) -> MicroBatchPredictor:
        """This model for a device whose reference micro-batch now takes ``reference_s`` seconds.

        Only for a model of normalised cost: a model of raw seconds knows no reference."""
        if not self.reference_:
            raise InputError(
                "this predictor learned raw seconds; re-measuring the reference needs a "
                "model trained on normalised cost (`resihp predictor calibrate`)"
            )
        if not (np.isfinite(reference_s) and reference_s > 0):
            raise InputError(
                f"reference time: expected a positive number of seconds, got {reference_s}"
            )
        other = copy.copy(self)
        other.reference_s_ = float(reference_s)
        return other

    def predict_seq_lens(
        self, seq_lens: Sequence[Sequence[int]], phase: str, shape: TransformerShape
    ) -> np.ndarray:
        """Seconds for each micro-batch on ``shape``'s layers.

        Args:
            seq_lens: one list of packed sequence lengths (tokens) per micro-batch.
            phase: the op phase predicted (one of ``PHASES``: forward or backward).
            shape: the layers' shape (hidden size, heads, layers, ...).
        """
        lengths = length_features(seq_lens)
        shapes = pd.DataFrame({k: np.full(len(lengths), v) for k, v in shape.to_dict().items()})
        flops = flops_features(lengths, shapes, phase)
        feats = pd.concat([lengths, flops, shapes], axis=1).assign(phase=phase)
        return self._predict_features(feats) * self.reference_s_

    # --- persistence -------------------------------------------------------------------------
    def save(self, directory: str | Path, card: dict | None = None) -> Path:
        directory = Path(directory)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file by that name, or a folder it cannot make
            raise InputError(
                f"{directory}: cannot make the model directory ({exc.strerror})"
            ) from None
        for phase, booster in self.boosters_.items():
            booster.save_model(directory / f"{phase}.lgb.txt")
        files = {
            f"{phase}.lgb.txt": sha256_of(directory / f"{phase}.lgb.txt")
            for phase in self.boosters_
        }
        full_card = {
            "format": FORMAT,
            "kind": "micro-batch time predictor",
            "device": self.device_,
            "base_terms": [
                "flops_dense",
                "flops_attn",
                "layers*tokens*(hidden+ffn)/tp",
                "layers*n_seqs",
                "layers",
            ],
            "base_coef": {p: c.tolist() for p, c in self.base_coef_.items()},
            "base_coef_by_width": {k: c.tolist() for k, c in self.width_coef_.items()},
            "gbm_features": GBM_FEATURES,
            "gbm_params": GBM_PARAMS,
            "gbm_trees": {p: b.num_trees() for p, b in self.boosters_.items()},
            "target": "log(time_s / analytic base)",
            "versions": versions(),
            "reference": self.reference_,
            "files": files,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **(card or {}),
        }
        (directory / "card.json").write_text(json.dumps(full_card, indent=2) + "\n")
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> MicroBatchPredictor:
        directory = Path(directory)
        card_path = directory / "card.json"
        try:
            card = json.loads(card_path.read_text())
        except (FileNotFoundError, NotADirectoryError):
            raise InputError(f"{directory}: not a predictor directory (no card.json)") from None
        except ValueError:  # not JSON, or not UTF-8
            raise InputError(f"{card_path}: not valid JSON") from None
        if not isinstance(card, dict):
            raise InputError(f"{card_path}: expected a JSON object (a predictor's card)")
        if card.get("format") != FORMAT:
            raise InputError(
                f"{card_path}: field format is {card.get('format')!r}; this resihp "
                f"reads {FORMAT!r} (retrain with `resihp predictor train`)"
            )
        _check_card(card, card_path)
        self = cls()
        self.card_ = card
        self.device_ = card["device"]
        self.reference_ = card.get("reference")
        self.reference_s_ = float((self.reference_ or {}).get("seconds", 1.0))
        self.base_coef_ = {p: np.asarray(c) for p, c in card["base_coef"].items()}
        self.width_coef_ = {k: np.asarray(c) for k, c in card.get("base_coef_by_width", {}).items()}
        self.boosters_ = {}
        for phase in PHASES:
            path = directory / f"{phase}.lgb.txt"
            if not path.exists():
                raise InputError(f"{path}: missing (the predictor directory is incomplete)")
            _check_model_file(path, card.get("files", {}).get(path.name))
            self.boosters_[phase] = lgb.Booster(model_file=str(path))
        return self


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _coefficients(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) for v in value
    )


def _check_card(card: dict, path: Path) -> None:
    """The fields ``load`` reads: a device name and per phase the base model's coefficients."""
    if not isinstance(card.get("device"), str):
        raise InputError(
            f"{path}: field device: expected the device's name, got {card.get('device')!r}"
        )
    for name, phases in (("base_coef", PHASES), ("base_coef_by_width", ())):
        coef = card.get(name, {})
        if (
            not isinstance(coef, dict)
            or any(p not in coef for p in phases)
            or not all(_coefficients(c) for c in coef.values())
        ):
            raise InputError(
                f"{path}: field {name}: expected per phase ({', '.join(PHASES)}) a list "
                "of finite numbers"
            )


def _check_model_file(path: Path, sha256: str | None) -> None:
    """Refuse a damaged LightGBM file before LightGBM reads it: its C++ parser aborts the whole
    process on a truncated file. Against the card's checksum, or (a card without one) by the
    markers a complete text model ends with."""
    if sha256 is not None:
        if sha256_of(path) != sha256:
            raise InputError(
                f"{path}: does not match the sha256 in card.json (damaged or replaced); "
                "retrain or re-copy the predictor directory"
            )
        return
    text = path.read_bytes()
    if b"end of trees" not in text or b"end of parameters" not in text[-4096:]:
        raise InputError(
            f"{path}: not a complete LightGBM model (truncated?); retrain or re-copy "
            "the predictor directory"
        )


def holdout_split(log: pd.DataFrame, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (train, test); both phases of one measured micro-batch stay on the same side.

    Args:
        log: the profiling log (rows of measured micro-batch phases).
        fraction: the share of measured micro-batches held out for the test side, in (0, 1).
        seed: the shuffle's seed.
    """
    if not 0 < fraction < 1:
        raise InputError(f"held-out fraction must be between 0 and 1, got {fraction}")
    mb = (
        log["mb_id"].astype(str)
        if "mb_id" in log.columns
        else pd.Series([str(s) for s in log["seq_lens"]], index=log.index)
    )
    groups = log.get("log", pd.Series("", index=log.index)).astype(str) + ":" + mb
    n = groups.nunique()
    if n < 2 or round(fraction * n) < 1 or n - int(np.ceil(fraction * n)) < 1:
        raise InputError(
            f"profiling logs: {n} measured micro-batch(es), too few to hold out "
            f"{fraction:g} of them and train on the rest (profile more: --microbatches)"
        )
    split = GroupShuffleSplit(n_splits=1, test_size=fraction, random_state=seed)
    return next(split.split(log, groups=groups))


def evaluate(predictor: MicroBatchPredictor, baseline: LinearBaseline, log: pd.DataFrame) -> dict:
    """Per-phase MAPE / p95 APE of the learned model and of the linear baseline on ``log``.

    In the unit both learned (the log's ``time_s`` column).

    Args:
        predictor: the learned model.
        baseline: the linear baseline.
        log: the profiling log to score on (held-out rows).
    """
    feats = with_features(log)
    learned, linear = predictor._predict_features(feats), baseline.predict(feats)
    actual = feats["time_s"].to_numpy()
    out: dict = {}
    for phase in PHASES:
        mask = (feats["phase"] == phase).to_numpy()
        if mask.any():
            out[phase] = metrics(learned[mask], actual[mask])
            out[phase]["linear_baseline"] = metrics(linear[mask], actual[mask])
    return out
