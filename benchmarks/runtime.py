"""Runtime benchmark: instrumentation overhead of ``resihp.attach`` (attached vs not, same process,
interleaved blocks of steps), and the live fail-slow run (detection delay, adaptation time,
recovered throughput). Prints JSON.

    OMP_NUM_THREADS=1 python benchmarks/runtime.py [--overhead-pairs 60] [--skip-runs]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import resihp
from resihp.model.gpt import GPTConfig, GPTStage, init_by_name, lm_loss
from resihp.runtime.data import DataSource


def overhead(pairs: int, seed: int = 0) -> dict:
    """Step time of the same training loop with and without resihp attached: two copies of one
    model, stepped alternately on the same micro-batches, so that the shared machine's drifts hit
    both alike; the overhead is the median of the paired ratios. The same comparison between two
    plain copies (``noise_fraction``) shows how much of it the machine's noise can explain."""
    torch.set_num_threads(1)
    cfg = GPTConfig(layers=4, hidden=256, heads=4, ffn_hidden=1024, vocab=4096, max_seq_len=1024)
    data = DataSource("text", global_tokens=1024, budget=1024, max_len=1024, seed=seed)
    copies = []
    for _ in range(3):
        model = GPTStage(cfg)
        init_by_name(model, seed)
        copies.append((model, torch.optim.AdamW(model.parameters(), lr=1e-4)))
    ratios, noise, times = [], [], {"plain": [], "attached": [], "plain2": []}
    with tempfile.TemporaryDirectory() as out:
        monitor = resihp.attach(copies[1][0], optimizer=copies[1][1], out=out)
        modes = [("plain", copies[0]), ("attached", copies[1]), ("plain2", copies[2])]
        for i in range(pairs + 3):
            mb = data.step(i % 8).microbatches[0]
            x, y = data.tokens(i % 8, mb, cfg.vocab)
            pair = {}
            order = modes[i % 3:] + modes[: i % 3]  # rotate which copy goes first
            for mode, (model, opt) in order:
                t0 = time.perf_counter()
                with monitor.step(seq_lens=mb.seq_lens) if mode == "attached" else contextlib.nullcontext():
                    loss = lm_loss(model(x, mb.seq_lens), y) / mb.tokens
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                pair[mode] = time.perf_counter() - t0
            if i >= 3:  # warm-up
                ratios.append(pair["attached"] / pair["plain"])
                noise.append(pair["plain2"] / pair["plain"])
                for mode in pair:
                    times[mode].append(pair[mode])
        monitor.close()
        self_s = monitor.self_s
    return {"plain_step_s": statistics.median(times["plain"]),
            "attached_step_s": statistics.median(times["attached"]),
            "overhead_fraction": statistics.median(ratios) - 1.0,
            "noise_fraction": statistics.median(noise) - 1.0, "pairs": len(ratios),
            # resihp's own code per step (hooks, records, stream and heartbeat writes) over the
            # step time: the part of the paired difference that is not machine noise
            "self_time_fraction": self_s / (pairs + 3) / statistics.median(times["plain"]),
            "target_overhead_fraction": 0.01}


def fail_slow(out: Path) -> dict:
    """The demo job: steps from injection to detection, time to apply the re-plan, throughput."""
    from resihp.detect.config import DetectorConfig
    from resihp.runtime.demo import run_demo

    onset = DetectorConfig().calibration_steps + 4
    s = run_demo(out, steps=onset + 20, inject=f"slow:rank=1,factor=3,step={onset}")
    return {k: s[k] for k in ("injected", "detection_delay_steps", "detected_step", "plan_applied_step",
                              "adaptation_s", "tokens_per_s_before", "tokens_per_s_during",
                              "tokens_per_s_after", "remaining_capacity_fraction",
                              "recovered_fraction")} | {
        "plan_changes": [{k: c.get(k) for k in ("dp_weights", "layer_splits", "applied", "solve_s",
                                                 "applied_step")} for c in s["plan_changes"]],
        "targets": {"detection_delay_steps": 5, "recovered_fraction": 0.9}}


def layer_repartition(out: Path) -> dict:
    """Time to move layers (parameters + AdamW state) between stages while training goes on."""
    from resihp.opstrace import read_ops_trace
    from resihp.runtime.config import RunConfig
    from resihp.runtime.demo import DEMO
    from resihp.runtime.launch import launch

    cfg = RunConfig(**DEMO, steps=6, out=str(out), replan=[
        {"step": 2, "layer_split": [3, 1]}, {"step": 4, "layer_split": [1, 3]}])
    proc = launch(cfg, timeout_s=300)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    trace = read_ops_trace(out / "ops.parquet")
    moves = trace[trace.optype == "replan-layers"].groupby("step").agg(
        seconds=("duration", "max"), bytes_sent=("bytes", "sum"))
    steps = trace[trace.optype == "step"].groupby("step").duration.max()
    return {"moves": [{"step": int(k), "layers_moved": 1 if k == 2 else 2, "seconds": float(v.seconds),
                       "bytes_sent": int(v.bytes_sent)} for k, v in moves.iterrows()],
            "median_step_s": float(steps.median())}


def elastic_restart(out: Path) -> dict:
    """A stopped rank: detection, checkpoint save, and restart of the surviving layout."""
    from resihp.opstrace import read_ops_trace

    args = ["--layers", "4", "--hidden", "64", "--heads", "2", "--ffn-hidden", "256", "--vocab", "512",
            "--global-tokens", "8192", "--budget", "512", "--max-len", "512", "--steps", "10",
            "--ckpt-every", "3", "--inject", "stop:rank=3,step=7", "--out", str(out), "--json"]
    proc = subprocess.run([sys.executable, "-m", "resihp.cli", "run", *args], capture_output=True,
                          text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    summary = json.loads(proc.stdout)
    trace = read_ops_trace(out / "ops.parquet")
    saves = trace[trace.optype == "checkpoint-save"].groupby("step").duration.max()
    loads = read_ops_trace(out / "restart" / "ops.parquet")
    load_s = loads[loads.optype == "checkpoint-load"].duration.max()
    change = summary["plan_changes"][0]
    return {"failure_detected_after_s": summary["failure"].get("detected_s"),
            "checkpoint_save_s": float(saves.median()), "checkpoint_load_s": float(load_s),
            "restart_to_first_step_s": change["restart_s"], "resumed_step": change["resumed_step"],
            "steps_redone": summary["failure"]["step"] - change["resumed_step"],
            "new_layout": change["layout"],
            "tokens_per_s_before": summary["tokens_per_s"],
            "tokens_per_s_after": summary["tokens_per_s_after"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--overhead-pairs", type=int, default=60)
    parser.add_argument("--skip-runs", action="store_true", help="only the overhead benchmark")
    args = parser.parse_args()
    result = {"overhead": overhead(args.overhead_pairs)}
    if not args.skip_runs:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            result["fail_slow"] = fail_slow(tmp / "demo")
            result["layer_repartition"] = layer_repartition(tmp / "layers")
            result["elastic_restart"] = elastic_restart(tmp / "elastic")
    print(json.dumps(result, indent=1, default=lambda o: float(o) if isinstance(o, np.floating) else str(o)))


if __name__ == "__main__":
    main()
