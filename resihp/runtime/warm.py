"""What a warm agent (``resihp.runtime.spares``) runs once the server has forked it: ``serve``, with
the ``Launch`` the launcher hands it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing.connection import Connection

from resihp.procexit import run_then_exit
from resihp.runtime.lifecycle import die_with_parent


@dataclass(frozen=True)
class Launch:
    """One launch of the agent: its options (torchrun's, then ``-m resihp.runtime.worker --config
    PATH``) and its environment."""

    argv: list[str]
    env: dict[str, str]


def serve(launch: Launch, stderr: Connection) -> None:
    """A forked agent: a session of its own, SIGKILL when the server dies, stderr the launcher's
    pipe, stdout discarded, the launch's environment; then the agent, ended as a cold one ends."""
    # imported by the server before it forks (``spares.PRELOAD``): here it costs nothing, and the
    # launcher, which only names this function, never imports torch for it
    from resihp.runtime import agent

    os.setsid()
    die_with_parent()
    os.dup2(stderr.fileno(), 2)
    stderr.close()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    os.environ.clear()
    os.environ.update(launch.env)
    run_then_exit(lambda: agent.main(launch.argv))
