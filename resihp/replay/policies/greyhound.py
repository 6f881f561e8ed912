"""Greyhound-style fail-slow handling, alone and added to other systems' fail-stop handling."""

from __future__ import annotations

from resihp.replay.detectors import DetectorFeed, greyhound_detector
from resihp.replay.failures import GREYHOUND_CLASSES
from resihp.replay.interface import Context, Detection, Policy, Reaction, Window
from resihp.replay.layout import ReplicaLayout
from resihp.replay.policies.common import balance_microbatches, believed_speeds
from resihp.replay.policies.oobleck import Oobleck
from resihp.replay.policies.recycle import ReCycle
from resihp.replay.policies.restart import CheckpointRestart

# Greyhound weighs each mitigation's cost against the gain over the fail-slow's expected remaining
# life; its Table 1 gives about 72 minutes for jobs of 512 GPUs or more.
HORIZON_S = GREYHOUND_CLASSES["512gpus"][0] * 60.0


class GreyhoundModule:
    """Raw-iteration-time detection with multi-level mitigation (Wu et al., ATC 2025).

    Detection is the Greyhound-style change-point detector of ``resihp.detect.baselines`` on the
    job's raw iteration time, which names the rank whose time rose most and the iteration slowdown.
    Mitigation picks, by expected tokens over the fail-slow's expected remaining life, among:
    ignore; rebalance micro-batches across data-parallel replicas (no pause); and taking the slow
    device out with the host system's own mechanism (a restart after an on-demand checkpoint for
    plain Greyhound, template re-instantiation for Oobleck, rerouting for ReCycle). When the
    detector sees the device recover, the belief is dropped and the choice made again. Simplified:
    Greyhound's separate topology-adjustment level (moving slow devices into one pipeline) is not
    modelled; its decisions use the replay's cost model with the believed slowdowns.
    """

    def __init__(self, host: Policy) -> None:
        self.host = host
        self.feed: DetectorFeed | None = None
        self.slow: dict[int, float] = {}

    def observe(self, ctx: Context, window: Window) -> Reaction | None:
        if self.feed is None:
            self.feed = greyhound_detector(ctx.scenario)
        findings = self.feed.feed(window)
        if not findings:
            return None
        index = findings[0].index
        time_s = window.start_s + float(window.step_time[: index + 1].sum())
        detections = []
        for f in findings:
            if f.ended:
                self.slow.pop(f.device, None)
            else:
                self.slow[f.device] = max(f.slowdown, 1.0)
                detections.append(Detection(time_s, f.step, "fail-slow", f.device, f.slowdown))
        reaction = self.mitigate(ctx) or Reaction(label="ignore")
        reaction.at = index
        reaction.detections = detections
        return reaction

    def mitigate(self, ctx: Context) -> Reaction | None:
        speeds = believed_speeds(ctx, self.slow)
        tokens_per_step = ctx.total_microbatches * float(ctx.pool.tokens.mean())
        current = ctx.layout
        options: list[tuple[float, Reaction | None]] = []

        def value(layout: ReplicaLayout | None, pause_s: float) -> float:
            if layout is None or not layout.replicas:
                return -1.0
            step = ctx.predicted_step_time(layout, speeds)
            return max(0.0, HORIZON_S - pause_s) * tokens_per_step / step if step > 0 else -1.0

        options.append((value(current, 0.0), None))
        rebalanced = balance_microbatches(ctx, current, speeds)
        options.append(
            (
                value(rebalanced, 0.0),
                Reaction(
                    rebalanced.with_note("rebalance micro-batches"),
                    label="S2 rebalance micro-batches",
                ),
            )
        )
        without = self.host.layout_without(ctx, set(self.slow))
        if without is not None and without.replicas:
            without = balance_microbatches(ctx, without, speeds)
            cost = self.host.exclude_cost_s(ctx)
            options.append(
                (
                    value(without, cost),
                    Reaction(
                        without, cost, label=f"{self.host.exclude_label} slow {sorted(self.slow)}"
                    ),
                )
            )
        best = max(options, key=lambda o: o[0])
        return best[1]

    def reset(self) -> None:
        if self.feed is not None:
            self.feed.reset()


class _WithGreyhound:
    observes = True

    def __init__(self) -> None:
        self.module = GreyhoundModule(self)

    def observe(self, ctx: Context, window: Window) -> Reaction | None:
        return self.module.observe(ctx, window)


class Greyhound(_WithGreyhound, CheckpointRestart):
    """Greyhound: checkpoint-restart for fail-stops plus the Greyhound fail-slow module."""

    name = "greyhound"


class OobleckGreyhound(_WithGreyhound, Oobleck):
    """Strengthened Oobleck, as the ResiHP paper compares: Oobleck plus Greyhound's fail-slow
    module."""

    name = "oobleck+greyhound"


class ReCycleGreyhound(_WithGreyhound, ReCycle):
    """Strengthened ReCycle, as the ResiHP paper compares: ReCycle plus Greyhound's fail-slow
    module."""

    name = "recycle+greyhound"
