"""A user's own checkpoint (``Snapshots.save``) resumed into another layout under torchrun:
FSDP2 at 2 ranks into FSDP2 at 4 and at 1, DDP at 2 into FSDP2 at 4; the losses after the resume
continue the first run's. A model of another shape is refused in one line. These are the only
tests that reshard a user's DCP checkpoint across real process groups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp2_reshard.py"
STEPS, SAVED = 6, 2


def _torchrun(nproc: int, out: Path, dcp: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RESIHP_SHM": str(out.parent / "shm")}
    args = ["--out", str(out), "--dcp", str(dcp), "--steps", str(STEPS), *extra]
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        + ["--nproc-per-node", str(nproc), str(EXAMPLE), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _losses(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "losses.jsonl").read_text().splitlines())}


_FIRST: dict[str, tuple[Path, dict[int, dict]]] = {}


def _first(wrap: str, tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    """A 2-rank run of 6 steps (``wrap``: fsdp2 or ddp) that saves its state after step 2."""
    if wrap not in _FIRST:
        base = tmp_path_factory.mktemp(wrap)
        run = _torchrun(2, base / "a", base / "ckpt", "--save-at", str(SAVED), "--wrap", wrap)
        assert run.returncode == 0, run.stderr[-3000:]
        _FIRST[wrap] = base / "ckpt", _losses(base / "a")
    return _FIRST[wrap]


@pytest.mark.parametrize("wrap, world", [("fsdp2", 4), ("fsdp2", 1), ("ddp", 4)])
def test_a_checkpoint_resumes_at_another_world_size_and_the_losses_go_on(
    wrap, world, tmp_path, tmp_path_factory
):
    ckpt, before = _first(wrap, tmp_path_factory)
    run = _torchrun(world, tmp_path / "b", ckpt, "--resume")
    assert run.returncode == 0, run.stderr[-3000:]
    after = _losses(tmp_path / "b")
    assert sorted(after) == list(range(SAVED + 1, STEPS))
    assert after[SAVED + 1]["resumed_from"] == "disk" and after[SAVED + 1]["world"] == world
    for step, rec in after.items():
        # the same global batch, reduced over another number of ranks: equal to float rounding
        assert rec["loss"] == pytest.approx(before[step]["loss"], rel=1e-6), step


def test_a_model_of_another_shape_is_refused_in_one_line(tmp_path, tmp_path_factory):
    ckpt, _ = _first("fsdp2", tmp_path_factory)
    run = _torchrun(2, tmp_path / "b", ckpt, "--resume", "--hidden", "48")
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if "error: " in line]
    assert lines and all("does not fit this state" in line for line in lines), run.stderr[-3000:]
    assert "model.0.weight" in lines[0] and f"step{SAVED}" in lines[0]
    assert not (tmp_path / "b" / "losses.jsonl").exists()  # nothing trained on a wrong load
