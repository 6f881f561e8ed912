"""PyTorch Lightning integration (the optional ``lightning`` extra):

    from resihp.train.lightning_callback import ResihpLightningCallback
    trainer = L.Trainer(callbacks=[ResihpLightningCallback(out="runs/pl")])

Attaches resihp to the LightningModule when training starts; every training batch is a resihp
step with its sequence lengths read from the batch (``attention_mask``'s ones per row, else the
rows of ``input_ids`` or of the first tensor). Forward and backward are timed on the module (its
``training_step`` must call ``self(...)``, or pass ``module=`` a function returning the submodule
it calls). The optimizer is timed from ``on_before_optimizer_step`` (Lightning runs the forward
and backward inside ``optimizer.step(closure)`` and calls that hook after the closure) to the end
of the batch. Keyword arguments go to ``resihp.attach``; ``monitor.report()`` is at
``callback.monitor``.

With ``snapshot_every=K`` the module, the optimizers, the LR schedulers, the fit loop's progress
and each rank's random generators go to the node's memory tier every K optimizer steps
(``resihp.train.Snapshots``). Lightning restores loops before any callback hook runs, so
``resume_checkpoint`` (collective, before ``fit``) writes the newest snapshot every rank holds as a
Lightning checkpoint beside the tier and returns it for ``fit(ckpt_path=...)``; the generators
come back through this callback's state. As with Lightning's own checkpoints, a snapshot inside an
epoch resumes exactly only with a resumable data loader (``state_dict``/``load_state_dict``);
with a plain ``DataLoader`` take them at epoch ends (K a multiple of the steps per epoch).

    callback = ResihpLightningCallback(out="runs/pl", snapshot_every=steps_per_epoch)
    trainer = L.Trainer(callbacks=[callback], ...)
    trainer.fit(module, loader, ckpt_path=callback.resume_checkpoint())
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch

from resihp.train.attach import Monitor, attach
from resihp.train.snapshots import RestoredState, Snapshots
from resihp.train.state import RNG

RESUME = "pl-resume"  # beside the tier's slots: the checkpoints resume_checkpoint writes


def lengths_from_batch(batch: object) -> list[int] | None:
    """Per-row sequence lengths of a training batch (a dict, a tuple or a tensor of token ids)."""
    if isinstance(batch, dict):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() >= 2:
            return [int(x) for x in mask.reshape(mask.shape[0], -1).sum(-1).tolist()]
        batch = batch.get("input_ids", next(iter(batch.values()), None))
    if isinstance(batch, (list, tuple)):
        batch = next((b for b in batch if isinstance(b, torch.Tensor)), None)
    if isinstance(batch, torch.Tensor) and batch.dim() >= 2:
        return [int(batch.shape[1])] * int(batch.shape[0])
    return None


class _Counters:
    """The Trainer's epoch and global step as a Stateful (a checkpoint's ``epoch``,
    ``global_step``)."""

    def __init__(self, trainer: L.Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict:
        return {"epoch": self.trainer.current_epoch, "global_step": self.trainer.global_step}

    def load_state_dict(self, saved: dict) -> None:
        raise NotImplementedError("Lightning loads its counters from resume_checkpoint's file")


class ResihpLightningCallback(L.Callback):
    """resihp in a Lightning ``Trainer``: steps recorded, and snapshots when asked.

    Args:
        out: the run folder of ``resihp.attach``.
        module: a function returning the submodule ``training_step`` calls (default: the module).
        snapshot_every: take a snapshot in memory every this many optimizer steps (None: none).
        **attach_kwargs: passed to ``resihp.attach``.
    """

    def __init__(
        self,
        out: str | Path = "runs/lightning",
        module: Callable[[L.LightningModule], torch.nn.Module] | None = None,
        snapshot_every: int | None = None,
        **attach_kwargs: object,
    ) -> None:
        self.out, self.module, self.attach_kwargs = out, module, attach_kwargs
        self.snapshot_every = snapshot_every
        self.monitor: Monitor | None = None
        self.snapshots: Snapshots | None = None
        self.restored: RestoredState | None = None  # what resume_checkpoint found
        self._step = None
        self._snapshot_after = 0  # the global step of the newest snapshot taken or resumed
        self._resume_file: Path | None = None
        self._rng: dict | None = None  # the generators to set, from resume_checkpoint's file

    def resume_checkpoint(self) -> str | None:
        """Collective: ``fit``'s ``ckpt_path``, the newest snapshot every rank holds; else None.

        Written as a Lightning checkpoint (this rank's, with its generators) beside the tier.
        What it found is at ``callback.restored``.
        """
        if not self.snapshot_every:
            return None
        t0 = time.perf_counter()
        reader = Snapshots({}, rng=False)
        try:
            found = reader.saved()
        finally:
            reader.close()
        if found is None:
            return None
        restored, saved = found
        n_opt = sum(1 for k in saved if k.startswith("optimizer"))
        n_sched = sum(1 for k in saved if k.startswith("scheduler"))
        checkpoint = {
            **saved["counters"],
            "pytorch-lightning_version": L.__version__,
            "state_dict": saved["model"],
            "loops": {"fit_loop": saved["fit_loop"]},
            "callbacks": {self.state_key: {"rng": saved["rng"]}},
            "optimizer_states": [saved[f"optimizer{i}"] for i in range(n_opt)],
            "lr_schedulers": [saved[f"scheduler{i}"] for i in range(n_sched)],
        }
        path = reader.dir / RESUME / f"rank{reader.rank}.ckpt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(checkpoint, path)
        self._resume_file = path
        self.restored = RestoredState(restored.step, "memory", time.perf_counter() - t0)
        return str(path)

    def state_dict(self) -> dict[str, Any]:
        """Nothing of its own in Lightning's checkpoints (``resume_checkpoint`` adds the RNG)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set this rank's random generators from ``resume_checkpoint``'s file.

        Args:
            state_dict: the callback's state in the checkpoint Lightning restores.
        """
        if "rng" in state_dict:
            RNG().load_state_dict(state_dict["rng"])

    def on_train_start(self, trainer, pl_module):
        """Attach resihp to the module; set up the snapshots if asked.

        Args:
            trainer: the Lightning ``Trainer``: its optimizers, schedulers and fit loop.
            pl_module: the ``LightningModule`` being trained.
        """
        target = self.module(pl_module) if self.module else pl_module
        self.monitor = attach(target, out=self.out, **self.attach_kwargs)
        if self._resume_file is not None:  # read: Lightning restored from it before this hook
            self._resume_file.unlink(missing_ok=True)
            self._resume_file = None
        if self.snapshot_every:
            state: dict[str, Any] = {"model": pl_module, "fit_loop": trainer.fit_loop}
            state.update({f"optimizer{i}": o for i, o in enumerate(trainer.optimizers)})
            configs = trainer.lr_scheduler_configs
            state.update({f"scheduler{i}": c.scheduler for i, c in enumerate(configs)})
            state["counters"] = _Counters(trainer)
            self.snapshots = Snapshots(state, self.snapshot_every)
            self._snapshot_after = trainer.global_step  # a resumed step is in memory already

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        """Open a monitor step with the batch's sequence lengths (``lengths_from_batch``).

        Args:
            trainer: the Lightning ``Trainer`` (unused).
            pl_module: the ``LightningModule`` being trained (unused).
            batch: the training batch, read for its sequence lengths.
            batch_idx: the batch's index in the epoch (unused).
        """
        self._step = self.monitor.step(seq_lens=lengths_from_batch(batch))
        self._step.__enter__()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        """Mark the optimizer's update as started (after Lightning's closure ran the backward).

        Args:
            trainer: the Lightning ``Trainer`` (unused).
            pl_module: the ``LightningModule`` being trained (unused).
            optimizer: the optimizer about to step (unused).
        """
        if self._step is not None:
            self.monitor.optimizer_step_begins()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        """Mark the optimizer's update as done and close the monitor step; snapshot when due.

        Args:
            trainer: the Lightning ``Trainer``; its ``global_step`` counts the steps done.
            pl_module: the ``LightningModule`` being trained (unused).
            outputs: the training step's outputs (unused).
            batch: the training batch (unused).
            batch_idx: the batch's index in the epoch (unused).
        """
        if self._step is not None:
            self.monitor.optimizer_step_ends()
            self._step.__exit__(None, None, None)
            self._step = None
        step = trainer.global_step  # optimizer steps done (several batches each when accumulating)
        if self.snapshots is not None and step > self._snapshot_after:
            self._snapshot_after = step
            self.snapshots.after_step(step - 1)  # numbered from 0, as Snapshots'

    def on_train_end(self, trainer, pl_module):
        """Close the open step, the snapshots and the monitor.

        Args:
            trainer: the Lightning ``Trainer`` (unused).
            pl_module: the ``LightningModule`` being trained (unused).
        """
        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None
        if self.snapshots is not None:
            self.snapshots.close()
        if self.monitor is not None:
            self.monitor.close()
