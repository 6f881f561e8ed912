"""Imported first by the warm-agent server (``resihp.launch.warm.PRELOAD``), for its effects.

Its effects on the server and the agents it forks:

- the server asks for SIGKILL when the launcher that started it dies. multiprocessing's forkserver
  ends when every holder of its pipe has closed it, and each forked agent holds one, so without
  this a launcher killed by SIGKILL would leave the server and, through it, its agents running;
- each forked agent runs the launcher's main module again as ``__mp_main__`` (multiprocessing's
  rule), by ``runpy``; for ``python -m resihp.cli`` that module is preloaded already, and ``runpy``
  warns of that on the user's terminal, once per agent. The preload is what makes the fork warm,
  so the warning says nothing there and is silenced in the server (its children inherit it).

Only the server imports this module."""

from __future__ import annotations

import warnings

from resihp.train.lifecycle import die_with_parent

die_with_parent()
warnings.filterwarnings(
    "ignore",
    category=RuntimeWarning,
    module="runpy",
    message=r".* found in sys\.modules after import of package .*",
)
