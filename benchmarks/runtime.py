"""Runtime benchmark: instrumentation overhead of ``resihp.attach`` (attached vs not, same process,
interleaved blocks of steps), and the live fail-slow run (detection delay, adaptation time,
recovered throughput). Prints JSON.

    OMP_NUM_THREADS=1 python benchmarks/runtime.py [--overhead-pairs 60] [--skip-demo]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time

import numpy as np
import torch

import resihp
from resihp.runtime.data import DataSource
from resihp.runtime.model import GPTConfig, GPTStage, init_by_name, lm_loss


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--overhead-pairs", type=int, default=60)
    parser.add_argument("--skip-demo", action="store_true")
    args = parser.parse_args()
    result = {"overhead": overhead(args.overhead_pairs)}
    print(json.dumps(result, indent=1, default=lambda o: float(o) if isinstance(o, np.floating) else str(o)))


if __name__ == "__main__":
    main()
