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
from resihp.model.config import GPTConfig
from resihp.model.gpt import GPTStage, init_by_name, lm_loss
from resihp.train.data import DataSource


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
            order = modes[i % 3 :] + modes[: i % 3]  # rotate which copy goes first
            for mode, (model, opt) in order:
                t0 = time.perf_counter()
                with (
                    monitor.step(seq_lens=mb.seq_lens)
                    if mode == "attached"
                    else contextlib.nullcontext()
                ):
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
    return {
        "plain_step_s": statistics.median(times["plain"]),
        "attached_step_s": statistics.median(times["attached"]),
        "overhead_fraction": statistics.median(ratios) - 1.0,
        "noise_fraction": statistics.median(noise) - 1.0,
        "pairs": len(ratios),
        # resihp's own code per step (hooks, records, stream and heartbeat writes) over the
        # step time: the part of the paired difference that is not machine noise
        "self_time_fraction": self_s / (pairs + 3) / statistics.median(times["plain"]),
        "target_overhead_fraction": 0.01,
    }


def fail_slow(out: Path) -> dict:
    """The demo job: steps from injection to detection, time to apply the re-plan, throughput."""
    from resihp.detect.config import DetectorConfig
    from resihp.launch.demo import run_demo

    onset = DetectorConfig().calibration_steps + 4
    s = run_demo(out, steps=onset + 20, inject=f"slow:rank=1,factor=3,step={onset}")
    return {
        k: s[k]
        for k in (
            "injected",
            "detection_delay_steps",
            "detected_step",
            "plan_applied_step",
            "adaptation_s",
            "tokens_per_s_before",
            "tokens_per_s_during",
            "tokens_per_s_after",
            "remaining_capacity_fraction",
            "recovered_fraction",
        )
    } | {
        "plan_changes": [
            {
                k: c.get(k)
                for k in ("dp_weights", "layer_splits", "applied", "solve_s", "applied_step")
            }
            for c in s["plan_changes"]
        ],
        "targets": {"detection_delay_steps": 5, "recovered_fraction": 0.9},
    }


def layer_repartition(out: Path) -> dict:
    """Time to move layers (parameters + AdamW state) between stages while training goes on."""
    from resihp.launch.demo import DEMO
    from resihp.launch.launch import launch
    from resihp.opstrace import read_ops_trace
    from resihp.train.config import RunConfig

    cfg = RunConfig.from_flags(
        **DEMO,
        steps=6,
        out=str(out),
        replan=[{"step": 2, "layer_split": [3, 1]}, {"step": 4, "layer_split": [1, 3]}],
    )
    proc = launch(cfg, timeout_s=300)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    trace = read_ops_trace(out / "ops.parquet")
    moves = (
        trace[trace.optype == "replan-layers"]
        .groupby("step")
        .agg(seconds=("duration", "max"), bytes_sent=("bytes", "sum"))
    )
    steps = trace[trace.optype == "step"].groupby("step").duration.max()
    return {
        "moves": [
            {
                "step": int(k),
                "layers_moved": 1 if k == 2 else 2,
                "seconds": float(v.seconds),
                "bytes_sent": int(v.bytes_sent),
            }
            for k, v in moves.iterrows()
        ],
        "median_step_s": float(steps.median()),
    }


def elastic_restart(out: Path) -> dict:
    """A stopped rank: detection, checkpoint save, and restart of the surviving layout."""
    from resihp.opstrace import read_ops_trace

    args = [
        "--layers",
        "4",
        "--hidden",
        "64",
        "--heads",
        "2",
        "--ffn-hidden",
        "256",
        "--vocab",
        "512",
        "--global-tokens",
        "8192",
        "--budget",
        "512",
        "--max-len",
        "512",
        "--steps",
        "10",
        "--ckpt-every",
        "3",
        "--inject",
        "stop:rank=3,step=7",
        "--out",
        str(out),
        "--json",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "run", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    summary = json.loads(proc.stdout)
    trace = read_ops_trace(out / "ops.parquet")
    saves = trace[trace.optype == "checkpoint-save"].groupby("step").duration.max()
    loads = read_ops_trace(out / "restart" / "ops.parquet")
    load_s = loads[loads.optype == "checkpoint-load"].duration.max()
    change = summary["plan_changes"][0]
    return {
        "failure_detected_after_s": summary["failure"].get("detected_s"),
        "checkpoint_save_s": float(saves.median()),
        "checkpoint_load_s": float(load_s),
        "restart_to_first_step_s": change["restart_s"],
        "resumed_step": change["resumed_step"],
        "steps_redone": summary["failure"]["step"] - change["resumed_step"],
        "new_layout": change["layout"],
        "tokens_per_s_before": summary["tokens_per_s"],
        "tokens_per_s_after": summary["tokens_per_s_after"],
    }


def _rows(rank: int, step: int, microbatches: int = 8) -> list[dict]:
    """One rank's ops of one 1F1B step (forward/backward compute, sends and receives per
    micro-batch; the all-reduce, optimizer and step rows), with plausible lengths and times."""
    rng = np.random.default_rng(rank * 100003 + step)
    t, rows = time.time(), []
    for mb in range(microbatches):
        lens = [int(x) for x in rng.integers(64, 1024, size=int(rng.integers(2, 9)))]
        for op in (
            "forward-recv",
            "forward-compute",
            "forward-send",
            "backward-recv",
            "backward-compute",
            "backward-send",
        ):
            d = float(rng.uniform(0.001, 0.05))
            rows.append(
                {
                    "step": step,
                    "rank": rank,
                    "dp_rank": rank % 8,
                    "stage": rank // 8 % 4,
                    "tp_rank": 0,
                    "optype": op,
                    "start_ts": t,
                    "duration": d,
                    "seq_id": mb,
                    "mb_id": mb,
                    "seq_lens": lens,
                    "tokens": sum(lens),
                    "loss": None,
                    "bytes": None,
                }
            )
            t += d
    for op in ("grads-all-reduce", "optimizer", "step"):
        rows.append(
            {
                "step": step,
                "rank": rank,
                "dp_rank": rank % 8,
                "stage": rank // 8 % 4,
                "tp_rank": 0,
                "optype": op,
                "start_ts": t,
                "duration": 0.01,
                "seq_id": 0,
                "mb_id": None,
                "seq_lens": None,
                "tokens": None,
                "loss": 2.5 if op == "step" else None,
                "bytes": None,
            }
        )
    return rows


def _simulated_nodes(
    endpoint: str,
    job: str,
    nodes: list[int],
    per_node: int,
    step_s: float,
    steps: int,
    t_start: float,
    costs,
) -> None:
    """One process standing in for several nodes: every rank's heartbeat thread (one loop here) and
    each node's aggregator, and every rank publishing its step's records at each step boundary."""
    import threading

    from resihp.detect.heartbeat import HeartbeatSender, NodeAggregator
    from resihp.train.controlplane import StepPublisher, heartbeat_prefix
    from resihp.train.store import JobStore

    stop = threading.Event()
    hb = heartbeat_prefix(job)

    def beats() -> None:
        store = JobStore(endpoint, host=False).store
        senders = [
            HeartbeatSender(store, n * per_node + i, n, prefix=hb)
            for n in nodes
            for i in range(per_node)
        ]
        aggs = [
            NodeAggregator(
                store,
                n,
                range(n * per_node, (n + 1) * per_node),
                prefix=hb,
                timeout_s=10.0,
                check_pids=False,
            )
            for n in nodes
        ]
        while not stop.wait(0.5):
            for snd in senders:
                snd.state.phase, snd.state.ops = "train", snd.state.ops + 1
                snd.tick()
            for agg in aggs:
                agg.tick()

    thread = threading.Thread(target=beats, daemon=True)
    thread.start()
    store = JobStore(endpoint, host=False).store
    pubs = {n * per_node + i: StepPublisher(store, job, n) for n in nodes for i in range(per_node)}
    rows = {
        rank: _rows(rank, 0) for rank in pubs
    }  # made once: the simulation's cost is not the plane's
    for step in range(steps):
        time.sleep(max(0.0, t_start + (step + 1) * step_s - time.time()))
        for rank, pub in pubs.items():
            pub.publish([{**r, "step": step} for r in rows[rank]])
    stop.set()
    thread.join(timeout=5)
    costs.put([(p.seconds, p.bytes, p.messages) for p in pubs.values()])


def control_plane(
    world: int = 1024, per_node: int = 8, processes: int = 8, step_s: float = 2.0, steps: int = 12
) -> dict:
    """A simulated ``world``-rank job on this machine: store clients in ``processes`` processes
    send every rank's heartbeats and per-step records, per-node aggregators beat, and node 0's
    reader and heartbeat monitor (this process) take complete steps and judge ranks, as in a real
    job. Measures the live loop's lag (records sent -> step observed), bytes and messages per
    rank-step, each rank's publishing time against the step time, and false fail-stops."""
    import multiprocessing as mp

    from resihp.detect.heartbeat import HeartbeatMonitor
    from resihp.train.controlplane import StepReader, heartbeat_prefix, node_ranks
    from resihp.train.store import JobStore

    nnodes = world // per_node
    job = "bench"
    layout = node_ranks(nnodes, per_node)
    with JobStore(timeout_s=120) as js:
        reader = StepReader(js.store, job, layout, first_step=0, owner=True)
        monitor = HeartbeatMonitor(
            js.store, layout, timeout_s=10.0, prefix=heartbeat_prefix(job), startup_s=60
        )
        ctx = mp.get_context("spawn")
        costs = ctx.Queue()
        t_start = time.time() + 15  # every process connected before the first step ends
        share = [list(range(nnodes))[i::processes] for i in range(processes)]
        procs = [
            ctx.Process(
                target=_simulated_nodes,
                args=(js.endpoint, job, share[i], per_node, step_s, steps, t_start, costs),
            )
            for i in range(processes)
        ]
        for proc in procs:
            proc.start()
        lags, late, false_stops, polls, read_s = [], [], [], 0, 0.0
        end = t_start + (steps + 3) * step_s
        while time.time() < end and reader.steps < steps:
            t0 = time.perf_counter()
            for rec in reader.complete_steps():
                rec.frame()  # the detector's input, as the live loop builds it
                lags.append(
                    time.time() - rec.sent
                )  # the step's last record sent -> ready for the detector
                late.append(
                    rec.sent - (t_start + (rec.step + 1) * step_s)
                )  # the simulation's own delay
            read_s += time.perf_counter() - t0
            if time.time() > t_start:
                false_stops += monitor.poll(reader.next_step or 0)
            polls += 1
            time.sleep(0.2)
        per_rank = [c for _ in procs for c in costs.get(timeout=60)]
        for proc in procs:
            proc.join(timeout=30)
    publish_s = statistics.median(c[0] for c in per_rank) / steps
    return {
        "world": world,
        "nodes": nnodes,
        "step_s": step_s,
        "steps_observed": reader.steps,
        "lag_s_median": round(statistics.median(lags), 3) if lags else None,
        "lag_s_max": round(max(lags), 3) if lags else None,
        "lag_steps_max": round(max(lags) / step_s, 3) if lags else None,
        "record_bytes_per_rank_step": round(statistics.mean(c[1] for c in per_rank) / steps, 1),
        "record_messages_per_rank_step": round(statistics.mean(c[2] for c in per_rank) / steps, 3),
        "heartbeat_messages_per_rank_step": round(step_s / 0.5, 2),
        "publish_s_per_rank_step": round(publish_s, 6),
        "overhead_fraction_of_step": round(publish_s / step_s, 6),
        "reader_requests_per_step": round(reader.messages / max(1, reader.steps), 1),
        "reader_s_per_step": round(read_s / max(1, reader.steps), 4),
        "senders_late_s_median": round(statistics.median(late), 3) if late else None,
        "false_fail_stops": len(false_stops),
    }


def control_plane_live(out: Path) -> dict:
    """The control plane of a real 4-rank run (``resihp run --json``'s ``control_plane``)."""
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
            "30",
            "--recovery",
            "none",  # one torchrun job, as in the figures before replica default
            "-o",
            str(out),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = json.loads(proc.stdout)
    step_s = 8192 / summary["tokens_per_s"]
    cp = summary["control_plane"]
    return {
        **cp,
        "step_s": round(step_s, 3),
        "overhead_fraction_of_step": round(cp["publish_s_per_rank_step"] / step_s, 6),
        "lag_steps_median": round(cp["lag_s"]["median"] / step_s, 3),
        "lag_steps_max": round(cp["lag_s"]["max"] / step_s, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--overhead-pairs", type=int, default=60)
    parser.add_argument("--skip-runs", action="store_true", help="only the overhead benchmark")
    parser.add_argument(
        "--control-plane-only",
        action="store_true",
        help="only the control plane: a real 4-rank run and a simulated 1,024-rank job",
    )
    parser.add_argument("--world", type=int, default=1024, help="ranks of the simulated job")
    args = parser.parse_args()
    if args.control_plane_only:
        with tempfile.TemporaryDirectory() as tmp:
            live = control_plane_live(Path(tmp) / "cp")
        print(
            json.dumps(
                {"control_plane": {"live_4_ranks": live, "simulated": control_plane(args.world)}},
                indent=1,
            )
        )
        return
    result = {"overhead": overhead(args.overhead_pairs)}
    if not args.skip_runs:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            result["fail_slow"] = fail_slow(tmp / "demo")
            result["layer_repartition"] = layer_repartition(tmp / "layers")
            result["elastic_restart"] = elastic_restart(tmp / "elastic")
            result["control_plane"] = {
                "live_4_ranks": control_plane_live(tmp / "cp"),
                "simulated": control_plane(args.world),
            }
    print(
        json.dumps(
            result, indent=1, default=lambda o: float(o) if isinstance(o, np.floating) else str(o)
        )
    )


if __name__ == "__main__":
    main()
