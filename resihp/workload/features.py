"""Per-micro-batch features computed from packed sequence lengths, vectorised over micro-batches."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import pandas as pd

from resihp.errors import InputError
from resihp.workload.flops import TransformerShape, stage_flops

LENGTH_FEATURES = ["tokens", "sum_sq", "n_seqs", "max_len", "mean_len", "sum_cube"]


def length_features(seq_lens: Sequence[Sequence[int]]) -> pd.DataFrame:
    """tokens, sum of squared lengths, number of sequences, longest, mean, sum of cubes."""
    return pd.DataFrame(length_feature_arrays(seq_lens))


def length_feature_arrays(seq_lens: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    """``length_features`` as arrays by name, without the frame (for a caller on a hot path)."""
    counts = np.fromiter(map(len, seq_lens), dtype=np.int64, count=len(seq_lens))
    if len(seq_lens) and isinstance(seq_lens[0], np.ndarray):
        flat = np.concatenate(seq_lens)
    else:
        flat = np.fromiter(chain.from_iterable(seq_lens), dtype=np.int64, count=int(counts.sum()))
    return _feature_arrays(flat, counts)


def length_features_flat(flat: np.ndarray, counts: np.ndarray) -> pd.DataFrame:
    """As ``length_features`` for micro-batches given as all lengths in one array plus the
    number of sequences of each micro-batch (no Python per micro-batch)."""
    return pd.DataFrame(_feature_arrays(flat, counts))


def _feature_arrays(flat: np.ndarray, counts: np.ndarray) -> dict[str, np.ndarray]:
    counts = np.asarray(counts, dtype=np.int64)
    if len(counts) == 0:
        return {name: np.zeros(0) for name in LENGTH_FEATURES}
    if counts.min() <= 0:
        raise InputError(f"micro-batch {int(np.argmin(counts))} has no sequences")
    flat = np.asarray(flat, dtype=np.float64)
    if flat.min() <= 0:
        raise InputError(f"sequence lengths must be positive, got {int(flat.min())}")
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    tokens = np.add.reduceat(flat, starts)
    squares = flat * flat
    return {
        "tokens": tokens,
        "sum_sq": np.add.reduceat(squares, starts),
        "n_seqs": counts.astype(np.float64),
        "max_len": np.maximum.reduceat(flat, starts),
        "mean_len": tokens / counts,
        "sum_cube": np.add.reduceat(squares * flat, starts),
    }


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
