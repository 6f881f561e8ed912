"""The error budget of each CUSUM series: false-alarm run length, delays and Lorden's bound.

A series is tested on its standardised log value ``z`` (its calibrated noise ``sigma``), each step
adding ``clip(z, -c, c) - k`` to a sum floored at zero, an alarm at ``h``. The increments' mean and
variance are those of a clipped Gaussian (exact); the run lengths follow Siegmund's approximation
for a random walk of such increments, normalised to unit variance:
``ARL = (exp(-2 D b) + 2 D b - 1) / (2 D^2)``, ``D`` the normalised drift, ``b = h' + 1.166``.
``ARL0`` (no shift) is the expected steps between false alarms; the delay of a slowdown ``f`` is
the run length at a shift of ``log(f)`` (its share of the series) and at least ``min_persist`` and
``h / (c - k)`` steps (no step adds more). Lorden's bound on any test with that ``ARL0``:
``delay >= 2 sigma^2 ln(ARL0) / log(f)^2`` (first order in ``ln ARL0``: at a shift near the noise
the approximate delay can fall under it, a ratio below 1).
"""

from __future__ import annotations

import math

import numpy as np

from resihp.detect.changepoint import _OVERSHOOT, CusumBank

FACTORS = (1.5, 2.0)


def clipped_moments(shift: float, clip: float) -> tuple[float, float]:
    """Mean and variance of ``clip(Z + shift, -clip, clip)`` for a standard Gaussian ``Z``."""
    a, b = -clip - shift, clip - shift  # the clip's bounds in units of Z

    def pdf(x: float) -> float:
        return math.exp(-x * x / 2) / math.sqrt(2 * math.pi)

    def cdf(x: float) -> float:
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    inside = cdf(b) - cdf(a)
    m1 = pdf(a) - pdf(b)  # E[Z; a < Z < b]
    m2 = inside + a * pdf(a) - b * pdf(b)  # E[Z^2; a < Z < b]
    mean = shift * inside + m1 - clip * cdf(a) + clip * (1 - cdf(b))
    second = shift * shift * inside + 2 * shift * m1 + m2 + clip * clip * (cdf(a) + 1 - cdf(b))
    return mean, max(second - mean * mean, 1e-12)


def run_length(shift: float, k: float, h: float, clip: float) -> float:
    """Siegmund's expected steps to an alarm of the clipped CUSUM at a standardised ``shift``.

    Args:
        shift: the series' shift in sigmas (0: healthy).
        k: the CUSUM allowance, in sigmas.
        h: the decision threshold, in sigmas.
        clip: the per-step clip of standardised values.
    """
    mean, var = clipped_moments(shift, clip)
    sd = math.sqrt(var)
    drift, b = (mean - k) / sd, h / sd + _OVERSHOOT
    if abs(drift) < 1e-9:
        return b * b
    x = -2 * drift * b
    if x > 700:
        return math.inf
    return (math.exp(x) - x - 1) / (2 * drift * drift)


def series_budget(
    sigma: float,
    k: float,
    h: float,
    clip: float,
    share: float = 1.0,
    min_persist: int = 1,
    floor: float = 1.0,
) -> dict:
    """The budget of one series of log-noise ``sigma`` (the module doc).

    Args:
        sigma: the series' calibrated log-noise.
        k: the CUSUM allowance, in sigmas.
        h: the decision threshold, in sigmas.
        clip: the per-step clip of standardised values.
        share: the part of the series' value the slowed work is (a phase's share of its rank's).
        min_persist: raised steps an alarm needs.
        floor: the least factor an alarm is raised for; below it no delay.
    """
    arl0 = run_length(0.0, k, h, clip)
    out: dict = {
        "sigma": round(float(sigma), 6),
        "k": round(float(k), 4),
        "h": round(float(h), 4),
        "clip": round(float(clip), 4),
        "arl0_steps": _num(arl0),
    }
    least = max(float(min_persist), h / max(clip - k, 1e-9))
    for f in FACTORS:
        shift = math.log(f) * share / sigma
        delay = max(run_length(shift, k, h, clip), least) if f >= floor else math.inf
        bound = 2 * math.log(arl0) / (shift * shift) if arl0 > 1 else 0.0
        tag = f"x{f:g}".replace(".", "_")
        out[f"delay_{tag}_steps"] = _num(delay)
        out[f"lorden_{tag}_steps"] = _num(bound)
        out[f"delay_over_lorden_{tag}"] = _num(delay / bound) if bound > 0 else None
    return out


def bank_budget(bank: CusumBank, floor: float = 1.0) -> dict[int, dict]:
    """Per calibrated series of ``bank``, its budget at its thresholds and calibrated noise."""
    cfg = bank.cfg
    return {
        int(i): series_budget(
            float(bank.calibrated_sigma[i]),
            float(bank.k[i]),
            float(bank.h[i]),
            float(bank.clip[i]),
            bank.share,
            cfg.min_persist,
            floor,
        )
        for i in np.flatnonzero(bank.calibrated & (bank.calibrated_sigma > 0))
    }


def job_arl0(budgets: list[dict]) -> float | None:
    """Expected steps between false alarms of the whole job: its series' alarm rates added.

    Each series is taken as independent."""
    rates = [1 / b["arl0_steps"] for b in budgets if b["arl0_steps"]]
    return _num(1 / sum(rates)) if rates and sum(rates) > 0 else None


def _num(x: float) -> float | None:
    """A finite figure to 4 significant digits; None for infinite (never)."""
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.4g}")
