"""Real torch measurements of a decoder-layer stack, forward and backward, per packed micro-batch.

Each micro-batch is timed ``repeats`` times after ``warmup`` untimed passes; the log keeps the median
(``time_s``) and the spread, so a user can see how noisy the machine was.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
import torch

from resihp.perf.device import device_name
from resihp.runtime.model import DecoderBlock, GPTConfig

PROFILE_COLUMNS = ["device", "model", "layers", "hidden", "heads", "ffn_hidden", "tp", "phase",
                   "seq_lens", "time_s"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_microbatch(
    layers: torch.nn.Module, seq_lens: Sequence[int], hidden: int, device: torch.device,
    dtype: torch.dtype, repeats: int, warmup: int
) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of ``repeats`` forward and backward passes of ``layers`` over one packed micro-batch."""
    tokens = int(sum(seq_lens))
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, hidden, device=device, dtype=dtype)
    fwd, bwd = np.empty(repeats), np.empty(repeats)
    for i in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        y = x
        for layer in layers:
            y = layer(y, seq_lens)
        _sync(device)
        t1 = time.perf_counter()
        y.backward(grad)
        _sync(device)
        t2 = time.perf_counter()
        x.grad = None
        layers.zero_grad(set_to_none=True)
        if i >= warmup:
            fwd[i - warmup], bwd[i - warmup] = t1 - t0, t2 - t1
    return fwd, bwd


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
        fwd, bwd = time_microbatch(layers, seq_lens, cfg.hidden, device, dtype, repeats, warmup)
        for phase, times in (("fwd", fwd), ("bwd", bwd)):
            median = float(np.median(times))
            rows.append({
                "device": name, "model": model_name, "layers": cfg.layers, "hidden": cfg.hidden,
                "heads": cfg.heads, "ffn_hidden": cfg.ffn_hidden, "tp": 1, "phase": phase,
                "seq_lens": seq_lens, "time_s": median, "mb_id": mb_id,
                "tokens": sum(seq_lens), "repeats": repeats, "time_min_s": float(times.min()),
                "time_spread": float((times.max() - times.min()) / median),
                "dtype": str(dtype).removeprefix("torch."),
                "measured_at": time.time(),
            })
        if on_progress:
            on_progress(mb_id + 1)
    return pd.DataFrame(rows)
