"""Predictor benchmark on this machine, in one run: calibration time, the device's noise floor
before and after normalisation, held-out micro-batch MAPE (random split and
leave-one-length-source-out) for the learned and the linear model with and without normalisation,
step-time MAPE against real multi-process runs, and prediction throughput. Prints JSON.

    python benchmarks/predictor.py [--microbatches 60] [--repeats 3] [--steps 12] [--quick]
                                   [--keep DIR]
    python benchmarks/predictor.py --profiles LOG.parquet ...

``--profiles``: no calibration and no runs here; the accuracy arms on profiling logs measured
elsewhere (the GPU logs of ``benchmarks/gpu.sh``, ``traces/profiles/cuda-nvidia-h200``): their
device and versions as recorded, noise floors, held-out MAPE of every target the logs have.

The calibration is the real ``resihp predictor calibrate`` (its profiles interleave every repeat
with a reference micro-batch); every arm below is trained and tested on those same profiles.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from resihp.opstrace import read_meta, read_ops_trace
from resihp.perf.calibrate import CalibrationPlan, calibrate, shape_name
from resihp.perf.device import versions
from resihp.perf.logs import read_profile_logs
from resihp.perf.predictor import LinearBaseline, MicroBatchPredictor, evaluate, holdout_split
from resihp.perf.profiler import noise_floor
from resihp.perf.step_replay import replay_steps
from resihp.perf.training import cross_source, measured_on, with_target
from resihp.workload.flops import TransformerShape
from resihp.workload.lengths import resolve_source, sample_sequences
from resihp.workload.packing import pack_greedy

# target -> (clock, normalised?)
ARMS = {
    "time_s": ("wall", False),
    "cost": ("wall", True),
    "cpu_time_s": ("cpu", False),
    "cpu_cost": ("cpu", True),
}


def _phase_pair(metrics: dict) -> dict:
    return {
        phase: {
            "learned_mape": metrics[phase]["mape"],
            "linear_mape": metrics[phase]["linear_baseline"]["mape"],
            **(
                {
                    "learned_worst_mape": metrics[phase]["worst_mape"],
                    "linear_worst_mape": metrics[phase]["linear_baseline"]["worst_mape"],
                }
                if "worst_mape" in metrics[phase]
                else {}
            ),
        }
        for phase in ("fwd", "bwd")
    }


def accuracy(logs: list[Path], target: str, seed: int = 0) -> dict:
    """Held-out MAPE of the learned and the linear model on ``target``: a random 25% of the
    micro-batches, and each length source held out in turn (trained on the others)."""
    log = with_target(read_profile_logs(logs), target, str(logs[0]))
    train_idx, test_idx = holdout_split(log, 0.25, seed)
    predictor = MicroBatchPredictor(random_state=seed).fit(log.iloc[train_idx])
    linear = LinearBaseline().fit(log.iloc[train_idx])
    random_split = evaluate(predictor, linear, log.iloc[test_idx])
    cross = cross_source(log, seed)
    return {
        "random": _phase_pair(random_split),
        "cross_source": _phase_pair(cross),
        "cross_source_by_source": {s: _phase_pair(m) for s, m in cross["by_source"].items()},
    }


def floors(logs: list[Path]) -> dict:
    return {p.stem: noise_floor(read_profile_logs([p])) for p in logs}


def step_accuracy(dp: int, pp: int, schedule: str, steps: int, workdir: Path) -> dict:
    out = workdir / f"run-dp{dp}-pp{pp}-{schedule}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={dp * pp}",
        "-m",
        "resihp.train.worker",
        "--dp",
        str(dp),
        "--pp",
        str(pp),
        "--schedule",
        schedule,
        "--steps",
        str(steps),
        "--source",
        "text",
        "--out",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=900)
    ops = read_ops_trace(out / "ops.parquet")
    meta, _ = read_meta(out / "job.yaml")
    table = replay_steps(ops, meta, schedule)
    return {
        "dp": dp,
        "pp": pp,
        "schedule": schedule,
        "steps": len(table),
        "step_mape": float(table["ape"].mean()),
        "step_p95": float(np.percentile(table["ape"], 95)),
        "median_step_s": float(table["measured_s"].median()),
    }


def throughput(model: Path, shape: TransformerShape, n: int = 100_000, repeats: int = 5) -> dict:
    predictor = MicroBatchPredictor.load(model)
    seqs = sample_sequences(resolve_source("text"), n * 1024, 1024, np.random.default_rng(0))
    mbs = [m.tolist() for m in pack_greedy(seqs, 1024)[:n]]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        predictor.predict_seq_lens(mbs, "fwd", shape)
        times.append(time.perf_counter() - t0)
    median = float(np.median(times))
    return {"microbatches": len(mbs), "median_s": median, "per_s": len(mbs) / median}


def measured_elsewhere(logs: list[Path]) -> dict:
    """The accuracy arms on logs measured on another device (wall-clock targets only: a GPU's
    host thread time says nothing about its kernels)."""
    log = read_profile_logs(logs)
    targets = [t for t in ARMS if t in log.columns and log[t].notna().all()]
    return {
        "device": sorted(log["device"].unique().tolist()),
        "measured_on": measured_on(log),
        "logs": [str(p) for p in logs],
        "microbatches": {p.stem: int(read_profile_logs([p])["mb_id"].nunique()) for p in logs},
        "noise_floor": floors(logs),
        "micro_batch": {
            t: {"clock": ARMS[t][0], "normalised": ARMS[t][1], **accuracy(logs, t)} for t in targets
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--microbatches", type=int, default=60, help="per source and shape")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="one short multi-process run")
    parser.add_argument("--keep", type=Path, help="copy the calibrated model directory here")
    parser.add_argument(
        "--profiles",
        type=Path,
        nargs="+",
        help="evaluate these profiling logs instead (measured elsewhere)",
    )
    args = parser.parse_args()
    if args.profiles:
        print(json.dumps(measured_elsewhere(args.profiles), indent=2))
        return
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        plan = CalibrationPlan(microbatches=args.microbatches, repeats=args.repeats)
        model, card = calibrate(plan, workdir / "model")
        calibration_s = card["calibration"]["seconds"]
        logs = sorted((model / "profiles").glob("*.parquet"))
        result = {
            "device": card["device"],
            "versions": versions(),
            "calibration_s": calibration_s,
            "calibration": {
                "shapes": [shape_name(s) for s in plan.shapes],
                "sources": list(plan.sources),
                "microbatches_per_source_and_shape": plan.microbatches,
                "repeats": plan.repeats,
                "measurements": plan.measurements,
            },
            "speed": {k: v["speed"] for k, v in card["calibration"]["profiles"].items()},
            "noise_floor": floors(logs),
            "micro_batch": {
                t: {"clock": ARMS[t][0], "normalised": ARMS[t][1], **accuracy(logs, t)}
                for t in ARMS
            },
        }
        runs = [(1, 2, "1f1b")] if args.quick else [(1, 2, "1f1b"), (1, 2, "gpipe"), (2, 2, "1f1b")]
        result["step"] = [
            step_accuracy(dp, pp, s, 4 if args.quick else args.steps, workdir) for dp, pp, s in runs
        ]
        result["step_mape"] = float(np.mean([r["step_mape"] for r in result["step"]]))
        result["throughput"] = throughput(model, plan.shapes[0].shape())
        if args.keep:
            shutil.copytree(model, args.keep, dirs_exist_ok=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
