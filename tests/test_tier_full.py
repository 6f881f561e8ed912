"""The memory tier's file system filling while a job runs (issue 70): a real ``resihp run`` whose
tier is a small tmpfs of its own (root only), filled by the test once step N is in the trace.
Without a checkpoint due from the tier, training goes on and says so once; with one, the job stops
in one line naming the tier, the bytes needed and free and the newest good checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from resihp.ckpt.integrity import candidates
from tests.faults import fill
from tests.test_bounded_inputs import SMALL_RUN, _tmpfs

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
FILL_AT = 4  # the step after which the test fills the tier


@pytest.fixture
def tier_root(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs for the job's memory tier (its slots take about 2.5 MiB)."""
    with _tmpfs(tmp_path / "shm", "16m", " for the memory tier") as root:
        yield root


def _newest_step(out: Path) -> int:
    stream = out / "ops.jsonl"
    steps = [-1]
    if stream.exists():
        for line in stream.read_text().splitlines():
            try:
                steps.append(int(json.loads(line).get("step", -1)))
            except (ValueError, TypeError):  # a line being written
                continue
    return max(steps)


def _run_filling(out: Path, root: Path, steps: int, *extra: str) -> tuple[subprocess.Popen, str]:
    """Run the small job; fill ``root`` once step ``FILL_AT`` is in its trace; (process, stderr)."""
    args = list(SMALL_RUN)
    args[args.index("--steps") + 1] = str(steps)
    proc = subprocess.Popen(
        [sys.executable, "-m", "resihp.cli", "run", "-o", str(out), *args, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**ENV, "RESIHP_SHM": str(root)},
    )
    filled = False
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if not filled and _newest_step(out) >= FILL_AT:
            fill(root)
            filled = True
        time.sleep(0.02)
    if proc.poll() is None:
        proc.kill()
    _, err = proc.communicate()
    assert filled, f"the job ended before step {FILL_AT}: {err[-2000:]}"
    return proc, err


@pytest.mark.slow
def test_a_tier_filling_mid_run_leaves_training_going_and_says_so_once(
    tier_root: Path, tmp_path: Path
) -> None:
    """Snapshots only: every step is trained, the job is done, and one line says the tier is
    full, where, and the newest snapshot kept (it stalled 60 s, then 'workers exited')."""
    out = tmp_path / "run"
    proc, err = _run_filling(out, tier_root, 24)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["error"] is None and len(summary["losses"]) == 24
    notes = [line for line in err.splitlines() if line.startswith("resihp: note:")]
    assert len(notes) == 1, err[-3000:]
    (note,) = notes
    assert str(tier_root) in note and "is full" in note and "MiB is free" in note, note
    assert "snapshots go on without it" in note and "newest snapshot in memory: step" in note
    assert json.loads((out / "run.json").read_text())["state"] == "done"


@pytest.mark.slow
def test_a_tier_filling_before_a_checkpoint_due_from_it_stops_in_one_line(
    tier_root: Path, tmp_path: Path
) -> None:
    """The keeper writes the checkpoints from the snapshots: a checkpoint due once the tier is
    full cannot be taken, so the job stops (failed, never done) in one line naming the tier, the
    bytes needed and free, and the newest good checkpoint, which is on disk and resumable."""
    out = tmp_path / "run"
    proc, err = _run_filling(out, tier_root, 40, "--ckpt-every", "4")
    assert proc.returncode != 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    (line,) = [x for x in err.splitlines() if "cannot be: stopped" in x]
    assert str(tier_root) in line and "a snapshot needs" in line and "MiB is free" in line, line
    # the checkpoint it names is one on disk, or none (the keeper may still be writing the one
    # due before the fill when the trainers stop: it is then the run's resumable one)
    named = line.split("newest good checkpoint: ")[1].split(";")[0]
    assert named == "none" or Path(named).is_dir(), line
    record = json.loads((out / "run.json").read_text())
    assert record["state"] == "failed"
    found = candidates(out / "ckpt")
    assert record["resumable"]["checkpoint"] == (str(found[0]) if found else None)
