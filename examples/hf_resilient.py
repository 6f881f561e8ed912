"""A user's own DDP loop over a Hugging Face ``transformers`` model with resihp's in-memory
snapshots: killed, restarted by torchrun, it goes on from memory with the losses of a run never
killed.

    torchrun --nproc-per-node 2 --max-restarts 2 examples/hf_resilient.py --out runs/hf-res

The model is a tiny Llama built from its config (no download), dropout on. The ``# resihp`` lines
are those of ``examples/ddp_resilient.py``, whose deterministic batches it reads; every rank
appends its loss per step to ``OUT/losses.rankR.jsonl``.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from ddp_resilient import Batches  # the script's folder is on sys.path
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM

import resihp.train  # resihp


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
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.1,  # the RNG is part of the state
    )
    config._attn_implementation = "eager"
    model = DistributedDataParallel(LlamaForCausalLM(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
    data = Batches(args.seed, rank, config.vocab_size, tokens=32)
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
        source = restored.source if restored else None
        f.write(json.dumps({"start": start, "source": source, "pid": os.getpid()}) + "\n")
    model.train()
    for step in range(start, args.steps):
        ids = data.next()
        loss = model(input_ids=ids, labels=ids).loss  # the model shifts the labels
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
