"""Cost models: a micro-batch's seconds per layer and head, and a step's communication times.

They give the seconds of one micro-batch through one layer (and through the LM head) on a device,
and the analytic times of a step's communication and optimizer step.

The planner only needs per-layer forward/backward times at full speed for a tensor-parallel degree;
a device at speed ``s`` takes ``1/s`` as long. Two implementations share the interface:
``AnalyticCost`` (analytic FLOPs / the device's FLOP rate plus tensor-parallel all-reduces, for
cluster-scale planning) and ``PredictorCost`` (the learned micro-batch predictor of resihp.perf,
for the devices it was trained on).

The analytic formulas are defined once here, for the planner (``AnalyticCost``, ``StageCoster``)
and the replay's simulator alike (vectorised: tokens and widths may be arrays): ``flops_per_s``
(a device's sustained rate), ``head_flops`` (the LM head's forward), ``tp_allreduce_s`` (a
tensor-parallel all-reduce of activations, ring, intra-node), ``p2p_s`` (activations across a
stage boundary, inter-node), ``grad_sync_s`` (the data-parallel ring all-reduce of bf16 gradients,
inter-node) and ``optimizer_s`` (one read and write of the optimizer state in HBM).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Protocol

import numpy as np

from resihp.plan.specs import ClusterSpec, ModelSpec
from resihp.workload.flops import stage_flops
from resihp.workload.lengths import resolve_source
from resihp.workload.packing import packed_microbatches

ACTIVATION_BYTES = 2.0  # bf16 activations and gradients on the wire
GRADIENT_BYTES = 2.0


def flops_per_s(tflops: float | np.ndarray, efficiency: float = 1.0) -> float | np.ndarray:
    """A device's FLOP rate in training: ``tflops`` (sustained) x ``efficiency``."""
    return tflops * 1e12 * efficiency


def head_flops(model: ModelSpec, tokens: float | np.ndarray) -> float | np.ndarray:
    """Forward FLOPs of the LM head (the logits projection) for ``tokens`` tokens, at tp = 1.

    Its backward is twice as many."""
    return 2.0 * tokens * model.hidden * model.vocab


def tp_allreduce_s(
    model: ModelSpec, cluster: ClusterSpec, tokens: float | np.ndarray, width: float | np.ndarray
) -> float | np.ndarray:
    """Seconds of one tensor-parallel all-reduce of activations (bf16) over the intra-node links.

    Ring algorithm; 0 for one device. Megatron runs two per layer forward and two backward.

    Args:
        model: the model (its hidden size).
        cluster: the cluster (its intra-node bandwidth).
        tokens: the tokens whose activations are reduced (a number or an array).
        width: the tensor-parallel group's size in devices (a number or an array)."""
    width = np.asarray(width, dtype=np.float64)
    size = np.asarray(tokens, dtype=np.float64) * model.hidden * ACTIVATION_BYTES
    return 2.0 * (width - 1.0) / width * size / (cluster.intra_node_gbs * 1e9)


def p2p_s(
    model: ModelSpec,
    cluster: ClusterSpec,
    width: float | np.ndarray = 1.0,
    tokens: float | None = None,
) -> float | np.ndarray:
    """Seconds of one micro-batch's activations (bf16) across a stage boundary, inter-node.

    The transfer is split over ``width`` tensor-parallel senders (each sends its sequence-parallel
    shard). The replay gives a replica's narrowest group; the planner prices every boundary unsplit
    (width 1), whatever its groups. Plus the cluster's ``p2p_overhead_s`` per transfer (a live
    job's measured software overhead; 0 in specs).

    Args:
        model: the model (its hidden size and micro-batch token budget).
        cluster: the cluster (its inter-node bandwidth and ``p2p_overhead_s``).
        width: the tensor-parallel senders the transfer is split over (a number or an array).
        tokens: the micro-batch's tokens (None: the model's ``microbatch_tokens``)."""
    tokens = model.microbatch_tokens if tokens is None else tokens
    return (
        tokens
        * model.hidden
        * ACTIVATION_BYTES
        / np.asarray(width, dtype=np.float64)
        / (cluster.inter_node_gbs * 1e9)
        + cluster.p2p_overhead_s
    )


def grad_sync_s(
    model: ModelSpec, cluster: ClusterSpec, shard_layers: float, replicas: int
) -> float:
    """Seconds of the data-parallel ring all-reduce of one device's bf16 gradients, inter-node.

    Args:
        model: the model (its parameters per layer).
        cluster: the cluster (its inter-node bandwidth).
        shard_layers: the layers the device holds (a stage's layers / its tensor-parallel width).
        replicas: the data-parallel replicas in the ring (below 2: no sync, 0 seconds)."""
    if replicas < 2:
        return 0.0
    grads = shard_layers * model.params_per_layer * GRADIENT_BYTES
    return 2.0 * (replicas - 1) / replicas * grads / (cluster.inter_node_gbs * 1e9)


def optimizer_s(model: ModelSpec, cluster: ClusterSpec, shard_layers: float) -> float:
    """Seconds of the optimizer step of a device holding ``shard_layers`` layers.

    One read and one write of their state in HBM, at the slowest device's bandwidth.

    Args:
        model: the model (its parameters per layer and state bytes per parameter).
        cluster: the cluster (its slowest HBM bandwidth).
        shard_layers: the layers the device holds (a stage's layers / its tensor-parallel width)."""
    return (
        shard_layers
        * model.params_per_layer
        * model.state_bytes_per_param
        * 2
        / (cluster.min_hbm_gbs * 1e9)
    )


class CostModel(Protocol):
    def layer_seconds(
        self, model: ModelSpec, cluster: ClusterSpec, tp: int, tflops: float
    ) -> tuple[float, float]:
        """(forward, backward) seconds of one micro-batch through one layer at full speed.

        Args:
            model: the model and its batch.
            cluster: the cluster (its links).
            tp: the tensor-parallel degree.
            tflops: the device's sustained TFLOP/s."""

    def head_seconds(
        self, model: ModelSpec, cluster: ClusterSpec, tp: int, tflops: float
    ) -> tuple[float, float]:
        """(forward, backward) seconds of one micro-batch through the LM head and loss.

        Args:
            model: the model and its batch.
            cluster: the cluster (its links).
            tp: the tensor-parallel degree.
            tflops: the device's sustained TFLOP/s."""


@lru_cache(maxsize=64)
def cost_key(cost: CostModel) -> tuple:
    """What keys the caches of one cost model's derived tables.

    Its type and settings, or the object itself when they do not hash."""
    try:
        key = (type(cost).__qualname__, tuple(sorted(vars(cost).items())))
        hash(key)
        return key
    except TypeError:
        return (type(cost).__qualname__, cost)  # by identity, and kept alive with its items


def expected_microbatches(
    workload: str | None,
    microbatch_tokens: int,
    max_seq_len: int,
    samples: int = 256,
    seed: int = 0,
) -> tuple[tuple[int, ...], ...]:
    """Micro-batches as a data loader would pack them from the workload's real document lengths.

    Without a workload, every micro-batch is full-length sequences.

    Args:
        workload: the sequence-length source's name (None: full-length sequences only).
        microbatch_tokens: the token budget of one micro-batch.
        max_seq_len: the longest sequence, in tokens.
        samples: how many micro-batches to pack.
        seed: the packing's random seed."""
    if workload is None:
        per = microbatch_tokens // max_seq_len
        return ((max_seq_len,) * per,)
    batches = packed_microbatches(
        resolve_source(workload),
        samples,
        microbatch_tokens,
        max_seq_len,
        np.random.default_rng(seed),
    )
    return tuple(tuple(int(x) for x in b) for b in batches)


def mean_mix(model: ModelSpec) -> tuple[float, float]:
    """(tokens, sum of squared lengths) of the mean micro-batch."""
    batches = expected_microbatches(model.workload, model.microbatch_tokens, model.max_seq_len)
    tokens = np.array([sum(b) for b in batches], dtype=np.float64)
    sum_sq = np.array([sum(x * x for x in b) for b in batches], dtype=np.float64)
    return float(tokens.mean()), float(sum_sq.mean())


class AnalyticCost:
    """Analytic FLOPs over the device's sustained FLOP rate, plus the tensor-parallel all-reduces.

    There are two all-reduces per layer forward and two backward, on the intra-node links.
    ``efficiency`` scales the rate given in the cluster spec (1.0, the default, when ``tflops`` is
    already the sustained rate, as in the shipped clusters and the replay's).
    """

    def __init__(self, efficiency: float = 1.0) -> None:
        self.efficiency = efficiency

    def layer_seconds(
        self, model: ModelSpec, cluster: ClusterSpec, tp: int, tflops: float
    ) -> tuple[float, float]:
        """(forward, backward) seconds of the mean micro-batch through one layer at full speed.

        Args:
            model: the model and its batch.
            cluster: the cluster (its intra-node bandwidth).
            tp: the tensor-parallel degree.
            tflops: the device's sustained TFLOP/s."""
        tokens, sum_sq = mean_mix(model)
        rate = flops_per_s(tflops, self.efficiency)
        comm = 2.0 * float(tp_allreduce_s(model, cluster, tokens, tp))
        out = []
        for phase in ("fwd", "bwd"):
            dense, attn = stage_flops(
                model.shape(1, tp), np.array([tokens]), np.array([sum_sq]), phase
            )
            out.append(float(dense[0] + attn[0]) / rate + comm)
        return out[0], out[1]

    def head_seconds(
        self, model: ModelSpec, cluster: ClusterSpec, tp: int, tflops: float
    ) -> tuple[float, float]:
        """(forward, backward) seconds of the mean micro-batch through the LM head.

        Args:
            model: the model and its batch.
            cluster: the cluster (unused by the analytic head).
            tp: the tensor-parallel degree.
            tflops: the device's sustained TFLOP/s."""
        tokens, _ = mean_mix(model)
        fwd = head_flops(model, tokens) / tp / flops_per_s(tflops, self.efficiency)
        return fwd, 2.0 * fwd

    def microbatch_factors(
        self, model: ModelSpec, cluster: ClusterSpec, tp: int, tflops: float
    ) -> np.ndarray:
        """Each packed micro-batch's layer time (forward + backward) over the mean micro-batch's.

        This is what makes one micro-batch slower than another on the critical path. Mean 1 (the
        analytic cost is linear in tokens and in the sum of squared lengths).

        Args:
            model: the model and its batch (its workload).
            cluster: the cluster (its intra-node bandwidth).
            tp: the tensor-parallel degree.
            tflops: the device's sustained TFLOP/s."""
        batches = expected_microbatches(model.workload, model.microbatch_tokens, model.max_seq_len)
        tokens = np.array([sum(b) for b in batches], dtype=np.float64)
        sum_sq = np.array([sum(x * x for x in b) for b in batches], dtype=np.float64)
        rate = flops_per_s(tflops, self.efficiency)
        total = 2.0 * 2.0 * tp_allreduce_s(model, cluster, tokens, tp)
        for phase in ("fwd", "bwd"):
            dense, attn = stage_flops(model.shape(1, tp), tokens, sum_sq, phase)
            total = total + (np.asarray(dense) + np.asarray(attn)) / rate
        return total / total.mean()


class PredictorCost:
    """The learned micro-batch predictor as a cost model (``MicroBatchPredictor.load(path)``).

    A layer's time is the mean predicted time of the workload's micro-batches for the whole layer
    stack, divided by the number of layers. Device FLOP rates are not used: the predictor knows its
    device.
    """

    def __init__(self, predictor: object) -> None:
        if not hasattr(predictor, "predict_seq_lens"):
            raise TypeError("predictor must provide predict_seq_lens(seq_lens_list, phase, shape)")
        self.predictor = predictor
        self._cache: dict[tuple, tuple[float, float]] = {}

    @classmethod
    def load(cls, path: str) -> PredictorCost:
        # deferred for start-up time: the predictor imports lightgbm and scikit-learn
        from resihp.perf.predictor import MicroBatchPredictor

        return cls(MicroBatchPredictor.load(path))

    def layer_seconds(
        self, model: ModelSpec, cluster: ClusterSpec, tp: int, tflops: float
    ) -> tuple[float, float]:
        """(forward, backward) seconds through one layer: the micro-batches' mean predicted time.

        Args:
            model: the model and its batch.
            cluster: the cluster (unused: the predictor knows its device).
            tp: the tensor-parallel degree.
            tflops: the device's TFLOP/s (unused: the predictor knows its device)."""
        key = (model, tp)
        if key not in self._cache:
            batches = [
                list(b)
                for b in expected_microbatches(
                    model.workload, model.microbatch_tokens, model.max_seq_len
                )
            ]
            shape = model.shape(model.layers, tp)
            times = [
                float(np.mean(self.predictor.predict_seq_lens(batches, phase, shape)))
                / model.layers
                for phase in ("fwd", "bwd")
            ]
            self._cache[key] = (times[0], times[1])
        return self._cache[key]

    def head_seconds(
        self, model: ModelSpec, cluster: ClusterSpec, tp: int, tflops: float
    ) -> tuple[float, float]:
        """(0, 0): the predictor prices no separate LM head.

        Args:
            model: the model and its batch (unused).
            cluster: the cluster (unused).
            tp: the tensor-parallel degree (unused).
            tflops: the device's TFLOP/s (unused)."""
        return 0.0, 0.0

    def microbatch_factors(
        self, model: ModelSpec, cluster: ClusterSpec, tp: int, tflops: float
    ) -> np.ndarray:
        """Each packed micro-batch's predicted time (forward + backward) over their mean.

        Args:
            model: the model and its batch (its workload).
            cluster: the cluster (unused: the predictor knows its device).
            tp: the tensor-parallel degree.
            tflops: the device's TFLOP/s (unused)."""
        batches = [
            list(b)
            for b in expected_microbatches(
                model.workload, model.microbatch_tokens, model.max_seq_len
            )
        ]
        shape = model.shape(model.layers, tp)
        total = sum(
            np.asarray(self.predictor.predict_seq_lens(batches, phase, shape), dtype=np.float64)
            for phase in ("fwd", "bwd")
        )
        return total / total.mean()
