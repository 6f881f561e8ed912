"""Run metrics as TensorBoard scalars (``--tensorboard`` / ``attach(tensorboard=True)``).

They are step time, tokens/s, detector events, plan changes and recovery. Needs the optional
``tensorboard`` extra (``pip install 'resihp[tensorboard]'``); without it, asking for it is a
one-line error."""

from __future__ import annotations

import time
from pathlib import Path

from resihp.errors import InputError


class Metrics:
    def __init__(self, directory: str | Path) -> None:
        try:
            # deferred: an optional extra, imported only by runs that ask for TensorBoard
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise InputError(
                "--tensorboard: needs the tensorboard package (pip install 'resihp[tensorboard]')"
            ) from None
        self.writer = SummaryWriter(log_dir=str(directory))
        self.events = 0
        self.changes = 0

    def step(self, step: int, seconds: float | None, tokens: int | None) -> None:
        """Write one step's time and tokens/s.

        Args:
            step: the step.
            seconds: its time, in seconds (None or 0: nothing written).
            tokens: its tokens (None or 0: no tokens/s)."""
        if seconds:
            self.writer.add_scalar("train/step_time_s", seconds, step)
            if tokens:
                self.writer.add_scalar("train/tokens_per_s", tokens / seconds, step)

    def event(self, event: dict) -> None:
        self.events += 1
        step = int(event.get("detected_step", 0))
        self.writer.add_scalar("resihp/events", self.events, step)
        if event.get("rank") is not None:
            self.writer.add_scalar(
                f"resihp/slowdown/rank{event['rank']}", float(event["slowdown"]), step
            )

    def plan_change(self, step: int, applied: bool) -> None:
        self.changes += 1
        self.writer.add_scalar("resihp/plan_changes", self.changes, step)
        self.writer.add_scalar("resihp/plan_applied", 1.0 if applied else 0.0, step)

    def scalar(self, name: str, value: float, step: int) -> None:
        """Write one scalar at ``step``, stamped with the wall time.

        Args:
            name: the scalar's TensorBoard tag.
            value: its value.
            step: the step it belongs to."""
        self.writer.add_scalar(name, value, step, walltime=time.time())

    def close(self) -> None:
        self.writer.close()


def write_run(out: str | Path, summary: dict) -> None:
    """A finished ``resihp run``'s metrics from its trace and summary into ``OUT/tensorboard``."""
    import pandas as pd

    out = Path(out)
    m = Metrics(out / "tensorboard")
    try:
        trace = pd.read_parquet(out / "ops.parquet")
        steps = (
            trace[trace.optype == "step"]
            .groupby("step")
            .agg(wall=("duration", "max"), tokens=("tokens", "max"))
        )
        for step, row in steps.iterrows():
            m.step(
                int(step), float(row.wall), int(row.tokens) if row.tokens == row.tokens else None
            )
    except (OSError, ValueError, KeyError):
        pass  # a run stopped before its trace was merged: events and changes only
    for event in summary.get("events") or []:
        m.event(event)
    for change in summary.get("plan_changes") or []:
        m.plan_change(
            int(change.get("applied_step") or change.get("decided_step") or 0),
            change.get("applied") is True,
        )
    rec = summary.get("recovery") or {}
    if rec.get("resumed_step") is not None:
        m.scalar(
            "resihp/recovery_lost_steps",
            float(rec.get("lost_steps") or 0),
            int(rec["resumed_step"]),
        )
    m.close()
