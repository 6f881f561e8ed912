"""Hugging Face ``transformers.Trainer`` integration (the optional ``hf`` extra):

    from resihp.train.hf_callback import ResihpTrainerCallback
    callback = ResihpTrainerCallback(out="runs/hf", snapshot_every=2)
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[callback])
    trainer.train(resume_from_checkpoint=callback.resume_checkpoint(trainer))

Attaches resihp to the Trainer's model and optimizer when training starts; every optimizer step is a
resihp step, every forward call a micro-batch whose sequence lengths come from its attention mask
(the count of ones per row; without a mask, the row length). Keyword arguments go to
``resihp.attach`` (``detect=True``, ``on_event``, ``on_fault``, ...); ``monitor.report()`` is at
``callback.monitor``.

With ``snapshot_every=K`` the model, the optimizer, the LR scheduler, the ``TrainerState`` and the
random generators go to the node's memory tier every K optimizer steps (``resihp.train.Snapshots``).
A callback cannot restore them alone: the Trainer works out the epoch and the batches to skip from
``resume_from_checkpoint`` before any callback runs. So ``resume_checkpoint`` (collective, before
``train``) writes the newest snapshot every rank holds as a Trainer checkpoint folder beside the
tier (``/dev/shm``) and returns it, and the Trainer resumes through its own code: weights,
optimizer, scheduler, state, batches skipped, generators set after the skip. Without one in memory
it returns the Trainer's newest checkpoint in ``output_dir`` (``save_strategy``), else None.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainerState
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from transformers.training_args import ParallelMode
from transformers.utils import WEIGHTS_NAME

from resihp.train.attach import Monitor, attach
from resihp.train.snapshots import RestoredState, Snapshots

RESUME = "hf-resume"  # beside the tier's slots: the checkpoint folders resume_checkpoint writes


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


class _StateOf:
    """The Trainer's ``TrainerState`` as a Stateful: its JSON, as in the Trainer's checkpoints."""

    def __init__(self, state: TrainerState) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return {"json": json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True)}

    def load_state_dict(self, saved: dict) -> None:
        raise NotImplementedError("the Trainer loads its state from resume_checkpoint's folder")


class ResihpTrainerCallback(TrainerCallback):
    """resihp in a ``transformers.Trainer``: steps recorded, and snapshots when asked.

    Args:
        out: the run folder of ``resihp.attach``.
        snapshot_every: take a snapshot in memory every this many optimizer steps (None: none).
        **attach_kwargs: passed to ``resihp.attach``.
    """

    def __init__(
        self,
        out: str | Path = "runs/hf",
        snapshot_every: int | None = None,
        **attach_kwargs: object,
    ) -> None:
        self.out, self.snapshot_every, self.attach_kwargs = out, snapshot_every, attach_kwargs
        self.monitor: Monitor | None = None
        self.snapshots: Snapshots | None = None
        self._step = None
        self._hook = None
        self._resume_dir: Path | None = None
        self.restored: RestoredState | None = None  # what resume_checkpoint found
        self._snapshot_after = 0  # the global step of the newest snapshot taken or resumed

    def resume_checkpoint(self, trainer: Trainer) -> str | None:
        """Collective: ``trainer.train``'s ``resume_from_checkpoint``, or None for a fresh start.

        The newest step every rank holds in memory, written as a Trainer checkpoint folder,
        unless the Trainer's newest checkpoint in ``output_dir`` is newer; that one without a
        snapshot in memory; else None. What it found is at ``callback.restored``.

        Args:
            trainer: the Trainer about to train (its process group already up).
        """
        t0 = time.perf_counter()
        args = trainer.args
        disk = get_last_checkpoint(args.output_dir) if Path(args.output_dir).is_dir() else None
        disk_step = int(Path(disk).name[len(PREFIX_CHECKPOINT_DIR) + 1 :]) if disk else 0
        found = None
        if self.snapshot_every:
            reader = Snapshots({}, rng=False)
            try:
                found = reader.saved()
            finally:
                reader.close()
        if found is None or found[0].step + 1 < disk_step:  # global_step is the step index + 1
            if disk:
                self.restored = RestoredState(disk_step - 1, "disk", time.perf_counter() - t0)
            return disk
        folder = reader.dir / RESUME / f"rank{reader.rank}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        saved = found[1]
        torch.save(saved["model"], folder / WEIGHTS_NAME)
        torch.save(saved["optimizer"], folder / OPTIMIZER_NAME)
        torch.save(saved["scheduler"], folder / SCHEDULER_NAME)
        (folder / TRAINER_STATE_NAME).write_text(saved["trainer"]["json"])
        rng = saved["rng"]
        np_state = rng["numpy"]
        numpy = (np_state["kind"], np_state["keys"].numpy().astype("uint32"), np_state["pos"])
        numpy += (np_state["has_gauss"], np_state["gauss"])
        hf_rng = {"python": rng["python"], "numpy": numpy, "cpu": rng["torch"]}
        if "cuda" in rng:  # the Trainer's form: every device's in a distributed job
            cuda = rng["cuda"]
            distributed = args.parallel_mode == ParallelMode.DISTRIBUTED
            hf_rng["cuda"] = cuda if distributed else cuda[torch.cuda.current_device()]
        name = f"rng_state_{args.process_index}.pth" if args.world_size > 1 else "rng_state.pth"
        torch.save(hf_rng, folder / name)
        self._resume_dir = folder
        self.restored = RestoredState(found[0].step, "memory", time.perf_counter() - t0)
        return str(folder)

    def on_train_begin(
        self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs
    ):
        """Attach resihp to the Trainer's model and optimizer; set up the snapshots if asked.

        Args:
            args: the Trainer's ``TrainingArguments`` (unused).
            state: the Trainer's ``TrainerState``, held in each snapshot.
            control: the Trainer's ``TrainerControl`` (unused).
            model: the model whose forward calls are timed and read for sequence lengths.
            optimizer: the Trainer's optimizer (accelerate's wrapper or a torch optimizer).
            lr_scheduler: the Trainer's LR scheduler, held in each snapshot.
            **kwargs: the Trainer's other callback arguments (unused).
        """
        # accelerate wraps the optimizer; its hooks live on the torch optimizer inside
        inner = getattr(optimizer, "optimizer", optimizer)
        inner = inner if isinstance(inner, torch.optim.Optimizer) else None
        self.monitor = attach(model, optimizer=inner, out=self.out, **self.attach_kwargs)
        self._hook = model.register_forward_pre_hook(self._lengths, with_kwargs=True, prepend=True)
        if self.snapshot_every:
            held = {"model": model, "optimizer": inner, "scheduler": lr_scheduler}
            self.snapshots = Snapshots({**held, "trainer": _StateOf(state)}, self.snapshot_every)
            self._snapshot_after = state.global_step  # a resumed step is in memory already

    def _lengths(self, module, args, kwargs):
        lengths = lengths_from_inputs(kwargs, args)
        if lengths and self._step is not None and torch.is_grad_enabled():
            self.monitor.note_lengths(lengths)

    def on_step_begin(self, args, state, control, **kwargs):
        """Snapshot the steps done when one is due; open the monitor's step ``global_step``.

        The snapshot is taken here, not at the end of the step before: the Trainer logs and saves
        after ``on_step_end``, so a step restored is a step logged and in ``log_history``, and the
        generators are as they are when this step's forward runs (after its batches were
        fetched), where the Trainer's resume sets them (at an epoch's first step,
        ``on_epoch_begin`` takes it).

        Args:
            args: the Trainer's ``TrainingArguments`` (unused).
            state: the Trainer's ``TrainerState``; its ``global_step`` numbers the step.
            control: the Trainer's ``TrainerControl`` (unused).
            **kwargs: the Trainer's other callback arguments (unused).
        """
        self._snapshot(state)
        if self._resume_dir is not None:  # read: the generators were set before this step
            shutil.rmtree(self._resume_dir, ignore_errors=True)
            self._resume_dir = None
        self._step = self.monitor.step(step=state.global_step)
        self._step.__enter__()

    def on_epoch_begin(self, args, state, control, **kwargs):
        """Snapshot the steps done when one is due, before the epoch's batches are drawn.

        A resume at an epoch's start sets the generators before the data loader draws its order.

        Args:
            args: the Trainer's ``TrainingArguments`` (unused).
            state: the Trainer's ``TrainerState``; ``global_step`` counts the steps done.
            control: the Trainer's ``TrainerControl`` (unused).
            **kwargs: the Trainer's other callback arguments (unused).
        """
        self._snapshot(state)

    def _snapshot(self, state: TrainerState) -> None:
        if self.snapshots is not None and state.global_step > self._snapshot_after:
            self._snapshot_after = state.global_step
            self.snapshots.after_step(state.global_step - 1)  # numbered from 0, as Snapshots'

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
        if self.snapshots is not None:
            self.snapshots.close()
        if self._hook is not None:
            self._hook.remove()
        if self.monitor is not None:
            self.monitor.close()
