"""The workload-aware fail-slow detector, fed step by step (live) or a whole trace (offline).

Per rank and step it takes the rank's own-work ratio (measured / expected cost of the ops the rank
ran; see ``observe``), divides out what all ranks share that step (a job-wide slowdown is not a
device fault), and runs a per-rank CUSUM against the rank's own healthy baseline. Constant
differences that were there from the first steps are sorted out at calibration: a whole stage slower
than the others is ``stage-imbalance``; one rank slower than the peers of its stage is a device that
was slow from the start. A data-parallel replica that took longer only because its data cost more is
``workload-imbalance``. Transfer times with the waits taken out (``links``) get their own CUSUMs:
per pipeline link, and per rank in gradient collectives; an alarm is a ``link-slow`` naming both
ends (``"ranks": [A, B]``) and the traffic (``pipeline`` or ``gradient-sync``), never a fail-slow.

The rank's own-work ratio mixes its forward and backward ops (with waits on neighbours, a low
quantile of them), so a slowdown of one phase alone moves it little. Each phase is therefore also
tested on its own (``phase_matrices``: forward, backward and the optimizer step): such an alarm is a
``fail-slow`` of the rank with ``"phase"`` naming the phase, unless the whole rank has alarmed
already.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from resihp.detect.budget import bank_budget, job_arl0
from resihp.detect.changepoint import CusumBank
from resihp.detect.config import DetectorConfig
from resihp.detect.events import Event, events_json
from resihp.detect.fitted import fit_trace
from resihp.detect.linkgroups import LinkAlarm, join, onset_groups, shared_event
from resihp.detect.observe import (
    ExpectedCompute,
    Observations,
    RankPlacement,
    infer_meta,
    layout_parts,
    observe_ops,
    rank_layout,
    shape_from_meta,
)
from resihp.errors import InputError
from resihp.opstrace import JobMeta, validate_ops_trace

# compute, pipeline-link and gradient-sync banks, and one bank per phase
Banks = tuple[CusumBank, CusumBank, CusumBank, dict[str, CusumBank]]


class OnlineDetector:
    """``observe(step_df)`` per step, or ``observe_arrays`` with per-rank vectors (the fast
    path)."""

    name = "resihp"

    def __init__(
        self,
        meta: JobMeta,
        expected: ExpectedCompute | None = None,
        config: DetectorConfig | None = None,
        *,
        meta_dict: dict | None = None,
        layout: RankPlacement | None = None,
        banks: Banks | None = None,
        peers: np.ndarray | None = None,
        keep_levels: bool = False,
    ) -> None:
        """``banks``: the CUSUM banks to go on with (``carried``); new ones where None. ``peers``:
        per rank a label, equal for ranks doing the same work (a re-formed layout's pipelines differ
        in depth and group size: a rank alone in its group is no peer of a pair's ranks at the same
        stage); where None, the ranks of one stage are peers. ``keep_levels``: keep each step's
        own-work vector (``levels``), which the banks see only against the ranks' median."""
        self.meta = meta
        self.peers = None if peers is None else np.asarray(peers)
        self.expected = expected
        self.cfg = config or DetectorConfig()
        self.shape = shape_from_meta(meta_dict)
        w = meta.world_size
        self.layout = layout or RankPlacement(*(np.full(w, -1, dtype=np.int64) for _ in range(3)))
        # per rank: its compute, its pipeline transfers, its gradient collectives' transfers, and
        # each phase's compute
        self.compute, self.link, self.sync, self.phase_banks = banks or self._new_banks(w)
        self._bank_of: dict[tuple[str, int], CusumBank] = {}
        self.events: list[Event] = []
        self._open: dict[tuple[str, int], Event] = {}
        # alarms whose measured factor is below ``alarm_floor``: per (series, index) its onset,
        # confidence and (links) ends, until the factor reaches the floor or the series recovers
        self._held: dict[tuple[str, int], tuple[int, float, list[int] | None]] = {}
        # the links of open shared-link findings (``linkgroups``), by held key
        self._shared: dict[tuple[str, int], Event] = {}
        self._last_step: int | None = None
        self._steps_seen = 0
        self._wl_open: dict[int, Event] = {}
        self._wl_quiet: dict[int, int] = {}
        self._wl_steps: dict[int, int] = {}
        self._checked = np.zeros(w, dtype=bool)  # ranks compared with their stage's peers
        self.cost_model = "none"
        self._healthy_transfers: dict[str, list[float]] = {
            "pipeline": [],
            "gradient-sync": [],
            "compute": [],
        }
        # per traffic: each rank's transfers of the calibration steps, and of the last few steps
        self._healthy_rows: dict[str, list[np.ndarray]] = {"pipeline": [], "gradient-sync": []}
        self._recent: dict[str, dict[int, np.ndarray]] = {"pipeline": {}, "gradient-sync": {}}
        self._fit_window: list[pd.DataFrame] | None = (
            [] if fits_cost(meta, expected, self.cfg) else None
        )
        # per phase, each rank's share of its compute seconds (a running mean of its calm steps)
        self._phase_share = {p: np.full(w, np.nan) for p in PHASES}
        # per step, each rank's own work against its expected cost (NaN: no record), as observed
        self.levels: dict[int, np.ndarray] | None = {} if keep_levels else None

    def _new_banks(self, w: int) -> Banks:
        # the phase tests: three more per rank, each held to a hundredfold false-alarm run length
        phase_cfg = replace(
            self.cfg,
            min_slowdown=max(self.cfg.min_slowdown, self.cfg.phase_min_slowdown),
            false_alarm_steps=100 * self.cfg.false_alarm_steps,
        )
        return (
            CusumBank(w, self.cfg, rises=True),
            CusumBank(w, self.cfg),
            CusumBank(w, self.cfg),
            {p: CusumBank(w, phase_cfg) for p in PHASES},
        )

    def carried(self, meta: JobMeta, layout: RankPlacement, source: np.ndarray) -> OnlineDetector:
        """This detector after a re-plan moved ranks.

        Open fail-slow and link events move with their ranks; those of ranks not carried are
        dropped. The new detector takes this one's state over: this one is not to be used after.

        Args:
            meta: the new job's meta.
            layout: where each rank of the new job sits.
            source: per rank ``j`` of the new job, the rank of this detector it continues (the same
                device doing the same work, so its baseline holds); below 0: calibrates afresh.
        """
        source = np.asarray(source, dtype=np.int64)
        banks = (
            self.compute.carried(source),
            self.link.carried(source),
            self.sync.carried(source),
            {p: b.carried(source) for p, b in self.phase_banks.items()},
        )
        new = OnlineDetector(meta, self.expected, self.cfg, layout=layout, banks=banks)
        new.shape, new.cost_model = self.shape, self.cost_model
        new._last_step, new._steps_seen = self._last_step, self._steps_seen
        new._checked[source >= 0] = self._checked[source[source >= 0]]
        for p, share in self._phase_share.items():
            new._phase_share[p] = np.where(source >= 0, share[np.maximum(source, 0)], np.nan)
        new.events = self.events
        # each old rank's new rank, looked up for the few ranks with an open event
        moved = dict(
            _moved(
                source,
                {i for _, i in self._open}
                | {i for _, i in self._bank_of}
                | {i for _, i in self._held},
            )
        )
        new._held = {
            (name, moved[i]): (
                onset,
                conf,
                None if ends is None else [moved.get(r, r) for r in ends],
            )
            for (name, i), (onset, conf, ends) in self._held.items()
            if i in moved
        }
        new._open = {(kind, moved[i]): ev for (kind, i), ev in self._open.items() if i in moved}
        banks = {
            id(b): b2
            for b, b2 in [(self.compute, new.compute), (self.link, new.link), (self.sync, new.sync)]
            + [(self.phase_banks[p], new.phase_banks[p]) for p in PHASES]
        }
        new._bank_of = {
            (kind, moved[i]): banks[id(b)] for (kind, i), b in self._bank_of.items() if i in moved
        }
        return new

    # -- feeding -------------------------------------------------------------------------------
    def observe(self, step_df: pd.DataFrame) -> list[Event]:
        """Ops-trace rows of one step (or several consecutive steps); returns the new events.

        Where the cost is to be fitted (``fits_cost``), the calibration window's steps are held
        until it is complete, then fitted and observed together."""
        df = validate_ops_trace(step_df, source="step records")
        if self._fit_window is not None:
            self._fit_window.append(df)
            df = pd.concat(self._fit_window, ignore_index=True)
            if df["step"].nunique() < self.cfg.calibration_steps:
                return []
            self._fit_window = None
            self.expected = fit_trace(df, self.cfg.calibration_steps, self.shape) or self.expected
        self._merge_layout(rank_layout(df, self.meta, source="step records"))
        obs = observe_ops(
            df,
            self.meta,
            expected=self.expected,
            shape=self.shape,
            own_quantile=self.cfg.own_quantile,
            phases=self.cfg.phases,
        )
        phases = phase_matrices(df, obs, self.cfg)
        if self._steps_seen < self.cfg.calibration_steps:
            self._healthy_transfers["compute"] += _compute_per_token(df)
        return self.observe_matrices(obs, phases)

    def observe_matrices(
        self,
        obs: Observations,
        phases: PhaseMatrices | None = None,
        rebase_at: set[int] | frozenset[int] = frozenset(),
    ) -> list[Event]:
        """Every step of ``obs`` through ``observe_arrays``; the events found.

        Args:
            obs: the per-step observations of a trace (``observe_ops``).
            phases: the phases' matrices (``phase_matrices``), or None to test only the rank's
                whole own work.
            rebase_at: steps before which every rank's baseline is learned afresh
                (``rebaseline``).
        """
        self.cost_model = obs.cost_model
        new: list[Event] = []
        for i, step in enumerate(obs.steps):
            if int(step) in rebase_at:
                self.rebaseline()
            own, share = phases.at(i) if phases is not None else (None, None)
            new += self.observe_arrays(
                int(step),
                obs.own[i],
                obs.raw[i],
                None if obs.expected is None else obs.expected[i],
                None if obs.comm is None else obs.comm[i],
                phases=own,
                sync=None if obs.sync is None else obs.sync[i],
                phase_shares=share,
            )
        return new

    def observe_arrays(
        self,
        step: int,
        own: np.ndarray,
        raw: np.ndarray | None = None,
        expected: np.ndarray | None = None,
        comm: np.ndarray | None = None,
        phases: dict[str, np.ndarray] | None = None,
        sync: np.ndarray | None = None,
        phase_shares: dict[str, np.ndarray] | None = None,
    ) -> list[Event]:
        """One step's observations; the new events they raise.

        Each vector runs over ranks 0..world_size-1, NaN where a rank has no record.

        Args:
            step: the step's number (increasing from call to call).
            own: per rank its own-work ratio (measured / expected cost).
            raw: per rank its compute seconds.
            expected: per rank the seconds the cost model expects (None: no cost model).
            comm: per rank its pipeline link's transfer time per token.
            phases: per phase name (``PHASES``) that phase's own-work vector.
            sync: per rank its gradient collectives' transfer seconds.
            phase_shares: per phase name its share of each rank's compute seconds.
        """
        if self._last_step is not None and step <= self._last_step:
            raise InputError(
                f"step records: step {step} arrives after step {self._last_step}; "
                "expected increasing step numbers"
            )
        self._last_step = step
        self._steps_seen += 1
        if self.levels is not None:
            self.levels[step] = np.array(own, dtype=np.float64)
            for old in [k for k in self.levels if k <= step - LEVEL_STEPS]:
                del self.levels[old]
        new: list[Event] = []
        x = _common_mode_log(own)
        alarms, recoveries, calibrated = self.compute.update(step, x)
        if calibrated.size:
            new += self._calibration_findings(step, calibrated)
        for i, onset, conf, _, factor in self._due("compute"):
            new += self._rank_alarm(step, i, onset, factor, conf)
        for a in alarms:
            if ("fail-slow", a.index) in self._open or self._floored(
                ("compute", a.index), a.onset_step, a.confidence, a.slowdown
            ):
                new += self._rank_alarm(step, a.index, a.onset_step, a.slowdown, a.confidence)
        for r in recoveries:
            if self._bank_of.get(("fail-slow", r.index), self.compute) is self.compute:
                self._close_event("fail-slow", r.index, r.end_step, r.slowdown)
        for name, values in (phases or {}).items():
            new += self._phase_step(step, name, values, (phase_shares or {}).get(name))
        if comm is not None:
            new += self._link_step(step, comm)
        if sync is not None:
            new += self._sync_step(step, sync)
        for name, values in (("pipeline", comm), ("gradient-sync", sync)):
            if values is None:
                continue
            recent = self._recent[name]
            recent[step] = np.asarray(values, dtype=np.float64)
            for old in [k for k in recent if k <= step - RECENT_STEPS]:
                del recent[old]
            if self._steps_seen <= self.cfg.calibration_steps and np.isfinite(values).any():
                self._healthy_transfers[name].append(float(np.nanmedian(values)))
                self._healthy_rows[name].append(np.asarray(values, dtype=np.float64))
        if expected is not None and raw is not None:
            new += self._workload_step(step, raw, expected)
        self.events += new
        return new

    def _rank_alarm(
        self, step: int, i: int, onset: int, slowdown: float, confidence: float
    ) -> list[Event]:
        """Rank ``i``'s whole own work alarmed at or above the floor: a fail-slow, or the take-over
        of the one a phase opened (the whole rank is slow: its bank takes the event over)."""
        ev = self._open.get(("fail-slow", i))
        if ev is None:
            ev = self._open_event("fail-slow", i, onset, step, slowdown, confidence)
            self._floor_evidence(ev, slowdown)
            return [ev]
        ev.phase = None
        ev.rank_slowdown = None
        ev.slowdown = slowdown
        self._bank_of.pop(("fail-slow", i), None)
        return []

    def _floored(
        self,
        key: tuple[str, int],
        onset: int,
        confidence: float,
        factor: float,
        ends: list[int] | None = None,
    ) -> bool:
        """Whether an alarm of measured ``factor`` is raised now: at or above ``alarm_floor``;
        below it, it is held (``_due`` raises it once its level since ``onset`` reaches it)."""
        if factor >= self.cfg.alarm_floor:
            self._held.pop(key, None)
            return True
        self._held[key] = (onset, confidence, ends)
        return False

    def _bank_named(self, name: str) -> CusumBank:
        banks = {"compute": self.compute, "pipeline": self.link, "sync": self.sync}
        return banks[name] if name in banks else self.phase_banks[name]

    def _due(self, name: str) -> list[tuple[int, int, float, list[int] | None, float]]:
        """The held alarms of series ``name`` whose factor has reached the floor, taken off the held
        ones: (index, onset, confidence, ends, factor). A held alarm whose series left its alarm
        (recovered, or was learned afresh) is dropped: it never reached the floor. A series' factor
        is its mean level since the onset; a link's, its transfers against its healthy ones."""
        bank = self._bank_named(name)
        out = []
        for key in [k for k in self._held if k[0] == name]:
            i = key[1]
            onset, conf, ends = self._held[key]
            members = ends if name == "sync" and ends else [i]
            if not bank.alarmed[members].all():
                del self._held[key]
                continue
            level = bank.level_since(i, onset)
            if name in ("pipeline", "sync"):
                traffic = "pipeline" if name == "pipeline" else "gradient-sync"
                level = self._link_slowdown(traffic, members, onset, level or 1.0)
            if level is not None and level >= self.cfg.alarm_floor:
                del self._held[key]
                out.append((i, onset, conf, ends, level))
        return out

    def _floor_evidence(self, ev: Event, factor: float) -> None:
        """The measured factor that raised ``ev`` beside the floor it cleared."""
        ev.alarm_factor = round(float(factor), 4)
        ev.alarm_floor = self.cfg.alarm_floor

    def finish(self) -> list[Event]:
        """Close what is still open (its slowdown becomes the mean over the whole episode)."""
        for (kind, i), ev in list(self._open.items()):
            bank = self._bank_of.get((kind, i), self.compute if kind == "fail-slow" else self.link)
            ev.slowdown = bank.episode_slowdown(i)
        self._wl_open.clear()
        return self.events

    # -- findings -----------------------------------------------------------------------------
    def _where(self, i: int) -> tuple[int | None, int | None, int | None]:
        lay = self.layout

        def val(a: np.ndarray) -> int | None:
            return None if a[i] < 0 else int(a[i])

        return val(lay.dp_rank), val(lay.stage), val(lay.tp_rank)

    def _open_event(
        self,
        kind: str,
        i: int,
        onset: int,
        step: int,
        slowdown: float,
        confidence: float,
        bank: CusumBank | None = None,
        key: tuple[str, int] | None = None,
    ) -> Event:
        dp, st, tp = self._where(i)
        ev = Event(kind, i, dp, st, tp, onset, step, slowdown, confidence)
        key = key or (kind, i)
        self._open[key] = ev
        if bank is not None:
            self._bank_of[key] = bank
        return ev

    def _phase_step(
        self, step: int, name: str, values: np.ndarray, share: np.ndarray | None
    ) -> list[Event]:
        """One phase of every rank tested on its own; an alarm of a rank with no open fail-slow
        opens one naming the phase (a second phase of the same rank is added to its name). Its
        ``rank_slowdown`` is what the phase's slowdown costs the rank: ``1 + share x (slowdown -
        1)``, the share that of the rank's calm steps (a 2x slower optimizer step that takes 1% of
        the step costs the rank 1%)."""
        bank = self.phase_banks[name]
        alarms, recoveries, _ = bank.update(step, _common_mode_log(values))
        if share is not None:  # steps of no rise under way (this one's included) only
            running = self._phase_share[name]
            calm = ~bank.alarmed & (bank.s <= 0) & np.isfinite(share)
            first = calm & np.isnan(running)
            running[first] = share[first]
            running[calm & ~first] += SHARE_RATE * (share[calm & ~first] - running[calm & ~first])
        out = []
        for i, onset, conf, _, factor in self._due(name):
            out += self._phase_alarm(step, name, i, onset, factor, conf)
        for a in alarms:
            if ("fail-slow", a.index) in self._open or self._floored(
                (name, a.index), a.onset_step, a.confidence, a.slowdown
            ):
                out += self._phase_alarm(
                    step, name, a.index, a.onset_step, a.slowdown, a.confidence
                )
        for r in recoveries:
            if self._bank_of.get(("fail-slow", r.index)) is bank:
                self._close_event("fail-slow", r.index, r.end_step, r.slowdown)
        return out

    def _phase_alarm(
        self, step: int, name: str, i: int, onset: int, slowdown: float, confidence: float
    ) -> list[Event]:
        """Phase ``name`` of rank ``i`` alarmed: a fail-slow naming the phase, or the phase added
        to the name of the rank's open one."""
        ev = self._open.get(("fail-slow", i))
        cost = self._phase_cost(name, i, slowdown)
        if ev is None:
            ev = self._open_event(
                "fail-slow", i, onset, step, slowdown, confidence, self.phase_banks[name]
            )
            ev.phase = name
            ev.rank_slowdown = round(1.0 + cost, 4)
            self._floor_evidence(ev, slowdown)
            return [ev]
        if ev.phase is not None and name not in ev.phase.split("+"):
            ev.phase += f"+{name}"
            ev.rank_slowdown = round((ev.rank_slowdown or 1.0) + cost, 4)
        return []

    def _phase_cost(self, name: str, i: int, slowdown: float) -> float:
        """The rank's extra time, as a fraction of its step, from ``slowdown`` of phase ``name``
        alone; the whole slowdown where the phase's share is not known."""
        share = float(self._phase_share[name][i])
        return (slowdown - 1.0) * (share if np.isfinite(share) else 1.0)

    def rebaseline(self) -> None:
        """Every rank calibrates afresh, after a re-plan that changed the ranks' work.

        Open device faults stay open (no end is known) and are not reported again."""
        for bank in (self.compute, self.link, self.sync, *self.phase_banks.values()):
            bank.recalibrate()

    def healthy_transfers(self) -> dict[str, float]:
        """The transfers measured over the calibration steps (medians).

        ``pipeline`` seconds per token of a pipeline message, ``gradient-sync`` seconds of a
        rank's gradient collectives per step, and beside them ``compute``: a rank's forward and
        backward seconds per token (each only where the trace had them)."""
        return {k: float(np.median(v)) for k, v in self._healthy_transfers.items() if v}

    def open_events(self) -> list[Event]:
        """The findings still open (a device still slow, a link still slow), current estimates."""
        return list(self._open.values())

    def current_cost(self, event: Event) -> float | None:
        """What an open fail-slow of a device costs its rank's step now.

        Measured over the last ``CURRENT_STEPS`` steps (``Event.slowdown_of_rank`` is its estimate
        when found, and a slowdown that grows or fades after that leaves it behind); None when it is
        no longer open or its baseline was learned afresh since (``rebaseline``: its deviations say
        nothing then)."""
        key = (event.kind, event.rank)
        if event.kind != "fail-slow" or event.rank is None or self._open.get(key) is not event:
            return None
        i = int(event.rank)
        if event.phase is None:
            return self.compute.recent_slowdown(i, CURRENT_STEPS)
        now = [
            (name, self.phase_banks[name].recent_slowdown(i, CURRENT_STEPS))
            for name in event.phase.split("+")
        ]
        if all(s is None for _, s in now):
            return None
        return 1.0 + sum(self._phase_cost(name, i, s) for name, s in now if s is not None)

    def noise(self) -> dict:
        """Per calibrated rank its measured noise and the smallest slowdown it can detect.

        The noise is the calibration dispersion of its own-work ratio, as a fraction; the slowdown
        is the smallest found within ``detect_within`` steps at that noise."""
        bank = self.compute
        low = bank.min_detectable()
        sigma = bank.calibrated_sigma
        return {
            int(i): {
                "noise": round(float(np.expm1(sigma[i] / bank.share)), 4),
                "min_detectable_slowdown": round(float(low[i]), 3),
                "adapted": bool(bank.adapted[i]),
            }
            for i in np.flatnonzero(bank.calibrated)
        }

    def budget(self) -> dict:
        """The error budget of every calibrated series (``budget``).

        Per series name (``compute``: each rank's own work; ``pipeline``, ``gradient-sync``: its
        links; each phase) and index, its noise, thresholds, expected steps between false alarms,
        delays at x1.5 and x2 and Lorden's bound; ``job_arl0_steps``: steps between false alarms
        over them all."""
        floor = self.cfg.alarm_floor
        series = {
            "compute": bank_budget(self.compute, floor),
            "pipeline": bank_budget(self.link, floor),
            "gradient-sync": bank_budget(self.sync, floor),
            **{p: bank_budget(b, floor) for p, b in self.phase_banks.items()},
        }
        every = [b for per in series.values() for b in per.values()]
        return {
            "alarm_floor": floor,
            "job_arl0_steps": job_arl0(every),
            "series": {
                name: {str(i): b for i, b in per.items()} for name, per in series.items() if per
            },
        }

    def _close_event(self, kind: str, i: int, end_step: int, slowdown: float) -> None:
        self._bank_of.pop((kind, i), None)
        ev = self._open.pop((kind, i), None)
        if ev is not None:
            ev.end_step = end_step
            ev.slowdown = slowdown

    def _calibration_findings(self, step: int, ranks: np.ndarray) -> list[Event]:
        """Differences present from the first steps: stage imbalance, or one rank slow from the
        start.

        Runs once every rank seen so far has its baseline, over the ranks not yet compared (all of
        them the first time; after ``carried``, the ranks that calibrated afresh). A rank slow from
        the start is re-based on its peers and stays alarmed, so its recovery is found as any other.
        """
        cfg = self.cfg
        bank = self.compute
        if not bank.calibrated.all() and (bank.first_step >= 0).sum() > bank.calibrated.sum():
            return []  # wait until every rank seen so far has its baseline
        fresh = bank.calibrated & ~self._checked
        if not fresh.any():
            return []
        first_pass = not self._checked.any()
        self._checked |= bank.calibrated
        cal = np.flatnonzero(bank.calibrated)
        stages = self.layout.stage[cal]
        out: list[Event] = []
        mu = bank.mu[cal]
        overall = float(np.median(mu))
        known = stages >= 0
        peers_mu = mu.copy()
        for s in np.unique(stages[known]):
            sel = stages == s
            m = float(np.median(mu[sel]))
            peers_mu[sel] = m
            ratio = float(np.exp(m - overall))
            if first_pass and ratio > 1 + cfg.stage_imbalance and np.unique(stages[known]).size > 1:
                out.append(
                    Event(
                        "stage-imbalance",
                        None,
                        None,
                        int(s),
                        None,
                        int(bank.first_step[cal[sel]].min()),
                        step,
                        ratio,
                        1.0,
                    )
                )
        if self.peers is not None:  # the peers' level by work, not by stage
            labels = self.peers[cal]
            for label in np.unique(labels):
                peers_mu[labels == label] = float(np.median(mu[labels == label]))
        else:
            labels = stages
        for j in np.flatnonzero(known & fresh[cal]):
            sel = labels == labels[j]
            if sel.sum() < 3:
                continue  # two peers cannot say which of them is the odd one
            ratio = float(np.exp(mu[j] - peers_mu[j]))
            if ratio > 1 + cfg.rank_imbalance and ratio >= cfg.alarm_floor:
                i = int(cal[j])
                noise = float(bank.sigma[i])
                conf = float(min(1.0, (np.log(ratio) / noise) / 10))
                out.append(
                    self._open_event("fail-slow", i, int(bank.first_step[i]), step, ratio, conf)
                )
                out[-1].from_start = True
                self._floor_evidence(out[-1], ratio)
                bank.rebase_alarmed(i, float(peers_mu[j]))
        return out

    def _link_step(self, step: int, comm: np.ndarray) -> list[Event]:
        alarms, recoveries, _ = self.link.update(step, _others_log(comm))
        found = []
        for i, onset, conf, ends, factor in self._due("pipeline"):
            if self._pipeline_has_fail_slow(i):
                self._drop_link_alarm(i)
                continue
            found.append(
                LinkAlarm(("pipeline", i), ends or [i], "pipeline", onset, factor, conf, True)
            )
        for a in alarms:
            # a transfer that waited on a slow compute neighbour is not a slow link
            if self._pipeline_has_fail_slow(a.index):
                self._drop_link_alarm(a.index)
                continue
            factor = self._link_slowdown("pipeline", [a.index], a.onset_step, a.slowdown)
            peer = self._neighbour(a.index)
            ends = [a.index] + ([peer] if peer is not None else [])
            ready = self._floored(("pipeline", a.index), a.onset_step, a.confidence, factor, ends)
            found.append(
                LinkAlarm(
                    ("pipeline", a.index),
                    ends,
                    "pipeline",
                    a.onset_step,
                    factor,
                    a.confidence,
                    ready,
                )
            )
        out = self._link_findings(step, "pipeline", found)
        for r in recoveries:
            self._close_event("link-slow", r.index, r.end_step, r.slowdown)
            self._leave_shared(("pipeline", r.index), r.end_step)
        return out

    def _drop_link_alarm(self, i: int) -> None:
        """Pipeline link ``i``'s alarm explained away: out of alarm, its CUSUM from zero."""
        self.link.alarmed[i] = False
        self.link.s[i] = 0.0
        self._held.pop(("pipeline", i), None)

    def _link_findings(self, step: int, traffic: str, found: list[LinkAlarm]) -> list[Event]:
        """Links of one traffic in alarm this step (``found``; ``ready``: at or above the floor)
        judged with the other links of that traffic that began with them (``linkgroups``): the
        links held below the floor, and those of open findings. A ready link alone is a
        ``link-slow``; one that began with others makes (or joins) one ``shared-link-slow``."""
        if not any(a.ready for a in found):
            return []
        name = "pipeline" if traffic == "pipeline" else "sync"
        keys = {a.key for a in found}
        pool = list(found)
        for key, (onset, conf, ends) in self._held.items():
            if key[0] == name and key not in keys and ends:
                pool.append(LinkAlarm(key, ends, traffic, onset, 1.0, conf, False))
        reported = {}
        for (kind, i), ev in self._open.items():
            if (
                kind == ("link-slow" if name == "pipeline" else "sync")
                and ev.traffic == traffic
                and (name, i) not in keys
            ):
                reported[(name, i)] = ev
                pool.append(
                    LinkAlarm(
                        (name, i),
                        list(ev.ranks or [i]),
                        traffic,
                        ev.onset_step,
                        float(ev.alarm_factor or ev.slowdown),
                        ev.confidence,
                        False,
                    )
                )
        for key, ev in self._shared.items():
            if key[0] == name and key not in keys:
                pool.append(LinkAlarm(key, [], traffic, ev.onset_step, 1.0, ev.confidence, False))
        out = []
        for group in onset_groups(pool):
            new = [a for a in group if a.ready]
            if not new:
                continue
            shared = next((self._shared[a.key] for a in group if a.key in self._shared), None)
            members = [a for a in group if a.ranks]
            for a in members:  # held below the floor: measured now
                if not a.ready and a.key not in reported:
                    ends = a.ranks if name == "sync" else a.ranks[:1]
                    a.factor = self._link_slowdown(traffic, ends, a.onset, 1.0)
            if shared is None and len(members) == 1:
                out.append(self._open_link(step, new[0]))
                continue
            if shared is None:
                shared = shared_event(
                    members, step, self.cfg.alarm_floor, self.layout.stage, self.layout.dp_rank
                )
                out.append(shared)
            for a in members:
                join(shared, a)
                if a.key not in reported:
                    self._shared[a.key] = shared
                    self._held.pop(a.key, None)
        return out

    def _open_link(self, step: int, a: LinkAlarm) -> Event:
        """A ``link-slow`` of one link (``a``: at or above the floor)."""
        if a.key[0] == "pipeline":
            ev = self._open_event("link-slow", a.key[1], a.onset, step, a.factor, a.confidence)
        else:
            ev = self._open_event(
                "link-slow", a.key[1], a.onset, step, a.factor, a.confidence, self.sync, key=a.key
            )
        ev.ranks = list(a.ranks)
        ev.traffic = a.traffic
        self._floor_evidence(ev, a.factor)
        return ev

    def _leave_shared(self, key: tuple[str, int], end_step: int) -> None:
        """A link of a shared-link finding recovered; the finding ends with its last link."""
        ev = self._shared.pop(key, None)
        if ev is not None and not any(e is ev for e in self._shared.values()):
            ev.end_step = end_step

    def _link_slowdown(self, traffic: str, ranks: list[int], onset: int, fallback: float) -> float:
        """How many times its own healthy transfers the link's transfers took since ``onset``
        (median over those steps, over its ends), measured in seconds rather than against the
        other links: with few links the others' noise would be in it. ``fallback`` where the
        healthy level is not known."""
        rows = self._healthy_rows[traffic]
        recent = [v for k, v in self._recent[traffic].items() if k >= onset]
        if not rows or not recent:
            return fallback
        healthy = np.nanmedian(np.array(rows)[:, ranks], axis=0)
        now = np.nanmedian(np.array(recent)[:, ranks], axis=0)
        ratio = now / healthy
        ratio = ratio[np.isfinite(ratio) & (ratio > 0)]
        return float(max(np.median(ratio), 1.0)) if ratio.size else fallback

    def _neighbour(self, i: int) -> int | None:
        """The rank at the next stage of rank ``i``'s pipeline (its link's other end)."""
        lay = self.layout
        hit = np.flatnonzero(
            (lay.dp_rank == lay.dp_rank[i])
            & (lay.stage == lay.stage[i] + 1)
            & (lay.tp_rank == lay.tp_rank[i])
        )
        return int(hit[0]) if hit.size and lay.stage[i] >= 0 else None

    def _sync_step(self, step: int, sync: np.ndarray) -> list[Event]:
        """Gradient collectives: a slow link between two members stretches the transfers of
        those two ends only. A group (the ranks of one stage and tensor-parallel rank) with exactly
        two members alarmed, and no fail-slow open in the job (a slow device can hold every
        collective up), is one event naming both, keyed by the lower rank."""
        alarms, recoveries, _ = self.sync.update(step, _others_log(sync))
        lay = self.layout
        quiet = (
            not any(kind == "fail-slow" for kind, _ in self._open)
            and not self.compute.alarmed.any()
        )
        found = [
            LinkAlarm(("sync", i), ends or [i], "gradient-sync", onset, factor, conf, True)
            for i, onset, conf, ends, factor in self._due("sync")
            if quiet
        ]
        for a in alarms:
            i = a.index
            group = np.flatnonzero((lay.stage == lay.stage[i]) & (lay.tp_rank == lay.tp_rank[i]))
            hot = [int(j) for j in group if self.sync.alarmed[j]]
            if not quiet or len(hot) != 2 or not self.sync.calibrated[group].all():
                continue
            lo, hi = hot
            key = ("sync", lo)
            if (
                key in self._open
                or key in self._held
                or key in self._shared
                or any(f.key == key for f in found)
            ):
                continue
            factor = self._link_slowdown("gradient-sync", [lo, hi], a.onset_step, a.slowdown)
            ready = self._floored(key, a.onset_step, a.confidence, factor, [lo, hi])
            found.append(
                LinkAlarm(key, [lo, hi], "gradient-sync", a.onset_step, factor, a.confidence, ready)
            )
        out = self._link_findings(step, "gradient-sync", found)
        for r in recoveries:
            for (kind, lo), ev in list(self._open.items()):
                if kind == "sync" and r.index in (ev.ranks or ()):
                    self._close_event("sync", lo, r.end_step, r.slowdown)
            for key, ev in list(self._shared.items()):
                if key[0] == "sync" and r.index in (self._held_ends(key, ev)):
                    self._leave_shared(key, r.end_step)
        return out

    def _held_ends(self, key: tuple[str, int], ev: Event) -> list[int]:
        """The ends of the gradient-sync link ``key`` of shared finding ``ev``."""
        return next((pair for pair in ev.links or [] if pair and pair[0] == key[1]), [key[1]])

    def _pipeline_has_fail_slow(self, i: int) -> bool:
        dp = self.layout.dp_rank
        same = np.flatnonzero(dp == dp[i]) if dp[i] >= 0 else np.array([i])
        return bool(self.compute.alarmed[same].any())

    def _workload_step(self, step: int, raw: np.ndarray, expected: np.ndarray) -> list[Event]:
        """A replica that took longer because its data cost more (not because a device is slow).

        Reported once such a stretch has lasted ``min_persist`` steps (single heavy steps are what
        variable sequence lengths do all the time), and never for a replica with a slow device.
        """
        dp = self.layout.dp_rank
        ok = ~np.isnan(raw) & ~np.isnan(expected) & (dp >= 0)
        if self.meta.dp_size < 2 or ok.sum() < 2:
            return []
        n = self.meta.dp_size
        raw_r = np.bincount(dp[ok], raw[ok], minlength=n)
        exp_r = np.bincount(dp[ok], expected[ok], minlength=n)
        has = np.bincount(dp[ok], minlength=n) > 0
        if has.sum() < 2:
            return []
        raw_rel = raw_r / np.median(raw_r[has])
        exp_rel = exp_r / np.median(exp_r[has])
        thr = self.cfg.workload_imbalance
        faulty = np.bincount(dp[self.compute.alarmed & (dp >= 0)], minlength=n) > 0
        explained = raw_rel / np.where(exp_rel > 0, exp_rel, np.inf) < 1 + thr / 2
        heavy = has & (raw_rel > 1 + thr) & (exp_rel > 1 + thr / 2) & explained & ~faulty
        out = []
        for d in range(n):
            ev = self._wl_open.get(d)
            if heavy[d]:
                if ev is None:
                    ev = Event(
                        "workload-imbalance",
                        None,
                        d,
                        None,
                        None,
                        step,
                        step,
                        float(raw_rel[d]),
                        1.0,
                        end_step=step,
                    )
                    self._wl_open[d] = ev
                    self._wl_steps[d] = 0
                ev.end_step = step
                ev.slowdown = max(ev.slowdown, float(raw_rel[d]))
                self._wl_steps[d] += 1
                if self._wl_steps[d] == self.cfg.min_persist:
                    ev.detected_step = step
                    out.append(ev)
                self._wl_quiet[d] = 0
            elif ev is not None:
                # a stretch of heavy data survives a few lighter steps inside it
                self._wl_quiet[d] = self._wl_quiet.get(d, 0) + 1
                if self._wl_quiet[d] >= self.cfg.recover_steps or faulty[d]:
                    del self._wl_open[d]
        return out

    def _merge_layout(self, lay: RankPlacement) -> None:
        for mine, theirs in (
            (self.layout.dp_rank, lay.dp_rank),
            (self.layout.stage, lay.stage),
            (self.layout.tp_rank, lay.tp_rank),
        ):
            seen = theirs >= 0
            clash = seen & (mine >= 0) & (mine != theirs)
            if clash.any():
                r = int(np.flatnonzero(clash)[0])
                raise InputError(
                    f"step records: rank {r} moved from its earlier place in the job "
                    "(dp_rank/stage/tp_rank changed)"
                )
            mine[seen] = theirs[seen]

    @property
    def steps_seen(self) -> int:
        return self._steps_seen


def noise_warnings(noise: dict, cfg: DetectorConfig) -> list[str]:
    """One line per group of ranks whose noise hides slowdowns above the config's target."""
    loud = {r: v for r, v in noise.items() if v["min_detectable_slowdown"] > cfg.target_slowdown}
    if not loud:
        return []
    worst = max(v["min_detectable_slowdown"] for v in loud.values())
    return [
        f"rank(s) {', '.join(sorted(loud, key=int))}: step-to-step noise up to "
        f"{max(v['noise'] for v in loud.values()):.0%} hides slowdowns below about "
        f"x{worst:.2f} for {cfg.detect_within} steps (larger ones are still found; "
        "--sensitivity trades sooner detection for false alarms)"
    ]


def budget_line(budget: dict) -> str:
    """One line of an error budget (``OnlineDetector.budget``).

    The job's steps between false alarms and, over the own-work series, the median delays at x2 and
    x1.5 against Lorden's."""
    comp = list(budget.get("series", {}).get("compute", {}).values())

    def med(field: str) -> str:
        v = [b[field] for b in comp if b.get(field) is not None]
        return f"{float(np.median(v)):.3g}" if v else "-"

    arl = budget.get("job_arl0_steps")
    return (
        f"error budget: a false alarm every {arl:.3g} steps (job), "
        if arl
        else "error budget: no false alarm expected (job), "
    ) + (
        f"delay x2 {med('delay_x2_steps')} steps (Lorden {med('lorden_x2_steps')}), x1.5 "
        f"{med('delay_x1_5_steps')} (Lorden {med('lorden_x1_5_steps')}), floor "
        f"x{budget['alarm_floor']:g}"
    )


PHASES = ("forward", "backward", "optimizer")
SHARE_RATE = 0.1  # weight of a step in a phase's running share of the rank's compute
_PHASE_OPTYPES = {
    "forward": ("forward-compute",),
    "backward": ("backward-compute",),
    "optimizer": ("optimizer", "optimizer-clip-main-grad"),
}


@dataclass(frozen=True)
class PhaseMatrices:
    """Per phase a (step x rank) matrix over the observed steps (NaN where a rank has none).

    ``own``: what the phase's test runs on (forward and backward: the phase's own-work ratio; the
    optimizer: its seconds, the same work every step). ``share``: the phase's fraction of the
    rank's compute seconds that step, which turns a slowdown of the phase alone into what it costs
    the rank (``Event.rank_slowdown``)."""

    own: dict[str, np.ndarray]
    share: dict[str, np.ndarray]

    def at(self, i: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The ``i``-th step's vectors: (own, share)."""
        return {p: m[i] for p, m in self.own.items()}, {p: m[i] for p, m in self.share.items()}


def phase_matrices(
    df: pd.DataFrame, obs: Observations, cfg: DetectorConfig
) -> PhaseMatrices | None:
    """The phases' matrices of ``df`` over ``obs.steps``, or None where the config tests no phases.

    Args:
        df: the ops trace (its optimizer rows give the optimizer phase's seconds).
        obs: its observations (forward and backward own work from
            ``observe_ops(..., phases=True)``).
        cfg: the detector's config.
    """
    if not cfg.phases or not len(obs.steps):
        return None
    steps = obs.steps
    optype = df["optype"].to_numpy()
    seconds = {}
    for name, optypes in _PHASE_OPTYPES.items():
        part = df[np.isin(optype, optypes)]
        if not len(part):
            continue
        m = np.full((len(steps), obs.own.shape[1]), np.nan)
        g = part.groupby(["step", "rank"], sort=False)["duration"].sum()
        step_of = g.index.get_level_values(0).to_numpy()
        s_idx = np.searchsorted(steps, step_of)
        ok = s_idx < len(steps)
        ok[ok] = steps[s_idx[ok]] == step_of[ok]
        m[s_idx[ok], g.index.get_level_values(1).to_numpy()[ok]] = g.to_numpy()[ok]
        seconds[name] = m
    own = dict(obs.phase_own or {})
    if "optimizer" in seconds:
        own["optimizer"] = seconds["optimizer"]
    total = np.nansum(np.stack(list(seconds.values())), axis=0) if seconds else None
    with np.errstate(invalid="ignore", divide="ignore"):
        share = {name: np.where(total > 0, m / total, np.nan) for name, m in seconds.items()}
    return PhaseMatrices(own, share)


def _moved(source: np.ndarray, old: set[int]) -> list[tuple[int, int]]:
    """(old rank, new rank) for the old ranks in ``old`` that ``source`` (per new rank, the old
    rank it continues, -1: none) carries; the last new rank where one is carried twice."""
    if not old:
        return []
    wanted = np.fromiter(old, dtype=np.int64, count=len(old))
    hit = np.flatnonzero(np.isin(source, wanted))
    return [(int(source[j]), int(j)) for j in hit]


def _common_mode_log(values: np.ndarray) -> np.ndarray:
    """log(value / the median over ranks this step), NaN where missing or non-positive.

    A one-rank job is compared with itself over time; in a larger job a step where a single rank
    reported says nothing about that rank relative to the others, so it is skipped.
    """
    v = np.asarray(values, dtype=np.float64)
    ok = v > 0
    out = np.full(v.shape, np.nan)
    n = int(ok.sum())
    if n == 0 or (n == 1 and v.size > 1):
        return out
    logs = np.log(v[ok])
    out[ok] = logs - (np.median(logs) if v.size > 1 else 0.0)
    return out


LEVEL_STEPS = 256  # steps of own-work vectors kept where asked (``keep_levels``)
CURRENT_STEPS = 3  # steps an open finding's current cost is the median over (``current_cost``)
RECENT_STEPS = 32  # steps of transfers kept to measure a slow link's slowdown


def _compute_per_token(df: pd.DataFrame) -> list[float]:
    """Per rank, its forward and backward seconds per token of one step's rows (where the rows
    carry their tokens)."""
    comp = df[df["optype"].isin(("forward-compute", "backward-compute"))]
    if "tokens" not in comp or not comp["tokens"].notna().any():
        return []
    comp = comp[comp["tokens"].notna()]
    g = comp.groupby(["step", "rank"])
    per = g["duration"].sum() / (
        g["tokens"].sum().astype(float) / 2
    )  # each token: one fwd, one bwd
    return [float(v) for v in per.to_numpy() if np.isfinite(v) and v > 0]


def _others_log(values: np.ndarray) -> np.ndarray:
    """log(value / the median of the other ranks' values) this step: ``_common_mode_log`` with the
    rank itself left out of its reference, so that with few links (two in a 2-stage, 2-replica
    job) a slow one's shift is measured whole. O(n): each leave-one-out median is one of the
    sorted values at the middle positions (``np.partition``), chosen by the rank's own value."""
    v = np.asarray(values, dtype=np.float64)
    ok = np.flatnonzero(v > 0)
    out = np.full(v.shape, np.nan)
    if ok.size == 1 and v.size == 1:
        out[ok] = np.log(v[ok])
    if ok.size < 2:
        return out
    logs = np.log(v[ok])
    n = logs.size
    rest = n - 1
    mids = sorted({min(j, n - 1) for j in range(max(0, rest // 2 - 1), rest // 2 + 2)})
    part = np.partition(logs, mids)

    def without(j: int) -> np.ndarray:
        """Sorted position ``j`` with each rank's own value taken out: ``a[j]`` for a value above
        it (its place is after ``j``), else ``a[j + 1]`` (a value equal to ``a[j]`` placed after
        ``j`` makes the two equal, so ties need no rank)."""
        return np.where(logs > part[j], part[j], part[min(j + 1, n - 1)])

    if rest % 2:
        median = without((rest - 1) // 2)
    else:
        median = 0.5 * (without(rest // 2 - 1) + without(rest // 2))
    out[ok] = logs - median
    return out


def fits_cost(meta: JobMeta, expected: ExpectedCompute | None, cfg: DetectorConfig) -> bool:
    """Whether the job's own cost is fitted: no predictor given, and one pipeline stage.

    With several stages, the same micro-batch on the other stages is the better reference.

    Args:
        meta: the job's meta.
        expected: the given cost model (None: no predictor).
        cfg: the detector's config (``fit_cost`` off: never fitted).
    """
    return cfg.fit_cost and expected is None and meta.pp_size == 1


def trace_cost(
    df: pd.DataFrame,
    meta: JobMeta,
    expected: ExpectedCompute | None,
    cfg: DetectorConfig,
    meta_dict: dict | None = None,
) -> ExpectedCompute | None:
    """The cost model for a whole trace.

    ``expected`` if given; where ``fits_cost``, the job's own cost fitted on its first
    ``calibration_steps`` steps; else None (FLOPs, peers or phases).

    Args:
        df: the ops trace.
        meta: the job's meta.
        expected: the given cost model (None: none).
        cfg: the detector's config.
        meta_dict: the job meta document (its model shape, ``shape_from_meta``).
    """
    if not fits_cost(meta, expected, cfg):
        return expected
    return fit_trace(df, cfg.calibration_steps, shape_from_meta(meta_dict)) or expected


@dataclass
class TracePart:
    """One layout's part of a trace (``layout_parts``), observed.

    Where each rank sits, the cost model, and the per-step observations every method reads."""

    df: pd.DataFrame
    meta: JobMeta
    layout: RankPlacement
    expected: ExpectedCompute | None
    obs: Observations

    @classmethod
    def observed(
        cls,
        df: pd.DataFrame,
        meta: JobMeta,
        expected: ExpectedCompute | None,
        cfg: DetectorConfig,
        meta_dict: dict | None,
        source: str = "ops trace",
    ) -> TracePart:
        """The part of trace ``df`` laid out as ``meta``, observed.

        Args:
            df: the part's ops rows.
            meta: the part's job meta.
            expected: the given cost model (None: ``trace_cost`` decides).
            cfg: the detector's config.
            meta_dict: the job meta document (its model shape).
            source: what errors name as the trace.
        """
        layout = rank_layout(df, meta, source=source)
        expected = trace_cost(df, meta, expected, cfg, meta_dict)
        obs = observe_ops(
            df,
            meta,
            expected=expected,
            shape=shape_from_meta(meta_dict),
            own_quantile=cfg.own_quantile,
            phases=cfg.phases,
            source=source,
        )
        return cls(df, meta, layout, expected, obs)

    def detect(self, det: OnlineDetector) -> list[Event]:
        """The events ``det`` finds over this part.

        A re-plan that moved layers changes the ranks' work from its step on: baselines are
        learned afresh there."""
        moved = set(self.df.loc[self.df["optype"] == "replan-layers", "step"].astype(int))
        det.observe_matrices(self.obs, phase_matrices(self.df, self.obs, det.cfg), rebase_at=moved)
        return det.finish()


def detect_trace(
    df: pd.DataFrame,
    meta: JobMeta | None = None,
    expected: ExpectedCompute | None = None,
    config: DetectorConfig | None = None,
    meta_dict: dict | None = None,
) -> dict:
    """The DESIGN event JSON for a whole (validated) ops trace.

    A trace whose ranks took new places in a live re-plan is read part by part
    (``layout_parts``), each with a fresh detector (``noise``: the last part's).

    Args:
        df: the ops trace.
        meta: the job's meta (default: inferred from the trace).
        expected: the cost model (None: ``trace_cost`` decides).
        config: the detector's config (default: ``DetectorConfig()``).
        meta_dict: the job meta document (its model shape).
    """
    df = validate_ops_trace(df)
    cfg = config or DetectorConfig()
    events: list[Event] = []
    parts = []
    for part_df, part_meta in layout_parts(df, meta or infer_meta(df)):
        part = TracePart.observed(part_df, part_meta, expected, cfg, meta_dict)
        det = OnlineDetector(part_meta, part.expected, cfg, meta_dict=meta_dict, layout=part.layout)
        events += part.detect(det)
        parts.append(part.obs)
    obs = Observations.joined(parts)
    return events_json(
        events,
        steps=len(obs.steps),
        ranks=int(df["rank"].nunique()),
        cost_model=obs.cost_model,
        noise=det.noise(),
        budget=det.budget(),
    )
