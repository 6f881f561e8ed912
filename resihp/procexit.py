"""Ending a process without Python's teardown of every module it imported.

At exit, Python finalises each imported module; with torch imported that alone takes 0.4 s, with
``torch._dynamo`` 0.75 s (measured on this project's 2-core VM), and a run waits for it in each
torchrun agent and again in its launcher. ``exit_now`` runs the ``atexit`` handlers (logging's
flush, multiprocessing's joins of its children, torch's own), flushes stdout and stderr, and ends
the process with ``os._exit``: what a normal exit does for the process's outputs, without the
teardown. Where a non-daemon thread is still running, a normal exit waits for it, so it does.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn


def exit_now(code: int | str | None = 0, said: Callable[[int], None] | None = None) -> NoReturn:
    """End the process with ``code`` as ``sys.exit(code)`` would, without finalising its modules.

    None means 0; a string is printed to stderr, status 1. ``said`` is handed the status first."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    code = 0 if code is None else int(code)
    if said is not None:
        said(code)
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if any(t.is_alive() and not t.daemon for t in others):
        sys.exit(code)
    atexit._run_exitfuncs()  # the registered handlers, as at a normal exit
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run_then_exit(fn: Callable[[], object], said: Callable[[int], None] | None = None) -> NoReturn:
    """A process's main: ``fn()``, then ``exit_now`` with the status it ended with.

    The status is 0, or its ``SystemExit``'s. Any other exception ends it as an uncaught one ends a
    Python program (its traceback on stderr, status 1), also in a multiprocessing child, which would
    print it under a "Process NAME:" line with its bootstrap's frames (a warm agent's failure in
    ``workers.log``). A ``KeyboardInterrupt`` propagates. ``said``: as ``exit_now``'s."""
    try:
        fn()
    except SystemExit as exc:
        exit_now(exc.code, said)
    except Exception:
        traceback.print_exc()
        exit_now(1, said)
    exit_now(0, said)
