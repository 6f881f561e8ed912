"""The training data of each step: real sequence lengths packed into micro-batches, and token ids.

The ids are deterministic, identical on every rank, so that no rank needs to be told shapes.

Every step draws documents from a real length source (``resihp.workload``) until the global token
budget is met, packs them greedily into micro-batches, and hands contiguous runs of micro-batches
to the data-parallel replicas in proportion to their weights (the planner's micro-batch allocation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from resihp.errors import InputError
from resihp.parallel import apportion
from resihp.workload.lengths import resolve_source, sample_sequences
from resihp.workload.packing import pack_greedy

STRIDES = np.arange(1, 8)


@dataclass(frozen=True)
class MicroBatch:
    mb_id: int  # index among the step's micro-batches, the same on every rank
    seq_lens: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return int(sum(self.seq_lens))


@dataclass(frozen=True)
class StepData:
    step: int
    microbatches: tuple[MicroBatch, ...]

    @property
    def tokens(self) -> int:
        return sum(mb.tokens for mb in self.microbatches)


class DataSource:
    """Per-step packed micro-batches from a length source (``code``, ``text`` or a file)."""

    def __init__(
        self, source: str, global_tokens: int, budget: int, max_len: int, seed: int
    ) -> None:
        if global_tokens < budget:
            raise InputError(
                f"--global-tokens {global_tokens} is smaller than the micro-batch "
                f"token budget --budget {budget}"
            )
        if max_len > budget:
            raise InputError(
                f"--max-len {max_len} exceeds the micro-batch token budget --budget {budget}"
            )
        self.lengths = resolve_source(source)
        self.global_tokens, self.budget, self.max_len, self.seed = (
            global_tokens,
            budget,
            max_len,
            seed,
        )

    def step(self, step: int) -> StepData:
        rng = np.random.default_rng([self.seed, step])
        seqs = sample_sequences(self.lengths, self.global_tokens, self.max_len, rng)
        # sample_sequences overshoots by up to one sequence; keep the global batch within budget
        seqs = seqs[
            : max(1, int(np.searchsorted(np.cumsum(seqs), self.global_tokens, side="right")))
        ]
        return StepData(
            step,
            tuple(
                MicroBatch(i, tuple(int(x) for x in b))
                for i, b in enumerate(pack_greedy(seqs, self.budget))
            ),
        )

    def tokens(self, step: int, mb: MicroBatch, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Input and target ids of a micro-batch.

        Each document is an arithmetic progression modulo ``vocab`` with a random start and stride,
        so the model has something to learn.

        Args:
            step: the training step (it seeds the ids with the source's seed).
            mb: the micro-batch (its id and sequence lengths).
            vocab: the vocabulary size."""
        rng = np.random.default_rng([self.seed, step, mb.mb_id, 1])
        inputs, targets = [], []
        for n in mb.seq_lens:
            ids = (rng.integers(vocab) + rng.choice(STRIDES) * np.arange(n + 1)) % vocab
            inputs.append(ids[:-1])
            targets.append(ids[1:])
        return (torch.from_numpy(np.concatenate(inputs)), torch.from_numpy(np.concatenate(targets)))


def replica_microbatches(
    data: StepData, dp_rank: int, weights: Sequence[float]
) -> list[MicroBatch]:
    """The contiguous run of the step's micro-batches that replica ``dp_rank`` trains.

    Args:
        data: the step's data.
        dp_rank: the replica's data-parallel rank.
        weights: every replica's share of the micro-batches (``apportion``'s weights)."""
    counts = apportion(len(data.microbatches), weights, what="micro-batch weights")
    start = sum(counts[:dp_rank])
    return list(data.microbatches[start : start + counts[dp_rank]])
