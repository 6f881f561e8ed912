"""Checkpoints the node's keeper writes from memory in real ``resihp run`` jobs (torchrun workers,
gloo, CPU, fixed seed): with ``--snapshot-every`` and ``--ckpt-every`` on one node the trainers do
not save; the keeper's checkpoints hold the same tensors as the trainers' own saves, ``--ckpt-keep``
prunes them, and when a rank dies the keeper writes the newest step complete in memory, which the
elastic restart then resumes from (instead of the older periodic checkpoint)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resihp.ckpt.integrity import candidates, problem
from resihp.ckpt.universal import read_full

pytestmark = pytest.mark.slow

SMALL = ["--layers", "2", "--hidden", "64", "--heads", "2", "--ffn-hidden", "128", "--vocab", "256",
         "--global-tokens", "1024", "--budget", "256", "--max-len", "256", "--no-live", "--json",
         "--heartbeat-timeout", "3", "--timeout", "60", "--recovery", "none"]


def _run(out: Path, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "resihp.cli", "run", "-o", str(out), *SMALL, *args],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "ckpt" / "persist.jsonl").read_text().splitlines()]


def test_keeper_checkpoints_hold_what_the_trainers_would_save(tmp_path):
    layout = ["--dp", "2", "--pp", "2", "--steps", "8"]
    saved = _run(tmp_path / "saved", *layout, "--ckpt-every", "3")
    kept = _run(tmp_path / "kept", *layout, "--ckpt-every", "3", "--snapshot-every", "1", "--ckpt-keep", "1")
    assert kept["losses"] == saved["losses"]
    assert [e["step"] for e in _log(tmp_path / "kept")] == [2, 5]
    assert [p.name for p in candidates(tmp_path / "kept" / "ckpt")] == ["step5"]  # --ckpt-keep 1
    assert not (tmp_path / "saved" / "ckpt" / "persist.jsonl").exists()  # no snapshots: the trainers saved
    ours, theirs = read_full(tmp_path / "kept" / "ckpt" / "step5"), read_full(tmp_path / "saved" / "ckpt" / "step5")
    assert set(ours) == set(theirs)
    # every model and AdamW tensor bitwise; the process-wide RNG state differs between the two
    # kinds of run (library calls draw from it; the training itself never does)
    for key in ours:
        if not key.startswith("rng."):
            assert torch.equal(ours[key], theirs[key]), key


def test_a_dead_rank_leaves_the_newest_snapshot_on_disk_for_the_restart(tmp_path):
    summary = _run(tmp_path / "run", "--dp", "2", "--pp", "1", "--steps", "10", "--snapshot-every", "1",
                   "--ckpt-every", "4", "--inject", "stop:rank=1,step=6")
    assert summary["failure"]["rank"] == 1
    log = _log(tmp_path / "run")
    assert log[0]["step"] == 3 and log[0]["reason"] == "due"
    breakpoint_ = [e for e in log if e["reason"] == "breakpoint"]
    assert len(breakpoint_) == 1 and breakpoint_[0]["step"] > 3  # newer than the periodic checkpoint
    newest = breakpoint_[0]["step"]
    assert problem(tmp_path / "run" / "ckpt" / f"step{newest}") is None
    change = summary["plan_changes"][-1]
    assert change["kind"] == "exclude" and change["restart_from"].endswith(f"step{newest}")
    assert change["resumed_step"] == newest + 1
    assert summary["after_restart"]["first_step"] == newest + 1
