"""Run metrics as TensorBoard scalars (``--tensorboard`` / ``attach(tensorboard=True)``): step
time, tokens/s, detector events, plan changes, recovery. Needs the optional ``tensorboard`` extra
(``pip install 'resihp[tensorboard]'``); without it, asking for it is a one-line error."""

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
            raise InputError("--tensorboard: needs the tensorboard package "
                             "(pip install 'resihp[tensorboard]')") from None
        self.writer = SummaryWriter(log_dir=str(directory))
        self.events = 0
        self.changes = 0

    def step(self, step: int, seconds: float | None, tokens: int | None) -> None:
        if seconds:
            self.writer.add_scalar("train/step_time_s", seconds, step)
            if tokens:
                self.writer.add_scalar("train/tokens_per_s", tokens / seconds, step)

    def event(self, event: dict) -> None:
        self.events += 1
        step = int(event.get("detected_step", 0))
        self.writer.add_scalar("resihp/events", self.events, step)
        if event.get("rank") is not None:
            self.writer.add_scalar(f"resihp/slowdown/rank{event['rank']}", float(event["slowdown"]), step)

    def plan_change(self, step: int, applied: bool) -> None:
        self.changes += 1
        self.writer.add_scalar("resihp/plan_changes", self.changes, step)
        self.writer.add_scalar("resihp/plan_applied", 1.0 if applied else 0.0, step)

    def scalar(self, name: str, value: float, step: int) -> None:
        self.writer.add_scalar(name, value, step, walltime=time.time())

    def close(self) -> None:
        self.writer.close()
