"""The Hugging Face ``Trainer`` with resihp's snapshots: a rank killed and restarted by torchrun
resumes from memory, and the logged losses are those of a run never killed.

    torchrun --nproc-per-node 2 --max-restarts 2 examples/hf_trainer_resilient.py --out runs/hft

A tiny Llama built from its config (no download, dropout on) on CPUs over gloo. The ``# resihp``
lines are all a Trainer script needs; every rank appends each logged loss to
``OUT/losses.rankR.jsonl``.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import resihp.train  # resihp
from resihp.train.hf_callback import ResihpTrainerCallback  # resihp


def rows(n: int, vocab: int, tokens: int) -> list[dict]:
    """``n`` deterministic rows of token ids, the model's labels the same ids."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (n, tokens), generator=g)
    return [{"input_ids": r, "labels": r} for r in ids]


class LossLog(TrainerCallback):
    """Each logged loss to ``OUT/losses.rankR.jsonl``; waits ``pace`` seconds before each step."""

    def __init__(self, path: Path, pace: float) -> None:
        self.path, self.pace = path, pace

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": state.global_step, "loss": logs["loss"]}) + "\n")

    def on_step_begin(self, args, state, control, **kwargs):
        time.sleep(self.pace)  # time to kill a rank by hand (after resihp's snapshot, called first)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=1, help="optimizer steps between snapshots")
    ap.add_argument("--pace", type=float, default=0.0, help="seconds to wait after each step")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    resihp.train.init_process_group("gloo")  # resihp: a restart rejoins on fresh store keys
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    training = TrainingArguments(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=2,
        max_steps=args.steps,
        learning_rate=1e-3,
        warmup_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.1,  # the generators are part of the state
    )
    config._attn_implementation = "eager"
    rank = training.process_index
    log = out / f"losses.rank{rank}.jsonl"
    resihp_cb = ResihpTrainerCallback(out=out / "run", snapshot_every=args.every)  # resihp
    trainer = Trainer(
        model=LlamaForCausalLM(config),
        args=training,
        train_dataset=rows(24, config.vocab_size, 32),  # 6 steps an epoch at 2 ranks
        callbacks=[resihp_cb, LossLog(log, args.pace)],
    )
    resume = resihp_cb.resume_checkpoint(trainer)  # resihp: collective, None on a fresh start
    restored = resihp_cb.restored
    start = restored.step + 1 if restored else 0
    source = restored.source if restored else None
    with log.open("a") as f:
        f.write(json.dumps({"start": start, "source": source, "pid": os.getpid()}) + "\n")
    trainer.train(resume_from_checkpoint=resume)  # resihp
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
