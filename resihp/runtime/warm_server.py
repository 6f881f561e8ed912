"""Imported first by the warm-agent server (``resihp.runtime.warm.PRELOAD``), for its one effect:
the server asks for SIGKILL when the launcher that started it dies. multiprocessing's forkserver
ends when every holder of its pipe has closed it, and each forked agent holds one, so without this
a launcher killed by SIGKILL would leave the server and, through it, its agents running. Only the
server imports this module."""

from __future__ import annotations

from resihp.runtime.lifecycle import die_with_parent

die_with_parent()
