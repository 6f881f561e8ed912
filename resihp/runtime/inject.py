"""Fault injection: ``slow`` makes a rank's compute really take ``factor`` x longer (a sleep
proportional to each measured compute op); ``stop`` kills the rank's process (SIGKILL, no cleanup)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass

from resihp.errors import InputError

FORMS = ("slow:rank=R,factor=F,step=S[,until=U], stop:rank=R,step=S or hang:rank=R,step=S[,how=block|stop] "
         "(time=T seconds instead of step=S)")
HANG_HOW = ("block", "stop")  # block: the rank's main thread never returns (its heartbeat thread beats on);
# stop: SIGSTOP on itself (alive, silent)


@dataclass(frozen=True)
class Fault:
    kind: str  # "slow" | "stop" | "hang"
    rank: int
    step: int | None = None
    time_s: float | None = None
    factor: float = 1.0
    until: int | None = None  # first step at normal speed again (slow only)
    how: str | None = None  # hang only: "block" or "stop"

    def to_dict(self) -> dict:
        data = {k: v for k, v in self.__dict__.items() if v is not None}
        if self.kind in ("stop", "hang"):
            data.pop("factor")
        return data


def parse_fault(text: str) -> Fault:
    """Parse one ``--inject`` value."""
    kind, _, rest = text.partition(":")
    if kind not in ("slow", "stop", "hang") or not rest:
        raise InputError(f"--inject {text!r}: expected {FORMS}")
    fields: dict[str, str] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in ("rank", "factor", "step", "time", "until", "how"):
            raise InputError(f"--inject {text!r}: unknown field {item!r}; expected {FORMS}")
        fields[key.strip()] = value.strip()
    try:
        rank = int(fields["rank"])
        step = int(fields["step"]) if "step" in fields else None
        time_s = float(fields["time"]) if "time" in fields else None
        factor = float(fields.get("factor", "1"))
        until = int(fields["until"]) if "until" in fields else None
    except KeyError:
        raise InputError(f"--inject {text!r}: rank= is required; expected {FORMS}") from None
    except ValueError:
        raise InputError(f"--inject {text!r}: rank, step and until are integers, factor and time "
                         f"numbers; expected {FORMS}") from None
    if (step is None) == (time_s is None):
        raise InputError(f"--inject {text!r}: give exactly one of step= or time=")
    if kind == "slow" and not factor >= 1.0:
        raise InputError(f"--inject {text!r}: factor must be >= 1, got {factor}")
    if kind == "stop" and ("factor" in fields or until is not None or "how" in fields):
        raise InputError(f"--inject {text!r}: stop takes only rank= and step= or time=")
    how = fields.get("how")
    if kind == "hang":
        how = how or "block"
        if how not in HANG_HOW or "factor" in fields or until is not None:
            raise InputError(f"--inject {text!r}: hang takes rank=, step= or time=, and how=block|stop")
    elif how is not None:
        raise InputError(f"--inject {text!r}: how= is for hang only")
    if rank < 0 or (step is not None and step < 0):
        raise InputError(f"--inject {text!r}: rank and step must be non-negative")
    return Fault(kind, rank, step, time_s, factor, until, how)


def check_faults(faults: Sequence[Fault], world_size: int) -> None:
    for f in faults:
        if f.rank >= world_size:
            raise InputError(f"--inject {f.kind}:rank={f.rank}: no such rank (the world has ranks "
                             f"0..{world_size - 1})")


class FaultInjector:
    """The faults aimed at one rank, applied by the engine at step boundaries and after compute."""

    def __init__(self, faults: Sequence[Fault], rank: int, t0: float | None = None) -> None:
        self.faults = [f for f in faults if f.rank == rank]
        self.t0 = time.time() if t0 is None else t0
        self.step = 0

    def _started(self, f: Fault, step: int) -> bool:
        if f.step is not None:
            return step >= f.step
        return time.time() - self.t0 >= f.time_s

    def begin_step(self, step: int) -> None:
        self.step = step
        for f in self.faults:
            if f.kind == "stop" and self._started(f, step):
                os.kill(os.getpid(), signal.SIGKILL)
            if f.kind == "hang" and self._started(f, step):
                if f.how == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                while True:  # no progress, no exit: only a signal ends it
                    time.sleep(1.0)

    def slow_factor(self) -> float:
        factor = 1.0
        for f in self.faults:
            if f.kind == "slow" and self._started(f, self.step) and (f.until is None or self.step < f.until):
                factor *= f.factor
        return factor

    def stretch(self, elapsed_s: float) -> None:
        """Called after a compute op that took ``elapsed_s``: wait so it takes factor x as long."""
        factor = self.slow_factor()
        if factor > 1.0:
            time.sleep((factor - 1.0) * elapsed_s)
