"""A one-sided CUSUM change-point test run side by side over many series (one per rank), in numpy.

Each series is first calibrated on its own healthy steps (robust centre and spread of the log
value), then every step adds ``clip(z, -z_clip, z_clip) - k`` to a running sum that is floored at
zero; the sum reaching ``h`` after ``min_persist`` raised steps is an alarm. The onset is the most
likely start of a raised level among the steps since the sum last left zero (on a noisy series the
sum often leaves zero a few healthy steps before the change, and those steps would also dilute the
slowdown). While a series is healthy its centre follows slow drift.

A series whose level rises inside its calibration window (a fault that began before the detector
had a baseline; banks made with ``rises``, the ranks' own work) would otherwise take a mix of its
healthy and slow steps as its centre and spread: its slowdown understated, its noise inflated and
every later change hidden. Each calibration window is therefore also fitted with two levels (the
split that leaves the least absolute residual); where the later level is a rise the CUSUM would have
found had the earlier one been the baseline, the series calibrates on the earlier steps and is in
alarm from the split.

``k``, ``h`` and the clip are per series: a quiet series keeps the configured ones; a noisy one gets
thresholds from its own calibration dispersion (``DetectorConfig``: target slowdown, false-alarm run
length), and its slowdown is estimated from every step of the run, not only the raised ones (whose
mean overstates it when the noise is large next to the shift).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np

from resihp.detect.config import DetectorConfig

_MAD_TO_SIGMA = 1.4826


@dataclass
class Alarm:
    index: int
    onset_step: int
    slowdown: float
    confidence: float


@dataclass
class Recovery:
    index: int
    end_step: int
    slowdown: float


class CusumBank:
    """CUSUM state for ``n`` series; ``update`` takes one step's log values (NaN: not observed)."""

    def __init__(self, n: int, config: DetectorConfig, rises: bool = False) -> None:
        """``rises``: fit each calibration window for a rise inside it (module doc); for series of
        a rank's own work, whose noise it was checked on (a link's transfer times on shared cores,
        1-13 ms over a window, raised a false alarm with it)."""
        self.n = n
        self.cfg = config
        self.rises = rises
        w = config.calibration_steps
        self._cal = np.full((w, n), np.nan)
        self._cal_step = np.full((w, n), -1, dtype=np.int64)
        self.cal_count = np.zeros(n, dtype=np.int64)
        self.calibrated = np.zeros(n, dtype=bool)
        self.mu = np.zeros(n)
        self.sigma = np.full(n, np.inf)
        self._sigma0 = np.zeros(n)
        self.first_step = np.full(n, -1, dtype=np.int64)
        self.s = np.zeros(n)
        self.run_start = np.full(n, -1, dtype=np.int64)
        self.run_n = np.zeros(n, dtype=np.int64)
        self.raised_sum = np.zeros(n)
        self.raised_n = np.zeros(n, dtype=np.int64)
        self.alarmed = np.zeros(n, dtype=bool)
        self.alarm_sum = np.zeros(n)
        self.alarm_n = np.zeros(n, dtype=np.int64)
        self.quiet = np.zeros(n, dtype=np.int64)
        self.last_quiet_start = np.full(n, -1, dtype=np.int64)
        self._log_min = float(np.log(config.min_slowdown))
        s = config.sensitivity
        self.k = np.full(n, config.cusum_k / s)
        self.h = np.full(n, config.cusum_h / s)
        self.clip = np.full(n, float(config.z_clip))
        self.adapted = np.zeros(n, dtype=bool)
        self.run_sum = np.zeros(n)
        self.down = np.zeros(n)  # a noisy series' downward CUSUM from its alarmed level
        self.share = _share(n)
        # the last steps' deviations (a ring: row ``step % _HISTORY``), to place an alarm's onset
        self._hist = np.full((_HISTORY, n), np.nan)
        self._hist_step = np.full(_HISTORY, -1, dtype=np.int64)
        self._unstarted = True  # some series has no first step yet
        self._all_calibrated = False
        self._buffers: tuple[np.ndarray, np.ndarray] | None = None  # ``_scratch``

    def _scratch(self) -> tuple[np.ndarray, np.ndarray]:
        """Two arrays of ``n`` floats for ``update``'s temporaries (their values are not kept)."""
        if self._buffers is None or self._buffers[0].shape != (self.n,):
            self._buffers = (np.empty(self.n), np.empty(self.n))
        return self._buffers

    def carried(self, source: np.ndarray) -> CusumBank:
        """A bank over a new set of series, each continuing one of this bank's or starting afresh.

        Series ``j`` continues this bank's series ``source[j]`` (its calibration, baseline, run and
        alarm), or starts afresh where ``source[j] < 0``. The new bank may take this one's arrays
        over: this bank is not to be used after."""
        source = np.asarray(source, dtype=np.int64)
        fresh = np.flatnonzero(source < 0)
        src = np.where(source >= 0, source, 0)
        # a re-plan that keeps every rank's work mostly recalibrates a few series in place: no
        # gather of the 2-D histories (16 MB each at 16,384 series)
        in_place = len(source) == self.n and bool(
            ((source == np.arange(self.n)) | (source < 0)).all()
        )
        start = CusumBank(1, self.cfg)  # a fresh series' values, broadcast over the fresh ones
        out = copy.copy(self)
        out.n, out.share = len(source), _share(len(source))
        for name, value in vars(self).items():
            if (
                name != "_hist_step"
                and isinstance(value, np.ndarray)
                and value.shape[-1:] == (self.n,)
            ):
                # a gather along the series axis (np.take: several times faster than fancy
                # indexing of the 2-D histories), then the fresh series reset
                moved = value if in_place else np.take(value, src, axis=-1)
                if fresh.size:
                    moved[..., fresh] = getattr(start, name)
                setattr(out, name, moved)
        out._hist_step = self._hist_step.copy()
        out._buffers = None
        out._unstarted = bool((out.first_step < 0).any())
        out._all_calibrated = bool(out.calibrated.all())
        return out

    def recalibrate(self) -> None:
        """Every series learns its baseline afresh, as after a re-plan that moved layers.

        A series in alarm leaves it without a recovery: its episode is not known to have
        ended, and its new baseline is the slow level."""
        cfg = self.cfg
        self._cal[:] = np.nan
        self._cal_step[:] = -1
        self.cal_count[:] = 0
        self.calibrated[:] = False
        self._all_calibrated = False
        self.alarmed[:] = False
        self.s[:] = 0.0
        self.run_n[:] = 0
        self.quiet[:] = 0
        self.down[:] = 0.0
        self.k[:], self.h[:], self.clip[:] = (
            cfg.cusum_k / cfg.sensitivity,
            cfg.cusum_h / cfg.sensitivity,
            cfg.z_clip,
        )
        self.adapted[:] = False
        self._hist[:] = np.nan  # deviations from the old baselines say nothing of the new ones

    def rebase_alarmed(self, i: int, baseline: float) -> None:
        """Take ``baseline`` as series ``i``'s healthy centre, the series in alarm above it.

        Series ``i`` ran above ``baseline`` since calibration: it is held alarmed at its calibrated
        level, so that its recovery is found."""
        self.alarmed[i] = True
        self.alarm_sum[i] = self.mu[i] - baseline
        self.alarm_n[i] = 1
        self.quiet[i] = 0
        self.mu[i] = baseline

    def update(self, step: int, x: np.ndarray) -> tuple[list[Alarm], list[Recovery], np.ndarray]:
        """Feed one step; returns new alarms, recoveries and the indices calibrated at this step."""
        cfg = self.cfg
        seen = ~np.isnan(x)
        if self._unstarted:
            self.first_step[seen & (self.first_step < 0)] = step
            self._unstarted = bool((self.first_step < 0).any())
        newly, risen = self._calibrate(step, x, seen)
        if self._all_calibrated and not newly.size:
            live = seen
        else:
            live = seen & self.calibrated
            live[newly] = False
        all_live = bool(live.all())
        if not all_live and not live.any():
            return risen, [], newly
        # whole arrays masked to the live series (most are, most steps: cheaper than gathers),
        # computed in place: at 16,384 series each temporary costs about as much as its arithmetic
        slot = step % _HISTORY
        dev = self._hist[slot]
        np.subtract(x, self.mu, out=dev)
        if not all_live:
            dev[~live] = np.nan
        self._hist_step[slot] = step
        tmp = self._scratch()
        z = np.divide(dev, self.sigma, out=tmp[0])
        k, h = self.k, self.h
        # np.minimum/np.maximum, not np.clip: the same values, several times faster with array
        # bounds
        clipped = np.maximum(z, np.negative(self.clip, out=tmp[1]), out=tmp[1])
        np.minimum(clipped, self.clip, out=clipped)
        s_new = np.add(self.s, clipped)
        np.subtract(s_new, k, out=s_new)
        np.maximum(0.0, s_new, out=s_new)
        if not all_live:
            np.copyto(s_new, self.s, where=~live)
        in_run = live & (s_new > 0)
        alarmed = self.alarmed.copy()  # as before this step's alarms
        # the run and alarm bookkeeping, on the series in a run, leaving one or in alarm only (a
        # few, most steps): a series out of a run has no run to count (its run_n is 0 already)
        a = np.flatnonzero(live & (in_run | (self.s > 0) | alarmed))
        ar, da = in_run[a], dev[a]
        start_idx = a[ar & (self.s[a] == 0)]
        self.run_start[start_idx] = step
        self.run_n[start_idx] = 0
        self.run_sum[start_idx] = 0.0
        self.raised_sum[start_idx] = 0.0
        self.raised_n[start_idx] = 0
        self.run_n[a] += ar
        self.run_sum[a] += np.where(ar, da, 0.0)
        up = ar & (z[a] > k[a])
        self.raised_sum[a] += np.where(up, da, 0.0)
        self.raised_n[a] += up
        self.run_n[a[~ar]] = 0
        self.s = s_new

        # healthy and not in a run: the baseline follows slow drift (clipped so outliers barely move
        # it)
        calm = live & ~alarmed & ~in_run
        if cfg.baseline_rate > 0 and calm.any():
            rate = cfg.baseline_rate
            bound = np.multiply(3, self.sigma, out=tmp[0])
            step_dev = np.maximum(dev, np.negative(bound, out=tmp[1]), out=tmp[1])
            np.minimum(step_dev, bound, out=step_dev)
            moved = np.multiply(rate, step_dev, out=tmp[0])
            np.add(self.mu, moved, out=moved)
            np.copyto(self.mu, moved, where=calm)
            # the spread is learned on as well (a few calibration steps can understate it), but
            # never below what calibration measured
            var = np.square(self.sigma, out=tmp[0])
            np.multiply(1 - rate, var, out=var)
            dev2 = np.square(step_dev, out=tmp[1])
            np.multiply(rate, dev2, out=dev2)
            np.add(var, dev2, out=var)
            np.sqrt(var, out=var)
            np.maximum(var, self._sigma0, out=var)
            np.copyto(self.sigma, var, where=calm)

        alarms: list[Alarm] = risen
        rn = self.raised_n[a]
        mean_raised = np.where(rn > 0, self.raised_sum[a] / np.maximum(rn, 1), 0.0)
        # a noisy series: the run's mean, every step of it (the raised steps alone overstate it)
        rmean = self.run_sum[a] / np.maximum(self.run_n[a], 1)
        level = np.where(self.adapted[a], rmean, mean_raised)
        fire = (
            ~alarmed[a]
            & (s_new[a] >= h[a])
            & (rn >= cfg.min_persist)
            & (level >= self._log_min * self.share)
        )
        for j in np.flatnonzero(fire).tolist():
            i = int(a[j])
            n_up = int(rn[j])
            # how far the raised steps sit above the noise, beyond what the threshold itself demands
            t = mean_raised[j] / self.sigma[i] * np.sqrt(n_up) - k[i]
            conf = float(0.5 * (1 + _erf(t / np.sqrt(2))))
            onset, shift_sum, shift_n = self._onset(i, step)
            if self.adapted[i]:  # a noisy series: the mean of every step since the onset
                self.alarm_sum[i], self.alarm_n[i] = shift_sum, shift_n
                est = shift_sum / shift_n
            else:
                self.alarm_sum[i], self.alarm_n[i] = self.raised_sum[i], n_up
                est = level[j]
            alarms.append(Alarm(i, onset, float(np.exp(est / self.share)), conf))
            self.alarmed[i] = True
            self.down[i] = 0.0
            self.quiet[i] = 0

        recoveries: list[Recovery] = []
        was = alarmed[a] & ~fire
        if was.any():
            a = a[was]
            d = dev[a]
            still = d > self._log_min / 2 * self.share
            # a noisy series recovers when a CUSUM of its fall from the alarmed level crosses h
            ad = self.adapted[a]
            if ad.any():
                fall = (self.alarm_sum[a] / np.maximum(self.alarm_n[a], 1) - d) / self.sigma[a]
                fall = np.clip(fall, -self.clip[a], self.clip[a]) - self.k[a]
                self.down[a] = np.where(ad, np.maximum(0.0, self.down[a] + fall), 0.0)
                still = np.where(ad, self.down[a] < self.h[a], still)
            # a noisy series' estimate is the mean of all its alarmed steps
            counted = still | ad
            self.alarm_sum[a[counted]] += d[counted]
            self.alarm_n[a[counted]] += 1
            quiet = a[~still]
            fresh = quiet[self.quiet[quiet] == 0]
            self.last_quiet_start[fresh] = step
            self.quiet[quiet] += 1
            self.quiet[a[still]] = 0
            for i in quiet[self.quiet[quiet] >= cfg.recover_steps]:
                i = int(i)
                recoveries.append(
                    Recovery(i, int(self.last_quiet_start[i]) - 1, self.episode_slowdown(i))
                )
                self.alarmed[i] = False
                self.down[i] = 0.0
                self.s[i] = 0.0
                self.run_n[i] = 0
                self.quiet[i] = 0
        return alarms, recoveries, newly

    def _onset(self, i: int, step: int) -> tuple[int, float, int]:
        """Where series ``i``'s raised level most likely began, among the steps since its sum last
        left zero (those still in the history), and the sum and count of its deviations since then:
        the start ``t`` maximising ``S_t^2 / n_t`` with ``S_t > 0`` (``S_t``, ``n_t``: sum and count
        of the deviations from ``t`` on), the likelihood ratio of a shift of unknown size from ``t``
        against none, for Gaussian steps around the calibrated centre."""
        first = max(int(self.run_start[i]), step - _HISTORY + 1)
        steps = np.arange(first, step + 1)
        rows = steps % _HISTORY
        v = np.where(self._hist_step[rows] == steps, self._hist[rows, i], np.nan)
        seen = ~np.isnan(v)
        steps, v = steps[seen], v[seen]
        tail_sum = np.cumsum(v[::-1])[::-1]
        tail_n = np.arange(len(v), 0, -1)
        score = np.where(tail_sum > 0, tail_sum**2 / tail_n, -np.inf)
        best = int(np.argmax(score))
        return int(steps[best]), float(tail_sum[best]), int(tail_n[best])

    def level_since(self, i: int, onset: int) -> float | None:
        """Series ``i``'s mean deviation from step ``onset`` on, as a ratio; None without any steps.

        Over its observed steps still in the history: the level a shift begun at ``onset`` has
        had."""
        order = np.argsort(self._hist_step)
        steps, v = self._hist_step[order], self._hist[order, i]
        v = v[(steps >= onset) & ~np.isnan(v)]
        return float(np.exp(np.mean(v) / self.share)) if v.size else None

    def episode_slowdown(self, i: int) -> float:
        """Mean slowdown over the raised steps of the current alarm of series ``i``."""
        return float(np.exp(self.alarm_sum[i] / max(self.alarm_n[i], 1) / self.share))

    def recent_slowdown(self, i: int, steps: int) -> float | None:
        """Series ``i``'s slowdown over its last ``steps`` observed steps; None unless in alarm.

        The median deviation from its baseline, so one noisy step does not move it; out of alarm,
        as after a recalibration, its baseline is the slow level and its deviations say
        nothing."""
        return self._recent(i, steps, 1) if self.alarmed[i] else None

    def recent_level(self, i: int, steps: int) -> float | None:
        """Series ``i``'s level over its last ``steps`` observed steps against its baseline.

        The median deviation (below 1: faster than the baseline), in alarm or not; None until that
        many steps were observed since it was calibrated. The one-sided test finds rises only:
        this is how a fall below the baseline is seen."""
        return self._recent(i, steps, steps) if self.calibrated[i] else None

    def _recent(self, i: int, steps: int, least: int) -> float | None:
        """The median of series ``i``'s last ``steps`` deviations as a ratio; None with fewer than
        ``least`` of them."""
        v = self._hist[:, i][np.argsort(self._hist_step)]
        v = v[~np.isnan(v)][-steps:]
        return float(np.exp(np.median(v) / self.share)) if len(v) >= least else None

    @property
    def calibrated_sigma(self) -> np.ndarray:
        """Each series' spread as calibrated (before it was learned on)."""
        return self._sigma0

    def min_detectable(self) -> np.ndarray:
        """Per series, the smallest slowdown found within ``detect_within`` steps at its noise.

        At its noise as calibrated (NaN before calibration): the shift whose CUSUM drift ``shift -
        k`` covers ``h`` (plus Siegmund's overshoot) in that many steps, and at least
        ``min_slowdown``."""
        cfg = self.cfg
        shift = self.k + (self.h + _OVERSHOOT) / cfg.detect_within  # in sigmas
        out = np.exp(np.maximum(shift * self._sigma0 / self.share, self._log_min))
        return np.where(self.calibrated, out, np.nan)

    def _set_thresholds(self, done: np.ndarray) -> None:
        """Thresholds of the series just calibrated, from their noise (see the module doc)."""
        cfg = self.cfg
        sens = cfg.sensitivity
        # a few calibration steps understate the noise as often as not: a noisy series is judged
        # with its spread raised by the standard error of a MAD over that many steps
        inflate = 1 + 1.7 / np.sqrt(cfg.calibration_steps)
        target = np.log(cfg.target_slowdown) * self.share / self.sigma[done]  # in sigmas
        # noisy: the configured thresholds would not find the target within detect_within steps
        noisy = target < cfg.cusum_k + (cfg.cusum_h + _OVERSHOOT) / cfg.detect_within
        target = np.where(noisy, target / inflate, target)
        # half the target's shift, plus the error of the calibrated centre (a median of that many
        # steps), which would otherwise eat into the allowance of every healthy step
        k = np.where(noisy, target / 2 + 1.25 / np.sqrt(cfg.calibration_steps), cfg.cusum_k)
        h = np.full(len(k), float(cfg.cusum_h))
        h[noisy] = _cusum_h_for(k[noisy], cfg.false_alarm_steps)  # a bisection: only where used
        self.k[done] = k / sens
        self.h[done] = h / sens
        # a noisy series' steps are clipped closer (heavy tails), but never to within a sigma of k
        self.clip[done] = np.where(
            noisy, np.maximum(min(cfg.noisy_z_clip, cfg.z_clip), k / sens + 1), cfg.z_clip
        )
        self.adapted[done] = noisy

    def _calibrate(
        self, step: int, x: np.ndarray, seen: np.ndarray
    ) -> tuple[np.ndarray, list[Alarm]]:
        """Fill the calibration windows; the series whose window filled at this step calibrated,
        and the alarms of those whose level rose inside it (``_risen``)."""
        cfg = self.cfg
        if self._all_calibrated:
            return np.empty(0, dtype=np.int64), []
        filling = np.flatnonzero(seen & ~self.calibrated)
        if filling.size == 0:
            return filling, []
        self._cal[self.cal_count[filling], filling] = x[filling]
        self._cal_step[self.cal_count[filling], filling] = step
        self.cal_count[filling] += 1
        done = filling[self.cal_count[filling] >= cfg.calibration_steps]
        if not done.size:
            return done, []
        cal = self._cal[:, done]
        med = np.median(cal, axis=0)
        mad = np.median(np.abs(cal - med), axis=0) * _MAD_TO_SIGMA
        self.mu[done] = med
        self.sigma[done] = np.maximum(mad, cfg.sigma_floor)
        self.calibrated[done] = True
        self._all_calibrated = bool(self.calibrated.all())
        risen = self._risen(done) if self.rises else np.empty((0, 2), dtype=np.int64)
        # a rank's own few steps can understate its noise: never below the typical rank's
        pooled = float(np.median(self.sigma[self.calibrated]))
        self.sigma[self.calibrated] = np.maximum(
            self.sigma[self.calibrated], cfg.pooled_sigma * pooled
        )
        self._sigma0[self.calibrated] = self.sigma[self.calibrated]
        self._set_thresholds(np.flatnonzero(self.calibrated))
        return done, self._risen_alarms(risen)

    def _risen(self, done: np.ndarray) -> np.ndarray:
        """Among the series just calibrated, those whose window holds a rise (module doc): each
        re-centred on its steps before the split, its spread from both levels' residuals, and its
        alarm's sum and count set from the steps after; returned as (series, split row)."""
        cfg = self.cfg
        w = cfg.calibration_steps
        head_min, tail_min = _HEAD_MIN, max(cfg.min_persist, 1)
        splits = np.arange(head_min, w - tail_min + 1)
        if not splits.size:
            return np.empty((0, 2), dtype=np.int64)
        cal = self._cal[:, done]
        costs, heads, tails = [], [], []
        for t in splits:  # a few splits, each vectorised over every series
            head, tail = np.median(cal[:t], axis=0), np.median(cal[t:], axis=0)
            heads.append(head)
            tails.append(tail)
            costs.append(np.abs(cal[:t] - head).sum(axis=0) + np.abs(cal[t:] - tail).sum(axis=0))
        best = np.argmin(np.array(costs), axis=0)
        cols = np.arange(done.size)
        head, tail = np.array(heads)[best, cols], np.array(tails)[best, cols]
        split = splits[best]
        rows = np.arange(w)[:, None]
        after = rows >= split
        resid = cal - np.where(after, tail, head)
        own = np.median(np.abs(resid), axis=0) * _MAD_TO_SIGMA
        # the typical series' spread, each just calibrated counted at its two-level fit's (the
        # windows with a rise in them would otherwise inflate it)
        earlier = self.calibrated.copy()
        earlier[done] = False
        pooled = cfg.pooled_sigma * float(np.median(np.concatenate([self.sigma[earlier], own])))
        sigma = np.maximum(own, max(cfg.sigma_floor, pooled))
        # the rise as the CUSUM would have judged it from the split on, at the configured thresholds
        # (not a noisy series' adapted ones: fitted to its own few steps, two levels understate
        # its spread, and the best of several splits is chosen; the adapted thresholds raised
        # 0.6-2% false alarms on series of 25-40% noise where these raised none)
        sens = cfg.sensitivity
        k, h = cfg.cusum_k / sens, cfg.cusum_h / sens
        z = np.clip((cal - head) / sigma, -cfg.z_clip, cfg.z_clip)
        drift = np.where(after, z - k, 0.0).sum(axis=0)
        raised = (after & (z > k)).sum(axis=0)
        rise_sum = np.where(after, cal - head, 0.0).sum(axis=0)
        rise = rise_sum / (w - split)
        hit = np.flatnonzero(
            (drift >= h)
            & (raised >= cfg.min_persist)
            & (tail - head >= self._log_min * self.share)
            & (rise > 0)
        )
        out = []
        for j in hit.tolist():
            i, t = int(done[j]), int(split[j])
            self.mu[i] = head[j]
            self.sigma[i] = sigma[j]
            self.alarmed[i] = True
            self.alarm_sum[i] = float(rise_sum[j])
            self.alarm_n[i] = w - t
            self.quiet[i] = 0
            self.down[i] = 0.0
            out.append((i, t))
        return np.array(out, dtype=np.int64).reshape(-1, 2)

    def _risen_alarms(self, risen: np.ndarray) -> list[Alarm]:
        """The alarms of the series ``_risen`` found, once their thresholds are set: the onset is
        the split's step, the slowdown the mean rise after it."""
        out = []
        for i, t in risen.tolist():
            n_up = int(self.alarm_n[i])
            mean = self.alarm_sum[i] / n_up
            conf = float(
                0.5 * (1 + _erf((mean / self.sigma[i] * np.sqrt(n_up) - self.k[i]) / np.sqrt(2)))
            )
            out.append(Alarm(i, int(self._cal_step[t, i]), float(np.exp(mean / self.share)), conf))
        return out


def _share(n: int) -> float:
    """What a slowdown of one of ``n`` series moves its own value by: its log value is taken
    against the median over series each step, and with two that median moves half-way with it."""
    return 0.5 if n == 2 else 1.0


_HISTORY = 128  # steps of deviations kept per series to place an onset
_HEAD_MIN = 4  # the fewest calibration steps before a rise inside the window to re-centre on
_OVERSHOOT = 1.166  # Siegmund's correction of the CUSUM threshold for Gaussian steps


def _cusum_h_for(k: np.ndarray, run_length: float) -> np.ndarray:
    """The threshold ``h`` at which a CUSUM with allowance ``k`` (in sigmas) on healthy Gaussian
    steps runs ``run_length`` steps on average before a false alarm (Siegmund:
    ``(exp(2kb) - 2kb - 1) / (2k^2)`` with ``b = h + 1.166``), solved by bisection on ``b``."""
    k = np.maximum(np.asarray(k, dtype=np.float64), 1e-3)
    lo, hi = np.zeros_like(k), np.full_like(k, 1e4)
    for _ in range(60):
        b = (lo + hi) / 2
        x = np.minimum(2 * k * b, 700.0)
        arl = (np.exp(x) - x - 1) / (2 * k * k)
        big = arl > run_length
        hi = np.where(big, b, hi)
        lo = np.where(big, lo, b)
    return np.maximum((lo + hi) / 2 - _OVERSHOOT, 1.0)


def _erf(x: float) -> float:
    return math.erf(float(x))
