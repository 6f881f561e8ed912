"""Where plan changes come from, read by rank 0 at each step boundary: changes scheduled in the
run config (``replan``: reproducible experiments and tests) and changes a side process (the live
detector and planner) drops into ``OUT/control/plan.json`` (written atomically, with an ``id``)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def control_path(out: str | Path) -> Path:
    return Path(out) / "control" / "plan.json"


def post_change(out: str | Path, change: dict) -> None:
    """Hand a plan change to a running job (its rank 0 picks it up at the next step boundary)."""
    path = control_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(change))
    os.replace(tmp, path)


class ControlInbox:
    def __init__(self, out: str | Path, scheduled: list[dict]) -> None:
        self.path = control_path(out)
        self.scheduled = {int(c["step"]): c for c in scheduled}
        self._seen_id = None
        self._mtime = None
        if self.path.exists():  # a change left by an earlier run of the same folder
            self.path.unlink()

    def poll(self, step: int) -> dict | None:
        if step in self.scheduled:
            return {**self.scheduled[step], "source": "scheduled"}
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return None
        if mtime == self._mtime:
            return None
        self._mtime = mtime
        try:
            change = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            self._mtime = None  # caught mid-replace; read again next step
            return None
        if change.get("id") == self._seen_id:
            return None
        self._seen_id = change.get("id")
        return change
