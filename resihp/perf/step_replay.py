"""Replays the measured op durations of a real run through the step-time predictor.

For each step of an ops trace this builds the per-stage, per-micro-batch forward and backward
durations that the job measured, feeds them with the measured transfer, gradient-sync and
optimizer times to ``pipeline_step_time``, and sets the prediction beside the step time the job
measured. This is how the step predictor is validated on real multi-process runs.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from resihp.errors import InputError
from resihp.opstrace import JobMeta
from resihp.perf.schedule import pipeline_step_time

SEND_OPTYPES = ("forward-send", "backward-send")
SYNC_OPTYPES = (
    "grads-all-reduce",
    "grads-reduce-scatter",
    "params-all-gather",
    "embedding-grads-all-reduce",
    "layernorm-grads-all-reduce",
)


def _grid(rows: pd.DataFrame, meta: JobMeta, source: str) -> np.ndarray:
    """[model chunks, micro-batches] of one replica's slowest tensor-parallel rank's duration;
    model chunk ``mc * pp_size + stage`` (``mc`` is 0 without interleaving)."""
    if meta.vpp_size > 1 and ("mc" not in rows.columns or rows["mc"].isna().any()):
        raise InputError(
            f"{source}: vpp_size is {meta.vpp_size} but compute ops lack the model chunk column mc"
        )
    chunk = rows["mc"].fillna(0).astype(np.int64) * meta.pp_size if "mc" in rows.columns else 0
    rows = rows.assign(chunk=rows["stage"] + chunk)
    grid = np.full((meta.pp_size * meta.vpp_size, int(rows["mb_id"].max()) + 1), np.nan)
    worst = rows.groupby(["chunk", "mb_id"])["duration"].max()
    idx = worst.index.to_frame().to_numpy(np.int64)
    grid[idx[:, 0], idx[:, 1]] = worst.to_numpy()
    if np.isnan(grid).any():
        g, j = (int(v[0]) for v in np.nonzero(np.isnan(grid)))
        raise InputError(
            f"{source}: step {int(rows['step'].iloc[0])} replica "
            f"{int(rows['dp_rank'].iloc[0])}: no duration for model chunk {g}, "
            f"micro-batch {j}"
        )
    return grid


def replay_step(
    ops: pd.DataFrame, meta: JobMeta, schedule: str, source: str = "ops trace"
) -> float:
    """Predicted time of one step from its measured op durations.

    Each data-parallel replica's critical path (replicas may run different numbers of
    micro-batches), its gradient sync, then the optimizer; the slowest replica sets the step.

    Args:
        ops: the step's ops rows.
        meta: the job's meta.
        schedule: the pipeline schedule the job ran.
        source: what errors name as the trace.
    """
    compute = ops[ops["optype"].isin(["forward-compute", "backward-compute"])]
    if compute.empty or compute["mb_id"].isna().any():
        raise InputError(f"{source}: step {ops['step'].iloc[0]} has compute ops without mb_id")
    sends = ops.loc[ops["optype"].isin(SEND_OPTYPES), "duration"]
    p2p = float(sends.median()) if len(sends) else 0.0
    optimizer = ops.loc[ops["optype"].str.startswith("optimizer"), "duration"]
    optimizer_s = float(optimizer.max()) if len(optimizer) else 0.0
    sync = ops[ops["optype"].isin(SYNC_OPTYPES)].groupby(["dp_rank", "stage"])["duration"].sum()
    worst = 0.0
    for dp_rank, rows in compute.groupby("dp_rank"):
        # micro-batch ids may be numbered across the whole step; the schedule wants 0..m-1
        rows = rows.assign(mb_id=pd.factorize(rows["mb_id"], sort=True)[0])
        dp_sync = np.zeros(meta.pp_size)
        if dp_rank in sync.index.get_level_values(0):
            per_stage = sync.loc[dp_rank]
            dp_sync[per_stage.index.to_numpy(np.int64)] = per_stage.to_numpy()
        fwd = _grid(rows[rows["optype"] == "forward-compute"], meta, source)
        bwd = _grid(rows[rows["optype"] == "backward-compute"], meta, source)
        step = pipeline_step_time(
            fwd,
            bwd,
            schedule,
            p2p_s=p2p,
            dp_sync_s=dp_sync,
            optimizer_s=optimizer_s,
            chunks=meta.vpp_size,
        )
        worst = max(worst, float(step))
    return worst


def replay_steps(
    ops: pd.DataFrame, meta: JobMeta, schedule: str, skip: int = 1, source: str = "ops trace"
) -> pd.DataFrame:
    """One row per step: measured step time (slowest rank's ``step`` record) and prediction.

    Args:
        ops: the ops trace.
        meta: the job's meta.
        schedule: the pipeline schedule the job ran.
        skip: the first steps, warm-up, left out.
        source: what errors name as the trace.
    """
    measured = ops[ops["optype"] == "step"].groupby("step")["duration"].max()
    if measured.empty:
        raise InputError(f"{source}: no 'step' records (the runtime writes one per rank and step)")
    rows = []
    for step, step_ops in ops.groupby("step"):
        if step < measured.index.min() + skip or step not in measured.index:
            continue
        rows.append(
            {
                "step": int(step),
                "measured_s": float(measured[step]),
                "predicted_s": replay_step(step_ops, meta, schedule, source),
            }
        )
    out = pd.DataFrame(rows)
    out["ape"] = (out["predicted_s"] - out["measured_s"]).abs() / out["measured_s"] * 100
    return out
