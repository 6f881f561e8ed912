"""Packing of sequences into micro-batches under a token budget."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from resihp.errors import InputError
from resihp.workload.lengths import sample_sequences


def pack_greedy(seq_lens: Sequence[int] | np.ndarray, budget: int) -> list[np.ndarray]:
    """Pack sequences in data order: a micro-batch is closed when the next sequence does not fit.

    This is what a data loader with sequence packing does: it keeps the data order, so the
    micro-batches' sequence-length mix varies as the data does.
    """
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    if budget < 1:
        raise InputError(f"micro-batch token budget must be positive, got {budget}")
    if seq_lens.size and seq_lens.min() <= 0:
        raise InputError(f"sequence lengths must be positive, got {int(seq_lens.min())}")
    if seq_lens.size and seq_lens.max() > budget:
        raise InputError(
            f"sequence of length {int(seq_lens.max())} exceeds the micro-batch "
            f"token budget {budget}"
        )
    batches: list[np.ndarray] = []
    start, used = 0, 0
    for i, n in enumerate(seq_lens.tolist()):
        if used + n > budget:
            batches.append(seq_lens[start:i])
            start, used = i, 0
        used += n
    if start < len(seq_lens):
        batches.append(seq_lens[start:])
    return batches


def packed_microbatches(
    documents: np.ndarray, n: int, budget: int, max_len: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """``n`` micro-batches packed from documents drawn at random from a length source.

    Each document is chunked to ``min(max_len, budget)``: what a packing data loader feeds a job
    reading that source.

    Args:
        documents: the source's document lengths.
        n: micro-batches to pack.
        budget: tokens per micro-batch.
        max_len: the model's longest sequence.
        rng: the random generator.
    """
    seqs = sample_sequences(documents, n * budget, min(max_len, budget), rng)
    return pack_greedy(seqs, budget)[:n]
