"""Failure generators driven by published rates and real traces.

- ``llama3``: unexpected interruptions at the rate of the Llama 3 405B pre-training (419 in 54 days
  on 16,384 GPUs; Dubey et al. 2024, Table 5), scaled to the scenario's device count; the cause of
  each is drawn from the table's counts. Hardware causes (GPU, host, network, unplanned maintenance)
  take the device out for ``costs.repair``; software causes (dependency, unknown) only kill the
  process, which comes back after ``costs.restart``.
- ``greyhound``: fail-slows at a given frequency (``per_day``, required: the paper reports how many
  jobs saw one, not a per-device rate), with mean duration and mean slowdown from Greyhound's
  Table 1 for the job's size class (Wu et al., ATC 2025). Durations are exponential around the mean;
  slowdown factors are 1 + exponential around the mean excess, capped at 10x (the paper's compound
  events reach 10% of normal throughput). ``communication`` (a share in [0, 1], or ``greyhound``:
  the paper's mix, 40% network congestion against under 2% computation, so 40/42 of the drawn
  events) makes that share of the events slow links (``link``: the device's network transfers take
  factor x as long; 24 minutes on average, the paper's network-congestion mean) and the rest compute
  slowdowns (the size class's duration); without it every event slows compute.
- ``alibaba``: the per-worker slowdowns of a real Alibaba PAI job over time (worker time / median
  worker, smoothed over 10 iterations), placed on chosen devices, one iteration per
  ``seconds_per_iteration`` of replay time.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from resihp.errors import InputError
from resihp.paths import TRACES
from resihp.replay.noise import worker_times
from resihp.replay.scenario import FailureEvent, Generator, Scenario, parse_duration

LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16384
SOFTWARE_CATEGORIES = ("Dependency", "Unknown")
# Greyhound Table 1: (mean fail-slow duration in minutes, mean job slowdown) per job size class
GREYHOUND_CLASSES = {"1node": (10.0, 0.1179), "4nodes": (24.0, 0.1545), "512gpus": (72.0, 0.3459)}
# Greyhound's causes: network congestion 40% of fail-slows (mean 24 minutes), computation under 2%
GREYHOUND_COMMUNICATION = 0.40 / (0.40 + 0.02)
GREYHOUND_COMMUNICATION_MIN = 24.0


def llama3_causes() -> pd.DataFrame:
    return pd.read_csv(TRACES / "failures" / "llama3_54day_interruptions.csv")


class _Occupancy:
    """Which devices are busy (slow or stopped) over which intervals, to keep events from
    overlapping."""

    def __init__(self, events: list[FailureEvent]) -> None:
        self.busy: dict[int, list[tuple[float, float]]] = {}
        open_at: dict[int, float] = {}
        for e in events:
            if e.kind == "recover":
                self.busy.setdefault(e.device, []).append((open_at.pop(e.device, 0.0), e.at_s))
            else:
                open_at[e.device] = e.at_s
        for dev, start in open_at.items():
            self.busy.setdefault(dev, []).append((start, float("inf")))

    def free(self, device: int, start: float, end: float) -> bool:
        return all(end <= a or start >= b for a, b in self.busy.get(device, []))

    def take(self, device: int, start: float, end: float) -> None:
        self.busy.setdefault(device, []).append((start, end))


def _param(gen: Generator, scenario: Scenario, key: str, default=None, minimum: float = 0.0):
    where = f"{scenario.path}:{gen.line}: generators.{gen.kind}.{key}"
    if key not in gen.params:
        if default is None:
            raise InputError(f"{where}: missing")
        return default
    value = gen.params[key]
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not minimum <= value < math.inf
    ):
        raise InputError(f"{where}: expected a finite number >= {minimum:g}, got {value!r}")
    return float(value)


# the most failures a generator may draw over a scenario (a rate typed with a few zeros too many
# must not stall the replay: 10**6 events take minutes to replay, 10**9 would never end)
MAX_EVENTS = 10**6


def _check_expected(gen: Generator, scenario: Scenario, key: str, per_s: float) -> None:
    expected = per_s * scenario.duration_s
    if expected > MAX_EVENTS:
        raise InputError(
            f"{scenario.path}:{gen.line}: generators.{gen.kind}.{key}: about {expected:,.0f} "
            f"failures over the scenario's {scenario.duration_s / 86400:g} days, more than the "
            f"{MAX_EVENTS:,} a replay takes"
        )


def _check_keys(gen: Generator, scenario: Scenario, allowed: set[str]) -> None:
    unknown = sorted(set(gen.params) - allowed)
    if unknown:
        raise InputError(
            f"{scenario.path}:{gen.line}: generators.{gen.kind}: unknown field(s) "
            f"{', '.join(unknown)} (expected some of {', '.join(sorted(allowed))})"
        )


def _pair(
    events: list[FailureEvent],
    occ: _Occupancy,
    device: int,
    start: float,
    end: float,
    stop_kind: str,
    factor: float,
    cause: str,
    duration_s: float,
) -> bool:
    if not occ.free(device, start, end):
        return False
    occ.take(device, start, end)
    events.append(FailureEvent(start, device, stop_kind, factor, cause=cause))
    if end < duration_s:
        events.append(FailureEvent(end, device, "recover", cause=cause))
    return True


def llama3_events(
    gen: Generator, scenario: Scenario, rng: np.random.Generator, occ: _Occupancy
) -> list[FailureEvent]:
    """The events the scenario's ``llama3`` generator draws (Llama 3 interruptions).

    Args:
        gen: the generator's entry in the scenario (its parameters and line).
        scenario: the scenario (cluster, duration, costs).
        rng: the random generator events are drawn with.
        occ: the devices already busy, so that drawn events do not overlap.
    """
    _check_keys(gen, scenario, {"scale"})
    scale = _param(gen, scenario, "scale", 1.0)
    n = len(scenario.cluster)
    rate_per_s = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 86400.0 * LLAMA3_GPUS) * n * scale
    _check_expected(gen, scenario, "scale", rate_per_s)
    causes = llama3_causes()
    p = causes["count"].to_numpy(np.float64)
    p /= p.sum()
    events: list[FailureEvent] = []
    t = 0.0
    while True:
        t += rng.exponential(1.0 / rate_per_s) if rate_per_s > 0 else float("inf")
        if t >= scenario.duration_s:
            break
        row = causes.iloc[int(rng.choice(len(causes), p=p))]
        software = row["category"] in SOFTWARE_CATEGORIES
        down = scenario.costs.restart_s if software else scenario.costs.repair_s
        for _ in range(32):  # a device already down cannot fail again; draw another
            if _pair(
                events,
                occ,
                int(rng.integers(n)),
                t,
                t + down,
                "stop",
                1.0,
                f"llama3: {row['cause']}",
                scenario.duration_s,
            ):
                break
    return events


def greyhound_events(
    gen: Generator, scenario: Scenario, rng: np.random.Generator, occ: _Occupancy
) -> list[FailureEvent]:
    """The events the scenario's ``greyhound`` generator draws (Greyhound fail-slows).

    Args:
        gen: the generator's entry in the scenario (its parameters and line).
        scenario: the scenario (cluster, duration, costs).
        rng: the random generator events are drawn with.
        occ: the devices already busy, so that drawn events do not overlap.
    """
    _check_keys(gen, scenario, {"per_day", "size_class", "max_factor", "communication"})
    per_day = _param(gen, scenario, "per_day")
    _check_expected(gen, scenario, "per_day", per_day / 86400.0)
    size_class = gen.params.get("size_class", "512gpus")
    if size_class not in GREYHOUND_CLASSES:
        raise InputError(
            f"{scenario.path}:{gen.line}: generators.greyhound.size_class: expected one of "
            f"{', '.join(GREYHOUND_CLASSES)}, got {size_class!r}"
        )
    cap = _param(gen, scenario, "max_factor", 10.0, minimum=1.0)
    if gen.params.get("communication") == "greyhound":
        comm = GREYHOUND_COMMUNICATION
    else:
        comm = _param(gen, scenario, "communication", 0.0)
        if comm > 1.0:
            raise InputError(
                f"{scenario.path}:{gen.line}: generators.greyhound.communication: expected "
                f"a share in [0, 1] or greyhound, got {comm:g}"
            )
    mean_min, mean_slow = GREYHOUND_CLASSES[size_class]
    events: list[FailureEvent] = []
    t = 0.0
    while per_day > 0:
        t += rng.exponential(86400.0 / per_day)
        if t >= scenario.duration_s:
            break
        link = comm > 0 and rng.random() < comm
        length = rng.exponential((GREYHOUND_COMMUNICATION_MIN if link else mean_min) * 60.0)
        factor = float(min(cap, 1.0 + rng.exponential(mean_slow)))
        for _ in range(32):
            if _pair(
                events,
                occ,
                int(rng.integers(len(scenario.cluster))),
                t,
                t + length,
                "link" if link else "slow",
                round(factor, 3),
                f"greyhound {size_class}{' network' if link else ''}",
                scenario.duration_s,
            ):
                break
    return events


def alibaba_events(
    gen: Generator, scenario: Scenario, rng: np.random.Generator, occ: _Occupancy
) -> list[FailureEvent]:
    """The events the scenario's ``alibaba`` generator draws (a real Alibaba PAI job's slowdowns).

    Args:
        gen: the generator's entry in the scenario (its parameters and line).
        scenario: the scenario (cluster, duration, costs).
        rng: the random generator events are drawn with.
        occ: the devices already busy, so that drawn events do not overlap.
    """
    _check_keys(gen, scenario, {"job", "devices", "seconds_per_iteration", "start", "threshold"})
    where = f"{scenario.path}:{gen.line}: generators.alibaba"
    job = int(_param(gen, scenario, "job", minimum=1))
    devices = gen.params.get("devices")
    if not isinstance(devices, list) or not all(
        isinstance(d, int) and 0 <= d < len(scenario.cluster) for d in devices
    ):
        raise InputError(
            f"{where}.devices: expected a list of device ids in 0..{len(scenario.cluster) - 1}"
        )
    per_iter = _param(gen, scenario, "seconds_per_iteration", minimum=1e-9)
    start = parse_duration(gen.params.get("start", 0), f"{where}.start")
    threshold = _param(gen, scenario, "threshold", 1.1, minimum=1.0)
    times = worker_times(job)
    if len(devices) < times.shape[1]:
        raise InputError(
            f"{where}.devices: job {job} has {times.shape[1]} workers; give that many devices"
        )
    ratio = times.div(times.median(axis=1), axis=0).rolling(10, min_periods=1).median()
    events: list[FailureEvent] = []
    for col, dev in zip(ratio.columns, devices):
        series = ratio[col].to_numpy()
        slow = series >= threshold
        edges = np.flatnonzero(np.diff(np.concatenate(([0], slow.astype(int), [0]))))
        for a, b in zip(edges[::2], edges[1::2]):
            t0, t1 = start + a * per_iter, start + b * per_iter
            if t0 >= scenario.duration_s:
                continue
            _pair(
                events,
                occ,
                int(dev),
                t0,
                t1,
                "slow",
                round(float(np.median(series[a:b])), 3),
                f"alibaba job {job} worker {col}",
                scenario.duration_s,
            )
    return events


GENERATOR_FUNCS = {
    "llama3": llama3_events,
    "greyhound": greyhound_events,
    "alibaba": alibaba_events,
}


def scenario_events(scenario: Scenario, seed: int | None = None) -> list[FailureEvent]:
    """The scenario's explicit events plus those its generators draw, in time order."""
    rng = np.random.default_rng(scenario.seed if seed is None else seed)
    events = list(scenario.events)
    occ = _Occupancy(events)
    for gen in scenario.generators:
        events += GENERATOR_FUNCS[gen.kind](gen, scenario, rng, occ)
    order = {"recover": 0, "slow": 1, "link": 1, "stop": 2}
    return sorted(events, key=lambda e: (e.at_s, order[e.kind], e.device))
