"""Analytic FLOPs of a GPT-style decoder stage with packed, document-masked causal attention."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from resihp.errors import InputError


@dataclass(frozen=True)
class TransformerShape:
    """The shape of a stack of decoder layers, as far as cost is concerned."""

    layers: int
    hidden: int
    heads: int
    ffn_hidden: int
    tp: int = 1
    mlp_matrices: int = 2  # 2: GELU MLP (up, down); 3: SwiGLU (gate, up, down)

    def __post_init__(self) -> None:
        if self.mlp_matrices not in (2, 3):
            raise InputError(
                f"model shape: mlp_matrices must be 2 (GELU) or 3 (SwiGLU), got "
                f"{self.mlp_matrices!r}"
            )
        for name in ("layers", "hidden", "heads", "ffn_hidden", "tp"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise InputError(f"model shape: {name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise InputError(
                f"model shape: hidden ({self.hidden}) must be divisible by heads ({self.heads})"
            )

    def to_dict(self) -> dict[str, int]:
        return {k: int(v) for k, v in asdict(self).items()}


def linear_flops_per_token(shape: TransformerShape) -> float:
    """Forward FLOPs per token of the dense parts of one layer (QKV, projection, MLP), per TP
    rank."""
    h, f = shape.hidden, shape.ffn_hidden
    return 2.0 * (4 * h * h + shape.mlp_matrices * h * f) / shape.tp


def attention_flops(shape: TransformerShape, sum_sq: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Forward FLOPs of causal attention scores and weighted sum in one layer, per TP rank.

    With document masking each sequence of length l attends within itself: l(l+1)/2 query-key pairs,
    each costing 2*hidden FLOPs for QK^T and 2*hidden for AV.

    Args:
        shape: the layer's shape (its hidden size and TP degree).
        sum_sq: per micro-batch the sum of its sequences' squared lengths.
        tokens: per micro-batch its tokens (the sum of its lengths).
    """
    pairs = (np.asarray(sum_sq, dtype=np.float64) + np.asarray(tokens, dtype=np.float64)) / 2.0
    return 4.0 * shape.hidden * pairs / shape.tp


def stage_flops(
    shape: TransformerShape, tokens: np.ndarray, sum_sq: np.ndarray, phase: str = "fwd"
) -> tuple[np.ndarray, np.ndarray]:
    """(dense FLOPs, attention FLOPs) of ``shape.layers`` layers for the given micro-batches.

    Backward costs twice the forward (gradients with respect to inputs and to weights).

    Args:
        shape: the stage's shape (``layers`` of it are counted).
        tokens: per micro-batch its tokens.
        sum_sq: per micro-batch the sum of its sequences' squared lengths.
        phase: ``fwd`` or ``bwd``.
    """
    factor = {"fwd": 1.0, "bwd": 2.0}.get(phase)
    if factor is None:
        raise InputError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
    tokens = np.asarray(tokens, dtype=np.float64)
    dense = factor * shape.layers * linear_flops_per_token(shape) * tokens
    attn = factor * shape.layers * attention_flops(shape, sum_sq, tokens)
    return dense, attn
