"""A user's own DDP training loop with resihp's in-memory snapshots: killed, restarted by
torchrun, it goes on from memory and trains the same losses as a run that was never killed.

    torchrun --nproc-per-node 2 --max-restarts 2 examples/ddp_resilient.py --out runs/ddp-res

The lines marked ``# resihp`` are all a loop needs (eight of them). Every rank appends its loss per
step to ``OUT/losses.rankR.jsonl``; a restarted rank appends again from the step it restored.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import resihp.train  # resihp


class Batches:
    """A deterministic stream of token batches with a position: a Stateful data source."""

    def __init__(self, seed: int, rank: int, vocab: int, tokens: int) -> None:
        self.seed, self.rank, self.vocab, self.tokens, self.position = seed, rank, vocab, tokens, 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(
            self.seed * 1_000_003 + self.rank * 10_007 + self.position
        )
        self.position += 1
        return torch.randint(0, self.vocab, (4, self.tokens), generator=g)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=1, help="steps between snapshots")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pace", type=float, default=0.0, help="seconds to wait after each step")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    resihp.train.init_process_group("gloo")  # resihp: a restart rejoins on fresh store keys
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    vocab = 256
    model = DistributedDataParallel(
        nn.Sequential(
            nn.Embedding(vocab, 64),
            nn.Linear(64, 128),
            nn.GELU(),
            nn.Dropout(0.1),
            nn.Linear(128, vocab),
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
    data = Batches(args.seed, rank, vocab, tokens=32)
    snaps = resihp.train.Snapshots(
        {
            "model": model,
            "optimizer": optimizer,  # resihp
            "scheduler": scheduler,
            "data": data,
        },
        every=args.every,
    )
    restored = snaps.restore()  # resihp
    start = restored.step + 1 if restored else 0  # resihp
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"losses.rank{rank}.jsonl"
    with log.open("a") as f:
        f.write(
            json.dumps(
                {
                    "start": start,
                    "source": restored.source if restored else None,
                    "pid": os.getpid(),
                }
            )
            + "\n"
        )
    for step in range(start, args.steps):
        ids = data.next()
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        with log.open("a") as f:  # before the snapshot: a step restored is a step logged
            f.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
        snaps.after_step(step)  # resihp
        time.sleep(args.pace)  # time to kill a rank by hand and watch it come back
    snaps.close()  # resihp
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
