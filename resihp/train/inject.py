"""Fault injection: real slowdowns, stops, hangs and errors in a rank's process.

``slow`` makes a rank's compute really take ``factor`` x longer (a sleep proportional to each
measured compute op); ``link`` makes every transfer between two ranks take
``factor`` x longer (a sleep proportional to each measured transfer, so it scales with the bytes);
``stop`` kills the rank's process (SIGKILL, no cleanup; ``during=restore``: in the middle of the
memory-tier restore of the first restart in place, after every rank has agreed what to load and
before the transfers; ``step=S,during=publish``: after step S's update, committed with
replica-level fault tolerance, before the rank publishes the step's records); ``hang`` stops its
progress; ``error`` raises a Python exception in it (a crash: the process ends by the exception)."""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from resihp.errors import InputError

FORMS = (
    "slow:rank=R,factor=F,step=S[,until=U], link:ranks=A+B,factor=F,step=S[,until=U], "
    "stop:rank=R,step=S[,during=publish] (or during=restore), "
    "error:rank=R,step=S or hang:rank=R,step=S[,how=block|stop] (time=T seconds instead of step=S)"
)
RATE_SAMPLES = 256  # healthy transfers kept per channel
RATE_QUANTILE = 0.1  # the low quantile of their per-byte times taken as the healthy rate
DURING = ("restore", "publish")  # stop only: where in a rank's work it is killed
HANG_HOW = (
    "block",
    "stop",
)  # block: the rank's main thread never returns (its heartbeat thread beats on);
# stop: SIGSTOP on itself (alive, silent)


class InjectedError(Exception):
    """The exception an ``error`` fault raises in its rank.

    It is not a RuntimeError: the worker takes those for a lost peer."""


@dataclass(frozen=True)
class Fault:
    kind: str  # "slow" | "link" | "stop" | "hang" | "error"
    rank: int  # link: its first end
    step: int | None = None
    time_s: float | None = None
    factor: float = 1.0
    until: int | None = None  # first step at normal speed again (slow only)
    how: str | None = None  # hang only: "block" or "stop"
    peer: int | None = None  # link only: its other end
    # stop only: "restore" (the first restart in place's restore, no step) or "publish" (after
    # ``step``'s update, before its records are published)
    during: str | None = None

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.rank,) if self.peer is None else (self.rank, self.peer)

    def to_dict(self) -> dict:
        data = {k: v for k, v in self.__dict__.items() if v is not None}
        if self.kind in ("stop", "hang", "error"):
            data.pop("factor")
        if self.kind == "link":
            data.pop("rank")
            data.pop("peer")
            data["ranks"] = list(self.ranks)
        return data

    def spec(self) -> str:
        """The ``--inject`` value that parses back to this fault."""
        if self.kind == "link":
            fields = [f"ranks={self.rank}+{self.peer}"]
        else:
            fields = [f"rank={self.rank}"]
        if self.kind in ("slow", "link"):
            fields.append(f"factor={self.factor!r}")
        for key, value in (
            ("step", self.step),
            ("time", self.time_s),
            ("until", self.until),
            ("how", self.how),
            ("during", self.during),
        ):
            if value is not None:
                fields.append(f"{key}={value}")
        return f"{self.kind}:{','.join(fields)}"


def carried_faults(
    faults: Sequence[Fault], survivors: Sequence[int], first_step: int
) -> list[Fault]:
    """The faults still ahead of a relaunch, renumbered to the survivors' new ranks.

    They are each stop, hang or error of a step at or after ``first_step``, and each slowdown (of a
    device or a link) still in force at it, from there on (the device is as slow as it was; the
    relaunch's live loop finds it again). Faults by wall time, of the first restart's restore, or
    aimed at a rank that is gone are not carried.

    Args:
        faults: the run's faults.
        survivors: the old ranks that go on, in the order of their new numbers.
        first_step: the step the relaunch goes on at."""
    new = {old: i for i, old in enumerate(survivors)}
    carried = []
    for f in faults:
        if f.step is None or any(r not in new for r in f.ranks):
            continue
        if f.kind in ("slow", "link"):
            if f.until is not None and f.until <= first_step:
                continue
            step = max(f.step, first_step)
        elif f.step >= first_step:
            step = f.step
        else:
            continue
        carried.append(
            replace(f, rank=new[f.rank], peer=None if f.peer is None else new[f.peer], step=step)
        )
    return carried


def parse_fault(text: str) -> Fault:
    """Parse one ``--inject`` value."""
    kind, _, rest = text.partition(":")
    if kind not in ("slow", "link", "stop", "hang", "error") or not rest:
        raise InputError(f"--inject {text!r}: expected {FORMS}")
    fields: dict[str, str] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in (
            "rank",
            "ranks",
            "factor",
            "step",
            "time",
            "until",
            "how",
            "during",
        ):
            raise InputError(f"--inject {text!r}: unknown field {item!r}; expected {FORMS}")
        if key.strip() in fields:
            raise InputError(f"--inject {text!r}: field {key.strip()}= given twice")
        fields[key.strip()] = value.strip()
    peer = None
    if kind == "link":
        if "rank" in fields or "ranks" not in fields:
            raise InputError(
                f"--inject {text!r}: a link takes ranks=A+B (its two ends); expected {FORMS}"
            )
        ends = fields.pop("ranks").split("+")
        try:
            ends_i = [int(e) for e in ends]
        except ValueError:
            ends_i = []
        if len(ends_i) != 2 or ends_i[0] == ends_i[1]:
            raise InputError(
                f"--inject {text!r}: ranks= names two different ranks as A+B; expected {FORMS}"
            )
        fields["rank"], peer = str(ends_i[0]), ends_i[1]
        if peer < 0:
            raise InputError(f"--inject {text!r}: rank and step must be non-negative")
    elif "ranks" in fields:
        raise InputError(f"--inject {text!r}: ranks=A+B is for link only; expected {FORMS}")
    try:
        rank = int(fields["rank"])
        step = int(fields["step"]) if "step" in fields else None
        time_s = float(fields["time"]) if "time" in fields else None
        factor = float(fields.get("factor", "1"))
        until = int(fields["until"]) if "until" in fields else None
    except KeyError:
        raise InputError(f"--inject {text!r}: rank= is required; expected {FORMS}") from None
    except ValueError:
        raise InputError(
            f"--inject {text!r}: rank, step and until are integers, factor and time "
            f"numbers; expected {FORMS}"
        ) from None
    during = fields.get("during")
    if during is not None and (kind != "stop" or during not in DURING):
        raise InputError(
            f"--inject {text!r}: during= is for stop only: during=restore, or step=S,during=publish"
        )
    if during == "publish" and step is None:
        raise InputError(
            f"--inject {text!r}: during=publish needs step=S (the step whose records it stops)"
        )
    if (step is None) + (time_s is None) + (during in (None, "publish")) != 2:
        raise InputError(
            f"--inject {text!r}: give exactly one of step= or time="
            + (" or during=" if kind == "stop" else "")
        )
    if kind in ("slow", "link") and not 1.0 <= factor < math.inf:
        raise InputError(f"--inject {text!r}: factor must be >= 1 (a finite number), got {factor}")
    if time_s is not None and not 0.0 <= time_s < math.inf:
        raise InputError(
            f"--inject {text!r}: time must be a finite number of seconds >= 0, got {time_s}"
        )
    if kind in ("stop", "error") and ("factor" in fields or until is not None or "how" in fields):
        raise InputError(
            f"--inject {text!r}: {kind} takes only rank= and step= or time="
            + (" (and during=publish) or during=restore" if kind == "stop" else "")
        )
    how = fields.get("how")
    if kind == "hang":
        how = how or "block"
        if how not in HANG_HOW or "factor" in fields or until is not None:
            raise InputError(
                f"--inject {text!r}: hang takes rank=, step= or time=, and how=block|stop"
            )
    elif how is not None:
        raise InputError(f"--inject {text!r}: how= is for hang only")
    if rank < 0 or (step is not None and step < 0):
        raise InputError(f"--inject {text!r}: rank and step must be non-negative")
    return Fault(kind, rank, step, time_s, factor, until, how, peer, during)


def check_faults(faults: Sequence[Fault], world_size: int, steps: int | None = None) -> None:
    """Every fault names ranks of the world and (given the run's ``steps``) a step it reaches.

    Raises InputError naming the fault that does not.

    Args:
        faults: the run's faults.
        world_size: the job's ranks.
        steps: the run's steps (None: steps not checked)."""
    for f in faults:
        what = f"ranks={f.rank}+{f.peer}" if f.kind == "link" else f"rank={f.rank}"
        for r in f.ranks:
            if r >= world_size:
                raise InputError(
                    f"--inject {f.kind}:{what}: no such rank {r} (the world has ranks "
                    f"0..{world_size - 1})"
                )
        if steps is not None and f.step is not None and f.step >= steps:
            raise InputError(
                f"--inject {f.kind}:{what},step={f.step}: the run's steps are 0..{steps - 1} "
                f"(--steps {steps}): it would never be injected"
            )


class FaultInjector:
    """The faults aimed at one rank, applied by the engine at step boundaries and after compute."""

    def __init__(
        self, faults: Sequence[Fault], rank: int, t0: float | None = None, sleep=time.sleep
    ) -> None:
        self.rank = rank
        self.faults = [f for f in faults if f.kind != "link" and f.rank == rank]
        self.links = [f for f in faults if f.kind == "link" and rank in f.ranks]
        self.t0 = time.time() if t0 is None else t0
        self.step = 0
        self.sleep = sleep
        # per channel (a peer, or a collective's members): seconds per byte of its healthy
        # transfers (``transfer_s``), and the rate fixed when a fault on it starts
        self._samples: dict[object, list[float]] = {}
        self._rate: dict[object, float] = {}
        self.delayed_s = 0.0  # seconds of injected link delay so far

    def _started(self, f: Fault, step: int) -> bool:
        if f.during is not None:
            return False  # not a step's fault (during_restore)
        if f.step is not None:
            return step >= f.step
        return time.time() - self.t0 >= f.time_s

    def begin_step(self, step: int) -> None:
        self.step = step
        for f in self.faults:
            if f.kind == "stop" and self._started(f, step):
                os.kill(os.getpid(), signal.SIGKILL)
            if f.kind == "error" and self._started(f, step):
                raise InjectedError(f"injected exception at step {step}")
            if f.kind == "hang" and self._started(f, step):
                if f.how == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                while True:  # no progress, no exit: only a signal ends it
                    time.sleep(1.0)

    def before_publish(self, step: int) -> None:
        """Called after ``step``'s update, before the rank publishes its records.

        A ``stop`` fault ``step=S,during=publish`` kills the rank there (with replica-level fault
        tolerance the step is committed by then)."""
        if any(f.kind == "stop" and f.during == "publish" and f.step == step for f in self.faults):
            os.kill(os.getpid(), signal.SIGKILL)

    def during_restore(self) -> None:
        """Called in the middle of a memory-tier restore.

        A ``stop`` fault ``during=restore`` kills the rank there."""
        if any(f.kind == "stop" and f.during == "restore" for f in self.faults):
            os.kill(os.getpid(), signal.SIGKILL)

    def slow_factor(self) -> float:
        factor = 1.0
        for f in self.faults:
            if (
                f.kind == "slow"
                and self._started(f, self.step)
                and (f.until is None or self.step < f.until)
            ):
                factor *= f.factor
        return factor

    def stretch(self, elapsed_s: float) -> None:
        """Called after a compute op that took ``elapsed_s``: wait so it takes factor x as long."""
        factor = self.slow_factor()
        if factor > 1.0:
            self.sleep((factor - 1.0) * elapsed_s)

    def link_factor(self, peers: Sequence[int]) -> float:
        """The slowdown of this rank's link to any of ``peers`` now (1.0: none)."""
        factor = 1.0
        for f in self.links:
            other = f.peer if f.rank == self.rank else f.rank
            if (
                other in peers
                and self._started(f, self.step)
                and (f.until is None or self.step < f.until)
            ):
                factor *= f.factor
        return factor

    def transfer_s(self, channel: object, elapsed_s: float, nbytes: int, slow: bool) -> float:
        """The transfer part of an op, in seconds, without its wait on the sender.

        It is the channel's healthy seconds per byte times the bytes. The healthy rate is a low
        quantile (``RATE_QUANTILE``: the receives whose data was ready) of the per-byte times
        measured on the channel before its fault started, fixed from then on, so that the delay
        scales with the bytes and not with waits or the machine's load.

        Args:
            channel: what the rates are kept by (a peer's receives, a collective's members).
            elapsed_s: the seconds the op took.
            nbytes: the bytes it moved.
            slow: the channel's fault has started (its per-byte times are no longer sampled)."""
        if nbytes <= 0:
            return 0.0
        per_byte = elapsed_s / nbytes
        if not slow:
            samples = self._samples.setdefault(channel, [])
            samples.append(per_byte)
            del samples[:-RATE_SAMPLES]
            return elapsed_s
        if channel not in self._rate:
            samples = sorted(self._samples.get(channel) or [per_byte])
            self._rate[channel] = samples[int(RATE_QUANTILE * (len(samples) - 1))]
        return self._rate[channel] * nbytes

    def received(self, src: int, elapsed_s: float, nbytes: int) -> None:
        """Called after a point-to-point receive: on a slow link, wait out the link's slowdown.

        The wait makes the transfer take factor x as long (the receiver sees the data that much
        later).

        Args:
            src: the sending rank.
            elapsed_s: the seconds the receive took.
            nbytes: the bytes received."""
        factor = self.link_factor((src,))
        transfer = self.transfer_s(("p2p", src), elapsed_s, nbytes, factor > 1.0)
        if factor > 1.0:
            self._delay((factor - 1.0) * transfer)

    def collective(self, members: Sequence[int], elapsed_s: float, nbytes: int) -> None:
        """Called by each member after a collective: the ends of a slow link in it wait.

        The two ends of a slow link both in it wait factor - 1 times its transfer (a ring is as slow
        as its slowest link).

        Args:
            members: the collective's ranks.
            elapsed_s: the seconds the collective took.
            nbytes: the bytes it moved."""
        members = tuple(members)
        factor = self.link_factor([m for m in members if m != self.rank])
        transfer = self.transfer_s(("coll", members), elapsed_s, nbytes, factor > 1.0)
        if factor > 1.0:
            self._delay((factor - 1.0) * transfer)

    def _delay(self, seconds: float) -> None:
        self.delayed_s += seconds
        self.sleep(seconds)
