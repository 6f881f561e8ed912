"""In-memory snapshots of a user's own training state, and the restore after a restart.

``Snapshots`` wraps what the user hands it (a model, an optimizer, an LR scheduler, a data
loader's state, anything with ``state_dict``/``load_state_dict``) and, every ``every`` steps,
copies its tensors into the node's memory tier (``/dev/shm``, the same tier and keeper as
``resihp run``) off the training path: the copy runs in a thread while the next forward and
backward run, and the next optimizer step waits for it. The keeper checksums and publishes each
slot and outlives the trainer, so a rank killed and restarted by torchrun finds its state in
memory. ``restore`` (collective) loads the newest step every rank holds, verified, or falls back
to the user's disk checkpoint (``dcp_dir``, written by ``torch.distributed.checkpoint``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from resihp.ckpt.integrity import refusals, safe_planner, safe_reader
from resihp.ckpt.keeper import ensure_keeper
from resihp.ckpt.memory import MemoryTier, SlotHeader, plan_shards, tier_dir
from resihp.ckpt.snapshot import Snapshotter
from resihp.errors import InputError
from resihp.train.state import RNG, flatten, like, state_dict_of, unflatten

KEEPER_OWNER = "RESIHP_KEEPER_OWNER"  # the process that owns a node's keeper (default: the parent)
FORMAT = "resihp-user-state/1"


@dataclass(frozen=True)
class RestoredState:
    """Where a restore found the state: the step it holds and its source."""

    step: int  # the snapshot's step: training goes on at step + 1
    source: str  # "memory" or "disk"
    seconds: float


class Snapshots:
    """Snapshots of the user's training state every ``every`` steps, and their restore.

    Args:
        state: name -> Stateful (module, optimizer, scheduler, data loader) or plain state dict;
            the random generators are added as ``rng`` unless ``rng=False``.
        every: take a snapshot after every ``every``-th step (1: each step).
        job_id: the job's id (default: torchrun's ``TORCHELASTIC_RUN_ID``).
        node: this node's index (default: torchrun's ``GROUP_RANK``).
        group: the process group restore agrees over (default: the world; a gloo group for NCCL
            jobs).
        dcp_dir: a folder of DCP checkpoints (``stepN``) to fall back on and to write with ``save``.
        rng: add the random generators (``RNG``) to the state as ``rng``.
        timeout_s: how long a snapshot waits for the keeper.
    """

    def __init__(
        self,
        state: Mapping[str, Any],
        every: int = 1,
        *,
        job_id: str | None = None,
        node: int | None = None,
        group: dist.ProcessGroup | None = None,
        dcp_dir: str | os.PathLike | None = None,
        rng: bool = True,
        timeout_s: float = 60.0,
    ) -> None:
        if every < 1:
            raise InputError(
                f"Snapshots: every must be >= 1 (steps between snapshots), got {every}"
            )
        self.state = dict(state)
        if rng:
            self.state.setdefault("rng", RNG())
        self.every, self.group, self.timeout_s = every, group, timeout_s
        self.dcp_dir = Path(dcp_dir) if dcp_dir is not None else None
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        job = job_id or os.environ.get("TORCHELASTIC_RUN_ID") or "local"
        node = int(os.environ.get("GROUP_RANK", "0")) if node is None else node
        self.dir = tier_dir(_safe(job), node)
        self.tier = MemoryTier(self.dir, self.rank)
        owner = int(os.environ.get(KEEPER_OWNER, os.getppid()))
        ensure_keeper(self.dir, owner)
        self._keep = lambda: ensure_keeper(self.dir, owner)  # noqa: E731 - restarted if it died
        self._snapshotter = self._new_snapshotter()
        for extra in self._optimizers()[1:]:  # every optimizer's step waits for the copy
            extra.register_step_pre_hook(lambda *_: self._snapshotter.fence())
        self._capacity_checked = False
        self._prepare_s: list[float] = []  # per snapshot: flattening the state, before the copy
        self._earlier_s: list[float] = []  # stalls of the snapshotters a restore replaced

    def _new_snapshotter(self) -> Snapshotter:
        return Snapshotter(self.tier, self.every, None, self._keep, self.timeout_s)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [v for v in self.state.values() if isinstance(v, torch.optim.Optimizer)]

    def after_step(self, step: int) -> None:
        """Call after the optimizer step of ``step``: starts the snapshot when one is due."""
        if (step + 1) % self.every:
            return
        t0 = time.perf_counter()
        tensors, tree = flatten(self.state)
        if not self._capacity_checked:
            self.tier.check_capacity(2 * plan_shards(tensors)[1])  # two slots
            self._capacity_checked = True
        optimizers = self._optimizers()
        layout = {"format": FORMAT, "keys": [k for k, _ in tensors], "run": {"tree": tree}}
        self._prepare_s.append(time.perf_counter() - t0)
        self._snapshotter.snapshot(
            step, None, optimizers[0] if optimizers else _NoOptimizer(), layout, tensors=tensors
        )

    @property
    def stall_s(self) -> list[float]:
        """Per snapshot, the seconds the training loop waited for it.

        The wait in ``after_step`` and, at the next optimizer step, for the copy to finish (the
        snapshot in flight not yet counted)."""
        done = self._earlier_s + list(self._snapshotter.blocked_s)
        return [a + b for a, b in zip(self._prepare_s, done)]

    def restore(self) -> RestoredState | None:
        """Collective: load the newest state in memory or on disk; None when there is none.

        The newest step every rank holds in memory (verified), else the newest DCP checkpoint in
        ``dcp_dir``; every rank returns alike."""
        t0 = time.perf_counter()
        header = self._newest_in_memory()
        if header is not None:
            self._load(header)
            self._discard_after(header.step)
            return RestoredState(header.step, "memory", time.perf_counter() - t0)
        on_disk = self._newest_on_disk()
        if on_disk is None:
            return None
        step, path = on_disk
        self.load(path)
        self._discard_after(step)
        return RestoredState(step, "disk", time.perf_counter() - t0)

    def saved(self) -> tuple[RestoredState, dict[str, Any]] | None:
        """Collective: the newest state every rank holds in memory, as saved; None when none.

        ``restore`` from memory, for a trainer that loads the state itself: name -> state dict
        (tensors in private copies) in place of loading it into the objects handed in. Snapshots
        of later steps are unpublished, as ``restore`` does."""
        t0 = time.perf_counter()
        header = self._newest_in_memory()
        if header is None:
            return None
        tensors = self._read(header)
        tree = header.layout["run"]["tree"]
        state = {name: unflatten(sub, tensors) for name, sub in tree.items()}
        self._discard_after(header.step)
        return RestoredState(header.step, "memory", time.perf_counter() - t0), state

    def save(self, step: int) -> Path:
        """Collective: a DCP checkpoint of the state after ``step`` in ``dcp_dir``/stepN."""
        if self.dcp_dir is None:
            raise InputError("Snapshots.save: no dcp_dir was given")
        path = self.dcp_dir / f"step{step}"
        dcp.save(self._dcp_state(), checkpoint_id=str(path))
        return path

    def load(self, path: str | os.PathLike) -> None:
        """Collective: load a DCP checkpoint of this state into the objects handed in.

        Models and their optimizers are read by parameter name (``torch.distributed.checkpoint
        .state_dict``), so a checkpoint of DDP, FSDP2 or a plain module at any world size loads
        into any of them; state that does not fit (another shape, a missing key) is one line.
        """
        state = self._dcp_state()
        try:
            with refusals():  # no pickled object of the checkpoint is ever run: plain values only
                dcp.load(
                    state,
                    storage_reader=safe_reader(path, tensors_only=False),
                    planner=safe_planner(path),
                )
        except (CheckpointException, RuntimeError, ValueError, KeyError) as exc:
            raise InputError(
                f"{path}: the checkpoint does not fit this state ({_first(exc)})"
            ) from None
        for name, value in self.state.items():
            if name not in state:
                continue
            if isinstance(value, torch.nn.Module):
                set_model_state_dict(value, state[name])
            elif (owner := self._owner(value)) is not None:
                set_optimizer_state_dict(owner, value, state[name])
            elif hasattr(value, "load_state_dict"):
                value.load_state_dict(state[name])

    def close(self) -> None:
        """Finish the snapshot in flight."""
        self._snapshotter.close()

    # -- helpers ---------------------------------------------------------------------------
    def _dcp_state(self) -> dict:
        # the generators are per rank: they are not in the checkpoint, which another layout reads.
        # A model's and its optimizer's state by parameter name (DDP's prefix dropped, FSDP2's
        # shards as DTensors), the optimizer's state made before its first step, so that a fresh
        # process loads every moment of it
        out = {}
        for name, value in self.state.items():
            if isinstance(value, RNG):
                continue
            if isinstance(value, torch.nn.Module):
                out[name] = get_model_state_dict(value)
            elif (owner := self._owner(value)) is not None:
                out[name] = get_optimizer_state_dict(owner, value)
            else:
                out[name] = state_dict_of(value)
        return out

    def _owner(self, value: object) -> torch.nn.Module | None:
        """The module handed in whose parameters optimizer ``value`` steps, or None.

        None also for a value that is no optimizer and for one no module holds all the
        parameters of.
        """
        if not isinstance(value, torch.optim.Optimizer):
            return None
        optimizer = value
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for value in self.state.values():
            if isinstance(value, torch.nn.Module) and mine <= {id(p) for p in value.parameters()}:
                return value
        return None

    def _gather(self, steps: list[int]) -> list[list[int]]:
        if not dist.is_initialized():
            return [steps]
        out: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, steps, group=self.group)
        return out

    def _newest_on_disk(self) -> tuple[int, Path] | None:
        if self.dcp_dir is None or not self.dcp_dir.is_dir():
            return None
        found = [
            (int(p.name[4:]), p)
            for p in self.dcp_dir.glob("step*")
            if p.name[4:].isdigit() and (p / ".metadata").exists()
        ]
        return max(found) if found else None

    def _newest_in_memory(self) -> SlotHeader | None:
        """Collective: this rank's verified slot of the newest step every rank holds, or None."""
        self._snapshotter.fence()
        mine = {
            h.step: h
            for h in self.tier.held()
            if h.rank == self.rank and h.layout.get("format") == FORMAT and self.tier.verify(h)
        }
        steps = self._gather(sorted(mine))
        common = set(steps[0]).intersection(*steps[1:]) if steps else set()
        return mine[max(common)] if common else None

    def _read(self, header: SlotHeader) -> dict[str, torch.Tensor]:
        """A slot's tensors by key, each copied into its own storage (the slot is reused later).

        Its own, not a view of one buffer: torch's generators refuse a view, and a view would
        save the whole slot."""
        data = self.tier.read(header)
        if data is None:
            raise RuntimeError(f"memory tier {self.dir}: slot {header.slot} vanished while read")
        saved = {}
        for shard in header.shards:
            piece = torch.from_numpy(np.array(data[shard.offset : shard.offset + shard.nbytes]))
            saved[shard.key] = piece.view(getattr(torch, shard.dtype)).reshape(shard.shape)
        return saved

    def _load(self, header: SlotHeader) -> None:
        saved = self._read(header)
        tree = header.layout["run"]["tree"]
        current, _ = flatten(self.state)
        now = dict(current)
        templates = {k: now.get(k) for k in saved}
        tensors = {
            k: like(templates[k], t) if templates[k] is not None else t for k, t in saved.items()
        }
        for name, value in self.state.items():
            if name in tree and hasattr(value, "load_state_dict"):
                value.load_state_dict(unflatten(tree[name], tensors))

    def _discard_after(self, step: int) -> None:
        """Training goes on after ``step``: this rank's snapshots of later steps are unpublished."""
        for h in self.tier.headers():
            if h.rank == self.rank and h.step > step:
                self.tier.header_path(h.slot).unlink(missing_ok=True)
        self._earlier_s += self._snapshotter.blocked_s
        self._snapshotter = self._new_snapshotter()


class _NoOptimizer(torch.optim.Optimizer):
    """Stands in where the state has no optimizer: nothing to fence."""

    def __init__(self) -> None:
        super().__init__([torch.zeros(1, requires_grad=True)], {})


def _safe(job: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in job)[:64]


def _first(exc: BaseException) -> str:
    """The first line of what went wrong (DCP wraps each rank's error with its traceback)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        exc = inner[0] if isinstance(inner, tuple) else inner
    text = str(exc).strip()
    return (text.splitlines()[0][:300] if text else "") or type(exc).__name__
