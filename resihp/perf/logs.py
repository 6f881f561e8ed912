"""Reading and validating profiling logs (the docs/DESIGN.md profiling-log contract)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from resihp.errors import InputError
from resihp.workload.features import flops_features, length_features

REQUIRED = [
    "device",
    "model",
    "layers",
    "hidden",
    "heads",
    "ffn_hidden",
    "tp",
    "phase",
    "seq_lens",
    "time_s",
]
SHAPE_COLUMNS = ["layers", "hidden", "heads", "ffn_hidden", "tp"]


def _check_seq_lens(values: pd.Series, source: str, budget: pd.Series | None) -> list[list[int]]:
    out = []
    for row, value in enumerate(values):
        if value is None or isinstance(value, (str, bytes, float, int)):
            raise InputError(
                f"{source}: column seq_lens row {row}: expected a list of integers, got {value!r}"
            )
        lens = np.asarray(value)
        if lens.size == 0:
            raise InputError(f"{source}: column seq_lens row {row}: empty list of sequence lengths")
        if not np.issubdtype(lens.dtype, np.number) or not np.all(np.isfinite(lens)):
            raise InputError(
                f"{source}: column seq_lens row {row}: expected integers, got {value!r}"
            )
        if lens.min() <= 0:
            raise InputError(
                f"{source}: column seq_lens row {row}: sequence lengths must be positive, "
                f"got {int(lens.min())}"
            )
        if budget is not None and lens.sum() > budget.iloc[row]:
            raise InputError(
                f"{source}: column seq_lens row {row}: {int(lens.sum())} tokens exceed "
                f"the micro-batch budget {int(budget.iloc[row])}"
            )
        out.append(lens.astype(np.int64).tolist())
    return out


def validate_profile_log(df: pd.DataFrame, source: str = "profiling log") -> pd.DataFrame:
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise InputError(
            f"{source}: missing column(s) {', '.join(missing)} (a profiling log has "
            f"{', '.join(REQUIRED)})"
        )
    if df.empty:
        raise InputError(f"{source}: profiling log has no rows")
    df = df.reset_index(drop=True).copy()
    for col in SHAPE_COLUMNS:
        values = pd.to_numeric(df[col], errors="coerce")
        if values.isna().any() or (values < 1).any() or (values % 1 != 0).any():
            row = int(
                np.flatnonzero((values.isna() | (values < 1) | (values % 1 != 0)).to_numpy())[0]
            )
            raise InputError(
                f"{source}: column {col} row {row}: expected a positive integer, "
                f"got {df[col].iloc[row]!r}"
            )
        df[col] = values.astype(np.int64)
    bad_phase = ~df["phase"].isin(["fwd", "bwd"])
    if bad_phase.any():
        row = int(np.flatnonzero(bad_phase.to_numpy())[0])
        raise InputError(
            f"{source}: column phase row {row}: expected 'fwd' or 'bwd', got "
            f"{df['phase'].iloc[row]!r}"
        )
    time_s = pd.to_numeric(df["time_s"], errors="coerce")
    bad = time_s.isna() | ~np.isfinite(time_s) | (time_s <= 0)
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise InputError(
            f"{source}: column time_s row {row}: expected a positive finite number of "
            f"seconds, got {df['time_s'].iloc[row]!r}"
        )
    df["time_s"] = time_s.astype(np.float64)
    budget = pd.to_numeric(df["budget"], errors="coerce") if "budget" in df.columns else None
    df["seq_lens"] = _check_seq_lens(df["seq_lens"], source, budget)
    df["device"] = df["device"].astype(str)
    df["model"] = df["model"].astype(str)
    return df


def read_profile_logs(paths: Sequence[str | Path]) -> pd.DataFrame:
    """Read, validate and concatenate profiling logs; a ``log`` column names each row's file."""
    if not paths:
        raise InputError("no profiling logs given")
    frames = []
    for path in map(Path, paths):
        try:
            df = pd.read_parquet(path)
        except FileNotFoundError:
            raise InputError(f"{path}: no such profiling log") from None
        except Exception as exc:  # pyarrow raises several types for files that are not Parquet
            raise InputError(
                f"{path}: not a readable Parquet profiling log ({type(exc).__name__})"
            ) from None
        frames.append(validate_profile_log(df, str(path)).assign(log=path.name))
    return pd.concat(frames, ignore_index=True)


def with_features(log: pd.DataFrame) -> pd.DataFrame:
    """The log with length and analytic-FLOPs feature columns added."""
    lengths = length_features(list(log["seq_lens"]))
    flops = flops_features(lengths, log[SHAPE_COLUMNS], log["phase"].to_numpy())
    base = log.drop(columns=[c for c in [*lengths.columns, *flops.columns] if c in log.columns])
    return pd.concat([base.reset_index(drop=True), lengths, flops], axis=1)
