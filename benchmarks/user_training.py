"""The stall a user's own training loop sees per checkpoint of its state: resihp's in-memory
snapshot (``resihp.train.Snapshots``) against a synchronous ``dcp.save``, ``dcp.async_save`` with
DCP's shared-memory stager, and the memcpy floor of the same bytes, all measured in one run.

    python benchmarks/user_training.py --rounds 9 --out benchmarks/results/user-training.json

One process on the CPU: a model of ``--params`` million parameters with AdamW state (so the
checkpoint is about 12 bytes per parameter), trained step after step. Each round takes one
checkpoint with every arm, in a rotating order (arms interleaved: the CPU drifts). A stall is what
the loop waits for: the call itself and, before the next optimizer step, whatever copy must finish
first (resihp's copy overlaps the next forward and backward; DCP's async staging likewise). The
memcpy floor copies the same tensors into buffers allocated once. Medians, with each arm's
spread (the 25th to 75th percentile) as its noise floor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from resihp.ckpt.keeper import stop_keeper
from resihp.ckpt.single import single_process
from resihp.train import KEEPER_OWNER, Snapshots
from resihp.train.state import flatten

ARMS = ("resihp", "dcp_save", "dcp_async_save", "memcpy")


def _model(params_m: float, vocab: int = 4096) -> nn.Module:
    hidden = 512
    blocks = max(1, round((params_m * 1e6 - 2 * vocab * hidden) / (8 * hidden * hidden)))
    layers: list[nn.Module] = [nn.Embedding(vocab, hidden)]
    for _ in range(blocks):
        layers += [nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)]
    layers.append(nn.Linear(hidden, vocab))
    return nn.Sequential(*layers)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=20.0, help="model size, millions of parameters")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="rounds first, not counted (first-use "
        "costs: the memory tier's slots, DCP's stager buffers)",
    )
    ap.add_argument("--tokens", type=int, default=256, help="tokens per step")
    ap.add_argument("--disk", default=None, help="folder for the DCP arms (default: a temp folder)")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    os.environ.setdefault(KEEPER_OWNER, str(os.getpid()))  # the keeper ends with this process
    model = _model(args.params)
    vocab = model[0].num_embeddings
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    snaps = Snapshots({"model": model, "optimizer": optimizer}, job_id=f"bench-{os.getpid()}")
    disk = Path(args.disk or tempfile.mkdtemp(prefix="resihp-bench-"))
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=True,
            use_async_staging=True,
            use_non_blocking_copy=False,
        )
    )
    step = 0

    def train_step() -> float:
        nonlocal step
        ids = torch.randint(0, vocab, (1, args.tokens + 1))
        t0 = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        compute = time.perf_counter() - t0
        optimizer.step()  # resihp's snapshot in flight is fenced here (counted in its stall)
        step += 1
        return compute

    train_step()  # AdamW state exists from here on
    tensors = flatten({"model": model, "optimizer": optimizer})[0]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    floor_bufs = [torch.empty_like(t) for _, t in tensors]
    stalls: dict[str, list[float]] = {arm: [] for arm in ARMS}
    compute_s: list[float] = []
    pending = None
    for r in range(args.warmup + args.rounds):
        if r == args.warmup:
            stalls = {arm: [] for arm in ARMS}
            compute_s = []
        for arm in ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]:
            compute_s.append(train_step())
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            t0 = time.perf_counter()
            if arm == "resihp":
                before = len(snaps.stall_s)
                snaps.after_step(step - 1)
                compute_s.append(train_step())  # the copy overlaps this step; its fence counts
                stalls[arm].append(snaps.stall_s[before])
                continue
            if arm == "memcpy":
                for buf, (_, t) in zip(floor_bufs, tensors):
                    buf.copy_(t)
                stalls[arm].append(time.perf_counter() - t0)
                continue
            target = disk / f"{arm}-{r}"
            if arm == "dcp_save":
                with single_process():
                    dcp.save(state, checkpoint_id=str(target), no_dist=True)
                stalls[arm].append(time.perf_counter() - t0)
            else:
                with single_process():
                    pending = dcp.async_save(
                        state, checkpoint_id=str(target), async_stager=stager, no_dist=True
                    )
                called = time.perf_counter() - t0
                t1 = time.perf_counter()
                pending.staging_completion.result()  # the next optimizer step must wait for it
                stalls[arm].append(called + time.perf_counter() - t1)
                pending.upload_completion.result()
            shutil.rmtree(target, ignore_errors=True)
    snaps.close()
    stop_keeper(snaps.dir)
    stager.close()
    if args.disk is None:
        shutil.rmtree(disk, ignore_errors=True)
    med = {arm: statistics.median(v) for arm, v in stalls.items()}
    result = {
        "benchmark": "user_training.snapshot_stall",
        "command": "python benchmarks/user_training.py "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
        "torch": torch.__version__,
        "params": sum(p.numel() for p in model.parameters()),
        "checkpoint_bytes": nbytes,
        "rounds": args.rounds,
        "step_compute_s_median": statistics.median(compute_s),
        "stall_s_median": med,
        "stall_s_p25_p75": {
            arm: [_percentile(v, 0.25), _percentile(v, 0.75)] for arm, v in stalls.items()
        },
        "stall_s_all": stalls,
        "ratios": {
            "resihp_over_memcpy": med["resihp"] / med["memcpy"],
            "resihp_over_dcp_save": med["resihp"] / med["dcp_save"],
            "resihp_over_dcp_async_save": med["resihp"] / med["dcp_async_save"],
        },
        "memcpy_gb_per_s": nbytes / med["memcpy"] / 1e9,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
