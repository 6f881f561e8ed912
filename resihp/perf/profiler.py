"""Real torch measurements of a decoder-layer stack, forward and backward, per packed micro-batch.

Each micro-batch is timed ``repeats`` times after ``warmup`` untimed passes; the log keeps the median
wall time (``time_s``), the minimum and the spread, so a user can see how noisy the machine was.

On a CPU device the log also keeps the calling thread's CPU time (``cpu_time_s``; with one intra-op
thread all the work runs on it). Wall time on a shared CPU includes time the OS gave to other
processes, which is contention (itself a fail-slow cause), not the micro-batch's cost; CPU time is
the better measure of that cost there, and ``resihp predictor train --target cpu_time_s`` uses it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
import torch

from resihp.model.gpt import DecoderBlock, GPTConfig
from resihp.perf.device import device_name

PROFILE_COLUMNS = ["device", "model", "layers", "hidden", "heads", "ffn_hidden", "tp", "phase",
                   "seq_lens", "time_s"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_microbatch(
    layers: torch.nn.Module, seq_lens: Sequence[int], hidden: int, device: torch.device,
    dtype: torch.dtype, repeats: int, warmup: int
) -> np.ndarray:
    """[clock (wall, thread CPU), phase (fwd, bwd), repeat] seconds of ``repeats`` passes of
    ``layers`` over one packed micro-batch."""
    tokens = int(sum(seq_lens))
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, hidden, device=device, dtype=dtype)
    out = np.empty((2, 2, repeats))
    for i in range(warmup + repeats):
        _sync(device)
        t0, c0 = time.perf_counter(), time.thread_time()
        y = x
        for layer in layers:
            y = layer(y, seq_lens)
        _sync(device)
        t1, c1 = time.perf_counter(), time.thread_time()
        y.backward(grad)
        _sync(device)
        t2, c2 = time.perf_counter(), time.thread_time()
        x.grad = None
        layers.zero_grad(set_to_none=True)
        if i >= warmup:
            out[:, :, i - warmup] = [[t1 - t0, t2 - t1], [c1 - c0, c2 - c1]]
    return out


def profile(
    cfg: GPTConfig,
    microbatches: Sequence[Sequence[int]],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
    warmup: int = 1,
    model_name: str = "gpt",
    seed: int = 0,
    on_progress: Callable[[int], None] | None = None,
) -> pd.DataFrame:
    """Measure ``cfg.layers`` decoder layers on each micro-batch; one row per micro-batch and phase."""
    device = torch.device(device)
    torch.manual_seed(seed)
    layers = torch.nn.ModuleList([DecoderBlock(cfg) for _ in range(cfg.layers)]).to(device, dtype)
    # one long untimed pass first: allocator, kernels and caches reach their steady state
    time_microbatch(layers, list(microbatches[0]), cfg.hidden, device, dtype, 1, 2)
    name = device_name(device)
    rows = []
    for mb_id, seq_lens in enumerate(microbatches):
        seq_lens = [int(n) for n in seq_lens]
        times = time_microbatch(layers, seq_lens, cfg.hidden, device, dtype, repeats, warmup)
        for k, phase in enumerate(("fwd", "bwd")):
            wall, cpu = times[0, k], times[1, k]
            median = float(np.median(wall))
            rows.append({
                "device": name, "model": model_name, "layers": cfg.layers, "hidden": cfg.hidden,
                "heads": cfg.heads, "ffn_hidden": cfg.ffn_hidden, "tp": 1, "phase": phase,
                "seq_lens": seq_lens, "time_s": median, "mb_id": mb_id,
                "tokens": sum(seq_lens), "repeats": repeats, "time_min_s": float(wall.min()),
                "time_spread": float((wall.max() - wall.min()) / median),
                "cpu_time_s": float(np.median(cpu)) if device.type == "cpu" else float("nan"),
                "cpu_time_min_s": float(cpu.min()) if device.type == "cpu" else float("nan"),
                "dtype": str(dtype).removeprefix("torch."),
                "measured_at": time.time(),
            })
        if on_progress:
            on_progress(mb_id + 1)
    return pd.DataFrame(rows)
