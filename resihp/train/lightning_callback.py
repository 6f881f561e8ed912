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
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch

from resihp.train.attach import Monitor, attach


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


class ResihpLightningCallback(L.Callback):
    def __init__(
        self,
        out: str | Path = "runs/lightning",
        module: Callable[[L.LightningModule], torch.nn.Module] | None = None,
        **attach_kwargs: object,
    ) -> None:
        self.out, self.module, self.attach_kwargs = out, module, attach_kwargs
        self.monitor: Monitor | None = None
        self._step = None

    def on_train_start(self, trainer, pl_module):
        target = self.module(pl_module) if self.module else pl_module
        self.monitor = attach(target, out=self.out, **self.attach_kwargs)

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
        """Mark the optimizer's update as done and close the monitor step.

        Args:
            trainer: the Lightning ``Trainer`` (unused).
            pl_module: the ``LightningModule`` being trained (unused).
            outputs: the training step's outputs (unused).
            batch: the training batch (unused).
            batch_idx: the batch's index in the epoch (unused).
        """
        if self._step is not None:
            self.monitor.optimizer_step_ends()
            self._step.__exit__(None, None, None)
            self._step = None

    def on_train_end(self, trainer, pl_module):
        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None
        if self.monitor is not None:
            self.monitor.close()
