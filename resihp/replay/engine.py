"""Step-level discrete-event replay of a hybrid-parallel job, vectorised across devices.

Steps are simulated by ``resihp.replay.simulator``; this module advances time through events and
policy actions and accounts tokens, downtime, lost work and detections.

Cost per replayed step does not grow with the number of steps: time advances in segments between
events (failures, recoveries, policy actions). Inside a segment the layout and device speeds are
constant, and the only variation is the i.i.d. draw of micro-batches and noise. The engine simulates
``window_steps`` steps in full (and hands them, with their ops records, to the policy), for
``observe_steps`` steps after every change and for one window every ``probe_interval`` (so detectors
also see long healthy stretches, where false alarms happen); between those windows it extrapolates
the rest of the segment at the mean throughput of the last simulated window of the same state. What
is extrapolated is therefore exactly the stretches in which nothing changes; policies see a trace
with gaps between step numbers there, as docs/DESIGN.md allows for sampled traces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from resihp.replay.costmodel import MicroBatchPool
from resihp.replay.failures import scenario_events
from resihp.replay.interface import Context, Detection, Policy, Reaction, Window
from resihp.replay.layout import compile_layout
from resihp.replay.scenario import FailureEvent, Scenario
from resihp.replay.simulator import Simulator, op_end_times, shared_pool

__all__ = [
    "Context",
    "Detection",
    "ReplayOutcome",
    "Policy",
    "Reaction",
    "Replay",
    "Window",
    "op_end_times",
    "shared_pool",
]


@dataclass
class ReplayOutcome:
    """Everything a replay of one policy measured."""

    policy: str
    duration_s: float
    tokens: float
    capacity_tokens: float
    downtime_s: float
    lost_s: float
    timeline: list[tuple[float, float, float]]  # (start, end, tokens/s)
    capacity_timeline: list[tuple[float, float, float]]
    actions: list[tuple[float, str]]
    detections: list[dict]
    simulated_steps: int
    replayed_steps: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.duration_s

    @property
    def bound_fraction(self) -> float:
        return self.tokens / self.capacity_tokens if self.capacity_tokens > 0 else float("nan")

    @property
    def effective_time(self) -> float:
        return max(0.0, 1.0 - (self.downtime_s + self.lost_s) / self.duration_s)

    @property
    def false_alarms(self) -> int:
        return sum(1 for d in self.detections if not d["true"])


class Replay:
    """Replays one scenario under one policy; ``run()`` returns the ``ReplayOutcome``."""

    def __init__(
        self,
        scenario: Scenario,
        policy: Policy,
        seed: int | None = None,
        events: list[FailureEvent] | None = None,
        pool: MicroBatchPool | None = None,
    ) -> None:
        self.scenario = scenario
        self.policy = policy
        seed = scenario.seed if seed is None else seed
        self.rng = np.random.default_rng(seed + 1)
        self.pool = pool or shared_pool(scenario)
        self.events = scenario_events(scenario, seed) if events is None else events
        self.ctx = Context(scenario, self.pool)
        self.sim = Simulator(scenario, self.pool, self.rng)

    def healthy_tokens_per_s(self) -> float:
        layout = self.ctx.uniform_layout(set())
        w = self.sim.window(
            compile_layout(layout),
            np.ones(len(self.scenario.cluster)),
            4 * self.scenario.settings.window_steps,
            0,
            0.0,
        )
        return float(w.tokens.sum() / w.step_time.sum())

    def run(self, on_progress: Callable[[float], None] | None = None) -> ReplayOutcome:
        sc, ctx, st = self.scenario, self.ctx, self.scenario.settings
        n = len(sc.cluster)
        speeds = np.ones(n)
        links = np.ones(n)  # each device's network link: a fraction of its bandwidth
        ctx._bench = lambda device: float(speeds[device])  # the true speed now (updated in place)
        ctx._bench_link = lambda a, b: float(min(links[a], links[b]))
        base_tps = self.healthy_tokens_per_s()
        job_n = len(ctx.job_devices)
        t, tokens, downtime, lost = 0.0, 0.0, 0.0, 0.0
        timeline: list[tuple[float, float, float]] = []
        capacity: list[tuple[float, float, float]] = []
        actions: list[tuple[float, str]] = []
        detections: list[dict] = []
        history: list[tuple[float, float]] = [(0.0, 0.0)]  # (time, tokens) for checkpoint rollback
        slow_since: dict[int, float] = {}
        detected: set[tuple] = set()
        simulated = 0
        replayed = 0.0
        layout = self.policy.start(ctx)
        ctx.layout = layout
        compiled = compile_layout(layout)
        actions.append((0.0, f"start: {layout.note}"))
        restart_s = 0.0  # the job's last (re)start: a checkpoint exists from then on
        observe_left = st.observe_steps
        next_probe = st.probe_interval_s
        cached: tuple[float, float] | None = None  # (tokens/s, mean step s) of the current state
        ei = 0
        events = self.events

        def tokens_at(time: float) -> float:
            times = np.array([h[0] for h in history])
            toks = np.array([h[1] for h in history])
            return float(np.interp(time, times, toks))

        def advance(t0: float, t1: float, tps: float) -> None:
            nonlocal tokens
            if t1 <= t0:
                return
            tokens += (t1 - t0) * tps
            if timeline and timeline[-1][2] == tps and timeline[-1][1] == t0:
                timeline[-1] = (timeline[-1][0], t1, tps)
            else:
                timeline.append((t0, t1, tps))
            history.append((t1, tokens))
            cap = base_tps * min(1.0, float(speeds[ctx.job_devices].sum()) / job_n)
            capacity.append((t0, t1, cap))

        def apply(reaction: Reaction | None, label: str) -> None:
            nonlocal t, tokens, downtime, lost, layout, compiled, restart_s, observe_left, cached
            if reaction is None:
                return
            for d in reaction.detections:
                truth = d.device is None and any(s < d.time_s for s in slow_since.values())
                truth = truth or (d.device in slow_since) or (d.device in ctx.known_dead)
                # a slow link: either end may be the slow one
                at = d.peer if d.peer in slow_since and d.device not in slow_since else d.device
                truth = truth or at in slow_since
                # the delay counts once per slow episode: from its onset to its first detection
                episode = (at, slow_since.get(at))
                delay = None
                if at in slow_since and episode not in detected:
                    delay = d.time_s - slow_since[at]
                    detected.add(episode)
                detections.append(
                    {
                        "time_s": d.time_s,
                        "step": d.step,
                        "kind": d.kind,
                        "device": d.device,
                        "slowdown": d.slowdown,
                        "true": bool(truth),
                        "delay_s": delay,
                    }
                )
            if reaction.rollback:
                ckpt = max(
                    restart_s,
                    np.floor(t / sc.costs.checkpoint_interval_s) * sc.costs.checkpoint_interval_s,
                )
                lost_tokens = tokens - tokens_at(ckpt)
                lost_time = t - ckpt
                tokens -= lost_tokens
                lost += lost_time
                history.append((t, tokens))
            pause = min(reaction.downtime_s + reaction.migration_s, sc.duration_s - t)
            if pause > 0:
                advance(t, t + pause, 0.0)
                downtime += pause
                t += pause
            if reaction.rollback:
                restart_s = t
                ctx.last_checkpoint_s = t
            if reaction.layout is None and pause <= 0 and not reaction.rollback:
                return  # seen and ignored: nothing changes
            if reaction.layout is not None:
                layout = reaction.layout
                ctx.layout = layout
                compiled = compile_layout(layout)
            actions.append(
                (t, f"{label}: {reaction.label or (layout.note if reaction.layout else '')}")
            )
            observe_left = st.observe_steps
            cached = None

        while t < sc.duration_s:
            while ei < len(events) and events[ei].at_s <= t:
                batch_t = events[ei].at_s
                stopped, returned = [], []
                while ei < len(events) and events[ei].at_s == batch_t:
                    e = events[ei]
                    ei += 1
                    if e.kind == "slow":
                        speeds[e.device] = 1.0 / e.factor
                        slow_since[e.device] = e.at_s
                    elif e.kind == "link":  # its transfers slow, its compute not
                        links[e.device] = 1.0 / e.factor
                        slow_since[e.device] = e.at_s
                    elif e.kind == "stop":
                        speeds[e.device] = 0.0
                        slow_since.pop(e.device, None)
                        stopped.append(e.device)
                    else:
                        if speeds[e.device] == 0.0:
                            returned.append(e.device)
                        speeds[e.device] = 1.0
                        links[e.device] = 1.0
                        slow_since.pop(e.device, None)
                ctx.now = t
                cached = None
                observe_left = st.observe_steps
                if returned:
                    ctx.known_dead.difference_update(returned)
                    apply(self.policy.on_recover(ctx, returned), f"recover {_names(returned)}")
                if stopped:
                    ctx.known_dead.update(stopped)
                    reaction = self.policy.on_stop(ctx, stopped)
                    reaction.downtime_s += sc.costs.heartbeat_timeout_s
                    apply(reaction, f"stop {_names(stopped)}")
            if t >= sc.duration_s:
                break
            seg_end = min(events[ei].at_s if ei < len(events) else sc.duration_s, sc.duration_s)
            wake = self.policy.wake_at(ctx) if self.policy.observes else None
            probe_due = t >= next_probe
            if observe_left > 0 or probe_due or cached is None or (wake is not None and t >= wake):
                ctx.now, ctx.step = t, int(simulated + replayed)
                win = self.sim.window(compiled, speeds, st.window_steps, ctx.step, t, links)
                simulated += len(win.steps)
                ends = t + np.cumsum(win.step_time)
                reaction = self.policy.observe(ctx, win) if self.policy.observes else None
                cut = len(win.steps)
                if reaction is not None and reaction.at is not None:
                    cut = min(cut, reaction.at + 1)
                cut = min(cut, int(np.searchsorted(ends, seg_end)) + 1)
                end = min(float(ends[cut - 1]), seg_end) if np.isfinite(ends[cut - 1]) else seg_end
                tps = (
                    float(win.tokens[:cut].sum() / win.step_time[:cut].sum())
                    if np.isfinite(win.step_time[:cut].sum())
                    else 0.0
                )
                advance(t, end, tps)
                replayed += cut
                t = end
                observe_left -= cut
                if probe_due:
                    next_probe = t + st.probe_interval_s
                if reaction is not None:
                    ctx.now = t
                    apply(reaction, "detect")
                else:
                    cached = (
                        float(win.tokens.sum() / win.step_time.sum())
                        if np.isfinite(win.step_time.sum())
                        else 0.0,
                        float(win.step_time.mean()),
                    )
            else:
                end = min(seg_end, next_probe, wake if wake is not None else np.inf)
                tps, mean_step = cached
                advance(t, end, tps)
                if np.isfinite(mean_step) and mean_step > 0:
                    replayed += (end - t) / mean_step
                t = end
            if on_progress:
                on_progress(t)
        cap_tokens = sum((b - a) * c for a, b, c in capacity)
        return ReplayOutcome(
            self.policy.name,
            sc.duration_s,
            tokens,
            cap_tokens,
            downtime,
            lost,
            timeline,
            capacity,
            actions,
            detections,
            simulated,
            replayed,
        )


def _names(devices: list[int]) -> str:
    return ",".join(map(str, devices)) if len(devices) <= 4 else f"{len(devices)} devices"
