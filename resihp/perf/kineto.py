"""Forward/backward spans of micro-batches from a torch.profiler (Kineto) Chrome trace.

A span is a ``torch.profiler.record_function`` range whose name is the phase, optionally the
micro-batch's id and its packed sequence lengths::

    fwd mb=3 seq_lens=512,300,212
    bwd mb=3 seq_lens=512,300,212

(``forward``/``backward`` and ``forward-compute``/``backward-compute`` name the phases too). The
lengths may instead come from a side file mapping micro-batch ids to their lengths (JSON,
``{"3": [512, 300, 212]}``). On a GPU trace the ranges' device time (``gpu_user_annotation``
events) is taken, else their host time; spans without ``mb=`` are numbered in order, the n-th
forward with the n-th backward.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

from resihp.errors import InputError
from resihp.perf.spans import PHASE_NAMES, ImportedTrace, Span

SPAN_NAME = re.compile(
    r"^(?P<phase>fwd|bwd|forward-compute|backward-compute|forward|backward)"
    r"(?:\s+mb=(?P<mb>\d+))?(?:\s+seq_lens=(?P<lens>\d+(?:,\d+)*))?$"
)
FORMAT = "torch.profiler trace"


def looks_like_kineto(path: Path) -> bool:
    """Whether ``path`` is a JSON file (plain or gzipped), the form Chrome traces take."""
    name = path.name.lower()
    return name.endswith((".json", ".json.gz"))


def _load(path: Path) -> dict:
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        doc = json.loads(raw)
    except FileNotFoundError:
        raise InputError(f"{path}: no such trace") from None
    except (OSError, EOFError, ValueError):  # gzip, JSON and UTF-8 errors are all ValueErrors
        raise InputError(
            f"{path}: not a torch.profiler trace (expected Chrome-trace JSON with "
            "traceEvents, plain or gzipped)"
        ) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise InputError(
            f"{path}: not a torch.profiler trace (expected a JSON object with a traceEvents list)"
        )
    return doc


def read_side_lengths(path: Path) -> dict[int, tuple[int, ...]]:
    """A side file's micro-batch lengths: a JSON object, micro-batch id -> list of lengths."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such lengths file") from None
    except (OSError, ValueError):
        raise InputError(
            f"{path}: expected JSON mapping micro-batch ids to lists of sequence "
            'lengths, e.g. {"0": [512, 300]}'
        ) from None
    if not isinstance(doc, dict):
        raise InputError(
            f"{path}: expected a JSON object mapping micro-batch ids to lists of sequence lengths"
        )
    out = {}
    for key, lens in doc.items():
        if (
            not str(key).isdigit()
            or not isinstance(lens, list)
            or not lens
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in lens)
        ):
            raise InputError(
                f"{path}: entry {key!r}: expected a micro-batch id (an integer) "
                f"mapped to a non-empty list of positive integers, got {lens!r}"
            )
        out[int(key)] = tuple(lens)
    return out


def _device(doc: dict) -> str | None:
    props = doc.get("deviceProperties")
    if isinstance(props, list) and props and isinstance(props[0], dict) and props[0].get("name"):
        return f"cuda:{props[0]['name']}"
    return None


def read_kineto(path: Path, side: dict[int, tuple[int, ...]] | None = None) -> ImportedTrace:
    """The micro-batch spans of a Chrome trace that torch.profiler exported."""
    doc = _load(path)
    events = [e for e in doc["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
    named = [
        (e, SPAN_NAME.match(str(e.get("name", ""))))
        for e in events
        if e.get("cat") in ("user_annotation", "gpu_user_annotation")
    ]
    named = [(e, m) for e, m in named if m]
    on_gpu = [(e, m) for e, m in named if e.get("cat") == "gpu_user_annotation"]
    chosen = sorted(on_gpu or named, key=lambda em: float(em[0].get("ts", 0.0)))
    spans, counts = [], {"fwd": 0, "bwd": 0}
    for event, match in chosen:
        phase = PHASE_NAMES[match["phase"]]
        mb = int(match["mb"]) if match["mb"] is not None else counts[phase]
        counts[phase] += 1
        if match["lens"] is not None:
            lens = tuple(int(v) for v in match["lens"].split(","))
        elif side is not None and mb in side:
            lens = side[mb]
        else:
            where = (
                "its lengths file" if side is not None else "its name (seq_lens=...) or --lengths"
            )
            raise InputError(
                f"{path}: span {event['name']!r} has no sequence lengths in {where} "
                f"(micro-batch {mb})"
            )
        try:
            seconds = float(event["dur"]) / 1e6  # Chrome traces count microseconds
        except (KeyError, TypeError, ValueError):
            raise InputError(
                f"{path}: span {event['name']!r}: expected a numeric dur (microseconds)"
            ) from None
        spans.append(Span(phase, lens, seconds, mb_id=mb))
    if not spans:
        raise InputError(
            f"{path}: no micro-batch spans in this torch.profiler trace (expected "
            "record_function ranges named like 'fwd mb=0 seq_lens=512,300' and "
            "'bwd mb=0 seq_lens=512,300')"
        )
    return ImportedTrace(str(path), FORMAT, tuple(spans), device=_device(doc))
