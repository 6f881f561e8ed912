"""When to re-plan, when to take a benched device back, when to leave the plan alone."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

Link = tuple[int, int]


class ControlAction(enum.Enum):
    """What the caller does about a decision."""

    REPLAN = "replan"  # plan again with the controller's believed speeds and links
    KEEP = "keep"  # the plan in force already accounts for it


@dataclass(frozen=True)
class ControlConfig:
    """The one set of thresholds the live loop and the replay policy decide by.

    Attributes:
        revise: a believed slowdown is re-priced (and re-planned) once a new measure moved it by
            this factor either way; smaller moves are noise to the planner.
        healthy: a benched device (or link) whose probe runs at this fraction of its reference
            speed, or better, is taken back.
        hold_steps: after a device or link was re-priced, a further re-pricing of it waits this
            many steps (hysteresis: noisy measures do not flip the plan back and forth). New
            findings, recoveries and probes are never held.
        recheck_s: seconds a benched device waits before its first probe (replay; a live job's
            ranks probe on their own schedule).
        max_backoff: a device still slow at its probe waits twice as long, up to
            ``2 ** max_backoff`` times ``recheck_s``.
        link_recheck_s: seconds between probes of a slow link the plan no longer uses.
    """

    revise: float = 1.25
    healthy: float = 0.8
    hold_steps: int = 3
    recheck_s: float = 1800.0
    max_backoff: int = 2
    link_recheck_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.revise > 1.0:
            raise ValueError(f"ControlConfig.revise must be > 1, got {self.revise}")
        if not 0.0 < self.healthy <= 1.0:
            raise ValueError(f"ControlConfig.healthy must be in (0, 1], got {self.healthy}")
        if self.hold_steps < 0 or self.max_backoff < 0:
            raise ValueError("ControlConfig.hold_steps and max_backoff must be >= 0")

    def moved(self, old: float, new: float) -> bool:
        """Whether ``new`` differs from ``old`` (two slowdowns, >= 1) by ``revise`` or more."""
        return max(old, new) >= self.revise * min(old, new)


@dataclass(frozen=True)
class ControlDecision:
    """One decision: its action, why, and the device or link it is about."""

    action: ControlAction
    reason: str
    device: int | None = None
    link: Link | None = None
    slowdown: float = 1.0

    @property
    def replan(self) -> bool:
        return self.action is ControlAction.REPLAN


@dataclass
class Controller:
    """The believed state of the devices and links, and the rules that change it.

    ``speeds`` maps a device to the speed it is believed to run at (1.0: healthy, missing:
    healthy); ``links`` a slow link's ends (low, high) to its slowdown. Times are whatever clock
    the caller keeps (replay seconds); steps are the job's step numbers.
    """

    config: ControlConfig = field(default_factory=ControlConfig)
    speeds: dict[int, float] = field(default_factory=dict)
    links: dict[Link, float] = field(default_factory=dict)
    _benched_at: dict[int, float] = field(default_factory=dict)  # found slow, or last probed
    _returned_at: dict[int, float] = field(default_factory=dict)  # last taken back
    _backoff: dict[int, int] = field(default_factory=dict)
    _link_at: dict[Link, float] = field(default_factory=dict)
    _priced_step: dict[int | Link, int] = field(default_factory=dict)

    # -- what is believed ------------------------------------------------------------------
    def slowdown(self, device: int) -> float:
        """The device's believed slowdown (1.0: healthy)."""
        return 1.0 / max(self.speeds.get(device, 1.0), 1e-9)

    def slow(self) -> dict[int, float]:
        """Every device believed slow, with its slowdown."""
        return {d: 1.0 / max(s, 1e-9) for d, s in self.speeds.items() if s < 1.0}

    # -- findings --------------------------------------------------------------------------
    def found_slow(
        self, device: int, slowdown: float, step: int, time_s: float = 0.0
    ) -> ControlDecision:
        """A detector (or the caller's own measure) puts ``device`` at ``slowdown``.

        Args:
            device: the device (rank) found slow.
            slowdown: its estimated slowdown (x; at most 1.0 means at speed).
            step: the training step of the finding (re-pricing waits ``hold_steps`` after one).
            time_s: the time of the finding in seconds (the clock its probes are timed on).
        """
        slowdown = max(float(slowdown), 1.0)
        old = self.slowdown(device)
        if old > 1.0:
            if not self.config.moved(old, slowdown):
                return ControlDecision(
                    ControlAction.KEEP, "priced within the revise factor", device, slowdown=old
                )
            if self._held(device, step):
                return ControlDecision(
                    ControlAction.KEEP, "re-priced too recently", device, slowdown=old
                )
        elif slowdown <= 1.0:
            return ControlDecision(ControlAction.KEEP, "at speed", device)
        elif time_s - self._returned_at.get(device, -math.inf) <= self._longest_recheck():
            # found slow again soon after it was taken back: wait longer before the next probe
            self._backoff[device] = self._backoff.get(device, 0) + 1
        else:
            self._backoff[device] = 0
        if slowdown <= 1.0:
            return self.found_recovered(device)
        self.speeds[device] = 1.0 / slowdown
        self._benched_at[device] = time_s
        self._priced_step[device] = step
        return ControlDecision(
            ControlAction.REPLAN, "slow" if old <= 1.0 else "re-priced", device, slowdown=slowdown
        )

    def found_recovered(self, device: int) -> ControlDecision:
        """The device's slowdown is over: at speed again."""
        if self.slowdown(device) <= 1.0:
            return ControlDecision(ControlAction.KEEP, "not believed slow", device)
        self.speeds[device] = 1.0
        self._priced_step.pop(device, None)
        return ControlDecision(ControlAction.REPLAN, "recovered", device)

    def found_link(
        self, ends: Iterable[int], slowdown: float, step: int, time_s: float = 0.0
    ) -> ControlDecision:
        """A detector puts the link between ``ends`` at ``slowdown`` of its bandwidth.

        Args:
            ends: the two devices (ranks) the link joins, in either order.
            slowdown: how many times slower than its bandwidth the link runs (x).
            step: the training step of the finding (re-pricing waits ``hold_steps`` after one).
            time_s: the time of the finding in seconds (the clock its probes are timed on).
        """
        link = _link(ends)
        slowdown = max(float(slowdown), 1.0)
        old = self.links.get(link)
        if old is not None:
            if not self.config.moved(old, slowdown):
                return ControlDecision(
                    ControlAction.KEEP, "priced within the revise factor", link=link, slowdown=old
                )
            if self._held(link, step):
                return ControlDecision(
                    ControlAction.KEEP, "re-priced too recently", link=link, slowdown=old
                )
        self.links[link] = slowdown
        self._link_at[link] = time_s
        self._priced_step[link] = step
        return ControlDecision(
            ControlAction.REPLAN,
            "slow link" if old is None else "re-priced",
            link=link,
            slowdown=slowdown,
        )

    def link_recovered(self, ends: Iterable[int]) -> ControlDecision:
        """The link's slowdown is over."""
        link = _link(ends)
        if self.links.pop(link, None) is None:
            return ControlDecision(ControlAction.KEEP, "not believed slow", link=link)
        self._priced_step.pop(link, None)
        return ControlDecision(ControlAction.REPLAN, "link recovered", link=link)

    def stopped(self, devices: Iterable[int]) -> ControlDecision:
        """Devices are dead: no longer believed slow; the plan goes around them."""
        for d in devices:
            self.speeds.pop(d, None)
            self._priced_step.pop(d, None)
        return ControlDecision(ControlAction.REPLAN, "fail-stop")

    # -- probes of what the plan leaves out -----------------------------------------------
    def probed(self, device: int, speed: float, time_s: float = 0.0) -> ControlDecision:
        """A benched device's probe ran at ``speed`` of its reference (1.0: healthy).

        Args:
            device: the probed device (rank).
            speed: the measured speed as a fraction of its reference (1.0: healthy).
            time_s: the time of the probe in seconds.
        """
        if self.slowdown(device) <= 1.0:
            return ControlDecision(ControlAction.KEEP, "not believed slow", device)
        self._benched_at[device] = time_s
        if speed >= self.config.healthy:
            self.speeds[device] = 1.0
            self._returned_at[device] = time_s
            self._priced_step.pop(device, None)
            return ControlDecision(ControlAction.REPLAN, "healthy at its probe", device)
        self._backoff[device] = self._backoff.get(device, 0) + 1
        slowdown, old = 1.0 / max(speed, 1e-6), self.slowdown(device)
        if not self.config.moved(old, slowdown):
            return ControlDecision(ControlAction.KEEP, "still slow", device, slowdown=old)
        self.speeds[device] = 1.0 / slowdown
        return ControlDecision(
            ControlAction.REPLAN, "still slow, re-priced", device, slowdown=slowdown
        )

    def probed_link(
        self, ends: Iterable[int], speed: float, time_s: float = 0.0
    ) -> ControlDecision:
        """A slow link out of use measured ``speed`` of its bandwidth.

        Args:
            ends: the two devices (ranks) the link joins, in either order.
            speed: the measured bandwidth as a fraction of the healthy link's (1.0: healthy).
            time_s: the time of the probe in seconds.
        """
        link = _link(ends)
        if link not in self.links:
            return ControlDecision(ControlAction.KEEP, "not believed slow", link=link)
        self._link_at[link] = time_s
        if speed >= self.config.healthy:
            del self.links[link]
            return ControlDecision(ControlAction.REPLAN, "link healthy at its probe", link=link)
        slowdown = 1.0 / max(speed, 1e-6)
        if not self.config.moved(self.links[link], slowdown):
            return ControlDecision(
                ControlAction.KEEP, "link still slow", link=link, slowdown=self.links[link]
            )
        self.links[link] = slowdown
        return ControlDecision(
            ControlAction.REPLAN, "link still slow, re-priced", link=link, slowdown=slowdown
        )

    def recheck_after(self, device: int) -> float:
        """Seconds a benched device waits from its last probe (or finding) to its next."""
        return self.config.recheck_s * 2 ** min(
            self._backoff.get(device, 0), self.config.max_backoff
        )

    def due_probes(self, now: float, used: set[int], dead: set[int]) -> list[int]:
        """Devices believed slow, out of the plan and not dead, whose probe is due at ``now``.

        Args:
            now: the time in seconds, on the clock of the findings' ``time_s``.
            used: the devices of the plan in force.
            dead: the devices known dead (never probed).
        """
        return [
            d
            for d in self._benched(used, dead)
            if now - self._benched_at.get(d, 0.0) >= self.recheck_after(d)
        ]

    def due_link_probes(self, now: float, used: set[int]) -> list[Link]:
        """Slow links the plan no longer uses (an end left out) whose probe is due at ``now``."""
        return [e for e in self._unused(used) if now >= self._link_due(e)]

    def wake_at(self, used: set[int], dead: set[int]) -> float | None:
        """The earliest time a probe falls due, None when none is pending."""
        times = [
            self._benched_at.get(d, 0.0) + self.recheck_after(d) for d in self._benched(used, dead)
        ]
        times += [self._link_due(e) for e in self._unused(used)]
        return min(times) if times else None

    # -- helpers ---------------------------------------------------------------------------
    def _held(self, key: int | Link, step: int) -> bool:
        last = self._priced_step.get(key)
        return last is not None and 0 <= step - last < self.config.hold_steps

    def _longest_recheck(self) -> float:
        return self.config.recheck_s * 2**self.config.max_backoff

    def _benched(self, used: set[int], dead: set[int]) -> list[int]:
        return [d for d, s in self.speeds.items() if s < 1.0 and d not in used and d not in dead]

    def _unused(self, used: set[int]) -> list[Link]:
        return [e for e in self.links if not (e[0] in used and e[1] in used)]

    def _link_due(self, link: Link) -> float:
        return self._link_at.get(link, 0.0) + self.config.link_recheck_s


def _link(ends: Iterable[int]) -> Link:
    a, b = sorted(int(e) for e in ends)
    return (a, b)
