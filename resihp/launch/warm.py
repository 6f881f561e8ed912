"""Warm agents: ``resihp run`` forks each agent of a CPU run from a server that imported it.

Instead of starting an interpreter that imports it again.

The warm agent (``resihp.launch.agent``) spends about 3 s of CPU on its imports before it can
fork a worker (``torch._dynamo``, which the optimizer's step imports, is half of it). ``resihp
run`` starts the server before its own imports, so that the two overlap: multiprocessing's
forkserver, preloaded with ``resihp.launch.warm_server`` (the server dies with the launcher) and the
agent. Each launch, the first ones and every relaunch after a fault, is then a fork of it. Measured
on this project's 2-core VM (``benchmarks/relaunch.py``, DP 2 x PP 2, rank 3 killed at step 10,
arms interleaved with the spare interpreters this replaced, medians of 4 rounds): a lost replica's
workers started 0.48 s after the failure instead of 3.23 s, it rejoined 5 steps after it instead of
21.5, the run's first worker 3.16 s after the command instead of 3.63 s; the survivors' stall the
same (0.12 s).

The launcher sees a forked agent as it sees a process it started (``ForkedAgent``: its PID, a
session of its own, its stderr a pipe, ``poll``, ``wait``, ``returncode``); it is the server's
child but dies with the launcher (``lifecycle.die_with``), not with the server: the server only
starts processes, and a server killed mid-run leaves every replica training. The launcher sees the
agent's end on its pidfd, and its exit status on a pipe the agent writes it to before it exits (or,
killed by a signal, over multiprocessing's sentinel while the server is there to say it). With the
server gone, the next launch says so in one line and starts its agent cold, as a new interpreter. As
every child of multiprocessing's forkserver, it first runs the launcher's main module again as
``__mp_main__``: a script that starts runs through ``resihp.launch`` itself keeps its work under
``if __name__ == "__main__":``.

The server serves a launch only where a forked agent is the same process that launch would start:
a forked-worker agent (``launch.forks_workers``), and an environment that differs from the
server's only in the variables read after start-up (``RUNTIME_ENV``: the store, node and replica of
the launch). The OpenMP runtime reads its thread count when torch loads it, and Python its
buffering at start, so a launch under other values of those starts its own interpreter. The server
is started from the thread that runs the job (``die_with_parent`` follows the thread that started
the process); its environment is the launch's less the runtime part (``agent_env``), set in this
process's ``os.environ`` only while it starts.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TextIO

from resihp.procexit import run_then_exit
from resihp.train.lifecycle import die_with, start_time

AGENT = "resihp.launch.agent"
# read by the agent, torchrun or the workers after they start, never at import
RUNTIME_ENV = frozenset(
    {
        "RESIHP_STORE",
        "RESIHP_NODE",
        "RESIHP_FIRST_RANK",
        "RESIHP_MANAGED",
        "RESIHP_REPLICA",
        "RESIHP_ATTEMPT",
        "RESIHP_GPU_OFFSET",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        "MASTER_ADDR",
        "GLOO_SOCKET_IFNAME",
        # snapshots.KEEPER_OWNER: set by a run with a memory tier once it starts
        "RESIHP_KEEPER_OWNER",
        "RESIHP_JOB_SECRET",  # records.JOB_SECRET_ENV: the job's secret, made at launch
    }
)
# warm_server first: the server dies with this process from then on. resihp.cli: each forked child
# runs the launcher's main module again as ``__mp_main__`` (multiprocessing's rule for its spawn and
# forkserver children), which with its imports loaded is a few milliseconds
PRELOAD = ["resihp.launch.warm_server", AGENT, "resihp.cli"]
# what a worker imports where its run checkpoints (a checkpoint written, a resume, a memory tier's
# restore, a layout resharded), deferred in the worker for torchrun's cold workers: preloaded for
# such a run, each forked worker has it (a relaunch's three workers each spent 1.6 s of CPU on it
# before resuming); another run's first launch would wait 0.6 s more for the server
CHECKPOINTING = ["resihp.ckpt.reshard", "resihp.ckpt.universal", "resihp.train.elastic"]
SIGNALLED_S = 5.0  # for the server to say how an agent killed by a signal ended


@dataclass(frozen=True)
class Launch:
    """One launch of the agent: its options and its environment.

    The options are torchrun's, then ``-m resihp.train.worker --config PATH``."""

    argv: list[str]
    env: dict[str, str]
    launcher: int  # the launcher's PID and start time: the agent dies with it
    launcher_started: int | None


def serve(launch: Launch, stderr: Connection, status: Connection) -> None:
    """Run a forked agent, ended as a cold one ends.

    A session of its own, SIGKILL when the launcher dies, stderr the launcher's pipe, stdout
    discarded, the launch's environment; then the agent, its exit status written to ``status``
    first.

    Args:
        launch: the launch's options and environment.
        stderr: the pipe the agent's stderr goes to (the launcher reads its other end).
        status: the pipe the agent's exit status is written to.
    """
    # deferred: the launcher names this function but must not import torch for it; the server
    # imported it before it forked (``PRELOAD``), so here it costs nothing
    from resihp.launch import agent

    os.setsid()
    die_with(launch.launcher, launch.launcher_started)
    os.dup2(stderr.fileno(), 2)
    stderr.close()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    os.environ.clear()
    os.environ.update(launch.env)
    run_then_exit(
        lambda: agent.main(launch.argv), said=lambda code: os.write(status.fileno(), b"%d" % code)
    )


def agent_options(cmd: Sequence[str]) -> list[str] | None:
    """The options after ``-m resihp.launch.agent`` in a launch command, or None without one.

    The command may be ``guarded`` or not; None when it does not run the warm agent."""
    cmd = list(cmd)
    for i in range(len(cmd) - 1):
        if cmd[i] == "-m" and cmd[i + 1] == AGENT:
            return cmd[i + 2 :]
    return None


def compatible(server_env: Mapping[str, str], env: Mapping[str, str]) -> bool:
    """Whether an agent forked from a server is the process a launch under ``env`` starts.

    The server was started under ``server_env``."""
    differ = {k for k in server_env.keys() | env.keys() if server_env.get(k) != env.get(k)}
    return differ <= RUNTIME_ENV


class ForkedAgent:
    """An agent forked by the server, used as the launcher uses a ``subprocess.Popen``.

    ``pid`` (it leads a session of its own), ``stderr`` (text), ``poll``, ``wait``, ``returncode``,
    ``communicate``, ``send_signal``, ``kill``. Its end and status are known with the server
    gone."""

    stdin = None
    stdout = None

    def __init__(self, process: BaseProcess, stderr: TextIO, status: int) -> None:
        self._process = process
        self._lock = threading.Lock()  # one reader of the exit status at a time
        self.pid: int = process.pid
        self.args = [AGENT]
        self.stderr = stderr
        self._status = status  # the read end of the pipe it writes its exit status to
        os.set_blocking(status, False)
        try:
            self._pidfd: int | None = os.pidfd_open(self.pid)
        except ProcessLookupError:  # ended and reaped already: the server has its status
            self._pidfd = None
        self._code: int | None = None

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        return self._await(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._await(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def _await(self, timeout: float | None) -> int | None:
        """Its exit status once it has ended, waiting up to ``timeout`` (None: for ever)."""
        with self._lock:
            if self._code is not None:
                return self._code
            if self._pidfd is None:
                self._process.join(timeout)
                ended = self._process.exitcode is not None
            else:
                ended = bool(select.select([self._pidfd], [], [], timeout)[0])
            if ended:
                self._code = self._exit_status()
            return self._code

    def _exit_status(self) -> int:
        """What it wrote before it exited; killed by a signal, what the server says (255: the
        server is gone too, the signal unknown)."""
        try:
            said = os.read(self._status, 32)
        except BlockingIOError:  # nothing written; its workers, also gone, hold the pipe still
            said = b""
        for fd in (self._status, self._pidfd):
            if fd is not None:
                os.close(fd)
        self._pidfd = None
        if said.strip().lstrip(b"-").isdigit():
            return int(said)
        self._process.join(SIGNALLED_S)
        return self._process.exitcode if self._process.exitcode is not None else 255

    def communicate(self, timeout: float | None = None) -> tuple[None, str]:
        """Its whole stderr and then its exit (``timeout`` bounds the wait for the exit only)."""
        err = self.stderr.read()
        self.stderr.close()
        self.wait(timeout)
        return None, err

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


AgentProcess = subprocess.Popen | ForkedAgent  # what a launch starts, either way


class WarmAgents:
    """This launcher's warm-agent server."""

    def __init__(self) -> None:
        self._context = multiprocessing.get_context("forkserver")
        self._env: dict[str, str] | None = None
        self._server: int | None = None
        self._forked: list[ForkedAgent] = []
        self._cold_said = False

    def start(self, env: Mapping[str, str], more: Sequence[str] = ()) -> None:
        """Start the server under ``env``, once, with the modules ``more`` preloaded too.

        ``env`` is a launch's environment, less its runtime part; ``more``: ``CHECKPOINTING``,
        say."""
        if self._env is not None:
            return
        self._context.set_forkserver_preload([*PRELOAD, *more])
        with _environ(env):
            forkserver.ensure_running()
        # multiprocessing would start a dead server again under this process's environment at
        # the next fork, not ``env``: a launch then starts cold instead (``popen``)
        self._server = getattr(forkserver._forkserver, "_forkserver_pid", None)
        self._env = dict(env)

    def popen(self, cmd: Sequence[str], env: Mapping[str, str]) -> AgentProcess:
        """The process of the launch ``cmd`` under ``env``: forked by the server, else a new one.

        Forked where the server serves that launch; else a new process (stdout discarded, stderr a
        text pipe, a session of its own, as a forked one)."""
        argv = agent_options(cmd)
        serving = self._server is not None and start_time(self._server) is not None
        if argv is not None and self._env is not None and not serving:
            self._gone()
        if argv is not None and self._env is not None and serving and compatible(self._env, env):
            try:
                return self._fork(Launch(argv, dict(env), os.getpid(), start_time(os.getpid())))
            except (OSError, EOFError):  # the server is gone (killed): this launch starts cold
                self._gone()
        return subprocess.Popen(
            list(cmd),
            env=dict(env),
            text=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def _gone(self) -> None:
        """The server is gone (killed): this launch and every later one start cold; said once."""
        if not self._cold_said:
            print(
                f"resihp: the warm-agent server (process {self._server}) is gone; launches start "
                "their agents cold from now on",
                file=sys.stderr,
                flush=True,
            )
            self._cold_said = True
        self._env = None

    def _fork(self, launch: Launch) -> ForkedAgent:
        read, write = os.pipe()
        said, say = os.pipe()
        pipes = [Connection(write, readable=False), Connection(say, readable=False)]
        try:
            process = self._context.Process(
                target=serve, args=(launch, *pipes), name=f"resihp-agent-{len(self._forked)}"
            )
            process.start()
        except BaseException:
            os.close(read)
            os.close(said)
            raise
        finally:
            for pipe in pipes:
                pipe.close()  # the agent holds its own copies
        agent = ForkedAgent(process, open(read), said)  # noqa: SIM115 - the agent's stderr, read to its end
        _await_session(agent)
        self._forked.append(agent)
        return agent

    def close(self) -> None:
        """End every forked agent still running, so that no exit waits for one.

        A job's end has ended them; this is for an error's way out."""
        for agent in self._forked:
            if agent.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        self._forked = []


def _await_session(process: ForkedAgent, timeout_s: float = 30.0) -> None:
    """Until the forked agent leads its own session (its first act), as a ``Popen`` started with
    ``start_new_session`` does on return: a signal to its process group must reach it."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(process.pid) == process.pid:
                return
        time.sleep(0.001)


@contextlib.contextmanager
def _environ(env: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` is ``env`` inside (the server's start reads it); only while this process
    runs one thread."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def agent_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the server starts under: the launcher's, with what every launch sets.

    What every launch sets at start-up; ``launch.worker_env`` adds the rest, all in
    ``RUNTIME_ENV``."""
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


WARM_AGENTS = WarmAgents()  # this process's
