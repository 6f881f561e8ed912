"""Scoring detectors against labelled traces.

The scores are precision, recall, F1, false alarms, delay and slowdown error.

A method's false alarms are also given per 10k rank-steps and per day of the job at a stated step
time; its delays against Lorden's bound, ``2 sigma^2 ln(gamma) / log(f)^2`` for a fault of factor
``f`` on a series of per-step noise ``sigma`` (the data's, as resihp calibrated it on that trace;
the same for every method) and ``gamma`` the method's measured healthy rank-steps per false alarm
(with none, the rank-steps watched: a lower bound, so the bound is too). The ratio counts the steps
watched after the onset, its own included (``delay + 1``), against the bound or one step, the
least an alarm takes: at a quiet series' noise the bound is a fraction of a step.

An event matches an injected fault when it is a device-fault event of the same kind on the faulty
rank (for ``link-slow``: either end of the link) detected between the onset and ``grace`` steps
after the end. Each fault matches at most once; further events on it are duplicates, not false
alarms. Every other device-fault event is a false alarm. ``workload-imbalance`` and
``stage-imbalance`` findings are not device faults and are never scored as such.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from resihp.detect.baselines import BASELINES
from resihp.detect.config import DEFAULT_STEP_TIME_S, DetectorConfig
from resihp.detect.events import Event
from resihp.detect.observe import (
    ExpectedCompute,
    Observations,
    layout_parts,
)
from resihp.detect.online import OnlineDetector, TracePart
from resihp.detect.synth import Injection
from resihp.opstrace import JobMeta
from resihp.parallel import ParallelDims

DAY_S = 86400.0


@dataclass
class Score:
    """One method's tally over some traces (``summary``: the figures)."""

    tp: int = 0
    fp: int = 0
    fn: int = 0
    duplicates: int = 0
    healthy_steps: int = 0
    healthy_rank_steps: int = 0
    false_alarms_healthy: int = 0
    delays: list[float] = field(default_factory=list)
    slowdown_errors: list[float] = field(default_factory=list)
    factors: list[float] = field(default_factory=list)
    detected_factors: list[float] = field(default_factory=list)
    # per found fault whose series' noise is known: (its delay, 2 sigma^2 / log(f)^2)
    lorden: list[tuple[float, float]] = field(default_factory=list)

    def add(self, other: Score) -> None:
        for name in (
            "tp",
            "fp",
            "fn",
            "duplicates",
            "healthy_steps",
            "healthy_rank_steps",
            "false_alarms_healthy",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("delays", "slowdown_errors", "factors", "detected_factors", "lorden"):
            getattr(self, name).extend(getattr(other, name))

    def summary(self, step_time_s: float = DEFAULT_STEP_TIME_S) -> dict:
        """The figures (module doc); false alarms per day of one job at ``step_time_s``."""
        out = self._quality()
        fa, steps, rank_steps = (
            self.false_alarms_healthy,
            self.healthy_steps,
            self.healthy_rank_steps,
        )
        out["healthy_rank_steps"] = rank_steps
        out["false_alarms_per_10k_rank_steps"] = round(1e4 * fa / max(rank_steps, 1), 4)
        out["false_alarms_per_day"] = round(fa / max(steps, 1) * DAY_S / step_time_s, 3)
        gamma = rank_steps / max(fa, 1)
        out["false_alarm_interval_rank_steps"] = round(gamma, 1)
        out["false_alarm_interval_is_lower_bound"] = fa == 0
        ratios, bounds = [], []
        if gamma > 1:
            for delay, unit in self.lorden:
                bounds.append(unit * math.log(gamma))
                # the steps it watched after the onset (its own included) against the bound, which
                # no test beats by less than the one step an alarm needs
                ratios.append((delay + 1) / max(bounds[-1], 1.0))
        out["lorden_steps_median"] = round(float(np.median(bounds)), 3) if bounds else None
        out["delay_over_lorden_median"] = round(float(np.median(ratios)), 3) if ratios else None
        out["delay_over_lorden_max"] = round(float(np.max(ratios)), 3) if ratios else None
        return out

    def _quality(self) -> dict:
        precision = self.tp / (self.tp + self.fp) if self.tp + self.fp else 1.0
        recall = self.tp / (self.tp + self.fn) if self.tp + self.fn else 1.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        d = np.asarray(self.delays, dtype=float)
        e = np.asarray(self.slowdown_errors, dtype=float)
        return {
            "tp": self.tp,
            "fp": self.fp,
            "fn": self.fn,
            "precision": round(precision, 4),
            "recall": round(recall, 4),
            "f1": round(f1, 4),
            "false_alarms_per_10k_healthy_steps": round(
                1e4 * self.false_alarms_healthy / max(self.healthy_steps, 1), 3
            ),
            "healthy_steps": self.healthy_steps,
            "delay_steps_median": float(np.median(d)) if d.size else None,
            "delay_steps_max": float(d.max()) if d.size else None,
            "slowdown_error_median": round(float(np.median(e)), 4) if e.size else None,
            "slowdown_error_p90": round(float(np.quantile(e, 0.9)), 4) if e.size else None,
        }


def fault_sigma(budget: dict, inj: Injection) -> float | None:
    """The calibrated per-step noise of the series a fault moves, or None where it was not.

    The series is its rank's own work, a pipeline link's (indexed by its lower rank) or a
    gradient-sync end's; the noise comes from resihp's error budget of its trace
    (``OnlineDetector.budget``)."""
    name = "compute" if inj.kind != "link-slow" else inj.traffic
    entry = budget.get("series", {}).get(name, {}).get(str(inj.rank))
    return float(entry["sigma"]) if entry and entry.get("sigma") else None


def score_events(
    events: list[Event],
    injections: list[Injection],
    steps: np.ndarray,
    dims: ParallelDims,
    *,
    grace: int = 5,
    skip_first: int = 0,
    sigma_of: Callable[[Injection], float | None] | None = None,
) -> Score:
    """Match ``events`` of one trace against its injected faults.

    A link-slow may be reported at either end of its link.

    Args:
        events: the events a method found on the trace.
        injections: the trace's injected faults.
        steps: the trace's step numbers.
        dims: the job's parallel sizes.
        grace: steps after a fault's end within which a detection still matches it.
        skip_first: steps at the start not counted as healthy (a method's calibration).
        sigma_of: a fault's series noise, for its delay against Lorden's bound (None: no bound).
    """
    sc = Score()
    faulty = np.zeros(len(steps), dtype=bool)
    for inj in injections:
        faulty |= (steps >= inj.onset_step) & (steps <= inj.end_step)
    counted = steps >= (steps[0] + skip_first if len(steps) else 0)
    sc.healthy_steps = int((~faulty & counted).sum())
    sc.healthy_rank_steps = sc.healthy_steps * dims.world_size
    healthy_steps = set(steps[~faulty].tolist())
    matched = [False] * len(injections)
    for ev in sorted((e for e in events if e.is_device_fault), key=lambda e: e.detected_step):
        hit = None
        for j, inj in enumerate(injections):
            ranks = set(inj.link_ends(dims))
            if (
                ev.kind == inj.kind
                and ev.rank in ranks
                and (ev.traffic or inj.traffic) == inj.traffic
                and inj.onset_step <= ev.detected_step <= inj.end_step + grace
            ):
                hit = j
                break
        if hit is None:
            sc.fp += 1
            sc.false_alarms_healthy += int(ev.detected_step in healthy_steps)
        elif matched[hit]:
            sc.duplicates += 1
        else:
            matched[hit] = True
            inj = injections[hit]
            sc.tp += 1
            sc.delays.append(ev.detected_step - inj.onset_step)
            sc.slowdown_errors.append(abs(ev.slowdown - inj.factor) / inj.factor)
            sc.detected_factors.append(inj.factor)
            sigma = sigma_of(inj) if sigma_of and inj.factor > 1 else None
            if sigma:
                sc.lorden.append(
                    (float(sc.delays[-1]), 2 * sigma * sigma / math.log(inj.factor) ** 2)
                )
    sc.fn = matched.count(False)
    sc.factors = [inj.factor for inj in injections]
    return sc


def make_detector(
    name: str,
    meta: JobMeta,
    layout,
    expected: ExpectedCompute | None = None,
    meta_dict: dict | None = None,
    config: DetectorConfig | None = None,
):
    """A new detector of method ``name``: resihp's ``OnlineDetector`` or a baseline.

    Args:
        name: ``resihp`` or a baseline's name (``BASELINES``).
        meta: the job's meta.
        layout: where each rank sits.
        expected: resihp's cost model (None: none).
        meta_dict: the job meta document (its model shape).
        config: resihp's detector config (default: ``DetectorConfig()``).
    """
    if name == "resihp":
        return OnlineDetector(meta, expected, config, meta_dict=meta_dict, layout=layout)
    return BASELINES[name](meta, layout)


METHODS = ["resihp", *BASELINES]


def run_methods(
    df: pd.DataFrame,
    meta: JobMeta,
    methods: list[str] | None = None,
    expected: ExpectedCompute | None = None,
    meta_dict: dict | None = None,
    config: DetectorConfig | None = None,
    on_obs: Callable[[Observations], None] | None = None,
    detectors: dict | None = None,
    source: str = "ops trace",
) -> tuple[dict[str, list[Event]], Observations]:
    """Every method over the same per-step observations of one trace; its events by method.

    A trace whose ranks took new places in a live re-plan (``layout_parts``) is observed part by
    part, each with fresh detectors, as the live loop does: a rank's work in its new place says
    nothing of its old baseline.

    Args:
        df: the ops trace.
        meta: the job's meta.
        methods: the methods' names (None: all of ``METHODS``).
        expected: resihp's cost model (None: ``trace_cost`` decides).
        meta_dict: the job meta document (its model shape).
        config: resihp's detector config (default: ``DetectorConfig()``).
        on_obs: called with each part's observations.
        detectors: if given, receives each method's detector by name (the last part's).
        source: what errors name as the trace (its file).
    """
    cfg = config or DetectorConfig()
    found: dict[str, list[Event]] = {}
    parts = []
    for part_df, part_meta in layout_parts(df, meta):
        part = TracePart.observed(part_df, part_meta, expected, cfg, meta_dict, source)
        if on_obs:
            on_obs(part.obs)
        for name in methods or METHODS:
            det = make_detector(name, part.meta, part.layout, part.expected, meta_dict, cfg)
            if name == "resihp":
                found.setdefault(name, []).extend(part.detect(det))
            else:
                for i, step in enumerate(part.obs.steps):
                    det.observe_arrays(int(step), part.obs.own[i], part.obs.raw[i])
                found.setdefault(name, []).extend(det.finish())
            if detectors is not None:
                detectors[name] = det
        parts.append(part.obs)
    return found, Observations.joined(parts)
