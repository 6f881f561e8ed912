"""The live loop beside a running job (node 0's launcher): detect, re-plan, hand the plan on.

Take each complete step's op records from the job's control plane (``controlplane.StepReader``,
through the supervisor), feed it to the online detector (``resihp.detect``), and on a device fault
ask the planner (``resihp.plan``) for a new plan and hand the part the running job can apply in
place to its rank 0 (``control``).

Applied in place: per-replica micro-batch shares and per-pipeline layer splits; a plan that
re-forms tensor-parallel groups, excludes a device (a hot spare), moves ranks between pipelines or
gives replicas different depths or stages different tensor-parallel sizes goes to the job as a
``layout`` (every rank forms the new process groups and reshards its state from memory,
``Engine.apply``). With replica-level fault tolerance each replica is a job of its own: the
planner re-forms a replica's groups from that replica's own ranks only
(``Planner(regroup=WITHIN_REPLICAS)``), and the commits carry the change to every rank
(``ReplicaEngine.take_plan``).
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from resihp.control import ControlConfig, Controller
from resihp.detect.config import DetectorConfig
from resihp.detect.observe import covering_meta
from resihp.detect.online import OnlineDetector
from resihp.plan.links import with_link_event
from resihp.plan.planner import WITHIN_REPLICAS, Planner
from resihp.train.config import RunConfig
from resihp.train.controlplane import StepRecords
from resihp.train.layout import ranges_from_counts
from resihp.train.planchange import PlanChange
from resihp.train.planning import (
    MIN_MEASURED_STEPS,
    current_plan,
    job_meta,
    paced_to,
    planner_specs,
    predicted_step_s,
    step_check,
    trace_compute_seconds,
    trace_step_seconds,
    with_change,
)

FASTER_STEPS = (
    5  # steps a rank's level below its baseline is the median over (``LiveLoop._faster``)
)
PRESENT_STEPS = 8  # the most steps since a finding's onset its peers' present pace is taken over


def _median_log(rows: list[np.ndarray]) -> np.ndarray:
    """Per rank, the median over ``rows`` (steps' own-work vectors) of the log level; NaN for a
    rank with no record in any of them."""
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN rank
        return np.nanmedian(np.log(np.stack(rows)), axis=0)


def _absolute(cost_model: str) -> bool:
    """Whether the detector's own-work levels are against a cost of the op's own (not its
    peers')."""
    return cost_model not in ("none", "phase") and "peers" not in cost_model


@dataclass
class Priced:
    """A rank planned around as slow: the detector that follows it, and its slowdowns.

    The slowdown priced, and the slowdown it already had when that detector set its baseline
    (``base``; 1.0: a baseline at speed, or one re-based on its peers), so what the detector
    measures is ``base`` times over."""

    detector: OnlineDetector
    slowdown: float
    base: float = 1.0


class LiveLoop:
    """The detector and the decision layer beside a running job; re-plans it live.

    Args:
        cfg: the run's configuration.
        time_limit_s: the planner's time limit per re-plan.
        detector_config: the online detector's settings (default: from ``cfg.live``).
        control: the decision thresholds (``resihp.control``), the replay policy's by default.
    """

    def __init__(
        self,
        cfg: RunConfig,
        time_limit_s: float = 2.0,
        detector_config=None,
        control: ControlConfig | None = None,
    ) -> None:
        self.cfg, self.out = cfg, Path(cfg.out)
        self.world = cfg.dims().world_size
        self.meta, self.meta_dict = job_meta(cfg)
        detector_config = detector_config or DetectorConfig(
            calibration_steps=cfg.live.calibration_steps,
            min_slowdown=cfg.live.min_slowdown,
            alarm_floor=cfg.live.alarm_floor,
        )
        self._make_detector = lambda: OnlineDetector(
            self.meta,
            config=detector_config,
            meta_dict=self.meta_dict,
            peers=self._peers(),
            keep_levels=True,
        )
        # each replica of replica-level fault tolerance is a job of its own: the planner re-forms
        # a replica's groups from its own ranks only
        self.replica_mode = cfg.faults.recovery.startswith("replica")
        self.planner = Planner(regroup=WITHIN_REPLICAS if self.replica_mode else True)
        self.time_limit_s = time_limit_s
        self.cluster, self.model = planner_specs(cfg)
        self.weights = cfg.weights()
        self.ranges = [cfg.stage_ranges() for _ in range(cfg.parallel.dp)]  # per replica
        dims = cfg.dims()
        self.groups = [
            [tuple(dims.tp_group_ranks(d, s)) for s in range(dims.pp)] for d in range(dims.dp)
        ]
        self.detector = self._make_detector()
        self.lags: list[float] = []  # seconds from a step's last record sent to its being observed
        self._post = None
        self.events: list[dict] = []
        self.changes: list[dict] = []
        self.handled: set[int | tuple[int, ...]] = set()
        self._priced: dict[int, Priced] = {}  # each rank planned around as slow
        # each rank planned around as slow: the slowdown it was priced at when the detector in
        # force set its baseline (``_faster``)
        self._baseline_at: dict[int, tuple[OnlineDetector, float]] = {}
        # what is believed of each rank and when to re-plan: the replay policy's controller
        self.control = Controller(control or ControlConfig())
        self.control.speeds.update({r: 1.0 for r in range(self.world)})
        self.speeds = (
            self.control.speeds
        )  # the same dict: the planner's speeds are the controller's
        self.probe_ref: dict[int, float] = {}  # each rank's fastest probe while placed (seconds)
        self.probes: list[
            dict
        ] = []  # hot spares' probes: step, rank, slowdown against the reference
        self.error: str | None = None
        # the run's scheduled changes (live.replan), which the job applies before their step
        self._scheduled = {int(c["step"]): c for c in cfg.live.replan}
        # each step's measured time; the first healthy ones pace the planner's analytic costs
        self.step_s: dict[int, float] = {}
        self._healthy: dict[int, float] = {}  # step -> seconds, under the launch plan
        self._healthy_compute: dict[
            int, float
        ] = {}  # the same steps' compute (trace_compute_seconds)
        self._calibration_steps = self.detector.cfg.calibration_steps
        self.calibration: dict | None = None
        # each rank's own-work level (log, the median of the steps the pace was taken on) and the
        # detector that measured it (``_present_pace``)
        self._level_ref: tuple[OnlineDetector, np.ndarray] | None = None

    def on_steps(self, steps: list[StepRecords], post: Callable[[dict], None]) -> None:
        """Observe complete steps; ``post`` hands a plan change to the job.

        Never raises: a failure of the detector or planner is kept in ``error`` and stops the loop,
        while the job trains on with the plan in force."""
        self._post = post
        if self.error is not None:
            return
        try:
            for records in steps:
                self._observe(records.step, records.frame())
                self.lags.append(time.time() - records.sent)
        except Exception as exc:  # noqa: BLE001 - the training job must not die of its monitor
            self.error = f"{type(exc).__name__}: {exc}"

    def _observe(self, step: int, df: pd.DataFrame) -> None:
        scheduled = self._scheduled.pop(step, None)
        if scheduled is not None:  # the plan in force from this step (the job applied it before it)
            self._adopt(scheduled)
        if df.optype.eq("replan-layout").any():  # ranks took new places: learned afresh from here
            self.detector = self._make_detector()
        df = df[~df.optype.str.startswith("replan")]
        placed = {r for p in self.groups for s in p for r in s}
        for probe in df[df.optype == "probe"].itertuples():
            waited = (
                0.0 if pd.isna(probe.wait_s) else float(probe.wait_s)
            )  # for a core (``Engine._probe``)
            self._probe(step, int(probe.rank), float(probe.duration) - waited, placed)
        df = df[df["rank"].isin(placed) & (df.optype != "probe")]  # a hot spare only keeps step
        if df.empty:
            return
        self._measure(step, df, fresh_plan=scheduled is not None)
        for event in self.detector.observe(df):
            self.events.append({**event.to_dict(), "seen_at": time.time()})
            if (
                event.kind == "link-slow"
                and event.ranks
                and tuple(event.ranks) not in self.handled
                and self.control.found_link(event.ranks, event.slowdown, step).replan
            ):
                # the link at its measured slowdown, priced at the transfers measured before it
                self.handled.add(tuple(event.ranks))
                self.cluster = with_link_event(
                    self.cluster,
                    self.model,
                    tuple(event.ranks),
                    event.slowdown,
                    event.traffic or "pipeline",
                    self.detector.healthy_transfers(),
                    self.planner.coster(self.cluster, self.model),
                )
                self._replan(step, self.events[-1])
                self.detector.rebaseline()  # the ranks' work moved off the link: fresh baselines
                self._baseline_at.clear()
        # a slow device is planned around at what it costs its rank's step: a slowdown of one
        # phase alone that costs the step less than the detector's least slowdown (a slower
        # optimizer step of a few milliseconds) is reported but not planned around, until its
        # rank's whole work is found slow (the event is then the rank's)
        least = self.detector.cfg.min_slowdown
        open_now = {}
        for event in self.detector.open_events():
            if event.kind != "fail-slow" or event.rank is None:
                continue
            open_now[event.rank] = event
            if event.slowdown_of_rank < least or event.rank in self._priced:
                continue
            if event.rank in self.handled:
                # planned around before a re-plan moved work and gave the loop a fresh detector:
                # one that found it slow against its peers from the start (re-based on them) says
                # its whole slowdown; one that found it slower than its own baseline, set while it
                # ran at the slowdown priced, says how much more (with two peers a stage, the
                # usual case at pp 2, no peer-based finding can name it). Either is followed from
                # here: moved 1.25x, it is re-planned
                if self.speeds[event.rank] >= 1.0:
                    continue
                priced = 1.0 / self.speeds[event.rank]
                base = 1.0 if event.from_start else priced
                self._priced[event.rank] = Priced(self.detector, priced, base)
                continue
            decision = self.control.found_slow(event.rank, event.slowdown_of_rank, step)
            self.handled.add(event.rank)
            self._priced[event.rank] = Priced(self.detector, event.slowdown_of_rank)
            if decision.replan:
                self._replan(
                    step, {**event.to_dict(), "slowdown": round(event.slowdown_of_rank, 4)}
                )
        self._revise(step, open_now)
        self._faster(step, placed)

    def _revise(self, step: int, open_now: dict) -> None:
        """Re-plan around a rank planned around as slow whose slowdown has since moved by
        ``ControlConfig.revise`` either way (found one phase or two steps in, it is often priced
        low), or whose finding has closed (its device at speed again while it still trains). Only
        while the detector that follows it keeps its baseline: a fresh one (a re-plan moved work)
        calibrates on the slow rank and takes it over when it finds it slow, against its peers or
        against that baseline (then its measure is times the slowdown the baseline had, and the
        finding's close means back to that slowdown; one faster than its baseline is not found)."""
        for rank, entry in list(self._priced.items()):
            if entry.detector is not self.detector:
                del self._priced[rank]
                continue
            priced, base = entry.slowdown, entry.base
            event = open_now.get(rank)
            if event is None and base > 1.0:  # back to the slowdown its baseline had
                del self._priced[rank]
                self._baseline_at[rank] = (self.detector, base)
                if self.control.found_slow(rank, base, step).replan:
                    self._replan(
                        step,
                        {
                            "kind": "fail-slow",
                            "rank": rank,
                            "slowdown": round(base, 4),
                            "detected_step": step,
                            "priced_at": round(priced, 4),
                        },
                    )
                continue
            if event is None:  # the episode ended: the device is at speed again
                del self._priced[rank]
                self.handled.discard(rank)
                if self.control.found_recovered(rank).replan:
                    self._replan(
                        step,
                        {"kind": "recovered", "rank": rank, "slowdown": 1.0, "detected_step": step},
                    )
                continue
            now = self.detector.current_cost(event)
            if now is None:
                continue
            now *= base
            if now < self.detector.cfg.min_slowdown:
                # at speed again, or nearly: the episode's close (a step or two on) says so
                continue
            if not self.control.found_slow(rank, now, step).replan:
                continue  # within the revise factor of its price, or re-priced too recently
            self._priced[rank] = Priced(self.detector, now, base)
            self._replan(
                step,
                {
                    **event.to_dict(),
                    "slowdown": round(now, 4),
                    "detected_step": step,
                    "priced_at": round(priced, 4),
                },
            )

    def _faster(self, step: int, placed: set[int]) -> None:
        """A rank planned around as slow that runs faster than the baseline the detector in force
        set for it. The detector's findings are rises only, so once a re-plan moved work (a fresh
        detector, its baselines set at the slowdowns priced) a rank that recovered in part or in
        full was never found: it stayed priced slow and kept too little work. Its slowdown is the
        one it had at its baseline times the level it runs at now (the median of the last
        ``FASTER_STEPS`` steps); moved ``ControlConfig.revise`` from its price, and by more than the
        rank's noise, it is re-planned, at full speed once under the detector's least slowdown. A
        rank the detector has found slow is ``_revise``'s. Not with two ranks in all: each is taken
        against their median, so one's fall is the other's rise, which the detector reports as
        such (and priced so, the two are even again)."""
        bank = self.detector.compute
        if bank.share < 1.0 or not self.handled:
            return
        noise = bank.min_detectable()
        for rank in sorted(r for r in self.handled if isinstance(r, int)):
            if rank in self._priced or rank not in placed or self.speeds[rank] >= 1.0:
                self._baseline_at.pop(rank, None)
                continue
            priced = 1.0 / self.speeds[rank]
            detector, base = self._baseline_at.get(rank, (None, priced))
            if detector is not self.detector:
                if bank.calibrated[rank]:
                    self._baseline_at[rank] = (self.detector, priced)
                continue
            level = bank.recent_level(rank, FASTER_STEPS)
            revise = self.control.config.revise
            if level is None or level > 1.0 / max(revise, float(noise[rank])):
                continue
            now = base * level
            if priced < revise * now:
                continue
            if now < self.detector.cfg.min_slowdown:
                del self._baseline_at[rank]
                self.handled.discard(rank)
                self.control.found_recovered(rank)
                self._replan(
                    step,
                    {
                        "kind": "recovered",
                        "rank": rank,
                        "slowdown": 1.0,
                        "detected_step": step,
                        "priced_at": round(priced, 4),
                    },
                )
                continue
            if not self.control.found_slow(rank, now, step).replan:
                continue  # re-priced too recently
            self._replan(
                step,
                {
                    "kind": "fail-slow",
                    "rank": rank,
                    "slowdown": round(now, 4),
                    "detected_step": step,
                    "priced_at": round(priced, 4),
                },
            )

    def _measure(self, step: int, df: pd.DataFrame, fresh_plan: bool) -> None:
        """Keep the step's time; the healthy steps under the launch plan (step 0, the warm-up,
        aside) calibrate the planner once there are as many as the detector calibrates on."""
        seconds = trace_step_seconds(df).get(step)
        if seconds is None:
            return
        self.step_s[step] = seconds
        if fresh_plan:
            self._healthy, self._healthy_compute = {}, {}
        if self.calibration is None and step > 0 and not self.events and not self.changes:
            self._healthy[step] = seconds
            compute = trace_compute_seconds(df).get(step)
            if compute is not None:
                self._healthy_compute[step] = compute
            if len(self._healthy) >= self._calibration_steps:
                self._calibrate()

    def _calibrate(self, onset: int | None = None) -> None:
        """Pace the planner's cluster to the steps measured under the plan in force: the healthy
        ones. Where a finding's ``onset`` falls inside them (an event before the calibration
        window filled), the steps before it, or, with too few of those, the steps from it on
        priced with the slowdowns found (``speeds``): the slow steps paced as healthy would price
        the slowdown twice, once in the pace and again in the planner's speeds."""
        steps = sorted(self._healthy)
        cluster = self.cluster
        if onset is not None:
            before = [s for s in steps if s < onset]
            if len(before) >= MIN_MEASURED_STEPS:
                steps = before
            else:
                steps = [s for s in steps if s >= onset]
                cluster = self.cluster.with_speeds(self.speeds)
        current = current_plan(
            self.cfg, cluster, self.model, self.weights, self.ranges, self.groups
        )
        measured = [self._healthy[s] for s in steps]
        compute = (
            [self._healthy_compute[s] for s in steps]
            if all(s in self._healthy_compute for s in steps)
            else None
        )
        paced, self.calibration = paced_to(
            cluster, self.model, current, measured, self.planner, compute
        )
        # the pace is the cluster's; the slowdowns stay the loop's own (speeds)
        self.cluster = paced.with_speeds(self.cluster.speeds)
        if self.calibration is not None and onset is not None:
            self.calibration["onset_step"] = onset
        levels = self.detector.levels or {}
        rows = [levels[s] for s in steps if s in levels]
        if self.calibration is not None and len(rows) >= MIN_MEASURED_STEPS:
            self._level_ref = (self.detector, _median_log(rows))

    def _present_pace(self, step: int, event: dict) -> tuple[float, dict] | None:
        """The healthy ranks' pace now against the steps the planner was paced on, for a
        finding at ``step`` with an onset: the median over the ranks at speed of each one's own
        work since the onset (its median) against its level in the pace's steps. The detector
        measures a slow rank against its peers; where the fault moved its peers too (on shared
        cores, a rank slowed by sleeps frees a core and the others run faster), that slowdown
        priced on the old pace misprices the step by the peers' move. Only while the plan and
        detector of the pace's steps are in force (an own-work level is per plan), and where the
        detector's cost of an op is its own (lengths, a predictor or the fitted cost), not scaled by
        the same micro-batch on the other stages (pipelines: a level against peers says nothing)."""
        onset = event.get("onset_step")
        if (
            self._level_ref is None
            or onset is None
            or self.changes
            or self._level_ref[0] is not self.detector
            or not _absolute(self.detector.cost_model)
        ):
            return None
        ref = self._level_ref[1]
        levels = self.detector.levels or {}
        recent = [levels[s] for s in sorted(levels) if int(onset) <= s <= step][-PRESENT_STEPS:]
        healthy = [
            r
            for r in range(self.world)
            if self.speeds.get(r, 1.0) >= 1.0 and r != event.get("rank") and np.isfinite(ref[r])
        ]
        if len(recent) < 2 or not healthy:
            return None
        now = _median_log(recent)[healthy]
        moved = now - ref[healthy]
        seen = np.isfinite(moved)
        if not seen.any():
            return None
        level = float(np.exp(np.median(moved[seen])))
        return level, {
            "level": round(level, 4),
            "steps": len(recent),
            "ranks": [r for r, ok in zip(healthy, seen.tolist()) if ok],
        }

    def _probe(self, step: int, rank: int, seconds: float, placed: set[int]) -> None:
        """A rank's probes while it trains (its first steps, ``Engine._probe``) give its reference,
        the fastest of them; a hot spare probes again with backoff: once it runs within
        ``ControlConfig.healthy`` of its reference speed, the planner may take it back; still
        slow by another ``ControlConfig.revise``, it is re-priced."""
        if rank in placed or rank not in self.probe_ref:
            self.probe_ref[rank] = min(self.probe_ref.get(rank, seconds), seconds)
            return
        slowdown = seconds / self.probe_ref[rank]
        self.probes.append({"step": step, "rank": rank, "slowdown": round(slowdown, 4)})
        # a probe times the device's compute: it can clear a device planned around as slow, not
        # one left out for a slow link (its probe was healthy all along; the link is not re-timed)
        if rank in placed or self.speeds[rank] >= 1.0:
            return
        decision = self.control.probed(rank, 1.0 / max(slowdown, 1e-9), step)
        if not decision.replan:
            return
        if self.speeds[rank] >= 1.0:
            self.handled.discard(rank)
        self._replan(
            step,
            {
                "kind": "recovered" if self.speeds[rank] >= 1.0 else "fail-slow",
                "rank": rank,
                "slowdown": round(slowdown, 4),
                "detected_step": step,
            },
        )

    def _replan(self, step: int, event: dict) -> None:
        if self.calibration is None:  # an event before the calibration window filled
            self._calibrate(event.get("onset_step"))
        t0 = time.perf_counter()
        present = self._present_pace(step, event) if event.get("kind") == "fail-slow" else None
        base = self.cluster if present is None else self.cluster.paced(present[0], links=1.0)
        cluster = base.with_speeds(self.speeds)
        current = current_plan(self.cfg, base, self.model, self.weights, self.ranges, self.groups)
        plan = self.planner.plan(cluster, self.model, current, time_limit_s=self.time_limit_s)
        solve_s = time.perf_counter() - t0
        pipes = sorted(plan.pipelines, key=lambda p: p.dp_rank)
        # the pipelines in force, hot spares (excluded devices) and all: a plan that keeps them
        # re-forms nothing (the spares follow from the pipelines)
        same_places = len(pipes) == len(current.pipelines) and all(
            [s.ranks for s in p.stages] == [s.ranks for s in q.stages]
            for p, q in zip(pipes, sorted(current.pipelines, key=lambda p: p.dp_rank))
        )
        change = {
            "id": len(self.changes) + 1,
            "reason": {
                k: event[k]
                for k in (
                    "kind",
                    "rank",
                    "ranks",
                    "traffic",
                    "slowdown",
                    "detected_step",
                    "priced_at",
                )
                if k in event
            },
            "decided_step": step,
            "solve_s": round(solve_s, 3),
            "predicted_step_s": predicted_step_s(plan),
            "plan": plan.to_dict(),
        }
        if present is not None:
            change["present_pace"] = present[1]
        # new process groups (layout): the job re-forms them and reshards live. In replica mode
        # every change names every replica's groups: a returning replica takes only the last one
        planned = PlanChange(
            dp_weights=tuple(float(p.microbatches) for p in pipes),
            layer_splits=tuple(tuple(s.n_layers for s in p.stages) for p in pipes),
            layout=plan.placement if not same_places or self.replica_mode else None,
        )
        change.update(planned.to_dict(), applied=True)
        if not same_places:
            self.groups = [[tuple(s.ranks) for s in p.stages] for p in pipes]
            self._cover(self.groups)
            self.ranges = []  # set below from the new splits, with a fresh detector baseline
        if same_places and self._unchanged(change):
            # the planner keeps the plan in force (e.g. no split beats it around a slow
            # data-parallel link): record the decision, hand the job nothing
            change = {k: v for k, v in change.items() if k not in ("dp_weights", "layer_splits")}
            change["applied"] = "none: the planner keeps the plan in force"
            self.changes.append(change)
            return
        self._post_in_place(change)

    def _post_in_place(self, change: dict) -> None:
        """Record ``change`` as the plan in force and hand it to the job."""
        if change.get("dp_weights") is not None:
            self.weights = change["dp_weights"]
        if change.get("layer_splits") is not None:
            new = [
                ranges_from_counts(split, self.cfg.model.layers, len(split))
                for split in change["layer_splits"]
            ]
            if new != self.ranges:
                self.ranges = new
                self.detector = self._make_detector()  # stage costs changed: a fresh baseline
        self.changes.append(change)
        self._post({k: v for k, v in change.items() if k != "plan"} | {"id": change["id"]})

    def _adopt(self, change: dict) -> None:
        """Take a change the job applies without this loop (a scheduled one) as the plan in
        force."""
        self.groups, self.weights, self.ranges, moved, resplit = with_change(
            change, self.cfg, self.groups, self.weights, self.ranges, self.world
        )
        if moved:
            self._cover(self.groups)
        if moved or resplit:
            self.detector = self._make_detector()  # new stage costs or places: a fresh baseline

    def _peers(self) -> list[int] | None:
        """Per rank a label of its work for the detector's peer comparison (``OnlineDetector``):
        its stage's layers and group size (ranks of other work at the same stage are no peers: a
        rank left alone in a re-formed group does twice a pair's work); None while the layer
        ranges of new groups are not yet known."""
        if len(self.ranges) != len(self.groups):
            return None
        kinds: dict[tuple, int] = {}
        labels = [-1] * self.world
        for ranges, pipe in zip(self.ranges, self.groups):
            for layers, group in zip(ranges, pipe):
                for r in group:
                    labels[r] = kinds.setdefault((tuple(layers), len(group)), len(kinds))
        return labels

    def _cover(self, groups: list[list[tuple[int, ...]]]) -> None:
        """A job meta whose coordinates take in ``groups`` (``observe.covering_meta``: a relaunch
        re-formed by the planner, two pipelines over three ranks launched as one)."""
        self.meta = covering_meta(
            self.meta,
            len(groups),
            max(len(p) for p in groups),
            max(len(s) for p in groups for s in p),
        )
        self.meta_dict = {**self.meta_dict, **self.meta.to_dict()}

    def _unchanged(self, change: dict) -> bool:
        """Whether a change in place gives every replica the share and layer split it has now."""

        def shares(w: list[float]) -> list[float]:
            total = sum(w)
            return [round(x / total, 9) for x in w] if total else list(w)

        splits = [[b - a for a, b in ranges] for ranges in self.ranges]
        return (
            shares(change["dp_weights"]) == shares(self.weights)
            and change["layer_splits"] == splits
        )

    def as_applied(self, records: list[dict], moved: tuple[str, ...] = ()) -> list[dict]:
        """Each change with the step the job applied it at and the record's ``moved`` fields.

        ``records``: the job's ``plan_changes.json``. ``applied`` stays true only with an applied
        step: a change handed to the job that it never reached a step boundary
        for is ``applied: false``."""
        by_id = {r.get("id"): r for r in records}
        out = []
        for change in self.changes:
            record = by_id.get(change["id"], {})
            merged = {
                **change,
                "applied_step": record.get("step"),
                **{k: record[k] for k in moved if k in record},
            }
            if merged.get("applied") is True and merged["applied_step"] is None:
                merged["applied"] = False
            out.append(merged)
        return out

    def measured_steps(self, applied_steps: list[int | None]) -> list[dict]:
        """For each change, the median measured step while it was in force, and its estimate's
        error.

        ``applied_steps``: per change the step the job applied it at (None: never applied); in
        force from the step after it until the next change; the error is ``predicted / measured -
        1``."""
        starts = sorted(s for s in applied_steps if s is not None)
        out = []
        for change, start in zip(self.changes, applied_steps):
            if start is None:
                out.append({})
                continue
            end = next((s for s in starts if s > start), None)
            seconds = [v for s, v in self.step_s.items() if s > start and (end is None or s < end)]
            out.append(step_check(change.get("predicted_step_s"), seconds))
        return out

    def save(self) -> None:
        (self.out / "live.json").write_text(
            json.dumps(
                {
                    "events": self.events,
                    "changes": self.changes,
                    "lag_s": self.lag_summary(),
                    "spare_probes": self.probes,
                    "planner_calibration": self.calibration,
                },
                indent=1,
                default=str,
            )
        )

    def lag_summary(self) -> dict | None:
        """How long after a step's records were sent the detector saw them (median, max)."""
        if not self.lags:
            return None
        ordered = sorted(self.lags)
        return {
            "median": round(ordered[len(ordered) // 2], 4),
            "max": round(ordered[-1], 4),
            "steps": len(ordered),
        }
