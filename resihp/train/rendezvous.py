"""Joining the default process group so that a torchrun restart rejoins on fresh store keys.

torchrun's agent keeps one TCP store across restarts, and ``env://`` hands the workers that store
unprefixed: a restarted rank can read its peer's address from the attempt before (a process that is
gone) and gloo's full mesh is refused. Keys under the job and the restart attempt keep each attempt
apart, as ``resihp run``'s workers do.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def attempt_prefix(job_id: str) -> str:
    """The store prefix of this job's current torchrun attempt."""
    return f"resihp/{job_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def init_process_group(
    backend: str | None = None, *, timeout: timedelta | None = None, **kwargs: Any
) -> None:
    """``torch.distributed.init_process_group`` from torchrun's environment.

    The store's keys are prefixed with this restart attempt's (``attempt_prefix``), so a restarted
    job never reads a failed attempt's keys.

    Args:
        backend: the backend (``"gloo"``, ``"nccl"``; None: torch's default for the device).
        timeout: the rendezvous and collective timeout (default: 10 minutes for the rendezvous,
            torch's default for collectives).
        **kwargs: passed through to ``torch.distributed.init_process_group``.
    """
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout or timedelta(minutes=10)))
    job = os.environ.get("TORCHELASTIC_RUN_ID", "job")
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(attempt_prefix(job), store),
        rank=rank,
        world_size=world,
        **({"timeout": timeout} if timeout else {}),
        **kwargs,
    )
