import os
import subprocess
import sys

import numpy as np
import pytest

from resihp.errors import InputError
from resihp.opstrace import read_meta, read_ops_trace
from resihp.perf.step_replay import replay_steps


@pytest.mark.slow
def test_replay_of_a_real_two_stage_run(tmp_path):
    """A real 2-process pipeline (torchrun, gloo): the replayed critical path tracks measured
    steps."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "resihp.train.worker",
        "--dp",
        "1",
        "--pp",
        "2",
        "--steps",
        "4",
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
        "2048",
        "--budget",
        "512",
        "--max-len",
        "512",
        "--out",
        str(out),
    ]
    subprocess.run(
        cmd,
        check=True,
        capture_output=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    ops = read_ops_trace(out / "ops.parquet")
    meta, _ = read_meta(out / "job.yaml")
    table = replay_steps(ops, meta, "1f1b")
    assert len(table) == 3
    # the critical path can never be longer than what every op it contains measured end to end,
    # and it must explain most of the measured step (loose bound: this machine is shared)
    assert np.all(table["predicted_s"] > 0.5 * table["measured_s"])
    assert np.all(table["predicted_s"] < 1.5 * table["measured_s"])


def test_replay_needs_step_records():
    import pandas as pd

    from resihp.opstrace import JobMeta, validate_ops_trace

    ops = validate_ops_trace(
        pd.DataFrame(
            {
                "step": [0, 0],
                "rank": [0, 0],
                "dp_rank": [0, 0],
                "stage": [0, 0],
                "optype": ["forward-compute", "backward-compute"],
                "duration": [0.1, 0.2],
                "mb_id": [0, 0],
            }
        )
    )
    with pytest.raises(InputError, match="no 'step' records"):
        replay_steps(ops, JobMeta(dp_size=1, pp_size=1, tp_size=1, world_size=1), "1f1b")
