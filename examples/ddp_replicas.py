"""A user's own data-parallel loop with replica-level fault tolerance: a replica killed mid-run is
relaunched alone and catches up from a live peer while the others train on; in zero-drift mode
(the default) the survivors train its shares, so the losses are bitwise the failure-free run's.

    resihp replicas --replicas 2 examples/ddp_replicas.py --out runs/ddp-replicas

The lines marked ``# resihp`` are all a loop needs. Each replica appends its global loss per step
to ``OUT/losses.replicaR.jsonl`` (a relaunched one appends again, from the step it rejoined at).
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

import resihp.train  # resihp


def batch(seed: int, step: int, share: int, vocab: int, tokens: int) -> torch.Tensor:
    """Share ``share`` of step ``step``'s global batch: the same tokens whoever trains it."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 10_007 + share)
    return torch.randint(0, vocab, (4, tokens), generator=g)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drop", action="store_true", help="leave a lost replica's shares out")
    ap.add_argument("--pace", type=float, default=0.0, help="seconds to wait after each step")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    vocab = 256
    model = nn.Sequential(
        nn.Embedding(vocab, 64),
        nn.Linear(64, 128),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(128, vocab),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
    reps = resihp.train.Replicas(  # resihp
        model, optimizer, steps=args.steps, schedulers=[scheduler], seed=args.seed, drop=args.drop
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"losses.replica{reps.member.replica}.jsonl"
    with log.open("a") as f:
        f.write(json.dumps({"attempt": reps.member.attempt, "pid": os.getpid()}) + "\n")
    for step in reps:  # resihp: an aborted step comes again
        trained = []
        for share in reps.shares():  # resihp: zero-drift: the absent replicas' shares too
            ids = batch(args.seed, step, share, vocab, tokens=32)
            logits = model(ids[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
            loss.backward()
            reps.add(loss, tokens=ids[:, 1:].numel())  # resihp
            trained.append(share)
        loss = reps.commit()  # resihp: sums, votes, steps the optimizer and scheduler
        if loss is None:
            continue
        with log.open("a") as f:
            f.write(json.dumps({"step": step, "loss": loss, "shares": trained}) + "\n")
        time.sleep(args.pace)
    if reps.catchup is not None:
        with log.open("a") as f:
            f.write(json.dumps({"catchup": reps.catchup}) + "\n")


if __name__ == "__main__":
    main()
