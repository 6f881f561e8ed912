"""Forward/backward compute spans from a resihp run folder (``resihp run`` or ``resihp.attach``).

Every ``forward-compute`` and ``backward-compute`` row of the run's ops trace that carries its
micro-batch's ``seq_lens`` is one span; its time is the row's ``duration`` less ``wait_s`` (time
inside tensor-parallel collectives, waiting for the group). The job meta (``job.yaml``) gives the
model's shape (``layers``, ``hidden``, ``heads``, ``ffn_hidden``, ``tp_size``), each stage's layers
(``layer_split``, else ``layers / pp_size``) and the ``device``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from resihp.errors import InputError
from resihp.opstrace import COMPUTE_OPTYPES, read_meta, read_run_folder
from resihp.perf.spans import PHASE_NAMES, ImportedTrace, Shape, Span

FORMAT = "resihp run folder"


def _stage_layers(meta: dict, pp: int, where: Path) -> list[int] | None:
    split = meta.get("layer_split")
    if split is not None:
        if (
            not isinstance(split, list)
            or len(split) != pp
            or not all(isinstance(n, int) and n > 0 for n in split)
        ):
            raise InputError(
                f"{where}: field layer_split: expected {pp} positive integers (one "
                f"per stage), got {split!r}"
            )
        return split
    layers = meta.get("layers")
    return [layers // pp] * pp if isinstance(layers, int) and layers >= pp else None


def _int(meta: dict, key: str) -> int | None:
    value = meta.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_run(folder: Path) -> ImportedTrace:
    """The compute spans of a run folder's ops trace."""
    if not folder.is_dir():
        raise InputError(f"{folder}: not a run folder")
    trace, meta_path = read_run_folder(folder)
    meta: dict = {}
    pp = 1
    if meta_path is not None:
        job, meta = read_meta(meta_path)
        pp = job.pp_size
    compute = trace[trace["optype"].isin(COMPUTE_OPTYPES)]
    if "seq_lens" not in compute.columns:
        raise InputError(
            f"{folder}: the ops trace's compute rows have no seq_lens column (a "
            "micro-batch's lengths; resihp run and attach record them)"
        )
    compute = compute[compute["seq_lens"].notna()]
    stage_layers = _stage_layers(meta, pp, meta_path or folder)
    wait = (
        compute["wait_s"].fillna(0.0)
        if "wait_s" in compute.columns
        else pd.Series(0.0, index=compute.index)
    )
    # one micro-batch of one step and replica is one id: its stages and TP ranks ran the same
    # lengths
    keys = ["step", "dp_rank", *(["mb_id"] if "mb_id" in compute.columns else [])]
    mb = compute.groupby(keys, sort=True, dropna=False).ngroup()
    spans = []
    for row, waited, mb_id in zip(compute.itertuples(index=False), wait, mb):
        seconds = float(row.duration) - float(waited)
        if seconds <= 0:
            continue
        layers = stage_layers[row.stage] if stage_layers and row.stage < len(stage_layers) else None
        spans.append(
            Span(
                PHASE_NAMES[row.optype],
                tuple(int(v) for v in row.seq_lens),
                seconds,
                mb_id=int(mb_id),
                step=int(row.step),
                rank=int(row.rank),
                layers=layers,
            )
        )
    shape = Shape(
        hidden=_int(meta, "hidden"),
        heads=_int(meta, "heads"),
        ffn_hidden=_int(meta, "ffn_hidden"),
        tp=_int(meta, "tp_size"),
    )
    device = meta.get("device") if isinstance(meta.get("device"), str) else None
    model = meta.get("name") if isinstance(meta.get("name"), str) else None
    return ImportedTrace(str(folder), FORMAT, tuple(spans), shape=shape, device=device, model=model)
