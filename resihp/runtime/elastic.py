"""Excluding a stopped device by an elastic restart: the surviving layout (one data-parallel replica
fewer, or one pipeline stage fewer when there is a single replica) restarts from the latest
universal checkpoint, with the same global batch, so the optimizer's mathematics do not change."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from resihp.ckpt.integrity import newest_good
from resihp.runtime.config import RunConfig


def latest_checkpoint(out: str | Path, cfg: RunConfig) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under ``OUT/ckpt`` that verifies against its manifest and was written
    by this job (``cfg.job_id``) for this model; and each newer one skipped, with why."""
    return newest_good(out, job_id=cfg.job_id, model_hash=cfg.model_hash())


def layout_without(cfg: RunConfig, rank: int, resume: Path, out: Path) -> RunConfig | None:
    """The run config that continues without ``rank``'s replica (or stage); None if nothing is left."""
    dims = cfg.dims()
    lost = dims.coords(rank)
    if cfg.dp > 1:
        weights = cfg.weights()
        del weights[lost.dp_rank]
        changes = dict(dp=cfg.dp - 1, dp_weights=weights if sum(weights) > 0 else None)
    elif cfg.pp > 1:
        changes = dict(pp=cfg.pp - 1, layer_split=None)
    else:
        return None
    return replace(cfg, **changes, inject=[], replan=[], resume=str(resume), out=str(out))
