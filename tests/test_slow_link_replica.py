"""A slow pipeline link under ``resihp run``'s default recovery (replica-level fault tolerance,
each replica a job of its own): the injected delay reaches both directions of the link's
messages, the live detector names the link by both ends, the live loop decides on it, and the job
ends exit 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from resihp.detect.config import DetectorConfig
from tests.test_runtime_cli import SMALL

ONSET, FACTOR, STEPS = 8, 100, 16


@pytest.mark.slow
def test_slow_link_is_found_in_replica_mode(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resihp.cli",
            "run",
            "--dp",
            "2",
            "--pp",
            "2",
            "--steps",
            str(STEPS),
            "--calibration-steps",
            "6",
            "--inject",
            f"link:ranks=0+2,factor={FACTOR},step={ONSET}",
            *SMALL,
            "--json",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((out / "config.json").read_text())["faults"]["recovery"] == "replica"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["error"] is None and summary["live_error"] is None, summary
    links = [e for e in summary["events"] if e["kind"] == "link-slow" and e["ranks"] == [0, 2]]
    assert links, summary["events"]
    ev = links[0]
    assert ev["traffic"] == "pipeline"
    assert ONSET <= ev["detected_step"] <= ONSET + DetectorConfig().detect_within, ev
    # never a fail-slow of either end: a slow link makes its ends wait, not compute longer
    slow = [e for e in summary["events"] if e["kind"] == "fail-slow" and e["rank"] in (0, 2)]
    assert not slow, slow
    # the live loop re-planned on the finding (replica mode: within each replica's own ranks)
    reasons = [c["reason"] for c in summary["plan_changes"]]
    assert any(r.get("kind") == "link-slow" and r.get("ranks") == [0, 2] for r in reasons), reasons
    assert len(summary["losses"]) == STEPS  # every step trained
