"""Checkpoints the node's keeper writes from memory in real ``resihp run`` jobs (torchrun workers,
gloo, CPU, fixed seed): with ``--snapshot-every`` and ``--ckpt-every`` on one node the trainers do
not save; the keeper's checkpoints hold the same tensors as the trainers' own saves, ``--ckpt-keep``
prunes them, and when a rank dies the keeper writes the newest step complete in memory, which the
elastic restart then resumes from (instead of the older periodic checkpoint)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from resihp.ckpt.integrity import candidates, problem
from resihp.ckpt.keeper import STOPPED_KEEPER_S
from resihp.ckpt.universal import read_full

pytestmark = pytest.mark.slow

SMALL = [
    "--layers",
    "2",
    "--hidden",
    "64",
    "--heads",
    "2",
    "--ffn-hidden",
    "128",
    "--vocab",
    "256",
    "--global-tokens",
    "1024",
    "--budget",
    "256",
    "--max-len",
    "256",
    "--no-live",
    "--json",
    "--heartbeat-timeout",
    "3",
    "--timeout",
    "60",
    "--recovery",
    "none",
]


def _run(out: Path, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "run", "-o", str(out), *SMALL, *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "ckpt" / "persist.jsonl").read_text().splitlines()]


def test_keeper_checkpoints_hold_what_the_trainers_would_save(tmp_path):
    layout = ["--dp", "2", "--pp", "2", "--steps", "8"]
    saved = _run(tmp_path / "saved", *layout, "--ckpt-every", "3")
    kept = _run(
        tmp_path / "kept", *layout, "--ckpt-every", "3", "--snapshot-every", "1", "--ckpt-keep", "1"
    )
    assert kept["losses"] == saved["losses"]
    assert [e["step"] for e in _log(tmp_path / "kept")] == [2, 5]
    assert [p.name for p in candidates(tmp_path / "kept" / "ckpt")] == ["step5"]  # --ckpt-keep 1
    assert not (
        tmp_path / "saved" / "ckpt" / "persist.jsonl"
    ).exists()  # no snapshots: the trainers saved
    ours, theirs = (
        read_full(tmp_path / "kept" / "ckpt" / "step5"),
        read_full(tmp_path / "saved" / "ckpt" / "step5"),
    )
    assert set(ours) == set(theirs)
    # every model and AdamW tensor bitwise; the process-wide RNG state differs between the two
    # kinds of run (library calls draw from it; the training itself never does)
    for key in ours:
        if not key.startswith("rng."):
            assert torch.equal(ours[key], theirs[key]), key


def test_a_dead_rank_leaves_the_newest_snapshot_on_disk_for_the_restart(tmp_path):
    summary = _run(
        tmp_path / "run",
        "--dp",
        "2",
        "--pp",
        "1",
        "--steps",
        "10",
        "--snapshot-every",
        "1",
        "--ckpt-every",
        "4",
        "--inject",
        "stop:rank=1,step=6",
    )
    assert summary["failure"]["rank"] == 1
    log = _log(tmp_path / "run")
    assert log[0]["step"] == 3 and log[0]["reason"] == "due"
    breakpoint_ = [e for e in log if e["reason"] == "breakpoint"]
    assert (
        len(breakpoint_) == 1 and breakpoint_[0]["step"] > 3
    )  # newer than the periodic checkpoint
    newest = breakpoint_[0]["step"]
    assert problem(tmp_path / "run" / "ckpt" / f"step{newest}") is None
    change = summary["plan_changes"][-1]
    assert change["kind"] == "exclude" and change["restart_from"].endswith(f"step{newest}")
    assert change["resumed_step"] == newest + 1
    assert summary["after_restart"]["first_step"] == newest + 1


def test_a_keeper_stopped_longer_than_the_hang_timeout_is_replaced_without_a_failure(tmp_path):
    """The keeper is stopped (SIGSTOP) once it has written its first checkpoint, and stays stopped:
    the trainers wait on it (a wait on the keeper, not a hang, however long past the hang timeout,
    3 s) until it has been stopped for ``STOPPED_KEEPER_S``, then a new keeper takes over. The run
    ends with every step and every checkpoint."""
    out, shm = tmp_path / "run", tmp_path / "shm"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RESIHP_SHM": str(shm)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resihp.cli",
            "run",
            "-o",
            str(out),
            *SMALL,
            "--dp",
            "2",
            "--pp",
            "1",
            "--steps",
            "10",
            "--snapshot-every",
            "1",
            "--ckpt-every",
            "2",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while (
            not (out / "ckpt" / "persist.jsonl").exists()
            and proc.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        pids = [int(p.read_text()) for p in shm.glob("*/keeper.pid")]
        assert pids, "no keeper found"
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        now: set[int] = set()
        while (
            not (now and not now & set(pids))
            and proc.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)  # a trainer waiting on it replaces it once it was stopped 2 s
            with contextlib.suppress(OSError, ValueError):
                now = {int(p.read_text()) for p in shm.glob("*/keeper.pid")}
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert now and not now & set(pids), (pids, now)  # a new keeper holds the tier
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["failure"] is None and len(summary["losses"]) == 10
    assert [e["step"] for e in _log(out)] == [1, 3, 5, 7, 9]
    ops = pd.read_parquet(out / "ops.parquet")
    # the trainers were held up while the keeper was stopped (no snapshot of an unstopped run is
    # near a second: they copy a few MB)
    assert ops.loc[ops.optype == "snapshot", "duration"].max() > STOPPED_KEEPER_S / 2
