"""Ranks started on gloo over a FileStore, inside the test process's reach (no torchrun): each runs
``body(rank, world, tmp) -> dict`` in a process group of ``world``; the results come back in rank
order, and a rank's exception fails the test with its traceback.

The ranks are forked from the test process, which has imported torch and the test's modules
already; spawned, each rank imported them again (about 2.5 s of CPU a rank: these tests took 31.7 s
spawned, 18.0 s forked, on this project's 2-core VM). On CPU with one OpenMP thread (``.ci/run``
sets OMP_NUM_THREADS=1) that is safe, as torch's DataLoader workers are forked."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _run(rank: int, body: Callable[[int, int, str], dict], world: int, tmp: str) -> None:
    result: dict = {}
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(os.path.join(tmp, "store"), world),
            rank=rank,
            world_size=world,
        )
        result = body(rank, world, tmp)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the test process
        result = {**result, "error": traceback.format_exc()}
    torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))


def spawn_ranks(body: Callable[[int, int, str], dict], world: int, tmp: str | Path) -> list[dict]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(
        _run, args=(body, world, str(tmp)), nprocs=world, join=True, start_method="fork"
    )
    out = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(out):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return out
