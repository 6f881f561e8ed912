"""Heartbeats: each worker's side thread rewrites ``DIR/rank{r}.json`` (time, step, pid, phase)
every ``interval`` seconds; a monitor reads them to tell a dead or hung rank (fail-stop) from a
merely slow one, which keeps beating."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

RECORD_BYTES = 256


@dataclass(frozen=True)
class Beat:
    rank: int
    time: float
    step: int
    pid: int
    phase: str  # "init", "train", "done"


class HeartbeatWriter:
    def __init__(self, directory: str | Path, rank: int, interval_s: float = 0.5) -> None:
        self.path = Path(directory) / f"rank{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        self.rank, self.interval = rank, interval_s
        self.step, self.phase = -1, "init"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resihp-heartbeat", daemon=True)

    def start(self) -> HeartbeatWriter:
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        # one fixed-size positioned write into a file kept open: microseconds, where creating and
        # renaming a file costs milliseconds on some file systems (and would show as overhead)
        record = json.dumps({"rank": self.rank, "time": time.time(), "step": self.step,
                             "pid": os.getpid(), "phase": self.phase}).encode()
        os.pwrite(self._fd, record.ljust(RECORD_BYTES), 0)

    def at_step(self, step: int) -> None:
        # no write here: a beat costs milliseconds on some file systems; the thread writes it
        self.step = step

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()

    def stop(self, phase: str = "done") -> None:
        self.phase = phase
        self._stop.set()
        self._thread.join(timeout=2 * self.interval)
        self.beat()
        os.close(self._fd)


def read_beats(directory: str | Path) -> dict[int, Beat]:
    beats = {}
    for path in Path(directory).glob("rank*.json"):
        try:
            data = json.loads(path.read_text())
            beats[int(data["rank"])] = Beat(int(data["rank"]), float(data["time"]), int(data["step"]),
                                            int(data["pid"]), str(data["phase"]))
        except (OSError, ValueError, KeyError):
            continue  # being replaced right now; the next read sees it
    return beats


def stale_ranks(beats: dict[int, Beat], timeout_s: float, now: float | None = None) -> list[int]:
    """Ranks still training whose last beat is older than ``timeout_s``."""
    now = time.time() if now is None else now
    return sorted(r for r, b in beats.items() if b.phase != "done" and now - b.time > timeout_s)
