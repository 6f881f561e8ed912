"""Per-micro-batch features computed from packed sequence lengths, vectorised over micro-batches."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from resihp.errors import InputError
from resihp.workload.flops import TransformerShape, stage_flops

LENGTH_FEATURES = ["tokens", "sum_sq", "n_seqs", "max_len", "mean_len", "sum_cube"]


def length_features(seq_lens: Sequence[Sequence[int]]) -> pd.DataFrame:
    """tokens, sum of squared lengths, number of sequences, longest, mean, sum of cubes."""
    counts = np.fromiter((len(s) for s in seq_lens), dtype=np.int64, count=len(seq_lens))
    if len(counts) == 0:
        return pd.DataFrame({name: np.zeros(0) for name in LENGTH_FEATURES})
    if counts.min() == 0:
        raise InputError(f"micro-batch {int(np.argmin(counts))} has no sequences")
    flat = np.concatenate([np.asarray(s, dtype=np.int64) for s in seq_lens]).astype(np.float64)
    if flat.min() <= 0:
        raise InputError(f"sequence lengths must be positive, got {int(flat.min())}")
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    tokens = np.add.reduceat(flat, starts)
    return pd.DataFrame(
        {
            "tokens": tokens,
            "sum_sq": np.add.reduceat(flat * flat, starts),
            "n_seqs": counts.astype(np.float64),
            "max_len": np.maximum.reduceat(flat, starts),
            "mean_len": tokens / counts,
            "sum_cube": np.add.reduceat(flat**3, starts),
        }
    )


def flops_features(lengths: pd.DataFrame, shapes: pd.DataFrame, phase: pd.Series | str) -> pd.DataFrame:
    """Analytic dense and attention FLOPs per row; ``shapes`` has layers/hidden/heads/ffn_hidden/tp."""
    n = len(lengths)
    phases = np.broadcast_to(np.asarray(phase, dtype=object), (n,))
    dense = np.empty(n)
    attn = np.empty(n)
    keys = ["layers", "hidden", "heads", "ffn_hidden", "tp"]
    groups = shapes[keys].astype(np.int64).assign(_phase=phases).groupby(keys + ["_phase"]).indices
    for (layers, hidden, heads, ffn, tp, ph), idx in groups.items():
        shape = TransformerShape(int(layers), int(hidden), int(heads), int(ffn), int(tp))
        d, a = stage_flops(shape, lengths["tokens"].to_numpy()[idx], lengths["sum_sq"].to_numpy()[idx], ph)
        dense[idx], attn[idx] = d, a
    return pd.DataFrame({"flops_dense": dense, "flops_attn": attn})
