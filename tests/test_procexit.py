"""Ending a process without module teardown keeps what a normal exit does for its outputs: the
status, buffered output, atexit handlers, and a running non-daemon thread's work."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROLOGUE = """
import atexit, sys, threading, time
from resihp.procexit import exit_now, run_then_exit
atexit.register(lambda: print("atexit ran"))
sys.stdout.write("buffered, no newline")
"""


def _run(body: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PROLOGUE + body], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("code, status", [(0, 0), (3, 3), (None, 0)])
def test_status_buffered_output_and_atexit_handlers(code, status):
    proc = _run(f"exit_now({code!r})")
    assert proc.returncode == status
    assert proc.stdout == "buffered, no newlineatexit ran\n"


def test_a_message_goes_to_stderr_with_status_1_as_with_sys_exit():
    proc = _run("run_then_exit(lambda: sys.exit('resihp: error: bad'))")
    assert proc.returncode == 1 and proc.stderr == "resihp: error: bad\n"


def test_a_running_non_daemon_thread_finishes_its_work_first():
    proc = _run(
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()\n"
        "run_then_exit(lambda: None)"
    )
    assert proc.returncode == 0 and "thread done" in proc.stdout and "atexit ran" in proc.stdout


def test_any_other_exception_is_a_traceback_and_status_1():
    proc = _run("run_then_exit(lambda: 1 / 0)")
    assert proc.returncode == 1 and "ZeroDivisionError" in proc.stderr


def test_an_exception_in_a_multiprocessing_child_is_its_traceback_alone():
    """A warm agent is a multiprocessing child: its failure reads in the log as a cold agent's,
    not under "Process NAME:" with the bootstrap's frames."""
    body = (
        "import multiprocessing as mp\n"
        "def child():\n"
        "    run_then_exit(lambda: 1 / 0)\n"
        "p = mp.get_context('fork').Process(target=child, name='resihp-agent-0')\n"
        "p.start(); p.join(); print('child status', p.exitcode)\n"
    )
    proc = _run(body)
    assert "child status 1" in proc.stdout, proc.stdout
    assert proc.stderr.startswith("Traceback (most recent call last):"), proc.stderr
    assert "ZeroDivisionError" in proc.stderr and "resihp-agent-0" not in proc.stderr
    assert "_bootstrap" not in proc.stderr
