"""A user's own 2-rank DDP job (torchrun, gloo, a tiny transformer, variable sequence lengths) with
resihp attached, and one rank made slower per token from a given step: the job of issue 19.

    torchrun --nproc-per-node 2 examples/ddp_straggler.py --out runs/ddp-slow --slow-rank 1 \
        --factor 2 --slow-from 30 --steps 80
    torchrun --nproc-per-node 2 examples/ddp_straggler.py --out runs/ddp-healthy --steps 80
    resihp detect runs/ddp-slow --json          # offline, on the run folder
    resihp follow runs/ddp-slow                 # live, beside the job (waits for it to start)

``--detect`` runs the detector inside the job (a thread on rank 0) and prints ``monitor.report()``
at the end. The slowdown is real work-proportional waiting, not a constant: on the slow rank the
forward and the backward each sleep ``(factor - 1)`` times the time they took (``--phase`` picks
forward, backward or both; ``optimizer`` slows the optimizer step the same way).
"""

import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import resihp


class TinyTransformer(nn.Module):
    """A small causal transformer over packed variable-length sequences: each document attends
    within itself (as varlen attention kernels do), so a step's work follows its lengths."""

    shape = {"layers": 2, "hidden": 128, "heads": 4, "ffn_hidden": 512}

    def __init__(self, vocab=512, max_len=1024):
        super().__init__()
        dim, heads, layers = self.shape["hidden"], self.shape["heads"], self.shape["layers"]
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        block = nn.TransformerEncoderLayer(
            dim, heads, self.shape["ffn_hidden"], dropout=0.0, batch_first=True
        )
        self.body = nn.TransformerEncoder(block, layers)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, lengths):
        h = self.emb(ids)
        h = _Slow.apply(h, "in")
        docs = []
        for doc in torch.split(h, lengths, dim=1):
            n = doc.shape[1]
            mask = nn.Transformer.generate_square_subsequent_mask(n)
            docs.append(self.body(doc + self.pos.weight[:n], mask=mask, is_causal=True))
        return _Slow.apply(self.head(torch.cat(docs, dim=1)), "out")


class _Slow(torch.autograd.Function):
    """Identity marks around the model body; on the slow rank they stretch the time between them."""

    factor = 1.0
    phases = ("forward", "backward")
    marks: dict = {}

    @staticmethod
    def forward(ctx, x, where):
        ctx.where = where
        now = time.perf_counter()
        if where == "in":
            _Slow.marks["fwd"] = now
        elif "forward" in _Slow.phases and _Slow.factor > 1:
            time.sleep((_Slow.factor - 1) * (now - _Slow.marks["fwd"]))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        now = time.perf_counter()
        if ctx.where == "out":
            _Slow.marks["bwd"] = now
        elif "backward" in _Slow.phases and _Slow.factor > 1:
            time.sleep((_Slow.factor - 1) * (now - _Slow.marks["bwd"]))
        return grad, None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--out", default="runs/ddp")
    parser.add_argument("--slow-rank", type=int, default=None)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--slow-from", type=int, default=30)
    parser.add_argument(
        "--phase", choices=["both", "forward", "backward", "optimizer"], default="both"
    )
    parser.add_argument(
        "--detect", action="store_true", help="detect inside the job (rank 0 thread)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(TinyTransformer())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _Slow.phases = ("forward", "backward") if args.phase == "both" else (args.phase,)
    clock = {}
    # the slow optimizer: hooks registered before resihp's, so its timing includes the sleep
    opt.register_step_pre_hook(lambda *_: clock.update(t0=time.perf_counter()))
    opt.register_step_post_hook(
        lambda *_: (
            "optimizer" in _Slow.phases
            and _Slow.factor > 1
            and time.sleep((_Slow.factor - 1) * (time.perf_counter() - clock["t0"]))
        )
    )
    extra = {"detect": True} if args.detect else {}
    monitor = resihp.attach(
        model, optimizer=opt, out=args.out, **TinyTransformer.shape, **extra
    )  # <- resihp
    rng = random.Random(args.seed * 1000 + rank)
    for step in range(args.steps):
        if rank == args.slow_rank and step >= args.slow_from:
            _Slow.factor = args.factor
        lengths = [rng.randint(16, 160) for _ in range(rng.randint(1, 4))]
        ids = torch.randint(0, 512, (1, sum(lengths)))
        with monitor.step(seq_lens=lengths):  # <- resihp
            logits = model(ids, lengths)
            loss = nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
    monitor.close()  # <- resihp
    if rank == 0:
        report = monitor.report() if hasattr(monitor, "report") else None
        print(json.dumps({"report": report, "world": dist.get_world_size(), "pid": os.getpid()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
