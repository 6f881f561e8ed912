"""Forward/backward compute times per micro-batch from a Megatron-LM training log.

Megatron's timers print, at every logging interval, each timer's time per iteration in
milliseconds: ``forward-compute ....: (min, max)`` under ``(min, max) time across ranks (ms):``
or ``forward-compute ....: max`` under ``max time across ranks (ms):`` (Megatron-Core), or
``time (ms) | forward-compute: T | backward-compute: T`` (older releases).
Only ``forward-compute`` and ``backward-compute`` are read, the ``max`` across ranks where both
are printed (the slowest rank's). One iteration's timer covers all of its micro-batches on a
pipeline stage, so a micro-batch's time is the timer over the micro-batches per iteration
(``global_batch_size / (micro_batch_size x data_parallel_size)``); its lengths are
``micro_batch_size`` sequences of ``seq_length`` and its layers a stage's share
(``num_layers / pipeline_model_parallel_size``). These come from the ``arguments`` block Megatron
prints at start, or from the import's options.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from resihp.errors import InputError
from resihp.perf.spans import PHASE_NAMES, ImportedTrace, Shape, Span

FORMAT = "Megatron log"
ARG_LINE = re.compile(r"^\s*([a-z_]+) \.{2,} (\S.*?)\s*$")
ITERATION = re.compile(r"\biteration\s+(\d+)\s*/")
NUMBER = r"([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)"
# Megatron-Core: "name ....: (min, max)" under "(min, max) time across ranks (ms):", or
# "name ....: max" under "max time across ranks (ms):"
NEW_TIMER = re.compile(
    rf"^\s*(forward-compute|backward-compute) \.*:\s*(?:\(\s*{NUMBER}\s*,\s*)?"
    rf"{NUMBER}\s*\)?\s*$"
)
OLD_TIMER = re.compile(rf"(forward-compute|backward-compute):\s*{NUMBER}")


@dataclass(frozen=True)
class MegatronBatch:
    """How a Megatron iteration is cut into micro-batches (None: take it from the log)."""

    seq_length: int | None = None
    micro_batch_size: int | None = None
    microbatches: int | None = None


def looks_like_megatron(text: str) -> bool:
    return bool(re.search(r"forward-compute\s*(?:\.+\s*)?:", text))


def _int_arg(args: dict[str, str], key: str) -> int | None:
    value = args.get(key)
    return int(value) if value is not None and value.isdigit() else None


def _batch(path: Path, args: dict[str, str], given: MegatronBatch) -> tuple[int, int, int]:
    seq = given.seq_length or _int_arg(args, "seq_length")
    mbs = given.micro_batch_size or _int_arg(args, "micro_batch_size")
    count = given.microbatches
    if count is None:
        gbs, dp = _int_arg(args, "global_batch_size"), _int_arg(args, "data_parallel_size")
        if gbs and mbs and dp:
            count = max(1, gbs // (mbs * dp))
    missing = [
        flag
        for flag, value in (
            ("--seq-length", seq),
            ("--micro-batch-size", mbs),
            ("--microbatches", count),
        )
        if not value
    ]
    if missing:
        raise InputError(
            f"{path}: the log's arguments block does not give the micro-batches' "
            f"{', '.join(m.lstrip('-') for m in missing)}; give {', '.join(missing)}"
        )
    return seq, mbs, count


def read_megatron(path: Path, given: MegatronBatch = MegatronBatch()) -> ImportedTrace:
    """Per-micro-batch forward and backward spans from Megatron's timer lines."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        raise InputError(f"{path}: no such log") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    args: dict[str, str] = {}
    timers: list[tuple[int | None, str, float]] = []  # (iteration, phase, ms per iteration)
    iteration = None
    for line in text.splitlines():
        if (m := ARG_LINE.match(line)) and m[1] not in args:
            args[m[1]] = m[2]
        if m := ITERATION.search(line):
            iteration = int(m[1])
        if m := NEW_TIMER.match(line):
            timers.append((iteration, PHASE_NAMES[m[1]], float(m[3])))
        elif "time (ms)" in line:
            timers += [
                (iteration, PHASE_NAMES[name], float(ms)) for name, ms in OLD_TIMER.findall(line)
            ]
    if not timers:
        raise InputError(
            f"{path}: no forward-compute/backward-compute timer lines (expected a "
            "Megatron-LM log with timing log level 1 or more)"
        )
    seq, mbs, count = _batch(path, args, given)
    pp = _int_arg(args, "pipeline_model_parallel_size") or 1
    layers = _int_arg(args, "num_layers")
    shape = Shape(
        layers=layers // pp if layers else None,
        hidden=_int_arg(args, "hidden_size"),
        heads=_int_arg(args, "num_attention_heads"),
        ffn_hidden=_int_arg(args, "ffn_hidden_size"),
        tp=_int_arg(args, "tensor_model_parallel_size"),
    )
    spans = tuple(
        Span(phase, (seq,) * mbs, ms / 1e3 / count, mb_id=n, step=it)
        for n, (it, phase, ms) in _numbered(timers)
    )
    return ImportedTrace(str(path), FORMAT, spans, shape=shape)


def _numbered(
    timers: list[tuple[int | None, str, float]],
) -> Iterator[tuple[int, tuple[int | None, str, float]]]:
    """Each timer with the number of its logging interval (forward and backward share one)."""
    seen: dict[str, int] = {}
    for it, phase, ms in timers:
        n = seen.get(phase, 0)
        seen[phase] = n + 1
        yield n, (it, phase, ms)
