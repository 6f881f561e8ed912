"""Predictor benchmark: held-out micro-batch MAPE (learned vs the paper's linear model), step-time
MAPE against real multi-process runs, and prediction throughput. Prints JSON.

    python benchmarks/predictor.py [--logs traces/profiles/*.parquet] [--steps 12] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from resihp.opstrace import read_meta, read_ops_trace
from resihp.paths import TRACES
from resihp.perf.device import versions
from resihp.perf.logs import read_profile_logs
from resihp.perf.predictor import MicroBatchPredictor
from resihp.perf.step_replay import replay_steps
from resihp.perf.training import train_predictor, with_target
from resihp.workload.flops import TransformerShape
from resihp.workload.lengths import resolve_source, sample_sequences
from resihp.workload.packing import pack_greedy


def accuracy(logs: list[Path], target: str, workdir: Path) -> dict:
    card = train_predictor(logs, workdir / f"model-{target}", holdout=0.25, seed=0, target=target)
    return {**card["held_out"], "noise_floor": noise_floor(logs, target)}


def noise_floor(logs: list[Path], target: str) -> dict:
    """Mean absolute deviation (%) of identical micro-batches (same model, same lengths, measured
    at different times) from their median: no predictor can beat this on the machine measured."""
    log = with_target(read_profile_logs(logs), target, str(logs[0]))
    log["key"] = log["model"] + ":" + log["seq_lens"].map(str)
    out = {}
    for phase, rows in log.groupby("phase"):
        groups = rows.groupby("key")["time_s"]
        big = groups.transform("size") >= 5
        dev = (rows["time_s"] / groups.transform("median") - 1).abs()[big] * 100
        out[phase] = {"mad_pct": float(dev.mean()), "n": int(big.sum())}
    return out


def step_accuracy(dp: int, pp: int, schedule: str, steps: int, workdir: Path) -> dict:
    out = workdir / f"run-dp{dp}-pp{pp}-{schedule}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={dp * pp}", "-m", "resihp.runtime.worker", "--dp", str(dp), "--pp",
           str(pp), "--schedule", schedule, "--steps", str(steps), "--source", "text",
           "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=900)
    ops = read_ops_trace(out / "ops.parquet")
    meta, _ = read_meta(out / "job.yaml")
    table = replay_steps(ops, meta, schedule)
    return {"dp": dp, "pp": pp, "schedule": schedule, "steps": len(table),
            "step_mape": float(table["ape"].mean()), "step_p95": float(np.percentile(table["ape"], 95)),
            "median_step_s": float(table["measured_s"].median())}


def throughput(model: Path, n: int = 100_000, repeats: int = 5) -> dict:
    predictor = MicroBatchPredictor.load(model)
    seqs = sample_sequences(resolve_source("text"), n * 1024, 1024, np.random.default_rng(0))
    mbs = [m.tolist() for m in pack_greedy(seqs, 1024)[:n]]
    shape = TransformerShape(2, 256, 4, 1024)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        predictor.predict_seq_lens(mbs, "fwd", shape)
        times.append(time.perf_counter() - t0)
    median = float(np.median(times))
    return {"microbatches": len(mbs), "median_s": median, "per_s": len(mbs) / median}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--logs", nargs="*", type=Path,
                        default=sorted((TRACES / "profiles").glob("cpu-*.parquet")))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="one short multi-process run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        result = {"logs": [p.name for p in args.logs], "versions": versions(),
                  "micro_batch": {t: accuracy(args.logs, t, workdir) for t in ("time_s", "cpu_time_s")}}
        runs = [(1, 2, "1f1b")] if args.quick else [(1, 2, "1f1b"), (1, 2, "gpipe"), (2, 2, "1f1b")]
        result["step"] = [step_accuracy(dp, pp, s, 4 if args.quick else args.steps, workdir)
                          for dp, pp, s in runs]
        result["step_mape"] = float(np.mean([r["step_mape"] for r in result["step"]]))
        result["throughput"] = throughput(workdir / "model-time_s")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
