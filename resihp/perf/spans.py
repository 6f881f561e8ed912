"""Measured phases of micro-batches read from other tools' logs, and the profiling log they make.

The readers of torch.profiler traces, Megatron timer logs and resihp run folders each return an
:class:`ImportedTrace`: the spans they found and what the log itself says about the model and the
device; :func:`to_profile_log` turns it into rows of the profiling-log contract.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import pandas as pd

from resihp.errors import InputError
from resihp.perf.logs import validate_profile_log

PHASE_NAMES = {
    "fwd": "fwd",
    "forward": "fwd",
    "forward-compute": "fwd",
    "bwd": "bwd",
    "backward": "bwd",
    "backward-compute": "bwd",
}


@dataclass(frozen=True)
class Span:
    """One measured phase of one micro-batch: ``time_s`` seconds of ``phase`` on ``seq_lens``."""

    phase: str
    seq_lens: tuple[int, ...]
    time_s: float
    mb_id: int | None = None
    step: int | None = None
    rank: int | None = None
    layers: int | None = None  # the layers this span ran, where its stage's share differs


@dataclass(frozen=True)
class Shape:
    """The model a log measured, as far as it is known (None: not said)."""

    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    ffn_hidden: int | None = None
    tp: int | None = None

    def overridden(self, other: Shape) -> Shape:
        """This shape with every field ``other`` gives replaced by it."""
        given = {
            f.name: getattr(other, f.name)
            for f in fields(other)
            if getattr(other, f.name) is not None
        }
        return replace(self, **given)

    def missing(self) -> list[str]:
        return [f.name for f in fields(self) if f.name != "tp" and getattr(self, f.name) is None]


@dataclass(frozen=True)
class ImportedTrace:
    """What a reader found in one file or folder: its spans and what the file states.

    The shape, device and model name the file itself states (None where it does not)."""

    source: str
    format: str
    spans: tuple[Span, ...]
    shape: Shape = Shape()
    device: str | None = None
    model: str | None = None


def to_profile_log(trace: ImportedTrace, shape: Shape, device: str, model: str) -> pd.DataFrame:
    """Rows of the profiling-log contract, one per span, validated like any profiling log.

    Args:
        trace: the spans a reader found.
        shape: the model's shape (all of layers, hidden, heads, ffn_hidden; tp defaults to 1).
        device: the device the spans were measured on, as a predictor card names it.
        model: the model's name for the log's ``model`` column.
    """
    if not trace.spans:
        raise InputError(f"{trace.source}: no forward/backward spans found in this {trace.format}")
    if all(s.layers is not None for s in trace.spans):
        shape = replace(shape, layers=shape.layers or 1)
    missing = shape.missing()
    if missing:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in missing)
        raise InputError(
            f"{trace.source}: the model's {', '.join(missing)} are not in this "
            f"{trace.format}; give them with {flags}"
        )
    rows = [
        {
            "device": device,
            "model": model,
            "layers": s.layers or shape.layers,
            "hidden": shape.hidden,
            "heads": shape.heads,
            "ffn_hidden": shape.ffn_hidden,
            "tp": shape.tp or 1,
            "phase": s.phase,
            "seq_lens": list(s.seq_lens),
            "time_s": s.time_s,
            "mb_id": s.mb_id,
            "step": s.step,
            "rank": s.rank,
        }
        for s in trace.spans
    ]
    log = pd.DataFrame(rows)
    for col in ("mb_id", "step", "rank"):
        log[col] = log[col].astype("Int64")
    log["format"] = trace.format
    log["imported_from"] = trace.source
    return validate_profile_log(log, trace.source)
