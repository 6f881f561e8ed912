"""No signal from a launcher reaches a process it did not start, whatever the job's store says."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from resihp.detect.heartbeat import connect_store, node_key, rank_key
from resihp.launch.supervisor import owned
from resihp.train import controlplane as cp
from resihp.train.lifecycle import ProcessTracker, start_time

SMALL = [
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "2",
    "--ffn-hidden",
    "64",
    "--vocab",
    "128",
    "--global-tokens",
    "512",
    "--budget",
    "256",
    "--max-len",
    "256",
    "--dp",
    "2",
    "--pp",
    "1",
    "--no-live",
    "--timeout",
    "30",
    "--heartbeat-timeout",
    "3",
    "--recovery",
    "none",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _bystander() -> subprocess.Popen:
    """A process no launcher started (SIGUSR1 or SIGKILL would end it)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])


def test_owned_needs_descent_and_the_same_start_time():
    root = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "time.sleep(60)",
        ]
    )
    other = _bystander()
    try:
        tracker = ProcessTracker(root.pid)
        deadline = time.time() + 20
        while len(tracker.known) < 2 and time.time() < deadline:
            tracker.scan()
            time.sleep(0.05)
        child = next(p for p in tracker.known if p != root.pid)
        assert owned(tracker, root.pid, child) and owned(tracker, root.pid, root.pid)
        assert not owned(tracker, root.pid, other.pid)
        assert not owned(tracker, root.pid, None) and not owned(tracker, root.pid, -1)
        tracker.known[child] = start_time(child) - 1  # the PID now names a later process
        assert not owned(tracker, root.pid, child)
    finally:
        for p in (root, other):
            p.kill()
            p.wait()
        for pid in list(tracker.known):
            if pid != root.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_forged_heartbeat_naming_another_process_gets_it_no_signal(tmp_path):
    """A forged beat and a forged node aggregate name a bystander's PID as a hung rank 1: neither
    carries the job's signature, so both are refused (one line per key), and no signal reaches the
    bystander, whether the job trains on or ends judging the hidden rank lost."""
    bystander = _bystander()
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resihp.cli",
            "run",
            *SMALL,
            "--steps",
            "100000",
            "--out",
            str(tmp_path / "run"),
            "--json",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        store = connect_store("127.0.0.1", port, timeout_s=60)
        end = time.monotonic() + 60
        while not store.check([cp.JOB_KEY]):
            assert time.monotonic() < end, "the job never announced itself"
            time.sleep(0.1)
        job = json.loads(store.get(cp.JOB_KEY))["job_id"]
        hb = cp.heartbeat_prefix(job)
        while not store.check([node_key(hb, 0)]):
            assert time.monotonic() < end, "node 0 never beat"
            time.sleep(0.1)
        beat = {"c": 10**6, "pid": bystander.pid, "step": 1, "phase": "train", "ops": 1, "wait": ""}
        entry = {
            "seen": True,
            "silent_s": 0.0,
            "stalled_s": 1000.0,
            "step": 1,
            "phase": "train",
            "ops": 1,
            "wait": "",
            "pid": bystander.pid,
            "exited": False,
            "stopped": False,
            "alive": True,
        }
        moving = {
            "seen": True,
            "silent_s": 0.0,
            "stalled_s": 0.0,
            "step": 5,
            "phase": "train",
            "ops": 50,
            "wait": "allreduce",
        }
        forged = {"beat": 10**6, "ranks": {"0": moving, "1": entry}}
        n, until = 0, time.monotonic() + 8  # past the hang timeout the forged aggregate claims
        while proc.poll() is None and time.monotonic() < until:
            try:
                store.set(rank_key(hb, 0, 1), json.dumps(beat))
                forged["beat"] += 1
                # overwriting node 0's own aggregate also hides its real one (refused records read
                # as silence, so the job may judge rank 1 lost: a denial of service, not steering)
                store.set(node_key(hb, 0), json.dumps(forged))
            except RuntimeError:  # the job ended, and its store with it
                break
            n += 1
            time.sleep(0.02)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the operator's Ctrl-C ends the run
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    try:
        assert bystander.poll() is None, f"the bystander died (exit {bystander.returncode})"
    finally:
        bystander.kill()
        bystander.wait()
    assert "Traceback" not in err, err[-3000:]
    refused = [line for line in err.splitlines() if "refused" in line]
    assert any(rank_key(hb, 0, 1) in line for line in refused), err[-3000:]
    assert any(node_key(hb, 0) in line for line in refused), err[-3000:]
    assert not [line for line in err.splitlines() if f"process {bystander.pid}" in line], err[
        -3000:
    ]
    assert n > 0
