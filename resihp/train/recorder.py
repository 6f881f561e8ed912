"""Per-op timing records in the ops-trace contract of docs/DESIGN.md (``resihp.opstrace``)."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from resihp.detect.heartbeat import KEEPER_WAIT, Progress
from resihp.opstrace import validate_ops_trace, write_ops_trace

if TYPE_CHECKING:
    import pandas as pd

COLUMNS = [
    "step",
    "rank",
    "dp_rank",
    "stage",
    "tp_rank",
    "optype",
    "start_ts",
    "duration",
    "seq_id",
    "mb_id",
    "seq_lens",
    "tokens",
    "loss",
    "bytes",
    "wait_s",
]


def is_wait(optype: str) -> bool:
    """Whether ``optype`` is an op in which a rank waits on its peers or on its node's keeper.

    Those are receives, collectives, plan broadcasts and barriers, and the keeper's waits."""
    return (
        optype.endswith(("-recv", "-send"))
        or "all-reduce" in optype
        or optype in ("plan-sync", "barrier", "send-wait", "ft-commit", KEEPER_WAIT)
    )


class OpRecorder:
    """Times operations of one rank.

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before each
    clock read so that asynchronous device work is attributed to the op that launched it."""

    def __init__(
        self,
        rank: int,
        dp_rank: int,
        stage: int,
        tp_rank: int = 0,
        sync: Callable[[], None] | None = None,
    ) -> None:
        self.ids = {"rank": rank, "dp_rank": dp_rank, "stage": stage, "tp_rank": tp_rank}
        self.sync = sync or (lambda: None)
        self.rows: list[dict] = []
        self.step = 0
        self._seq: dict[str, int] = defaultdict(int)
        self.listeners: list[Callable[[dict], None]] = []
        self._flushed = 0
        self.active: str | None = None  # the op running now (what a heartbeat reports)
        self.finished = 0  # ops finished so far: the rank's progress counter

    def begin_step(self, step: int) -> None:
        self.step = step
        self._seq.clear()

    @contextmanager
    def op(
        self,
        optype: str,
        mb_id: int | None = None,
        seq_lens: Sequence[int] | None = None,
        **extra: object,
    ) -> Iterator[dict]:
        """Times the body; the yielded row can be given more fields (e.g. ``loss``) inside it.

        Args:
            optype: the op's type (e.g. ``forward-compute``).
            mb_id: its micro-batch (None: none).
            seq_lens: the micro-batch's sequence lengths (None: none).
            **extra: more fields of the row."""
        self.sync()
        start_ts, t0 = time.time(), time.perf_counter()
        row: dict = {
            "step": self.step,
            **self.ids,
            "optype": optype,
            "start_ts": start_ts,
            "seq_id": self._seq[optype],
            "mb_id": mb_id,
            "seq_lens": list(seq_lens) if seq_lens is not None else None,
            "tokens": int(sum(seq_lens)) if seq_lens is not None else None,
            **extra,
        }
        self._seq[optype] += 1
        self.active = optype
        yield row
        self.sync()
        row["duration"] = time.perf_counter() - t0
        self.rows.append(row)
        self.active = None
        self.finished += 1
        for listener in self.listeners:
            listener(row)

    @contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Marks a wait on peers that is not an op of the trace (a plan broadcast, a barrier).

        A heartbeat then shows the rank waiting, not stuck (inside an op: the op is active again
        after)."""
        outer, self.active = self.active, what
        try:
            yield
        finally:
            self.active = outer
            self.finished += 1

    def progress(self, phase: str) -> Progress:
        """What the heartbeat carries: the step, ops finished, and the communication op it waits
        in."""
        wait = self.active if self.active is not None and is_wait(self.active) else ""
        return Progress(self.step, phase, self.finished, wait)

    def take_new(self) -> list[dict]:
        """The rows recorded since the last call (what a rank publishes after each step)."""
        new = self.rows[self._flushed :]
        self._flushed = len(self.rows)
        return new

    def frame(self) -> pd.DataFrame:
        return rows_frame(self.rows)

    def flush(self, path: str | Path) -> None:
        """Append the rows recorded since the last flush to a JSON-lines stream (one per rank).

        It is cheap enough to run every step, and what a side process tails to feed the
        detector."""
        new = self.rows[self._flushed :]
        if new:
            with open(path, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in new))
            self._flushed = len(self.rows)


def rows_frame(rows: Sequence[dict]) -> pd.DataFrame:
    # deferred for start-up time: workers import this module, never build a frame
    import pandas as pd

    return _typed(pd.DataFrame(list(rows), columns=COLUMNS))


def columns_frame(columns: dict[str, list]) -> pd.DataFrame:
    """``rows_frame`` from columns (name -> values) instead of row dicts."""
    # deferred for start-up time: workers import this module, never build a frame
    import pandas as pd

    return _typed(pd.DataFrame({c: columns.get(c, [None] * len(columns["step"])) for c in COLUMNS}))


def _typed(df: pd.DataFrame) -> pd.DataFrame:
    for col in ("mb_id", "tokens", "tp_rank", "seq_id"):
        df[col] = df[col].astype("Int64")
    df["loss"] = df["loss"].astype(float)
    df["wait_s"] = df["wait_s"].astype(float)
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
