"""Per-step compute noise measured on real jobs.

The source is the Alibaba PAI per-worker mini-batch times (traces/alibaba/, see its README).

Each worker's time is divided by its own rolling median (21 iterations, centred), which leaves the
step-to-step fluctuation and removes slow drifts; iterations where the worker is a straggler (more
than 1.2x the median worker of that iteration) are left out, so the pool holds healthy noise only.
The replay draws multipliers from this pool, one per pipeline stage and step.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pandas as pd

from resihp.detect.alibaba import ALIBABA_DIR, alibaba_path
from resihp.errors import InputError


def worker_times(job: int) -> pd.DataFrame:
    """Iterations x workers table of normalised mini-batch times of an Alibaba PAI job."""
    path = alibaba_path(job)
    if not path.exists():
        available = sorted(p.stem.split("_")[1] for p in ALIBABA_DIR.glob("job_*_norm.csv"))
        raise InputError(f"noise.alibaba_job: no trace for job {job} (have {', '.join(available)})")
    df = pd.read_csv(path)
    return df.pivot_table(index="time", columns="worker", values="batch_time_norm").sort_index()


@lru_cache(maxsize=8)
def noise_pool(job: int = 2) -> np.ndarray:
    """Healthy multiplicative noise samples (median 1) from one Alibaba job."""
    times = worker_times(job)
    local = times / times.rolling(21, center=True, min_periods=5).median()
    straggling = times.div(times.median(axis=1), axis=0) > 1.2
    values = local.where(~straggling).to_numpy().ravel()
    values = values[np.isfinite(values) & (values > 0)]
    return values / np.median(values)
