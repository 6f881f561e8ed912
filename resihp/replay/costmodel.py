"""What one micro-batch costs on one pipeline stage of a replayed cluster, and what a stage holds.

Compute: the analytic FLOPs of ``resihp.workload.flops`` (dense + document-masked attention, backward
twice forward) for the stage's layers, divided by the device's effective rate (peak x MFU) and the
tensor-parallel group size, plus the tensor-parallel all-reduces (two per layer each way, at the
intra-node link speed). The learned predictor of ``resihp.perf`` is trained on the machine that
profiled it; cluster-scale replay of A100/H100 models uses the analytic model scaled to the device,
with the per-step noise measured from real jobs (``resihp.replay.noise``).

Memory per device, mixed-precision Adam: 16 bytes per parameter held (bf16 weights and gradients,
fp32 master weights and two moments) plus activations with selective recomputation and sequence
parallelism, 34 bytes x tokens x hidden per layer / tp (Korthikanti et al., 2022), for the micro-batches
that 1F1B keeps in flight on the first stage (pp of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from resihp.errors import InputError
from resihp.workload.flops import stage_flops
from resihp.workload.lengths import sample_sequences
from resihp.workload.packing import pack_greedy

BYTES_PER_PARAM = 16.0
ACT_BYTES_PER_TOKEN_HIDDEN_LAYER = 34.0


@dataclass
class MicroBatchPool:
    """Packed micro-batches of the workload with their per-layer costs (one entry per micro-batch)."""

    tokens: np.ndarray  # [n]
    fwd_flops_per_layer: np.ndarray  # [n] at tp = 1
    head_flops: np.ndarray  # [n] logits projection, forward, at tp = 1
    seq_lens: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def seq_objects(self) -> np.ndarray:
        """``seq_lens`` as an object array, so records for many micro-batches index it at once."""
        out = np.empty(len(self.seq_lens), dtype=object)
        out[:] = self.seq_lens
        return out


def build_pool(model, lengths: np.ndarray, n_microbatches: int, rng: np.random.Generator,
               budget: int | None = None) -> MicroBatchPool:
    """Draw documents from a real length source, chunk to max_seq_len and pack to the token budget."""
    budget = budget or model.microbatch_tokens
    seqs = sample_sequences(lengths, n_microbatches * budget, min(model.max_seq_len, budget), rng)
    batches = pack_greedy(seqs, budget)[:n_microbatches]
    tokens = np.array([b.sum() for b in batches], dtype=np.float64)
    sum_sq = np.array([(b.astype(np.float64) ** 2).sum() for b in batches])
    shape = model.shape(1)  # per layer
    dense, attn = stage_flops(shape, tokens, sum_sq, "fwd")
    return MicroBatchPool(tokens=tokens, fwd_flops_per_layer=dense + attn,
                          head_flops=2.0 * model.hidden * model.vocab * tokens, seq_lens=batches)


def device_flops_per_s(device) -> float:
    return device.peak_tflops * 1e12 * device.mfu


def stage_memory_gb(model, layers: np.ndarray | float, tp: np.ndarray | float, pp: int) -> np.ndarray:
    """Memory per device of a stage with ``layers`` layers on a ``tp``-wide group, in GB."""
    layers = np.asarray(layers, dtype=np.float64)
    tp = np.maximum(np.asarray(tp, dtype=np.float64), 1.0)
    weights = layers * model.params_per_layer * BYTES_PER_PARAM / tp
    acts = (ACT_BYTES_PER_TOKEN_HIDDEN_LAYER * model.microbatch_tokens * model.hidden * layers
            / tp * pp)
    embed = model.vocab * model.hidden * BYTES_PER_PARAM / tp
    return (weights + acts + embed) / 1e9


def check_fits(scenario, where: str) -> None:
    """The initial layout must fit in device memory (even split of layers, the largest stage)."""
    m, p = scenario.model, scenario.parallel
    layers = -(-m.layers // p.pp)
    need = float(stage_memory_gb(m, layers, p.tp, p.pp))
    have = scenario.cluster.device.memory_gb
    if need > have:
        raise InputError(f"{where}: the model does not fit the cluster: a stage of {layers} layers on "
                         f"tp={p.tp} needs {need:.1f} GB per device, the device has {have:g} GB "
                         "(raise pp or tp)")


def p2p_seconds(scenario, tp: np.ndarray | float) -> np.ndarray:
    """One micro-batch's activations (bf16, the sequence-parallel shard of one of ``tp`` ranks)
    over the inter-node link."""
    m = scenario.model
    return m.microbatch_tokens * m.hidden * 2.0 / np.asarray(tp, dtype=np.float64) / (
        scenario.cluster.inter_node_gbps * 1e9)


def sync_seconds(scenario, shard_layers: float, dp: int) -> tuple[float, float]:
    """(data-parallel gradient sync, optimizer step) in seconds for the largest per-device shard of
    ``shard_layers`` layers (a stage's layers / its tensor-parallel width).

    sync: ring all-reduce of the shard's bf16 gradients over the inter-node link; optimizer: one
    read and write of the shard's fp32 state in HBM.
    """
    m, c = scenario.model, scenario.cluster
    grads = shard_layers * m.params_per_layer * 2.0
    sync = 2.0 * (dp - 1) / max(dp, 1) * grads / (c.inter_node_gbps * 1e9)
    optim = shard_layers * m.params_per_layer * BYTES_PER_PARAM * 2 / (c.device.hbm_gbps * 1e9)
    return sync, optim


def tp_allreduce_s(scenario, tokens: np.ndarray | float, width: np.ndarray | float) -> np.ndarray:
    """One tensor-parallel all-reduce of a micro-batch's activations (bf16) over the intra-node
    links, ring algorithm; Megatron runs two per layer forward and two backward."""
    width = np.asarray(width, dtype=np.float64)
    size = np.asarray(tokens, dtype=np.float64) * scenario.model.hidden * 2.0
    return 2.0 * (width - 1.0) / width * size / (scenario.cluster.intra_node_gbps * 1e9)
