"""The Hugging Face Trainer and PyTorch Lightning callbacks on tiny randomly initialised models (no
downloads); each skips when its optional extra is not installed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from resihp.opstrace import read_meta, read_run_folder


def _padded_batches(n=8, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, 16, (1,), generator=g))
        ids = torch.randint(0, vocab, (16,), generator=g)
        mask = torch.zeros(16, dtype=torch.long)
        mask[:length] = 1
        rows.append(
            {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        )
    return rows


def test_hf_trainer_callback_records_steps_with_lengths_from_the_attention_mask(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from resihp.train.hf_callback import ResihpTrainerCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=16,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    data = _padded_batches()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf-out"),
        per_device_train_batch_size=2,
        max_steps=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    cb = ResihpTrainerCallback(out=tmp_path / "run", detect=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    trainer.train()
    df, meta_path = read_run_folder(tmp_path / "run")
    assert set(df.step) == {0, 1, 2, 3}
    fwd = df[df.optype == "forward-compute"]
    # the Trainer shuffles: every row's mask length once, two rows per step
    assert fwd.seq_lens.map(len).tolist() == [2] * 4
    assert sorted(x for s in fwd.seq_lens for x in s) == sorted(
        int(r["attention_mask"].sum()) for r in data
    )
    assert {"backward-compute", "optimizer", "step"} <= set(df.optype)
    assert read_meta(meta_path)[0].world_size == 1
    assert cb.monitor.report()["steps"] == 4


def test_lightning_callback_records_steps_with_lengths_from_the_batch(tmp_path):
    L = pytest.importorskip("lightning")
    from resihp.train.lightning_callback import ResihpLightningCallback

    class TinyLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb, self.out = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)

        def forward(self, ids):
            return self.out(self.emb(ids))

        def training_step(self, batch, batch_idx):
            logits = self(batch["input_ids"])
            return torch.nn.functional.cross_entropy(
                logits.reshape(-1, 64), batch["labels"].reshape(-1), ignore_index=-100
            )

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = _padded_batches()
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    cb = ResihpLightningCallback(out=tmp_path / "run")
    trainer = L.Trainer(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(TinyLM(), loader)
    df, _ = read_run_folder(tmp_path / "run")
    assert set(df.step) == {0, 1, 2, 3}
    fwd = df[df.optype == "forward-compute"].sort_values("step")
    expected = [[int(r["attention_mask"].sum()) for r in data[i : i + 2]] for i in range(0, 8, 2)]
    assert fwd.seq_lens.map(list).tolist() == expected
    assert (df.optype == "backward-compute").sum() == 4
    # the optimizer's update is timed after Lightning's closure ran the forward and backward
    opt = df[df.optype == "optimizer"].set_index("step")
    assert sorted(opt.index) == [0, 1, 2, 3] and (opt.duration > 0).all()
    bwd = df[df.optype == "backward-compute"].set_index("step")
    assert (bwd.start_ts + bwd.duration <= opt.start_ts + 1e-6).all()


def test_tensorboard_scalars_of_an_attached_loop(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import resihp

    model = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = resihp.attach(model, optimizer=opt, out=tmp_path, tensorboard=True)
    for _ in range(3):
        ids = torch.randint(0, 64, (1, 12))
        with mon.step(seq_lens=[12]):
            torch.nn.functional.cross_entropy(
                model(ids).reshape(-1, 64), ids.reshape(-1)
            ).backward()
            opt.step()
    mon.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"train/step_time_s", "train/tokens_per_s"} <= set(acc.Tags()["scalars"])
    assert len(acc.Scalars("train/tokens_per_s")) == 3


def test_hf_trainer_resumes_from_the_newest_snapshot_in_memory_or_a_newer_checkpoint_on_disk(
    tmp_path, monkeypatch
):
    """One process: a Trainer snapshots every 2 steps and checkpoints at step 3. A fresh Trainer
    resumes from step 4 in memory and logs the first run's losses bitwise; with the newer
    checkpoint-5 on disk it takes that one."""
    transformers = pytest.importorskip("transformers")
    from resihp.ckpt.keeper import stop_keeper
    from resihp.ckpt.memory import tier_dir
    from resihp.train import KEEPER_OWNER
    from resihp.train.hf_callback import ResihpTrainerCallback

    monkeypatch.setenv("RESIHP_SHM", str(tmp_path / "shm"))
    monkeypatch.setenv(KEEPER_OWNER, str(os.getpid()))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "hf-one-process")

    class Losses(transformers.TrainerCallback):
        def __init__(self):
            self.losses = {}

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses[state.global_step] = logs["loss"]

    def trainer(save_steps: int | None):
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32, attn_pdrop=0.1
        )
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "hf-out"),
            per_device_train_batch_size=2,
            max_steps=6,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="steps" if save_steps else "no",
            save_steps=save_steps or 500,
            disable_tqdm=True,
        )
        cb, losses = ResihpTrainerCallback(out=tmp_path / "run", snapshot_every=2), Losses()
        t = transformers.Trainer(
            model=transformers.GPT2LMHeadModel(config),
            args=args,
            train_dataset=_padded_batches(n=8),
            callbacks=[cb, losses],
        )
        return t, cb, losses

    first, cb, reference = trainer(save_steps=3)
    try:
        assert cb.resume_checkpoint(first) is None and cb.restored is None  # a fresh start
        first.train()
        saved = tmp_path / "hf-saved"
        shutil.move(tmp_path / "hf-out", saved)  # only checkpoint-3 stays on disk: older
        shutil.copytree(saved / "checkpoint-3", tmp_path / "hf-out" / "checkpoint-3")
        again, cb, losses = trainer(save_steps=None)
        resume = cb.resume_checkpoint(again)
        assert (cb.restored.step, cb.restored.source) == (3, "memory")  # global step 4
        again.train(resume_from_checkpoint=resume)
        assert losses.losses == {s: reference.losses[s] for s in (5, 6)}
        assert not Path(resume).exists()  # the folder is gone once read
        newer = tmp_path / "hf-out" / "checkpoint-5"  # newer than step 4 in memory
        shutil.copytree(saved / "checkpoint-3", newer)
        third, cb, _ = trainer(save_steps=None)
        assert cb.resume_checkpoint(third) == str(newer) and cb.restored.source == "disk"
    finally:
        stop_keeper(tier_dir("hf-one-process", 0))
