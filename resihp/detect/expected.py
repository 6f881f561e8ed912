"""Adapters from a trained micro-batch predictor to the ``ExpectedCompute`` callable the detector
uses."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from resihp.detect.observe import ExpectedCompute, shape_from_meta
from resihp.errors import InputError
from resihp.opstrace import JobMeta
from resihp.perf.device import this_device
from resihp.perf.registry import check_device, resolve_model
from resihp.workload.flops import TransformerShape


def predictor_expected(predictor: object, shape: TransformerShape) -> ExpectedCompute:
    """Wrap anything with ``predict_seq_lens(seq_lens, phase, shape) -> seconds``."""

    def expected(seq_lens: Sequence[Sequence[int]], phase: str) -> np.ndarray:
        return np.asarray(
            predictor.predict_seq_lens([list(s) for s in seq_lens], phase, shape), dtype=np.float64
        )

    return expected


def stage_shape(meta: JobMeta, meta_dict: dict | None) -> TransformerShape | None:
    """The shape of one pipeline stage from the job meta's model fields (layers split evenly)."""
    full = shape_from_meta(meta_dict)
    if full is None:
        return None
    return TransformerShape(
        max(1, full.layers // meta.pp_size), full.hidden, full.heads, full.ffn_hidden, full.tp
    )


def load_expected(
    model: str | Path, shape: TransformerShape | None, device: str | None = None
) -> ExpectedCompute:
    """The predictor ``model`` bound to ``shape``; a predictor of another device is refused.

    Args:
        model: a folder, an installed predictor by name, or ``auto`` (the one measured on
            ``device``).
        shape: the job's stage shape the predictor costs.
        device: the job's device (its meta's ``device`` field; default: this machine's CPU).
    """
    device = device or this_device()
    model = resolve_model(model, device)
    try:  # deferred for start-up time: the predictor imports lightgbm and scikit-learn
        from resihp.perf.predictor import MicroBatchPredictor
    except ImportError:
        raise InputError(
            f"--predictor {model}: this installation has no micro-batch predictor"
        ) from None
    if shape is None:
        raise InputError(
            f"--predictor {model}: the job meta needs the model fields layers, hidden, heads "
            "and ffn_hidden to ask the predictor"
        )
    predictor = MicroBatchPredictor.load(model)
    check_device(model, predictor.device_, device)
    return predictor_expected(predictor, shape)
