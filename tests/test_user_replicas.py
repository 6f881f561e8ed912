"""Replica-level fault tolerance over the user's own loop (``resihp replicas``, ``Replicas``).

Real processes: ``resihp replicas`` runs examples/ddp_replicas.py, 2 replicas x 1 rank (gloo, CPU).
One replica's rank is SIGKILLed (or SIGSTOPped, then SIGKILLed; or SIGSTOPped alone, which the
launcher judges after ``--stopped-s``) at a random mid-run step; the
survivor trains on alone, taking the lost replica's shares (zero-drift), the victim is relaunched,
catches up from the survivor and rejoins, and every step's loss is bitwise the failure-free run's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.faults import alive, descendants, inject_signal, wait_for, wait_gone

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ddp_replicas.py"
STEPS = 30
PACE_S = 0.45  # the survivor's steps outlast the victim's relaunch (a Python start with torch)


def _launch(out: Path, steps: int, pace: float, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "resihp.cli", "replicas", "--replicas", "2", "--json", *extra,
         str(EXAMPLE), "--out", str(out), "--steps", str(steps), "--pace", str(pace)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _log(out: Path, replica: int) -> list[dict]:
    path = out / f"losses.replica{replica}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _losses(lines: list[dict]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in lines if "step" in e}


class _Descendants(threading.Thread):
    """Every process under the launcher seen while it runs (to check none is left after)."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.seen, self.stop = root, set(), threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() and alive(self.root):
            self.seen |= descendants(self.root)
            time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("reference")
    proc = _launch(out, STEPS, 0.0)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    losses = _losses(_log(out, 0))
    assert sorted(losses) == list(range(STEPS))
    assert _losses(_log(out, 1)) == losses
    return losses


@pytest.mark.parametrize("fault", ["kill", "stop-then-kill", "stop"])
def test_a_lost_replica_rejoins_and_the_losses_equal_the_failure_free_run(
    reference, tmp_path, fault
):
    at = random.Random().randint(2, 5)  # the victim's steps logged before the fault
    proc = _launch(tmp_path, STEPS, PACE_S, "--stopped-s", "2" if fault == "stop" else "30")
    watch = _Descendants(proc.pid)
    watch.start()
    try:
        wait_for(lambda: len(_losses(_log(tmp_path, 1))) >= at, 60, f"replica 1's step {at}")
        victim = _log(tmp_path, 1)[0]["pid"]
        assert victim in descendants(proc.pid)  # a process this test started
        if fault != "kill":
            inject_signal(victim, signal.SIGSTOP)
        if fault == "stop-then-kill":
            time.sleep(1.5)
        if fault != "stop":  # stopped alone: the launcher ends it after --stopped-s
            inject_signal(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        watch.stop.set()
        watch.join()
    assert proc.returncode == 0, err[-3000:]
    cause = "stopped" if fault == "stop" else "exited with status 1"
    assert f"replica 1 attempt 0 {cause}" in err and "relaunched" in err, err[-3000:]
    outcome = json.loads(out.strip().splitlines()[-1])
    assert [
        (f["replica"], f["attempt"], f["cause"], f["relaunched"]) for f in outcome["failures"]
    ] == [(1, 0, cause, True)]
    survivor, victim_log = _log(tmp_path, 0), _log(tmp_path, 1)
    relaunch = next(k for k, e in enumerate(victim_log) if e.get("attempt") == 1)
    before = len(_losses(victim_log[:relaunch]))  # the steps its first launch trained
    assert before >= at
    # the survivor kept training while the victim was down: it trained both shares
    alone = [e["step"] for e in survivor if "step" in e and e["shares"] == [0, 1]]
    assert alone and min(alone) >= before
    catchups = [e["catchup"] for e in victim_log if "catchup" in e]
    assert catchups, f"the relaunched replica did not rejoin: {victim_log[relaunch:]} {err[-2000:]}"
    catchup = catchups[0]
    assert catchup["from_step"] == max(alone) + 1
    assert catchup["bytes"] > 0 and catchup["state_step"] >= before
    rejoined = _losses(victim_log[relaunch:])
    assert sorted(rejoined) == list(range(catchup["from_step"], STEPS))
    # zero-drift: every step's loss, on either replica, is bitwise the failure-free run's
    assert _losses(survivor) == reference
    assert all(reference[s] == v for s, v in _losses(victim_log).items())
    assert wait_gone(watch.seen, 10) == set()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["-m", "resihp.cli", "replicas", "--replicas", "1", str(EXAMPLE)],
            "--replicas: expected 2",
        ),
        (["-m", "resihp.cli", "replicas", "nosuch.py"], "script nosuch.py: no such file"),
        (
            ["-m", "resihp.cli", "replicas", "--stopped-s", "0", str(EXAMPLE)],
            "expected seconds > 0",
        ),
        ([str(EXAMPLE), "--out", "OUT"], "run the script under `resihp replicas`"),
    ],
)
def test_bad_replicas_input_is_one_line(argv, message, tmp_path):
    argv = [a.replace("OUT", str(tmp_path)) for a in argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("RESIHP_STORE", None)
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
