import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from resihp.paths import TRACES


@pytest.fixture(scope="session")
def tiny_profile():
    """A committed real profiling log of a tiny decoder stack (traces/profiles/README.md): training
    and planning are tested on fixed data, never on how this machine happens to run today."""
    return TRACES / "profiles" / "tiny-cpu.parquet"


@pytest.fixture(scope="session")
def measured_profile():
    """A fresh real measurement of a few micro-batches, for tests of the profiler's bookkeeping
    (its columns and schedule), never of its numbers."""
    from resihp.model.config import GPTConfig
    from resihp.perf.calibrate import draw_microbatches, run_profile

    torch.set_num_threads(1)
    batches = draw_microbatches(["code", "changelog"], 3, 256, 256, np.random.default_rng(0))
    cfg = GPTConfig(layers=1, hidden=64, heads=2, ffn_hidden=128, max_seq_len=256)
    return batches, run_profile(
        cfg, batches, budget=256, device=torch.device("cpu"), repeats=3, model_name="tiny"
    )


@pytest.fixture
def shm(tmp_path, monkeypatch) -> Path:
    """A scratch root for memory tiers (under /dev/shm where there is one), as RESIHP_SHM."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    root = root / f"resihp-test-{os.getpid()}-{time.monotonic_ns()}"
    root.mkdir()
    monkeypatch.setenv("RESIHP_SHM", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def issue_run_losses(tmp_path_factory) -> list[float]:
    """The per-step losses of one process training the issue's run (``ISSUE_RUN``: DP 2 x TP 2 of
    the default model) failure-free for ``ISSUE_STEPS`` steps: the reference of both live tests that
    re-form its tensor-parallel group (``tests/test_replica_ft.py``,
    ``tests/test_reshard_live.py``), trained once (about 20 s on 2 cores). The learning rate is
    constant, so a shorter run's losses are its first ones."""
    from tests.replica_replay import ISSUE_RUN, ISSUE_STEPS, replay_membership

    return replay_membership(
        {**ISSUE_RUN, "steps": ISSUE_STEPS},
        [[0, 1]] * ISSUE_STEPS,
        tmp_path_factory.mktemp("issue-run-replay"),
    )


@pytest.fixture(autouse=True)
def _priority_kept():
    """A test that runs ``resihp follow`` in this process without ``--nice 0`` lowers pytest's CPU
    priority for every later test (and the followers they start read nice 19, not 10): the test
    that did it fails, not a later one."""
    before = os.nice(0)
    yield
    assert os.nice(0) == before, (
        f"this test changed pytest's nice value from {before} to {os.nice(0)}"
    )
