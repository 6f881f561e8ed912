"""Published-style detectors that watch raw times, behind the same interface as ``OnlineDetector``.

- ``RawThresholdDetector``: a rank whose step compute time exceeds ``threshold`` x its own trailing
  median is slow.
- ``RelativeScoreDetector``: the relative performance score of NVIDIA's resiliency extension
  (straggler detection): every ``report_every`` steps, score = reference (median over ranks of each
  rank's median time in the window) / the rank's median time; below ``threshold`` (0.75) is a
  straggler.
- ``IterationChangePointDetector``: Greyhound-style, a change-point test on the job's raw iteration
  time (slowest rank's step time); at an alarm the rank whose time rose most is named.

All take the per-step vectors of ``observe_ops`` through ``observe_arrays(step, own, raw, ...)`` and
ignore the workload-aware ``own`` ratio: they see what those systems see.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from resihp.detect.changepoint import CusumBank
from resihp.detect.config import DetectorConfig
from resihp.detect.events import Event
from resihp.detect.observe import RankPlacement
from resihp.opstrace import JobMeta


class _Base:
    name = "base"

    def __init__(self, meta: JobMeta, layout: RankPlacement | None = None) -> None:
        self.meta = meta
        w = meta.world_size
        self.layout = layout or RankPlacement(*(np.full(w, -1, dtype=np.int64) for _ in range(3)))
        self.events: list[Event] = []
        self._open: dict[int, Event] = {}

    def _event(self, i: int, onset: int, step: int, slowdown: float, confidence: float) -> Event:
        lay = self.layout

        def val(a: np.ndarray) -> int | None:
            return None if a[i] < 0 else int(a[i])

        ev = Event(
            "fail-slow",
            int(i),
            val(lay.dp_rank),
            val(lay.stage),
            val(lay.tp_rank),
            onset,
            step,
            float(slowdown),
            float(confidence),
        )
        self.events.append(ev)
        self._open[int(i)] = ev
        return ev

    def _close(self, i: int, step: int) -> None:
        ev = self._open.pop(int(i), None)
        if ev is not None:
            ev.end_step = step

    def finish(self) -> list[Event]:
        return self.events


class RawThresholdDetector(_Base):
    name = "raw-threshold"

    def __init__(
        self,
        meta: JobMeta,
        layout: RankPlacement | None = None,
        threshold: float = 1.2,
        window: int = 20,
    ) -> None:
        super().__init__(meta, layout)
        self.threshold = threshold
        self.history: deque[np.ndarray] = deque(maxlen=window)
        self.window = window

    def observe_arrays(
        self,
        step: int,
        own: np.ndarray,
        raw: np.ndarray | None = None,
        expected: np.ndarray | None = None,
        comm: np.ndarray | None = None,
    ) -> list[Event]:
        """One step's per-rank vectors; the new events (this baseline reads ``raw`` only).

        Args:
            step: the step's number.
            own: per rank its own-work ratio (unused).
            raw: per rank its compute seconds.
            expected: per rank the expected seconds (unused).
            comm: per rank its link's transfer time (unused).
        """
        raw = np.asarray(raw, dtype=float)
        new = []
        if len(self.history) >= min(self.window, 5):
            ref = np.nanmedian(np.stack(self.history), axis=0)
            ratio = raw / ref
            slow = ratio > self.threshold
            for i in np.flatnonzero(slow):
                if int(i) not in self._open:
                    new.append(self._event(int(i), step, step, ratio[i], 1.0))
            for i in list(self._open):
                if not slow[i] and not np.isnan(ratio[i]):
                    self._close(i, step - 1)
            healthy = np.where(slow, np.nan, raw)
        else:
            healthy = raw
        self.history.append(healthy)
        return new


class RelativeScoreDetector(_Base):
    name = "relative-score"

    def __init__(
        self,
        meta: JobMeta,
        layout: RankPlacement | None = None,
        threshold: float = 0.75,
        report_every: int = 10,
    ) -> None:
        super().__init__(meta, layout)
        self.threshold = threshold
        self.report_every = report_every
        self._window: list[np.ndarray] = []
        self._window_steps: list[int] = []

    def observe_arrays(
        self,
        step: int,
        own: np.ndarray,
        raw: np.ndarray | None = None,
        expected: np.ndarray | None = None,
        comm: np.ndarray | None = None,
    ) -> list[Event]:
        """One step's per-rank vectors; the new events (this baseline reads ``raw`` only).

        Args:
            step: the step's number.
            own: per rank its own-work ratio (unused).
            raw: per rank its compute seconds.
            expected: per rank the expected seconds (unused).
            comm: per rank its link's transfer time (unused).
        """
        self._window.append(np.asarray(raw, dtype=float))
        self._window_steps.append(step)
        if len(self._window) < self.report_every:
            return []
        med = np.nanmedian(np.stack(self._window), axis=0)
        first = self._window_steps[0]
        self._window, self._window_steps = [], []
        ref = np.nanmedian(med)
        score = ref / med
        new = []
        strag = score < self.threshold
        for i in np.flatnonzero(strag):
            if int(i) not in self._open:
                new.append(self._event(int(i), first, step, 1.0 / score[i], 1.0))
        for i in list(self._open):
            if not strag[i] and not np.isnan(score[i]):
                self._close(i, first - 1)
        return new


class IterationChangePointDetector(_Base):
    name = "iteration-changepoint"

    def __init__(
        self,
        meta: JobMeta,
        layout: RankPlacement | None = None,
        config: DetectorConfig | None = None,
    ) -> None:
        super().__init__(meta, layout)
        self.cfg = config or DetectorConfig(baseline_rate=0.0)
        self.bank = CusumBank(1, self.cfg)
        self._cal: list[np.ndarray] = []
        self._ref: np.ndarray | None = None
        self._current: int | None = None

    def observe_arrays(
        self,
        step: int,
        own: np.ndarray,
        raw: np.ndarray | None = None,
        expected: np.ndarray | None = None,
        comm: np.ndarray | None = None,
    ) -> list[Event]:
        """One step's per-rank vectors; the new events (this baseline reads ``raw`` only).

        Args:
            step: the step's number.
            own: per rank its own-work ratio (unused).
            raw: per rank its compute seconds.
            expected: per rank the expected seconds (unused).
            comm: per rank its link's transfer time (unused).
        """
        raw = np.asarray(raw, dtype=float)
        if self._ref is None:
            self._cal.append(raw)
            if len(self._cal) >= self.cfg.calibration_steps:
                self._ref = np.nanmedian(np.stack(self._cal), axis=0)
        it = np.nanmax(raw) if np.isfinite(raw).any() else np.nan
        alarms, recoveries, _ = self.bank.update(step, np.array([np.log(it)]))
        new = []
        for a in alarms:
            ref = self._ref if self._ref is not None else np.nanmedian(raw)
            i = int(np.nanargmax(raw / ref))
            self._current = i
            new.append(self._event(i, a.onset_step, step, a.slowdown, a.confidence))
        for r in recoveries:
            if self._current is not None:
                self._close(self._current, r.end_step)
                self._current = None
        return new


BASELINES = {
    cls.name: cls
    for cls in (RawThresholdDetector, RelativeScoreDetector, IterationChangePointDetector)
}
