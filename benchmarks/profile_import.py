"""A predictor from an imported torch.profiler trace: record a real training run of a decoder stack
with torch.profiler, import the trace with ``resihp profile import``, train ``resihp predictor
train`` on it and report the held-out MAPE beside the run's noise floor. Prints JSON.

    python benchmarks/profile_import.py [--microbatches 80] [--rounds 4] [--layers 2]
                                        [--hidden 256] [--out FILE]

The run trains on packed micro-batches drawn from the shipped length sources (code, text), each
micro-batch ``--rounds`` times, every round in a fresh shuffled order, one span per phase named
``fwd mb=N seq_lens=...`` / ``bwd mb=N seq_lens=...``. The noise floor is the mean absolute
deviation of one span from its micro-batch's median over the rounds: the same work timed at
different moments, which no predictor of one span's time can beat. Two targets are trained and
held out by micro-batch (both phases and all rounds of one on the same side): every span
(``spans``) and each micro-batch's median over its rounds (``medians``); the floor of a median is
measured as the deviation of the median of half the rounds from the median of all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from resihp.model.config import GPTConfig
from resihp.model.gpt import DecoderBlock
from resihp.perf.calibrate import draw_microbatches
from resihp.perf.device import this_device, versions
from resihp.perf.profile_import import ImportOptions, import_profiles, write_log
from resihp.perf.spans import Shape
from resihp.perf.training import train_predictor


def record(cfg: GPTConfig, batches: list[np.ndarray], rounds: int, trace: Path, seed: int) -> float:
    """Train ``cfg``'s layer stack over ``batches`` ``rounds`` times under torch.profiler; the
    Chrome trace goes to ``trace``. Returns the seconds the run took."""
    torch.manual_seed(seed)
    stack = torch.nn.ModuleList([DecoderBlock(cfg) for _ in range(cfg.layers)])
    opt = torch.optim.SGD(stack.parameters(), lr=1e-4)
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(rounds):
            for mb in rng.permutation(len(batches)):
                lens = [int(n) for n in batches[mb]]
                tag = f"mb={mb} seq_lens={','.join(map(str, lens))}"
                x = torch.randn(sum(lens), cfg.hidden)
                with record_function(f"fwd {tag}"):
                    y = x
                    for layer in stack:
                        y = layer(y, lens)
                    loss = y.square().mean()
                with record_function(f"bwd {tag}"):
                    loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    prof.export_chrome_trace(str(trace))
    return seconds


def floors(log: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Per phase: one span against its micro-batch's median, and half the rounds' median against
    all rounds' median (mean absolute deviation, %)."""
    out = {}
    for phase, rows in log.groupby("phase"):
        spans, halves = [], []
        for _, g in rows.groupby("mb_id"):
            t = g["time_s"].to_numpy()
            med = np.median(t)
            spans.append(np.abs(t / med - 1))
            if len(t) >= 2:
                halves.append(abs(np.median(t[::2]) / med - 1))
        out[phase] = {
            "span_pct": float(np.mean(np.concatenate(spans)) * 100),
            "half_median_pct": float(np.mean(halves) * 100) if halves else None,
        }
    return out


def medians(log: pd.DataFrame) -> pd.DataFrame:
    """One row per micro-batch and phase: the median time over its rounds."""
    keys = ["mb_id", "phase"]
    med = log.groupby(keys, as_index=False)["time_s"].median()
    first = log.drop(columns=["time_s"]).drop_duplicates(keys)
    return first.merge(med, on=keys)


def held_out(card: dict) -> dict:
    return {
        phase: {
            "n": r["n"],
            "mape": r["mape"],
            "p95": r["p95"],
            "linear_mape": r["linear_baseline"]["mape"],
        }
        for phase, r in card["held_out"].items()
        if phase in ("fwd", "bwd")
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--microbatches", type=int, default=80, help="per length source")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = GPTConfig(
        layers=args.layers,
        hidden=args.hidden,
        heads=max(1, args.hidden // 64),
        ffn_hidden=4 * args.hidden,
        max_seq_len=args.budget,
    )
    drawn = draw_microbatches(
        ["code", "text"],
        args.microbatches,
        args.budget,
        args.budget,
        np.random.default_rng(args.seed),
    )
    batches = [b for _, b in drawn]
    shape = Shape(layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads, ffn_hidden=cfg.ffn_hidden)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run_s = record(cfg, batches, args.rounds, tmp / "trace.json", args.seed)
        started = time.perf_counter()
        log = import_profiles([tmp / "trace.json"], ImportOptions(shape=shape)).log
        import_s = time.perf_counter() - started
        write_log(log, tmp / "spans.parquet")
        write_log(medians(log), tmp / "medians.parquet")
        cards = {
            name: train_predictor([tmp / f"{name}.parquet"], tmp / name, seed=args.seed)
            for name in ("spans", "medians")
        }
        trace_mb = (tmp / "trace.json").stat().st_size / 2**20
    result = {
        "benchmark": "profile-import",
        "command": "python benchmarks/profile_import.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if v is not None and k != "out"
        ),
        "device": this_device("cpu"),
        "versions": versions(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "shape": {
            "layers": cfg.layers,
            "hidden": cfg.hidden,
            "heads": cfg.heads,
            "ffn_hidden": cfg.ffn_hidden,
            "budget": args.budget,
        },
        "microbatches": len(batches),
        "rounds": args.rounds,
        "spans": len(log),
        "run_s": run_s,
        "trace_mb": trace_mb,
        "import_s": import_s,
        "noise_floor_pct": floors(log),
        "held_out": {name: held_out(card) for name, card in cards.items()},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
