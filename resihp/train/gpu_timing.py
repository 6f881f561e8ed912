"""Op timing on a GPU without stalling it: CUDA events instead of ``torch.cuda.synchronize``.

Synchronising before every clock read (what a CPU-side timer needs to attribute asynchronous GPU
work to the op that launched it) empties the GPU's queue several times per step and stops the host
from running ahead: a measured cost on a real training loop. Here each op records a start and an
end event on the stream it runs on; its duration is read once both events have completed, which a
step boundary checks for the ops of earlier steps only (normally long finished), so the host waits
for the device at most once per step and usually not at all.
"""

from __future__ import annotations

from collections import deque

import torch


class EventTimer:
    """Rows whose durations come from CUDA events.

    They are handed back in the order they were opened and only once their step has completed on
    the device."""

    def __init__(self) -> None:
        self._pending: deque[tuple[int, dict, torch.cuda.Event, torch.cuda.Event]] = deque()

    @staticmethod
    def mark() -> torch.cuda.Event:
        """An event recorded now on the current stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, step: int, row: dict, start: torch.cuda.Event) -> None:
        """``row`` ends now (its ``duration`` is filled in when the device gets there).

        Args:
            step: the step the row belongs to.
            row: the op's row.
            start: the event recorded where the op began (``mark``)."""
        self._pending.append((step, row, start, self.mark()))

    def completed(self, before_step: int | None = None) -> list[dict]:
        """The rows of steps before ``before_step`` (all, with None), durations filled in.

        Waits for their last event (by then normally complete)."""
        out = []
        while self._pending and (before_step is None or self._pending[0][0] < before_step):
            _, row, start, end = self._pending.popleft()
            end.synchronize()
            row["duration"] = start.elapsed_time(end) / 1000.0
            out.append(row)
        return out
