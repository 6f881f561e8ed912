"""Agents started ahead of need: ``resihp run`` starts the agents of its first launch before its
own imports, so that the two overlap.

The warm agent (``resihp.runtime.agent``) spends about 2 s of CPU on its imports before it can
fork a worker (``torch._dynamo``, which the optimizer's step imports, is most of it), and the
first launch waited for all of it after ``resihp run`` had done its own (about 1.7 s). A spare is
that agent started early (``python -m resihp.runtime.agent --spare``): it imports, then waits on
its stdin for one line, the options and environment of a launch, and runs it as the agent would
have. One that launched nothing is killed (it holds nothing but its imports). Measured on this
project's 2-core VM, a 6-step run from command to exit: 4.1-4.8 s before, 3.1-3.3 s with its
spare. Relaunches after a fault start a new agent as before: a spare started at the fault
competed with the stopping job for the two cores and shortened no stall (3 interleaved pairs:
4.1-4.2 s with one, 3.8-4.1 s without).

A spare serves a launch only where it is the same process that launch would start: a forked-worker
agent (``launch.forks_workers``), and an environment that differs from the spare's only in the
variables read after start-up (``RUNTIME_ENV``: the store, node and replica of the launch). The
OpenMP runtime reads its thread count when torch loads it, and Python its buffering at start, so a
spare started under other values of those is not used. A spare is started from the thread that
runs the job (``guarded``'s PR_SET_PDEATHSIG follows the thread that started the process), and dies
with the launcher as every launched process does.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from resihp.runtime.lifecycle import guarded

AGENT = "resihp.runtime.agent"
SPARE_FLAG = "--spare"
# read by the agent, torchrun or the workers after they start, never at import
RUNTIME_ENV = frozenset({
    "RESIHP_STORE", "RESIHP_NODE", "RESIHP_FIRST_RANK", "RESIHP_MANAGED", "RESIHP_REPLICA", "RESIHP_ATTEMPT",
    "RESIHP_GPU_OFFSET", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "MASTER_ADDR", "GLOO_SOCKET_IFNAME",
})


@dataclass(frozen=True)
class Launch:
    """What a spare receives: the agent's options (torchrun's, then ``-m resihp.runtime.worker
    --config PATH``) and the launch's environment."""

    argv: list[str]
    env: dict[str, str]

    def to_line(self) -> str:
        return json.dumps({"argv": self.argv, "env": self.env}) + "\n"

    @classmethod
    def from_line(cls, line: str) -> Launch:
        data = json.loads(line)
        return cls([str(a) for a in data["argv"]], {str(k): str(v) for k, v in data["env"].items()})


def agent_options(cmd: Sequence[str]) -> list[str] | None:
    """The options after ``-m resihp.runtime.agent`` in a launch command (``guarded`` or not), or
    None when it does not run the warm agent."""
    cmd = list(cmd)
    for i in range(len(cmd) - 1):
        if cmd[i] == "-m" and cmd[i + 1] == AGENT:
            return cmd[i + 2:]
    return None


def compatible(spare_env: Mapping[str, str], env: Mapping[str, str]) -> bool:
    """Whether a spare started under ``spare_env`` is the process a launch under ``env`` starts."""
    differ = {k for k in spare_env.keys() | env.keys() if spare_env.get(k) != env.get(k)}
    return differ <= RUNTIME_ENV


class Spares:
    """Spare agents of one launcher process."""

    def __init__(self) -> None:
        self._idle: list[tuple[subprocess.Popen, dict[str, str]]] = []

    def start(self, env: Mapping[str, str], count: int = 1) -> None:
        """Start ``count`` spares under ``env`` (a launch's environment, less its runtime part)."""
        for _ in range(count):
            proc = subprocess.Popen(guarded([sys.executable, "-m", AGENT, SPARE_FLAG]), env=dict(env),
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True)
            self._idle.append((proc, dict(env)))

    def popen(self, cmd: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen:
        """The process of the launch ``cmd`` under ``env``: a spare handed the launch when one fits,
        else a new process (stdout discarded, stderr a text pipe, a session of its own, as a spare)."""
        argv = agent_options(cmd)
        while argv is not None and self._idle:
            proc, spare_env = self._idle.pop(0)
            if proc.poll() is not None or not compatible(spare_env, env):
                self._end(proc)
                continue
            try:
                proc.stdin.write(Launch(argv, dict(env)).to_line())
                proc.stdin.close()
                proc.stdin = None  # as a process started without a stdin pipe (communicate, wait)
            except OSError:  # it died between the look and the write
                self._end(proc)
                continue
            return proc
        return subprocess.Popen(list(cmd), env=dict(env), text=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)

    def close(self) -> None:
        """End every idle spare."""
        idle, self._idle = self._idle, []
        for proc, _ in idle:
            self._end(proc)

    @staticmethod
    def _end(proc: subprocess.Popen) -> None:
        """An idle spare has launched nothing: ended at once, not after its imports."""
        with contextlib.suppress(OSError):
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stderr):
            with contextlib.suppress(OSError, AttributeError):
                stream.close()


def spare_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a spare starts under: the launcher's with what every launch sets at
    start-up (``launch.worker_env`` adds the rest, all in ``RUNTIME_ENV``)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


SPARES = Spares()  # this process's
