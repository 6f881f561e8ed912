"""Detector parameters, validated up front."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from resihp.errors import InputError

DEFAULT_STEP_TIME_S = 1.0  # the step time ``detect-eval`` states false alarms per day at


@dataclass(frozen=True)
class DetectorConfig:
    """Thresholds of the workload-aware detector.

    Per-step deviations are measured in units of each rank's own healthy noise (``sigma``, learned
    over the first ``calibration_steps`` steps a rank is seen), so the same numbers serve a noisy
    CPU job and a quiet GPU job.

    A quiet rank is tested with ``cusum_k``/``cusum_h``. A noisy rank (one where a
    ``target_slowdown`` moves its value by less than ``cusum_k`` of its sigmas, so that the
    configured allowance would swallow it and the CUSUM never grow) gets thresholds of its own, from
    its calibration window's dispersion: the allowance is half the target's shift (``k = log(target)
    / sigma / 2``), and the decision threshold is set so that a healthy rank would raise a false
    alarm about once in ``false_alarm_steps`` steps under Gaussian noise (Siegmund's approximation
    of the CUSUM's run length; the calibrated centre's own error and the baseline's drift-following
    make real rates higher, hence the large default). The allowance also covers the error of a
    centre calibrated on ``calibration_steps`` steps. Each rank's
    smallest slowdown found within ``detect_within`` steps at its noise is reported
    (``min_detectable_slowdown``). ``sensitivity`` divides every allowance and threshold: above 1
    finds smaller slowdowns sooner at more risk of false alarms; below 1, the reverse.
    """

    calibration_steps: int = 20
    # one-sided CUSUM on the standardised log own-work ratio: drift allowance and decision threshold
    cusum_k: float = 3.0
    cusum_h: float = 14.0
    # a single step can add at most this much to the CUSUM, so one wild step never alarms alone
    z_clip: float = 8.0
    min_persist: int = 3
    # an alarm needs an estimated slowdown at least this large (tiny persistent drifts are not
    # faults)
    min_slowdown: float = 1.08
    # the effect-size floor: no fail-slow or link-slow is raised whose measured factor (x slower
    # than expected) is below it; a test that alarms below it is held until the factor reaches it
    alarm_floor: float = 1.25
    sigma_floor: float = 0.01
    # no rank's noise is taken as less than this fraction of the typical rank's
    pooled_sigma: float = 1.0
    # the baseline follows slow healthy drift at this rate (per step, in healthy stretches only)
    baseline_rate: float = 0.02
    recover_steps: int = 3
    # among a rank's compute ops in one step, this quantile of measured/expected is its own-work
    # ratio; a low quantile ignores the ops that were inflated by waiting on a slow neighbour
    own_quantile: float = 0.1
    stage_imbalance: float = 0.10
    rank_imbalance: float = 0.15
    workload_imbalance: float = 0.15
    # noise-adapted thresholds (see the class doc)
    sensitivity: float = 1.0
    target_slowdown: float = 2.0
    false_alarm_steps: float = 1e7
    detect_within: int = 10
    # z of one step is clipped to this on a noisy rank (heavy-tailed noise: single wild steps)
    noisy_z_clip: float = 3.0
    # each phase (forward, backward, optimizer) also tested on its own; such an alarm needs a
    # slowdown of the phase at least this large
    phases: bool = True
    phase_min_slowdown: float = 1.5
    # with one pipeline stage and no trained predictor, each phase's cost is fitted on the job's
    # own calibration window (``fitted``), not taken from analytic FLOPs
    fit_cost: bool = True

    def __post_init__(self) -> None:
        positive = [
            "calibration_steps",
            "cusum_k",
            "cusum_h",
            "z_clip",
            "min_persist",
            "sigma_floor",
            "recover_steps",
            "sensitivity",
            "false_alarm_steps",
            "detect_within",
            "noisy_z_clip",
        ]
        for name in positive:
            if not 0 < getattr(self, name) < math.inf:
                raise InputError(
                    f"detector config: {name} must be a positive finite number, got "
                    f"{getattr(self, name)!r}"
                )
        if self.calibration_steps < 3:
            raise InputError("detector config: calibration_steps must be at least 3")
        if not 0 <= self.own_quantile <= 1:
            raise InputError(
                f"detector config: own_quantile must be in [0, 1], got {self.own_quantile}"
            )
        if not 0 <= self.baseline_rate < 1:
            raise InputError(
                f"detector config: baseline_rate must be in [0, 1), got {self.baseline_rate}"
            )
        if self.min_slowdown < 1:
            raise InputError(f"detector config: min_slowdown must be >= 1, got {self.min_slowdown}")
        floor = self.alarm_floor
        number = isinstance(floor, (int, float)) and not isinstance(floor, bool)
        if not number or not 1 <= floor < math.inf:
            raise InputError(
                "detector config: alarm_floor must be a finite factor >= 1 (x slower "
                f"than expected, e.g. 1.25), got {floor!r}"
            )
        for name in ("target_slowdown", "phase_min_slowdown"):
            if not getattr(self, name) > 1:
                raise InputError(
                    f"detector config: {name} must be above 1, got {getattr(self, name)!r}"
                )
        if self.z_clip <= self.cusum_k:
            raise InputError("detector config: z_clip must exceed cusum_k")

    def to_dict(self) -> dict:
        return asdict(self)
