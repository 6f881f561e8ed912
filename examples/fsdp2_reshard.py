"""A user's own FSDP2 loop whose checkpoint resumes at another world size.

    torchrun --nproc-per-node 2 examples/fsdp2_reshard.py --out runs/a --dcp runs/ckpt --save-at 2
    torchrun --nproc-per-node 4 examples/fsdp2_reshard.py --out runs/b --dcp runs/ckpt --resume

The model is sharded with ``fully_shard`` (``--wrap ddp``: replicated by DDP instead);
``Snapshots.save`` writes a DCP checkpoint and
``Snapshots.restore`` (no snapshot in memory: a new job) loads the newest one into whatever sharding
the new world has. Each step trains on the same global batch whatever the world size (rank ``r``
takes rows ``r::world``), so the losses after the resume continue the first run's. Rank 0 appends
each step's global loss to ``OUT/losses.jsonl``.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import resihp.train
from resihp.errors import InputError

VOCAB, TOKENS, GLOBAL_BATCH = 128, 16, 8


class Steps:
    """The position in the stream of global batches: a Stateful data source."""

    def __init__(self, seed: int) -> None:
        self.seed, self.position = seed, 0

    def next(self, rank: int, world: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        self.position += 1
        batch = torch.randint(0, VOCAB, (GLOBAL_BATCH, TOKENS + 1), generator=g)
        return batch[rank::world]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dcp", required=True, help="folder of DCP checkpoints (stepN)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-at", type=int, action="append", default=[])
    ap.add_argument("--resume", action="store_true", help="go on from the newest checkpoint")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--wrap", choices=("fsdp2", "ddp"), default="fsdp2")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(VOCAB, args.hidden),
        nn.Linear(args.hidden, 4 * args.hidden),
        nn.GELU(),
        nn.Linear(4 * args.hidden, VOCAB),
    )
    if args.wrap == "ddp":
        model = DistributedDataParallel(model)
    else:
        for layer in (model[1], model[3]):
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = Steps(seed=0)
    snaps = resihp.train.Snapshots(
        {"model": model, "optimizer": optimizer, "data": data}, every=1, dcp_dir=args.dcp
    )
    try:
        restored = snaps.restore() if args.resume else None
    except InputError as exc:  # a checkpoint that does not fit this model: one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        dist.destroy_process_group()
        sys.exit(2)
    start = restored.step + 1 if restored else 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for step in range(start, args.steps):
        ids = data.next(rank, world)
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # equal rows per rank: the mean of the means is the global mean
        snaps.after_step(step)
        if step in args.save_at:
            snaps.save(step)
        if rank == 0:
            with (out / "losses.jsonl").open("a") as f:
                line = {"step": step, "loss": total.item() / world, "world": world}
                if restored and step == start:
                    line["resumed_from"] = restored.source
                f.write(json.dumps(line) + "\n")
    snaps.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
