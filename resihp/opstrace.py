"""The ops-trace contract of docs/DESIGN.md: reading, validating and writing per-op timing records.

One row per operation: ``step, rank, dp_rank, stage, optype, duration`` (required) and optional
``start_ts, tp_rank, seq_id, mc, gmc, mb_id, seq_lens, tokens``. A job meta YAML beside it gives the
parallel sizes. Parquet or CSV; in CSV, ``seq_lens`` is written as a JSON list.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import yaml

from resihp.errors import InputError
from resihp.paths import write_text_atomic
from resihp.yamlio import check_keys, read_yaml_mapping

TRACE_STREAM = (
    "ops.jsonl"  # a run folder's stream of complete steps' rows (JSON lines; node 0 writes it)
)

if TYPE_CHECKING:
    import pandas as pd

REQUIRED = {
    "step": "int",
    "rank": "int",
    "dp_rank": "int",
    "stage": "int",
    "optype": "str",
    "duration": "float",
}
OPTIONAL_INT = ["tp_rank", "seq_id", "mc", "gmc", "mb_id", "tokens"]
OPTIONAL_FLOAT = ["start_ts", "wait_s", "bytes", "loss"]
MAX_STEP = 10**8  # resihp run's most steps; a larger step number is a damaged trace
OPTYPES = (
    "forward-compute",
    "backward-compute",
    "forward-send",
    "forward-recv",
    "backward-send",
    "backward-recv",
    "grads-reduce-scatter",
    "params-all-gather",
    "embedding-grads-all-reduce",
    "layernorm-grads-all-reduce",
    "optimizer",
    "optimizer-clip-main-grad",
    "gc",
)
COMPUTE_OPTYPES = ("forward-compute", "backward-compute")


@dataclass(frozen=True)
class JobMeta:
    dp_size: int
    pp_size: int
    tp_size: int
    world_size: int
    dsp_size: int = 1
    vpp_size: int = 1

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise InputError(f"job meta: {name} must be a positive integer, got {value!r}")
        product = self.dp_size * self.pp_size * self.tp_size * self.dsp_size
        if product != self.world_size:
            raise InputError(
                f"job meta: dp_size*pp_size*tp_size*dsp_size = {product} but world_size = "
                f"{self.world_size}"
            )

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


# the job meta's own fields and the optional model fields resihp writes and reads beside them
META_KEYS = (
    "dp_size",
    "pp_size",
    "tp_size",
    "world_size",
    "dsp_size",
    "vpp_size",
    "layers",
    "hidden",
    "heads",
    "ffn_hidden",
    "vocab",
    "max_seq_len",
    "mlp",
    "schedule",
    "source",
    "global_tokens",
    "budget",
    "layer_split",
    "seed",
    "name",
    "model",
)


def read_meta(path: str | Path) -> tuple[JobMeta, dict]:
    """The job meta YAML: (parallel sizes, the whole mapping including optional model fields)."""
    data = read_yaml_mapping(
        path, "job meta", "job meta must be a mapping with dp_size, pp_size, tp_size, world_size"
    )
    # a public trace's meta may carry fields of its own: only a near miss of a known key is refused
    check_keys(data, META_KEYS, str(path), typos_only=True)
    missing = [k for k in ("dp_size", "pp_size", "tp_size", "world_size") if k not in data]
    if missing:
        raise InputError(f"{path}: job meta lacks {', '.join(missing)}")
    fields = {
        k: data[k]
        for k in ("dp_size", "pp_size", "tp_size", "world_size", "dsp_size", "vpp_size")
        if k in data
    }
    try:
        return JobMeta(**fields), data
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None


def write_meta(meta: JobMeta, path: str | Path, **extra: object) -> None:
    """Write the job meta YAML ``path``: the sizes of ``meta``, then ``extra``'s fields.

    Args:
        meta: the job's parallel sizes.
        path: the ``job.yaml`` to write.
        **extra: further fields (the model's shape, the device).
    """
    # whole or not at all: a follower polls for it from another process
    write_text_atomic(
        path, yaml.safe_dump({**meta.to_dict(), **extra}, sort_keys=False), durable=False
    )


def _parse_seq_lens(value: object) -> list[int] | None:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return None
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else None
        if value is None:
            return None
    return [int(v) for v in value]


def read_ops_trace(path: str | Path) -> pd.DataFrame:
    """Read and validate an ops trace (Parquet or CSV); rows come back sorted by step, rank,
    time."""
    # deferred for start-up time: workers import this module, never build a frame
    import pandas as pd

    path = Path(path)
    try:
        if path.suffix.lower() in (".parquet", ".pq"):
            df = pd.read_parquet(path)
        else:
            df = pd.read_csv(path)
    except FileNotFoundError:
        raise InputError(f"{path}: no such ops trace") from None
    except Exception as exc:  # pyarrow and pandas raise many types for malformed files
        raise InputError(
            f"{path}: cannot read ops trace ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'malformed'})"
        ) from None
    return validate_ops_trace(df, source=str(path))


def json_lines(data: bytes, path: str | Path, first_line: int = 1) -> list[dict]:
    """The op records of complete JSON lines; blank lines are skipped.

    A line that is not a JSON object is one error naming the file and line.

    Args:
        data: the lines, ending at a newline.
        path: the file they come from, for errors.
        first_line: the number of ``data``'s first line in the file.
    """
    rows = []
    for number, line in enumerate(data.splitlines(), start=first_line):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8
            row = None
        if not isinstance(row, dict):
            raise InputError(
                f"{path}:{number}: expected one op record (a JSON object) per line, got "
                f"{line[:40].decode(errors='replace')!r}"
            )
        rows.append(row)
    return rows


def read_run_folder(folder: str | Path) -> tuple[pd.DataFrame, Path | None]:
    """The ops trace of a run folder and its job meta's path (None when it has none).

    The trace is its merged ``ops.parquet``, else its per-rank ``ops.rank<R>.parquet`` files merged,
    else the per-rank JSON-lines streams a running job appends to (``ranks/rank<R>.jsonl``; a line
    still being written is left out)."""
    # deferred for start-up time: workers import this module, never build a frame
    import pandas as pd

    folder = Path(folder)
    meta = folder / "job.yaml"
    meta_path = meta if meta.exists() else None
    if (folder / "ops.parquet").exists():
        return read_ops_trace(folder / "ops.parquet"), meta_path
    parts = sorted(folder.glob("ops.rank*.parquet"))
    if parts:
        df = pd.concat([read_ops_trace(p) for p in parts], ignore_index=True)
        return validate_ops_trace(df, source=str(folder)), meta_path
    streams = sorted((folder / "ranks").glob("rank*.jsonl")) or [
        p for p in [folder / TRACE_STREAM] if p.exists()
    ]  # a job stopped before its ops.parquet
    rows = []
    for path in streams:
        data = path.read_bytes()
        rows += json_lines(data[: data.rfind(b"\n") + 1], path)
    if not rows:
        raise InputError(
            f"{folder}: no ops trace in this folder (expected ops.parquet, "
            f"ops.rank<R>.parquet files, ranks/rank<R>.jsonl streams or {TRACE_STREAM})"
        )
    return validate_ops_trace(pd.DataFrame(rows), source=str(folder)), meta_path


def _plain(value: object) -> object:
    """A NumPy scalar as the Python value it holds (for an error message)."""
    return value.item() if isinstance(value, np.generic) else value


def validate_ops_trace(df: pd.DataFrame, source: str = "ops trace") -> pd.DataFrame:
    # deferred for start-up time: workers import this module, never build a frame
    import pandas as pd

    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise InputError(
            f"{source}: missing required column(s) {', '.join(missing)} "
            f"(required: {', '.join(REQUIRED)})"
        )
    if df.empty:
        raise InputError(f"{source}: ops trace has no rows")
    df = df.copy()
    for col in ["step", "rank", "dp_rank", "stage", *[c for c in OPTIONAL_INT if c in df.columns]]:
        values = pd.to_numeric(df[col], errors="coerce")
        # a missing value is allowed in an optional column only; a value that is not a whole number
        # nowhere (ranks of 0.5 were truncated to 0 before)
        given = df[col].notna() if col not in REQUIRED else pd.Series(True, index=df.index)
        bad = (values.isna() & given) | (values.notna() & (values != np.floor(values.fillna(0))))
        if bad.any():
            row = int(np.flatnonzero(bad.to_numpy())[0])
            raise InputError(
                f"{source}: column {col} row {row}: expected an integer, got "
                f"{_plain(df[col].iloc[row])!r}"
            )
        if col in REQUIRED:
            df[col] = values.astype(np.int64)
        else:
            df[col] = values.astype("Int64")
    duration = pd.to_numeric(df["duration"], errors="coerce")
    bad = duration.isna() | ~np.isfinite(duration) | (duration < 0)
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise InputError(
            f"{source}: column duration row {row}: expected a finite non-negative number "
            f"of seconds, got {df['duration'].iloc[row]!r}"
        )
    df["duration"] = duration.astype(np.float64)
    for col in [c for c in OPTIONAL_FLOAT if c in df.columns]:
        values = pd.to_numeric(df[col], errors="coerce")
        bad = values.isna() & df[col].notna()
        if bad.any():
            row = int(np.flatnonzero(bad.to_numpy())[0])
            raise InputError(
                f"{source}: column {col} row {row}: expected a number, got "
                f"{_plain(df[col].iloc[row])!r}"
            )
        df[col] = values.astype(np.float64)
    if (df[["step", "rank", "dp_rank", "stage"]] < 0).any().any():
        raise InputError(f"{source}: step, rank, dp_rank and stage must be non-negative")
    if int(df["step"].max()) > MAX_STEP:
        raise InputError(
            f"{source}: column step: at most {MAX_STEP:,} (a step number of a training run), "
            f"got {int(df['step'].max())}"
        )
    df["optype"] = df["optype"].astype(str)
    if "seq_lens" in df.columns:
        try:
            df["seq_lens"] = [_parse_seq_lens(v) for v in df["seq_lens"]]
        except (ValueError, TypeError):
            raise InputError(
                f"{source}: column seq_lens: expected a list of integers per row"
            ) from None
    order = ["step", "rank"] + (["start_ts"] if "start_ts" in df.columns else [])
    return df.sort_values(order, kind="stable").reset_index(drop=True)


def write_ops_trace(df: pd.DataFrame, path: str | Path) -> None:
    """Write the trace whole or not at all: into a temporary file renamed over ``path``.

    A full disk or a kill leaves the previous file (or none), never a truncated one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        if path.suffix.lower() in (".parquet", ".pq"):
            df.to_parquet(tmp, index=False)
        else:
            out = df.copy()
            if "seq_lens" in out.columns:
                out["seq_lens"] = [
                    json.dumps(list(map(int, v))) if v is not None else "" for v in out["seq_lens"]
                ]
            out.to_csv(tmp, index=False)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
