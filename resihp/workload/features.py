"""Per-micro-batch features computed from packed sequence lengths, vectorised over micro-batches."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from itertools import chain

import numpy as np
import pandas as pd

from resihp.errors import InputError
from resihp.workload.flops import TransformerShape, stage_flops

LENGTH_FEATURES = ["tokens", "sum_sq", "n_seqs", "max_len", "mean_len", "sum_cube"]


def length_features(seq_lens: Sequence[Sequence[int]]) -> pd.DataFrame:
    """tokens, sum of squared lengths, number of sequences, longest, mean, sum of cubes."""
    return pd.DataFrame(length_feature_arrays(seq_lens))


def length_feature_arrays(
    seq_lens: Sequence[Sequence[int]] | PooledLengths,
) -> dict[str, np.ndarray]:
    """``length_features`` as arrays by name, without the frame (for a caller on a hot path)."""
    if isinstance(seq_lens, PooledLengths):
        return seq_lens.features()
    counts = np.fromiter(map(len, seq_lens), dtype=np.int64, count=len(seq_lens))
    if len(seq_lens) and isinstance(seq_lens[0], np.ndarray):
        flat = np.concatenate(seq_lens)
    else:
        flat = np.fromiter(chain.from_iterable(seq_lens), dtype=np.int64, count=int(counts.sum()))
    return _feature_arrays(flat, counts)


def length_features_flat(flat: np.ndarray, counts: np.ndarray) -> pd.DataFrame:
    """As ``length_features`` for micro-batches given flat, with no Python per micro-batch.

    ``flat`` holds all lengths in one array, ``counts`` the number of sequences of each
    micro-batch."""
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


class LengthTable:
    """Distinct micro-batches' packed sequence lengths, each stored once.

    Their ``length_feature_arrays`` are computed once, on first use."""

    def __init__(self, seq_lens: Sequence[np.ndarray]) -> None:
        self.objects = np.empty(len(seq_lens), dtype=object)
        self.objects[:] = list(seq_lens)

    def __len__(self) -> int:
        return len(self.objects)

    @cached_property
    def features(self) -> dict[str, np.ndarray]:
        return length_feature_arrays(list(self.objects))


class PooledLengths:
    """A ``seq_lens`` column as codes into a ``LengthTable``.

    What a producer that draws its micro-batches from a pool writes (the replay's simulator). Rows
    index it like an array (an integer gives that row's lengths, an index array or slice the rows'
    column), and its features are the table's, gathered: no Python object per row, and none walked
    by the detector (``resihp.detect.observe_columns`` takes it where it takes an object column)."""

    __slots__ = ("table", "codes")

    def __init__(self, table: LengthTable, codes: np.ndarray) -> None:
        self.table, self.codes = table, codes

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            return self.table.objects[self.codes[key]]
        return PooledLengths(self.table, self.codes[key])

    def features(self) -> dict[str, np.ndarray]:
        """``length_feature_arrays`` of the rows."""
        return {name: values[self.codes] for name, values in self.table.features.items()}

    def objects(self) -> np.ndarray:
        """The rows as an object array of length arrays (for a frame)."""
        return self.table.objects[self.codes]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self.objects() if dtype is None else self.objects().astype(dtype)

    @staticmethod
    def concatenate(parts: Sequence[PooledLengths]) -> PooledLengths:
        """The rows of ``parts`` in order, as one column.

        One table where they share one, else their tables joined (a new table, its features
        computed afresh)."""
        tables = list({id(p.table): p.table for p in parts}.values())
        if len(tables) == 1:
            return PooledLengths(tables[0], np.concatenate([p.codes for p in parts]))
        offset = {
            id(t): o
            for t, o in zip(tables, np.cumsum([0] + [len(t) for t in tables])[:-1], strict=True)
        }
        joined = LengthTable(np.concatenate([t.objects for t in tables]))
        return PooledLengths(joined, np.concatenate([p.codes + offset[id(p.table)] for p in parts]))


def flops_features(
    lengths: pd.DataFrame, shapes: pd.DataFrame, phase: pd.Series | str
) -> pd.DataFrame:
    """Analytic dense and attention FLOPs per row.

    Args:
        lengths: per row the length features (``tokens``, ``sum_sq``: ``length_features``).
        shapes: per row the layers' shape (``layers``, ``hidden``, ``heads``, ``ffn_hidden``,
            ``tp``).
        phase: ``fwd`` or ``bwd``, for all rows or per row.
    """
    n = len(lengths)
    phases = np.broadcast_to(np.asarray(phase, dtype=object), (n,))
    dense = np.empty(n)
    attn = np.empty(n)
    keys = ["layers", "hidden", "heads", "ffn_hidden", "tp"]
    groups = shapes[keys].astype(np.int64).assign(_phase=phases).groupby(keys + ["_phase"]).indices
    for (layers, hidden, heads, ffn, tp, ph), idx in groups.items():
        shape = TransformerShape(int(layers), int(hidden), int(heads), int(ffn), int(tp))
        d, a = stage_flops(
            shape, lengths["tokens"].to_numpy()[idx], lengths["sum_sq"].to_numpy()[idx], ph
        )
        dense[idx], attn[idx] = d, a
    return pd.DataFrame({"flops_dense": dense, "flops_attn": attn})
