"""Feeding the ops records of replayed steps to the detectors of ``resihp.detect``.

The detector objects are the ones live runs use (``OnlineDetector`` and the baselines of
``resihp.detect.baselines``); this module only turns a replay window into their input (the ops trace
of docs/DESIGN.md, through ``resihp.detect.observe.observe_columns``) and maps the logical ranks
they name back to devices. The window's records reach ``observe_columns`` as the arrays the
simulator made (the same records ``Window.ops()`` gives as a frame, without building it). When a
re-plan moves ranks, ranks whose device does the same work as before keep their baselines
(``OnlineDetector.carried``) and the others recalibrate; a detector that cannot carry state is
rebuilt. A change of micro-batch counts keeps everything.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from resihp.detect.baselines import IterationChangePointDetector
from resihp.detect.config import DetectorConfig
from resihp.detect.observe import Observations, RankPlacement, StructureMemo, observe_columns
from resihp.detect.online import OnlineDetector
from resihp.opstrace import JobMeta
from resihp.replay.interface import Window
from resihp.workload.flops import TransformerShape

DEVICE_FAULT = "fail-slow"
LINK_FAULT = "link-slow"


@dataclass
class Finding:
    """A detector event placed on the replay: window index of the step, device, kind, slowdown."""

    index: int
    step: int
    device: int
    kind: str
    slowdown: float
    ended: bool = False
    peer: int | None = None  # link-slow: the link's other end


class DetectorFeed:
    """Owns one detector for the current layout and feeds it window after window."""

    def __init__(
        self,
        make: Callable[[JobMeta, object], object],
        shape: TransformerShape | None,
        own_quantile: float = 0.1,
        plan_aware: bool = False,
    ) -> None:
        self.make = make
        self.plan_aware = plan_aware
        self.shape = shape
        self.own_quantile = own_quantile
        self.detector = None
        self._layout = None
        self._rank_device: np.ndarray | None = None
        self._rank_work: np.ndarray | None = None
        self._rank_width: np.ndarray | None = None
        self._reported: dict[int | tuple[int, int], object] = {}  # by device, or link (ends)
        # every window of a layout writes its records in the same rows (``Simulator._columns``):
        # what the detector derives from their structure is derived once per layout
        self._structure = StructureMemo()

    def reset(self) -> None:
        self.detector = None
        self._layout = None

    def feed(self, window: Window) -> list[Finding]:
        """Feed the window step by step; stop at the first step with findings and return them."""
        if window.meta is None or not np.isfinite(window.step_time).all():
            return []
        signature = _signature(window)
        if self._layout != signature:
            places = RankPlacement(*(window.rank_place[:, k].copy() for k in range(3)))
            if self.detector is None or not hasattr(self.detector, "carried"):
                self.detector = self.make(window.meta, places)
                self._reported = {}
            else:  # ranks whose device does the same work as before keep their baselines
                source = _same_work(
                    self._rank_device, self._rank_work, window.rank_device, window.rank_work
                )
                self.detector = self.detector.carried(window.meta, places, source)
                kept = set(window.rank_device[source >= 0].tolist())
                self._reported = {
                    d: ev
                    for d, ev in self._reported.items()
                    if set(d if isinstance(d, tuple) else (d,)) <= kept
                }
            self._rank_width = _rank_width(window)
            self._structure = StructureMemo()
        self._layout = signature
        self._rank_device, self._rank_work = window.rank_device, window.rank_work
        first, n = int(window.steps[0]), len(window.steps)
        out: list[Finding] = []

        def records(i: int) -> dict[str, np.ndarray]:
            return window.step_columns(i, min(i + FEED_STEPS, n))

        def observe(i: int) -> Observations | None:
            cols = records(i)
            return (
                observe_columns(
                    cols,
                    window.meta,
                    shape=self.shape,
                    own_quantile=self.own_quantile,
                    structure=self._structure,
                )
                if cols
                else None
            )

        # a pipeline over the window, a few steps at a time: an observer thread makes and observes
        # the next steps' records (numpy, mostly without the GIL) while this one takes in the steps
        # before, and makes and observes some itself rather than wait (``_Chunks``)
        chunks = _Chunks(observe, list(range(0, n, FEED_STEPS)))
        try:
            for obs in chunks:
                if obs is not None:
                    self._feed_steps(window, obs, first, out)
                if out:  # the policy acts here; later steps of the window are simulated again
                    break
            return out
        finally:
            chunks.stop()  # steps made ahead and not needed

    def _feed_steps(
        self, window: Window, obs: Observations, first: int, out: list[Finding]
    ) -> None:
        """Feed the observed steps one by one, adding the findings to ``out``; stop at the
        first step with any."""
        if self.plan_aware and window.rank_work is not None:
            # the plan in force gives each rank its share of a micro-batch (layers / tp width); a
            # live system knows its own plan, so the per-rank expectation includes it
            obs.own = obs.own / window.rank_work[None, :]
        comm = obs.comm
        if comm is None and window.transfers is not None:  # the simulator's transfer timings
            comm = window.transfers[np.searchsorted(window.steps, obs.steps)]
        if comm is not None and self.plan_aware and self._rank_width is not None:
            # a rank sends its shard of the activations, 1 / its stage's width of them: the
            # detector weighs each rank's transfers against the others', so without this a
            # re-plan that changes the mix of widths reads as a slow link on ranks it kept
            comm = comm * self._rank_width[None, :]
        for i, step in enumerate(obs.steps):
            with warnings.catch_warnings():  # ranks with no record this step are NaN by design
                warnings.simplefilter("ignore", RuntimeWarning)
                events = self.detector.observe_arrays(
                    int(step),
                    obs.own[i],
                    obs.raw[i],
                    None if obs.expected is None else obs.expected[i],
                    None if comm is None else comm[i],
                )
            for ev in events:
                if ev.kind == LINK_FAULT and ev.ranks and len(ev.ranks) == 2:
                    ends = tuple(int(self._rank_device[r]) for r in ev.ranks)
                    if min(ends) >= 0:
                        self._reported[ends] = ev
                        out.append(
                            Finding(
                                int(step) - first,
                                int(step),
                                ends[0],
                                ev.kind,
                                float(ev.slowdown),
                                peer=ends[1],
                            )
                        )
                    continue
                if ev.kind != DEVICE_FAULT or ev.rank is None:
                    continue
                device = int(self._rank_device[ev.rank])
                if device < 0:
                    continue
                self._reported[device] = ev
                out.append(
                    Finding(int(step) - first, int(step), device, ev.kind, float(ev.slowdown))
                )
            for key, ev in list(self._reported.items()):
                if ev.end_step is not None:
                    del self._reported[key]
                    device, peer = key if isinstance(key, tuple) else (key, None)
                    out.append(
                        Finding(
                            int(step) - first,
                            int(step),
                            device,
                            ev.kind,
                            float(ev.slowdown),
                            ended=True,
                            peer=peer,
                        )
                    )
            if out:
                return


class _Chunks:
    """``make(key)`` of every key, in order, shared between the thread that iterates and one
    observer thread: each takes the next key not yet taken, at most ``AHEAD`` keys beyond the
    one the iterator waits for; where that one is still being made by the observer, the
    iterator makes the next one itself instead of waiting. On two cores the detector's own work
    and the making of the records are about even, so neither waits for the other long (one
    observer alone made the detector wait for about half of each window's feed)."""

    def __init__(self, make: Callable[[int], object], keys: list[int]) -> None:
        self.make, self.keys = make, keys
        self.done: dict[int, tuple[bool, object]] = {}  # key index -> (ok, result or exception)
        self.fed = 0  # index of the key the iterator waits for
        self.taken = 0  # keys taken by either thread
        self.stopped = False
        self.cond = threading.Condition()
        self.observer = threading.Thread(target=self._observe, name="resihp-observe", daemon=True)
        self.observer.start()

    def _take(self) -> int | None:
        """The next key's index if one may be taken now (under the lock)."""
        if self.stopped or self.taken >= len(self.keys) or self.taken >= self.fed + AHEAD:
            return None
        self.taken += 1
        return self.taken - 1

    def _run(self, j: int) -> None:
        try:
            result = (True, self.make(self.keys[j]))
        except BaseException as exc:  # noqa: BLE001 - raised where the iterator reaches it
            result = (False, exc)
        with self.cond:
            self.done[j] = result
            self.cond.notify_all()

    def _observe(self) -> None:
        while True:
            with self.cond:
                j = self._take()
                while j is None:
                    if self.stopped or self.taken >= len(self.keys):
                        return
                    self.cond.wait()
                    j = self._take()
            self._run(j)

    def __iter__(self):
        while self.fed < len(self.keys):
            with self.cond:
                j = None
                while self.fed not in self.done:
                    j = self._take()
                    if j is not None:
                        break
                    self.cond.wait()
            if j is not None:  # the one waited for is being made: make the next one meanwhile
                self._run(j)
                continue
            with self.cond:
                ok, result = self.done.pop(self.fed)
                self.fed += 1
                self.cond.notify_all()
            if not ok:
                raise result
            yield result

    def stop(self) -> None:
        """No more keys taken; what the observer is making it finishes alone."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


# steps of a window made and observed at once: a detector that fires early in a window (most
# re-plans come a few steps after the change that prompted them) leaves the rest unmade, and the
# arrays of a few steps stay in cache; every step's observations depend on that step's records alone
FEED_STEPS = 4
# chunks made ahead of the one the detector takes in next (``_Chunks``): one each for the
# detector's thread and the observer thread
AHEAD = 2


def _same_work(
    old_device: np.ndarray, old_work: np.ndarray, new_device: np.ndarray, new_work: np.ndarray
) -> np.ndarray:
    """For each rank of the new layout, the old rank whose device did the same work (-1: none)."""
    top = int(max(old_device.max(initial=-1), new_device.max(initial=-1))) + 1
    old_rank = np.full(top + 1, -1, dtype=np.int64)  # by device id; the last slot is "no device"
    had = np.flatnonzero(old_device >= 0)
    old_rank[old_device[had]] = had
    source = old_rank[np.where(new_device >= 0, new_device, top)]
    same = (source >= 0) & np.isclose(old_work[np.maximum(source, 0)], new_work, rtol=1e-9)
    return np.where(same, source, -1)


def _rank_width(window: Window) -> np.ndarray | None:
    """Each rank's tensor-parallel width (NaN where no device works), from the layout."""
    if window.rank_place is None:
        return None
    replicas = window.layout.replicas
    table = np.full((len(replicas), max(len(r.groups) for r in replicas)), np.nan)
    for i, r in enumerate(replicas):
        table[i, : len(r.groups)] = [len(g) for g in r.groups]
    dp, stage = window.rank_place[:, 0], window.rank_place[:, 1]
    real = (dp >= 0) & (stage >= 0)
    out = np.full(len(dp), np.nan)
    out[real] = table[dp[real], stage[real]]
    return out


def _signature(window: Window) -> tuple:
    return tuple((r.groups, r.layers, r.load) for r in window.layout.replicas)


def model_shape(scenario) -> TransformerShape:
    """The model's layer shape for the detector's analytic cost of each micro-batch (one layer)."""
    return scenario.model.shape(1)


def resihp_detector(scenario, config: DetectorConfig | None = None) -> DetectorFeed:
    """The workload-aware detector of ``resihp.detect`` (the one ``resihp detect`` runs)."""
    cfg = config or DetectorConfig()
    return DetectorFeed(
        lambda meta, layout: OnlineDetector(meta, None, cfg, layout=layout),
        model_shape(scenario),
        cfg.own_quantile,
        plan_aware=True,
    )


def greyhound_detector(scenario) -> DetectorFeed:
    """Greyhound-style change-point detection on raw iteration time
    (``resihp.detect.baselines``)."""
    return DetectorFeed(
        lambda meta, layout: IterationChangePointDetector(meta, layout), model_shape(scenario)
    )
