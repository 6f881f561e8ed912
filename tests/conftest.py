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
    return batches, run_profile(cfg, batches, budget=256, device=torch.device("cpu"), repeats=3,
                                model_name="tiny")


@pytest.fixture
def shm(tmp_path, monkeypatch) -> Path:
    """A scratch root for memory tiers (under /dev/shm where there is one), as RESIHP_SHM."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    root = root / f"resihp-test-{os.getpid()}-{time.monotonic_ns()}"
    root.mkdir()
    monkeypatch.setenv("RESIHP_SHM", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)
