"""``resihp profile import``: other tools' timing logs as a profiling log ``predictor train`` reads.

Three kinds of input, told apart by their form: a torch.profiler (Kineto) Chrome trace
(``resihp.perf.kineto``), a Megatron-LM training log (``resihp.perf.megatron_log``) and a resihp
run folder (``resihp.perf.run_import``). Each span becomes one row of the profiling-log contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from resihp.errors import InputError
from resihp.perf.device import this_device
from resihp.perf.kineto import looks_like_kineto, read_kineto, read_side_lengths
from resihp.perf.megatron_log import MegatronBatch, looks_like_megatron, read_megatron
from resihp.perf.run_import import read_run
from resihp.perf.spans import ImportedTrace, Shape, to_profile_log

FORMATS = ("auto", "kineto", "megatron", "run")


@dataclass(frozen=True)
class ImportOptions:
    """What the user says about the logs; it wins over what the logs say themselves."""

    shape: Shape = Shape()
    device: str | None = None
    model: str | None = None
    lengths: Path | None = None  # side file: micro-batch id -> sequence lengths (Kineto traces)
    batch: MegatronBatch = MegatronBatch()
    format: str = "auto"


@dataclass(frozen=True)
class ImportResult:
    """The profiling log and one line per input on where its device name came from."""

    log: pd.DataFrame
    notes: tuple[str, ...]


def _format_of(path: Path) -> str:
    if path.is_dir():
        return "run"
    if not path.exists():
        raise InputError(f"{path}: no such file or folder")
    if looks_like_kineto(path):
        return "kineto"
    try:
        head = path.read_bytes()[: 1 << 20].decode(errors="replace")
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    if head.lstrip().startswith("{"):
        return "kineto"
    if looks_like_megatron(head) or looks_like_megatron(path.read_text(errors="replace")):
        return "megatron"
    raise InputError(
        f"{path}: not a torch.profiler trace (.json), a Megatron-LM log (with "
        "forward-compute timer lines) or a resihp run folder"
    )


def read_trace(path: Path, options: ImportOptions) -> ImportedTrace:
    """One input read by the reader its form (or ``options.format``) calls for."""
    kind = _format_of(path) if options.format == "auto" else options.format
    if kind not in FORMATS[1:]:
        raise InputError(f"--format: expected one of {', '.join(FORMATS)}, got {kind!r}")
    if kind == "kineto":
        side = read_side_lengths(options.lengths) if options.lengths else None
        return read_kineto(path, side)
    if options.lengths is not None:
        raise InputError(
            f"--lengths {options.lengths}: a lengths file goes with a torch.profiler "
            f"trace; {path} is a {kind} input"
        )
    return read_megatron(path, options.batch) if kind == "megatron" else read_run(path)


def import_profiles(
    paths: Sequence[Path], options: ImportOptions = ImportOptions()
) -> ImportResult:
    """Every input read and turned into profiling-log rows, concatenated."""
    if not paths:
        raise InputError("resihp profile import: give one or more traces, logs or run folders")
    frames, notes = [], []
    for path in map(Path, paths):
        trace = read_trace(path, options)
        if options.shape.layers is not None:  # the user's layer count over a run's stage split
            trace = replace(trace, spans=tuple(replace(s, layers=None) for s in trace.spans))
        device = options.device or trace.device
        if device is None:
            device = this_device("cpu")
            notes.append(
                f"{path}: the trace does not name its device; taken as this machine's "
                f"{device!r} (give --device if it was measured elsewhere)"
            )
        shape = trace.shape.overridden(options.shape)
        model = options.model or trace.model or "gpt"
        frames.append(to_profile_log(trace, shape, device, model))
    return ImportResult(pd.concat(frames, ignore_index=True), tuple(notes))


def write_log(log: pd.DataFrame, out: Path) -> None:
    """The profiling log as Parquet at ``out``."""
    if out.suffix.lower() not in (".parquet", ".pq"):
        raise InputError(f"--out {out}: the profiling log is Parquet; use a .parquet name")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    try:
        log.to_parquet(tmp, index=False)
        tmp.replace(out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise InputError(f"{out}: cannot write the profiling log ({exc.strerror})") from None
