"""The Alibaba PAI per-worker mini-batch time files as ops traces (see traces/alibaba/README.md)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from resihp.errors import InputError
from resihp.opstrace import JobMeta, validate_ops_trace
from resihp.paths import TRACES, resolve

ALIBABA_DIR = TRACES / "alibaba"


def alibaba_path(job: int) -> Path:
    return ALIBABA_DIR / f"job_{job}_norm.csv"


def read_alibaba_job(path: str | Path) -> tuple[pd.DataFrame, JobMeta]:
    """One ``forward-compute`` row per worker and iteration; durations in the publisher's 0-1000
    units.

    Rows with no time (the files have a few gaps) are skipped, as the ops-trace contract allows.
    """
    path = resolve(path, "alibaba")
    try:
        raw = pd.read_csv(path)
    except OSError as exc:
        raise InputError(f"{path}: cannot read Alibaba mini-batch file ({exc.strerror})") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"{path}: not a CSV Alibaba mini-batch file ({first}); expected columns "
            "worker, time, batch_time_norm"
        ) from None
    need = {"worker", "time", "batch_time_norm"}
    if not need <= set(raw.columns):
        raise InputError(f"{path}: expected columns worker, time, batch_time_norm")
    for col, kind in (
        ("worker", "an integer"),
        ("time", "an integer"),
        ("batch_time_norm", "a number"),
    ):
        values = pd.to_numeric(raw[col], errors="coerce")
        bad = values.isna() & raw[col].notna()
        if bad.any():
            row = int(bad.to_numpy().nonzero()[0][0])
            raise InputError(
                f"{path}: column {col} row {row}: {raw[col].iloc[row]!r} is not {kind}"
            )
        raw[col] = values
    raw = raw.dropna(subset=["worker", "time", "batch_time_norm"])
    workers = sorted(raw["worker"].astype(int).unique())
    rank = {w: i for i, w in enumerate(workers)}
    df = pd.DataFrame(
        {
            "step": raw["time"].astype(int),
            "rank": raw["worker"].astype(int).map(rank),
            "dp_rank": raw["worker"].astype(int).map(rank),
            "stage": 0,
            "tp_rank": 0,
            "optype": "forward-compute",
            "duration": raw["batch_time_norm"].astype(float),
            "worker": raw["worker"].astype(int),
        }
    )
    meta = JobMeta(dp_size=len(workers), pp_size=1, tp_size=1, world_size=len(workers))
    return validate_ops_trace(df, source=str(path)), meta
