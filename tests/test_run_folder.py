"""A run folder used again: the new job reports its own summary, losses and trace, never the
previous job's; the previous job's outputs are kept in ``OUT/previous/<its job id>/``."""

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

TINY = [
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "4",
    "--ffn-hidden",
    "64",
    "--vocab",
    "61",
    "--global-tokens",
    "1024",
    "--budget",
    "256",
    "--max-len",
    "256",
    "--timeout",
    "60",
    "--no-live",
    "--json",
    "--dp",
    "1",
    "--pp",
    "1",
    "--tp",
    "1",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}


def run(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "run", *TINY, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def job_of(out) -> str:
    return json.loads((out / "run.json").read_text())["job_id"]


@pytest.mark.slow
@pytest.mark.parametrize("resume", [False, True], ids=["again", "resume-into-itself"])
def test_a_second_job_in_a_used_folder_reports_its_own_outputs(tmp_path, resume):
    out = tmp_path / "run"
    first = run("--steps", "4", "--ckpt-every", "2", "-o", str(out))
    first_job = job_of(out)
    assert first["job_id"] == first_job and len(first["losses"]) == 4
    second = (
        run("--steps", "6", "--resume", str(out), "-o", str(out))
        if resume
        else run("--steps", "2", "-o", str(out))
    )
    job = job_of(out)
    assert job != first_job and second["job_id"] == job
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["job_id"] == job and on_disk["losses"] == second["losses"]
    steps = sorted(pd.read_parquet(out / "ops.parquet").step.unique().tolist())
    if resume:  # steps 4 and 5 of 6, from the first job's checkpoint after step 3
        assert second["first_step"] == 4 and len(second["losses"]) == 2
        assert second["resume"]["checkpoint"] == str(out / "ckpt" / "step3")
        assert steps == [4, 5]
    else:
        assert second["first_step"] == 0 and len(second["losses"]) == 2 and steps == [0, 1]
        assert second["losses"] == first["losses"][:2]  # the same seed and data: the same losses
    kept = out / "previous" / first_job
    assert json.loads((kept / "summary.json").read_text())["losses"] == first["losses"]
    assert (kept / "ops.parquet").exists() and (kept / "logs").is_dir()
