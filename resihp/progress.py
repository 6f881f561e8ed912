"""A rich progress bar that stays quiet when output is not a terminal or JSON is asked for."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


@contextmanager
def progress_bar(description: str, total: int, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """Yields ``advance_to(n)``; draws on stderr so that stdout stays machine-readable."""
    console = Console(file=sys.stderr)
    if not enabled or not console.is_terminal:
        yield lambda n: None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.update(task, completed=n)
