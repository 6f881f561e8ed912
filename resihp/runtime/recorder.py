"""Per-op timing records in the ops-trace contract of DESIGN.md (``resihp.opstrace``)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from resihp.opstrace import validate_ops_trace, write_ops_trace

COLUMNS = ["step", "rank", "dp_rank", "stage", "tp_rank", "optype", "start_ts", "duration", "seq_id",
           "mb_id", "seq_lens", "tokens", "loss"]


class OpRecorder:
    """Times operations of one rank. ``sync`` (e.g. ``torch.cuda.synchronize``) runs before each
    clock read so that asynchronous device work is attributed to the op that launched it."""

    def __init__(self, rank: int, dp_rank: int, stage: int, tp_rank: int = 0,
                 sync: Callable[[], None] | None = None) -> None:
        self.ids = {"rank": rank, "dp_rank": dp_rank, "stage": stage, "tp_rank": tp_rank}
        self.sync = sync or (lambda: None)
        self.rows: list[dict] = []
        self.step = 0
        self._seq: dict[str, int] = defaultdict(int)
        self.listeners: list[Callable[[dict], None]] = []

    def begin_step(self, step: int) -> None:
        self.step = step
        self._seq.clear()

    @contextmanager
    def op(self, optype: str, mb_id: int | None = None, seq_lens: Sequence[int] | None = None,
           **extra: object) -> Iterator[dict]:
        """Times the body; the yielded row can be given more fields (e.g. ``loss``) inside it."""
        self.sync()
        start_ts, t0 = time.time(), time.perf_counter()
        row: dict = {"step": self.step, **self.ids, "optype": optype, "start_ts": start_ts,
                     "seq_id": self._seq[optype], "mb_id": mb_id,
                     "seq_lens": list(seq_lens) if seq_lens is not None else None,
                     "tokens": int(sum(seq_lens)) if seq_lens is not None else None, **extra}
        self._seq[optype] += 1
        yield row
        self.sync()
        row["duration"] = time.perf_counter() - t0
        self.rows.append(row)
        for listener in self.listeners:
            listener(row)

    def frame(self) -> pd.DataFrame:
        df = pd.DataFrame(self.rows, columns=COLUMNS)
        for col in ("mb_id", "tokens", "tp_rank", "seq_id"):
            df[col] = df[col].astype("Int64")
        df["loss"] = df["loss"].astype(float)
        return df

    def write(self, path: str | Path) -> None:
        write_ops_trace(self.frame(), path)


def merge_rank_traces(paths: Sequence[str | Path], out: str | Path) -> pd.DataFrame:
    """Concatenate per-rank Parquet parts into one ops trace sorted by step, rank and time."""
    parts = [pd.read_parquet(p) for p in paths if Path(p).exists()]
    df = validate_ops_trace(pd.concat(parts, ignore_index=True), source=str(out))
    write_ops_trace(df, out)
    return df
