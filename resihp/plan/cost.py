"""Cost models: seconds of one micro-batch through one layer (and through the LM head) on a device.

The planner only needs per-layer forward/backward times at full speed for a tensor-parallel degree;
a device at speed ``s`` takes ``1/s`` as long. Two implementations share the interface:
``AnalyticCost`` (analytic FLOPs / the device's FLOP rate plus tensor-parallel all-reduces, for
cluster-scale planning) and ``PredictorCost`` (the learned micro-batch predictor of resihp.perf,
for the devices it was trained on).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Protocol

import numpy as np

from resihp.plan.specs import ClusterSpec, ModelSpec
from resihp.workload.flops import stage_flops
from resihp.workload.lengths import resolve_source, sample_sequences
from resihp.workload.packing import pack_greedy


class CostModel(Protocol):
    def layer_seconds(self, model: ModelSpec, cluster: ClusterSpec, tp: int,
                      tflops: float) -> tuple[float, float]:
        """(forward, backward) seconds of one micro-batch through one layer at full speed."""

    def head_seconds(self, model: ModelSpec, cluster: ClusterSpec, tp: int,
                     tflops: float) -> tuple[float, float]:
        """(forward, backward) seconds of one micro-batch through the LM head and loss."""


@lru_cache(maxsize=64)
def expected_microbatches(workload: str | None, microbatch_tokens: int, max_seq_len: int,
                          samples: int = 256, seed: int = 0) -> tuple[tuple[int, ...], ...]:
    """Micro-batches as a data loader would pack them from the workload's real document lengths;
    without a workload, every micro-batch is full-length sequences."""
    if workload is None:
        per = microbatch_tokens // max_seq_len
        return ((max_seq_len,) * per,)
    lengths = resolve_source(workload)
    seqs = sample_sequences(lengths, samples * microbatch_tokens, max_seq_len,
                            np.random.default_rng(seed))
    batches = pack_greedy(seqs, microbatch_tokens)[:samples]
    return tuple(tuple(int(x) for x in b) for b in batches)


def mean_mix(model: ModelSpec) -> tuple[float, float]:
    """(tokens, sum of squared lengths) of the mean micro-batch."""
    batches = expected_microbatches(model.workload, model.microbatch_tokens, model.max_seq_len)
    tokens = np.array([sum(b) for b in batches], dtype=np.float64)
    sum_sq = np.array([sum(x * x for x in b) for b in batches], dtype=np.float64)
    return float(tokens.mean()), float(sum_sq.mean())


class AnalyticCost:
    """Analytic FLOPs over the device's sustained FLOP rate, plus the tensor-parallel all-reduces
    (two per layer forward, two backward) on the intra-node links.

    ``efficiency`` scales the rate given in the cluster spec (set 1.0 when ``tflops`` is already a
    measured sustained rate).
    """

    def __init__(self, efficiency: float = 1.0, activation_bytes: int = 2) -> None:
        self.efficiency = efficiency
        self.activation_bytes = activation_bytes

    def _allreduce_s(self, model: ModelSpec, cluster: ClusterSpec, tp: int, tokens: float) -> float:
        if tp == 1:
            return 0.0
        size = tokens * model.hidden * self.activation_bytes
        return 2.0 * (tp - 1) / tp * size / (cluster.intra_node_gbs * 1e9)

    def layer_seconds(self, model: ModelSpec, cluster: ClusterSpec, tp: int,
                      tflops: float) -> tuple[float, float]:
        tokens, sum_sq = mean_mix(model)
        rate = tflops * 1e12 * self.efficiency
        comm = 2.0 * self._allreduce_s(model, cluster, tp, tokens)
        out = []
        for phase in ("fwd", "bwd"):
            dense, attn = stage_flops(model.shape(1, tp), np.array([tokens]), np.array([sum_sq]),
                                      phase)
            out.append(float(dense[0] + attn[0]) / rate + comm)
        return out[0], out[1]

    def head_seconds(self, model: ModelSpec, cluster: ClusterSpec, tp: int,
                     tflops: float) -> tuple[float, float]:
        tokens, _ = mean_mix(model)
        fwd = 2.0 * tokens * model.hidden * model.vocab / tp / (tflops * 1e12 * self.efficiency)
        return fwd, 2.0 * fwd

    def microbatch_factors(self, model: ModelSpec, cluster: ClusterSpec, tp: int,
                           tflops: float) -> np.ndarray:
        """Each of the workload's packed micro-batches' layer time (forward + backward) over the
        mean micro-batch's: what makes one micro-batch slower than another on the critical path.
        Mean 1 (the analytic cost is linear in tokens and in the sum of squared lengths)."""
        batches = expected_microbatches(model.workload, model.microbatch_tokens,
                                        model.max_seq_len)
        tokens = np.array([sum(b) for b in batches], dtype=np.float64)
        sum_sq = np.array([sum(x * x for x in b) for b in batches], dtype=np.float64)
        rate = tflops * 1e12 * self.efficiency
        total = 2.0 * 2.0 * self._allreduce_s(model, cluster, tp, 1.0) * tokens
        for phase in ("fwd", "bwd"):
            dense, attn = stage_flops(model.shape(1, tp), tokens, sum_sq, phase)
            total = total + (np.asarray(dense) + np.asarray(attn)) / rate
        return total / total.mean()


class PredictorCost:
    """The learned micro-batch predictor (``MicroBatchPredictor.load(path)``, issue on the
    predictor): mean predicted time of the workload's micro-batches for the whole layer stack,
    divided by the number of layers. Device FLOP rates are not used: the predictor knows its device.
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

    def layer_seconds(self, model: ModelSpec, cluster: ClusterSpec, tp: int,
                      tflops: float) -> tuple[float, float]:
        key = (model, tp)
        if key not in self._cache:
            batches = [list(b) for b in expected_microbatches(
                model.workload, model.microbatch_tokens, model.max_seq_len)]
            shape = model.shape(model.layers, tp)
            times = [float(np.mean(self.predictor.predict_seq_lens(batches, phase, shape)))
                     / model.layers for phase in ("fwd", "bwd")]
            self._cache[key] = (times[0], times[1])
        return self._cache[key]

    def head_seconds(self, model: ModelSpec, cluster: ClusterSpec, tp: int,
                     tflops: float) -> tuple[float, float]:
        return 0.0, 0.0

    def microbatch_factors(self, model: ModelSpec, cluster: ClusterSpec, tp: int,
                           tflops: float) -> np.ndarray:
        """Each packed micro-batch's predicted time (forward + backward) over their mean."""
        batches = [list(b) for b in expected_microbatches(
            model.workload, model.microbatch_tokens, model.max_seq_len)]
        shape = model.shape(model.layers, tp)
        total = sum(np.asarray(self.predictor.predict_seq_lens(batches, phase, shape),
                               dtype=np.float64) for phase in ("fwd", "bwd"))
        return total / total.mean()
