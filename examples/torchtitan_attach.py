"""resihp on torchtitan's training loop (torchtitan/trainer.py, read at pytorch/torchtitan b5bcd76):
a Trainer subclass that attaches resihp once the model and optimizers are built and wraps each
``train_step`` in ``monitor.step``; per-micro-batch sequence lengths come from the labels (the
tokens that are not ``IGNORE_INDEX``, per row) in a forward pre-hook on the first model part.

    torchrun --nproc-per-node 8 examples/torchtitan_attach.py --module llama3
        --config llama3_debugmodel
    resihp follow runs/torchtitan          # beside the job, or detect=True below for in-process

Not run in resihp's CI (torchtitan is not a dependency); it follows torchtitan's Trainer API as of
that commit: ``Trainer.__init__(config)``, ``train_step(data_iterator)``, ``model_parts``,
``optimizers`` (an ``OptimizersContainer``, itself a ``torch.optim.Optimizer``), ``parallel_dims``
and ``close``. With pipeline parallelism, pass each rank's stage (``pp_size``/``stage``) as below.
"""

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import ConfigManager
from torchtitan.trainer import Trainer

import resihp


class ResihpTrainer(Trainer):
    def __init__(self, config):
        super().__init__(config)
        dims = self.parallel_dims
        stage = dims.get_mesh("pp").get_local_rank() if dims.pp_enabled else 0
        self.monitor = resihp.attach(
            self.model_parts[0],
            optimizer=self.optimizers,
            out="runs/torchtitan",
            dp_size=dims.dp_shard * dims.dp_replicate,
            pp_size=dims.pp,
            tp_size=dims.tp,
            stage=stage,
            detect=True,
            on_event=self._on_event,
        )
        self._lengths = []
        self.model_parts[0].register_forward_pre_hook(
            self._note_lengths, with_kwargs=True, prepend=True
        )

    def _note_lengths(self, module, args, kwargs):
        if self._lengths:  # one entry per micro-batch, in the order the forwards run
            self.monitor.note_lengths(self._lengths.pop(0))

    def _on_event(self, event):
        if event["kind"] == "fail-slow":
            print(
                f"resihp: rank {event['rank']} is x{event['slowdown']:.2f} slower "
                f"since step {event['onset_step']}"
            )

    def train_step(self, data_iterator):
        # peek the step's micro-batches to read their lengths, then hand them on unchanged
        batches = [
            next(data_iterator)
            for _ in range(self.gradient_accumulation_steps * self.num_pp_microbatches)
        ]
        self._lengths = [
            [int(n) for n in (labels != IGNORE_INDEX).sum(-1).tolist()] for _, labels in batches
        ]
        with self.monitor.step(step=self.step):
            super().train_step(iter(batches))

    def close(self):
        self.monitor.close()
        print(self.monitor.report())
        super().close()


def main():
    config = ConfigManager().parse_args()
    trainer = ResihpTrainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
