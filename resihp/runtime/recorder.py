"""Per-op timing records in the ops-trace contract of DESIGN.md (``resihp.opstrace``)."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from resihp.opstrace import validate_ops_trace, write_ops_trace

COLUMNS = ["step", "rank", "dp_rank", "stage", "tp_rank", "optype", "start_ts", "duration", "seq_id",
           "mb_id", "seq_lens", "tokens", "loss", "bytes"]


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
        self._flushed = 0

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
        return rows_frame(self.rows)

    def flush(self, path: str | Path) -> None:
        """Append the rows recorded since the last flush to a JSON-lines stream (one per rank):
        cheap enough to run every step, and what a side process tails to feed the detector."""
        new = self.rows[self._flushed:]
        if new:
            with open(path, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in new))
            self._flushed = len(self.rows)


def rows_frame(rows: Sequence[dict]) -> pd.DataFrame:
    df = pd.DataFrame(list(rows), columns=COLUMNS)
    for col in ("mb_id", "tokens", "tp_rank", "seq_id"):
        df[col] = df[col].astype("Int64")
    df["loss"] = df["loss"].astype(float)
    df["bytes"] = df["bytes"].astype("Int64")
    return df


def read_stream(path: str | Path) -> list[dict]:
    """Rows of a rank's JSON-lines stream; a line cut short by a killed writer is skipped."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def merge_streams(paths: Sequence[str | Path], out: str | Path) -> pd.DataFrame:
    """Concatenate per-rank streams into one ops trace sorted by step, rank and time."""
    rows = [r for p in paths if Path(p).exists() for r in read_stream(p)]
    df = validate_ops_trace(rows_frame(rows), source=str(out))
    write_ops_trace(df, out)
    return df
