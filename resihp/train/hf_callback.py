"""Hugging Face ``transformers.Trainer`` integration (the optional ``hf`` extra):

    from resihp.train.hf_callback import ResihpTrainerCallback
    trainer = Trainer(
        model, args, train_dataset=ds, callbacks=[ResihpTrainerCallback(out="runs/hf")]
    )

Attaches resihp to the Trainer's model and optimizer when training starts; every optimizer step is a
resihp step, every forward call a micro-batch whose sequence lengths come from its attention mask
(the count of ones per row; without a mask, the row length). Keyword arguments go to
``resihp.attach`` (``detect=True``, ``on_event``, ``on_fault``, ...); ``monitor.report()`` is at
``callback.monitor``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import TrainerCallback

from resihp.train.attach import Monitor, attach


def lengths_from_inputs(kwargs: dict, args: tuple = ()) -> list[int] | None:
    """Per-row sequence lengths of a model call, or None when it has no 2-D input to read.

    From ``attention_mask``, else ``input_ids``'s shape (or the first tensor argument's)."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() >= 2:
        return [int(x) for x in mask.reshape(mask.shape[0], -1).sum(-1).tolist()]
    ids = kwargs.get("input_ids")
    if ids is None:
        ids = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
        return [int(ids.shape[1])] * int(ids.shape[0])
    return None


class ResihpTrainerCallback(TrainerCallback):
    def __init__(self, out: str | Path = "runs/hf", **attach_kwargs: object) -> None:
        self.out, self.attach_kwargs = out, attach_kwargs
        self.monitor: Monitor | None = None
        self._step = None
        self._hook = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        """Attach resihp to the Trainer's model and optimizer.

        Args:
            args: the Trainer's ``TrainingArguments`` (unused).
            state: the Trainer's ``TrainerState`` (unused).
            control: the Trainer's ``TrainerControl`` (unused).
            model: the model whose forward calls are timed and read for sequence lengths.
            optimizer: the Trainer's optimizer (accelerate's wrapper or a torch optimizer).
            **kwargs: the Trainer's other callback arguments (unused).
        """
        # accelerate wraps the optimizer; its hooks live on the torch optimizer inside
        inner = getattr(optimizer, "optimizer", optimizer)
        inner = inner if isinstance(inner, torch.optim.Optimizer) else None
        self.monitor = attach(model, optimizer=inner, out=self.out, **self.attach_kwargs)
        self._hook = model.register_forward_pre_hook(self._lengths, with_kwargs=True, prepend=True)

    def _lengths(self, module, args, kwargs):
        lengths = lengths_from_inputs(kwargs, args)
        if lengths and self._step is not None and torch.is_grad_enabled():
            self.monitor.note_lengths(lengths)

    def on_step_begin(self, args, state, control, **kwargs):
        """Open the monitor's step ``state.global_step``.

        Args:
            args: the Trainer's ``TrainingArguments`` (unused).
            state: the Trainer's ``TrainerState``; its ``global_step`` numbers the step.
            control: the Trainer's ``TrainerControl`` (unused).
            **kwargs: the Trainer's other callback arguments (unused).
        """
        self._step = self.monitor.step(step=state.global_step)
        self._step.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        """Close the step the last ``on_step_begin`` opened, if any.

        Args:
            args: the Trainer's ``TrainingArguments`` (unused).
            state: the Trainer's ``TrainerState`` (unused).
            control: the Trainer's ``TrainerControl`` (unused).
            **kwargs: the Trainer's other callback arguments (unused).
        """
        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None

    def on_train_end(self, args, state, control, **kwargs):
        """Close the open step, remove the forward hook and close the monitor.

        Args:
            args: the Trainer's ``TrainingArguments`` (unused).
            state: the Trainer's ``TrainerState`` (unused).
            control: the Trainer's ``TrainerControl`` (unused).
            **kwargs: the Trainer's other callback arguments (unused).
        """
        self.on_step_end(args, state, control)
        if self._hook is not None:
            self._hook.remove()
        if self.monitor is not None:
            self.monitor.close()
