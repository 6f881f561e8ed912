"""Progress on stderr, so that stdout stays machine-readable.

A rich bar on a terminal; off a terminal (SLURM, Kubernetes, nohup, CI) plain lines every few
percent or 30 seconds, with the ETA; nothing when JSON is asked for."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return (
        f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
        if seconds >= 3600
        else (f"{seconds // 60}m{seconds % 60:02d}s")
    )


class PlainProgress:
    """``advance_to(n)`` that writes a progress line now and then, and at the end.

    A line when ``n`` crosses another ``every_pct`` percent of ``total`` or ``every_s`` seconds
    passed since the last line."""

    def __init__(
        self,
        description: str,
        total: int,
        file: TextIO,
        every_pct: float = 5.0,
        every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.description, self.total, self.file = description, max(int(total), 1), file
        self.every_pct, self.every_s, self.clock = every_pct, every_s, clock
        self.start = self.last_t = clock()
        self.last_pct = 0.0

    def __call__(self, n: int) -> None:
        now, pct = self.clock(), 100.0 * min(n, self.total) / self.total
        if not (
            n >= self.total
            or pct - self.last_pct >= self.every_pct
            or now - self.last_t >= self.every_s
        ):
            return
        elapsed = now - self.start
        eta = f", ETA {_clock(elapsed * (self.total - n) / n)}" if 0 < n < self.total else ""
        print(
            f"{self.description}: {n}/{self.total} ({pct:.0f}%), {_clock(elapsed)} elapsed{eta}",
            file=self.file,
            flush=True,
        )
        self.last_t, self.last_pct = now, pct


@contextmanager
def progress_bar(
    description: str, total: int, enabled: bool = True
) -> Iterator[Callable[[int], None]]:
    """Yields ``advance_to(n)``: a rich bar on a terminal, plain lines elsewhere.

    Args:
        description: the bar's label.
        total: the count ``n`` runs to.
        enabled: False shows nothing (``--json``).
    """
    console = Console(file=sys.stderr)
    if not enabled:
        yield lambda n: None
        return
    if not console.is_terminal:
        yield PlainProgress(description, total, sys.stderr)
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.update(task, completed=n)
