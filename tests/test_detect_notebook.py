"""notebooks/detector.ipynb runs end to end (quick mode) and finds Alibaba job 1's straggler."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.notebook_runner import run_notebook

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout (notebooks, examples)


@pytest.mark.slow
def test_detector_notebook_runs():
    proc = run_notebook(
        REPO_ROOT / "notebooks" / "detector.ipynb",
        timeout_s=600,
        env={"RESIHP_QUICK": "1", "OMP_NUM_THREADS": "1"},
    )
    out = proc.stdout
    assert "worker 6 found" in out
    assert "pipeline, lengths+timestamps" in out and "false_alarms_per_10k_healthy_steps" in out
    resihp_row = next(line for line in out.splitlines() if line.startswith("resihp "))
    assert "True" in resihp_row
