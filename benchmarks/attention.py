"""Attention benchmark: the time of one packed micro-batch through a stack of decoder layers under
each ``GPTConfig.attention`` path, and the achieved TFLOP/s. Prints JSON.

    OMP_NUM_THREADS=1 python benchmarks/attention.py [--repeats 11] [--out FILE]
    python benchmarks/attention.py --device cuda --dtype bfloat16 [--out FILE]

Micro-batches are packed from real document lengths (the ``code``, ``text`` and ``changelog``
length sources, ``--budget`` tokens each). Every repeat times each arm once on each micro-batch, the
arms' order rotated per repeat so that a drifting machine hits them alike; per source the result is
each arm's median time, and the median over (repeat, micro-batch) of its time over the
``per_document`` arm's time on the same micro-batch. Arms: forward+backward of every path that can
train on the device (flex_attention has no CPU backward), and forward alone of every path.
TFLOP/s is useful work: the decoder layers' analytic FLOPs (``resihp.workload.flops``, attention as
sum(l_i^2) terms, backward twice the forward) over the measured time, the same for every arm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from resihp.model.attention import PackedDocs, packed_attention
from resihp.model.config import ATTENTION_KINDS, GPTConfig
from resihp.model.gpt import DecoderBlock
from resihp.perf.device import measurement_env
from resihp.workload.flops import stage_flops
from resihp.workload.lengths import resolve_source
from resihp.workload.packing import packed_microbatches

SOURCES = ("code", "text", "changelog")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (layers, hidden, heads, ffn_hidden, budget): small enough for a shared CPU core; on a GPU the
# shape that benchmarks/gpu.py measured the per-document path at
SHAPES = {"cpu": (2, 256, 4, 1024, 2048), "cuda": (4, 2048, 16, 8192, 4096)}


def _trainable(kind: str, device: torch.device) -> bool:
    """Whether ``kind`` runs a backward on ``device``: tried, not assumed."""
    q = torch.zeros(2, 1, 8, device=device, requires_grad=True)
    try:
        packed_attention(q, q, q, PackedDocs((1, 1), device), kind).sum().backward()
    except Exception:  # noqa: BLE001 - any failure means this path cannot train here
        return False
    return True


def _timer(device: torch.device) -> Callable[[], float]:
    if device.type == "cuda":

        def now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return now
    return time.perf_counter


def bench_source(source: str, args: argparse.Namespace, device: torch.device) -> dict:
    """Every arm on ``args.microbatches`` micro-batches packed from ``source``."""
    layers, hidden, heads, ffn, budget = args.shape
    base = GPTConfig(layers=layers, hidden=hidden, heads=heads, ffn_hidden=ffn, max_seq_len=budget)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    # weights and activations in ``dtype``, as the profiler measures (resihp.perf.profiler)
    stack = torch.nn.ModuleList([DecoderBlock(base) for _ in range(layers)]).to(device, dtype)
    rng = np.random.default_rng([args.seed, SOURCES.index(source)])
    batches = [
        [int(n) for n in mb]
        for mb in packed_microbatches(
            resolve_source(source), args.microbatches, budget, budget, rng
        )
    ]
    inputs = [torch.randn(sum(b), hidden, device=device, dtype=dtype) for b in batches]
    trainable = [k for k in ATTENTION_KINDS if _trainable(k, device)]
    arms = [(k, "fwd_bwd") for k in trainable] + [(k, "fwd") for k in ATTENTION_KINDS]
    now = _timer(device)

    def run(arm: tuple[str, str], i: int) -> float:
        kind, phase = arm
        for layer in stack:
            layer.attention = kind
        x = inputs[i].requires_grad_(phase == "fwd_bwd")
        t0 = now()
        with torch.set_grad_enabled(phase == "fwd_bwd"):
            docs = PackedDocs.of(batches[i], device)  # built per micro-batch, as GPTStage does
            y = x
            for layer in stack:
                y = layer(y, docs)
            if phase == "fwd_bwd":
                y.float().square().mean().backward()
        elapsed = now() - t0
        stack.zero_grad(set_to_none=True)
        x.grad = None
        return elapsed

    for arm in arms:  # warm-up: allocator, compiled kernels (flex on CUDA), one per shape
        for i in range(len(batches)):
            run(arm, i)
    times: dict[tuple[str, str], list[list[float]]] = {a: [] for a in arms}
    for r in range(args.repeats):
        k = r % len(arms)
        order = arms[k:] + arms[:k]
        per_mb = {a: [0.0] * len(batches) for a in arms}
        for i in range(len(batches)):
            for arm in order:
                per_mb[arm][i] = run(arm, i)
        for arm in arms:
            times[arm].append(per_mb[arm])
    return _summary(source, batches, base, arms, times)


def _summary(
    source: str, batches: list[list[int]], cfg: GPTConfig, arms: list[tuple[str, str]], times: dict
) -> dict:
    tokens = np.array([sum(b) for b in batches], dtype=np.float64)
    sum_sq = np.array([sum(n * n for n in b) for b in batches], dtype=np.float64)
    fwd = np.add(*stage_flops(cfg.shape(), tokens, sum_sq, "fwd"))
    bwd = np.add(*stage_flops(cfg.shape(), tokens, sum_sq, "bwd"))
    out = {
        "source": source,
        "microbatches": len(batches),
        "tokens": tokens.astype(int).tolist(),
        "documents": [len(b) for b in batches],
        "longest": [max(b) for b in batches],
        "sum_sq_over_t_sq": [round(float(s / t**2), 4) for s, t in zip(sum_sq, tokens)],
        "arms": {},
    }
    for kind, phase in arms:
        t = np.array(times[(kind, phase)])  # [repeats, micro-batches]
        flops = fwd + bwd if phase == "fwd_bwd" else fwd
        ref = np.array(times[("per_document", phase)])
        out["arms"][f"{kind}/{phase}"] = {
            "median_ms": round(float(np.median(t)) * 1e3, 3),
            "tflops": round(float(np.median(flops[None, :] / t)) / 1e12, 5),
            "time_ratio_to_per_document": round(float(np.median(t / ref)), 4),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--sources", default=",".join(SOURCES))
    parser.add_argument("--shape", default=None, help="layers,hidden,heads,ffn_hidden,budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.repeats < 1 or args.microbatches < 1:
        parser.error("--repeats and --microbatches: expected integers >= 1")
    sources = args.sources.split(",")
    if any(s not in SOURCES for s in sources):
        parser.error(f"--sources {args.sources!r}: expected names among {', '.join(SOURCES)}")
    try:
        args.shape = (
            tuple(int(v) for v in args.shape.split(",")) if args.shape else SHAPES[args.device]
        )
        if len(args.shape) != 5 or min(args.shape) < 1:
            raise ValueError
    except ValueError:
        parser.error(
            f"--shape {args.shape!r}: expected five positive integers "
            "layers,hidden,heads,ffn_hidden,budget"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    started = time.time()
    results = [bench_source(s, args, device) for s in sources]
    layers, hidden, heads, ffn, budget = args.shape
    report = {
        "benchmark": "attention",
        "env": measurement_env(device),
        "dtype": args.dtype,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "shape": {
            "layers": layers,
            "hidden": hidden,
            "heads": heads,
            "ffn_hidden": ffn,
            "budget_tokens": budget,
        },
        "repeats": args.repeats,
        "wall_s": round(time.time() - started, 1),
        "median_time_ratio_to_per_document": {
            arm: round(
                statistics.median(
                    r["arms"][arm]["time_ratio_to_per_document"]
                    for r in results
                    if arm in r["arms"]
                ),
                4,
            )
            for arm in results[0]["arms"]
        },
        "sources": results,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
