"""The replayed workload's micro-batches and their analytic FLOPs, what the simulator prices.

Compute: the analytic FLOPs of ``resihp.workload.flops`` (dense + document-masked attention,
backward twice forward) per layer of each packed micro-batch, and the LM head's
(``resihp.plan.cost.head_flops``); the simulator divides them by the device's sustained rate and the
tensor-parallel group size and adds the communication, all with the planner's analytic formulas
(``resihp.plan.cost``: tensor-parallel all-reduces, stage-boundary transfers, gradient all-reduce,
optimizer step). The learned predictor of ``resihp.perf`` is trained on the machine that profiled
it; cluster-scale replay of A100/H100 models uses the analytic model scaled to the device, with the
per-step noise measured from real jobs (``resihp.replay.noise``). What a stage holds in memory is
the planner's model too (``resihp.plan.specs.stage_memory_gb``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from resihp.plan.cost import head_flops
from resihp.workload.features import LengthTable
from resihp.workload.flops import stage_flops
from resihp.workload.packing import packed_microbatches


@dataclass
class MicroBatchPool:
    """Packed micro-batches of the workload with their per-layer costs (one entry per
    micro-batch)."""

    tokens: np.ndarray  # [n]
    fwd_flops_per_layer: np.ndarray  # [n] at tp = 1
    head_flops: np.ndarray  # [n] logits projection, forward, at tp = 1
    seq_lens: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def lengths(self) -> LengthTable:
        """``seq_lens`` as the table the records' ``seq_lens`` column codes into.

        A ``PooledLengths`` column: records for many micro-batches index it at once."""
        return LengthTable(self.seq_lens)


def build_pool(
    model,
    lengths: np.ndarray,
    n_microbatches: int,
    rng: np.random.Generator,
    budget: int | None = None,
) -> MicroBatchPool:
    """Draw documents from a real length source, chunk to max_seq_len and pack to the token budget.

    Args:
        model: the scenario's model (its shape, ``max_seq_len`` and ``microbatch_tokens``).
        lengths: the length source's document lengths (tokens).
        n_microbatches: how many packed micro-batches to draw.
        rng: the random generator documents are drawn with.
        budget: tokens per micro-batch (default: the model's ``microbatch_tokens``).
    """
    budget = budget or model.microbatch_tokens
    batches = packed_microbatches(lengths, n_microbatches, budget, model.max_seq_len, rng)
    tokens = np.array([b.sum() for b in batches], dtype=np.float64)
    sum_sq = np.array([(b.astype(np.float64) ** 2).sum() for b in batches])
    shape = model.shape(1)  # per layer
    dense, attn = stage_flops(shape, tokens, sum_sq, "fwd")
    return MicroBatchPool(
        tokens=tokens,
        fwd_flops_per_layer=dense + attn,
        head_flops=head_flops(model, tokens),
        seq_lens=batches,
    )
