"""PyTorch Lightning with resihp's snapshots: a rank killed and restarted by torchrun resumes from
memory, and its losses are those of a run never killed.

    torchrun --nproc-per-node 2 --max-restarts 2 examples/lightning_resilient.py --out runs/pl-res

DDP over gloo on CPUs, dropout on. Two optimizer steps an epoch per rank with a plain
``DataLoader``: the snapshots are taken at epoch ends (``--every 2``), where Lightning resumes a
plain loader exactly. The ``# resihp`` lines are all a script needs; every rank appends its loss
per step to ``OUT/losses.rankR.jsonl``.
"""

import argparse
import json
import os
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn

import resihp.train  # resihp
from resihp.train.lightning_callback import ResihpLightningCallback  # resihp

VOCAB = 256


class TinyLM(L.LightningModule):
    """Embedding, MLP with dropout, logits: a next-token model."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Embedding(VOCAB, 64), nn.Linear(64, 128), nn.GELU(), nn.Dropout(0.1),
            nn.Linear(128, VOCAB),
        )  # fmt: skip

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(ids)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)]


class LossLog(L.Callback):
    """Each step's loss to ``OUT/losses.rankR.jsonl``; then waits ``pace`` seconds."""

    def __init__(self, path: Path, pace: float) -> None:
        self.path, self.pace = path, pace

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with self.path.open("a") as f:
            f.write(json.dumps({"step": trainer.global_step, "loss": outputs["loss"].item()}))
            f.write("\n")
        time.sleep(self.pace)  # time to kill a rank by hand (after resihp's snapshot, called first)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=2, help="optimizer steps between snapshots")
    ap.add_argument("--pace", type=float, default=0.0, help="seconds to wait after each step")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    resihp.train.init_process_group("gloo")  # resihp: a restart rejoins on fresh store keys
    rank = torch.distributed.get_rank()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"losses.rank{rank}.jsonl"
    L.seed_everything(0, verbose=False)
    module = TinyLM()
    g = torch.Generator().manual_seed(1234)
    rows = torch.randint(0, VOCAB, (8, 33), generator=g)  # 2 steps an epoch at 2 ranks
    loader = torch.utils.data.DataLoader(rows, batch_size=2, shuffle=True)
    resihp_cb = ResihpLightningCallback(out=out / "run", snapshot_every=args.every)  # resihp
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy="ddp",
        max_steps=args.steps,
        callbacks=[resihp_cb, LossLog(log, args.pace)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out / "lightning"),
    )
    ckpt = resihp_cb.resume_checkpoint()  # resihp: collective, None on a fresh start
    restored = resihp_cb.restored
    with log.open("a") as f:
        start = restored.step + 1 if restored else 0
        source = restored.source if restored else None
        f.write(json.dumps({"start": start, "source": source, "pid": os.getpid()}) + "\n")
    trainer.fit(module, loader, ckpt_path=ckpt)  # resihp
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
