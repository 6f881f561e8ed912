"""GPU benchmarks (issue 18), run on a machine with an NVIDIA GPU. Prints JSON.

    python benchmarks/gpu.py snapshot [--layers 4] [--microbatches 8] [--rounds 6] [--window 8]
    python benchmarks/gpu.py attach [--rounds 10] [--window 40]

``snapshot``: the memory tier's snapshot of GPU state (fp32 parameters and AdamW moments of a
stack of decoder layers at hidden 2048, at least 1 GiB; bf16 autocast training steps) against a
synchronous ``dcp.save`` of the same state to the local disk. Arms run in interleaved windows of
``--window`` steps with one save in the middle of each (rotated order per round; medians over
rounds): ``none``, ``snapshot`` (side-stream copy into the slot's pinned shared memory, fenced
before the next optimizer step; a real keeper process checksums and publishes it) and ``dcp``.
Blocked time = what the trainer waited (the snapshot call and the fence; the whole ``dcp.save``);
overhead = window time with the save minus the same round's window without.

``attach``: a small GPT (bf16 autocast) trained on packed micro-batches of real code lengths, its
step time without resihp, with ``resihp.attach`` timing by CUDA events (the default on a GPU), and
with ``gpu_timing="sync"``; interleaved windows, medians, ratios to the plain loop.
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

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

import resihp
from resihp.ckpt.keeper import ensure_keeper, stop_keeper
from resihp.ckpt.memory import MemoryTier, tier_dir
from resihp.ckpt.snapshot import Snapshotter, state_tensors
from resihp.model.config import GPTConfig
from resihp.model.gpt import DecoderBlock, GPTStage, lm_loss
from resihp.perf.device import measurement_env
from resihp.workload.lengths import resolve_source
from resihp.workload.packing import packed_microbatches


def _sync() -> None:
    torch.cuda.synchronize()


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def interleaved(window, arms: tuple[str, ...], rounds: int) -> dict[str, list]:
    """``window(arm)`` for every arm in every round, the order rotated each round (so a drifting
    device hits every arm alike); each arm's results in round order."""
    out: dict[str, list] = {a: [] for a in arms}
    for r in range(rounds):
        k = r % len(arms)
        for arm in arms[k:] + arms[:k]:
            out[arm].append(window(arm))
    return out


# --- snapshot -------------------------------------------------------------------------------------
def snapshot(args: argparse.Namespace) -> dict:
    dev = torch.device("cuda")
    cfg = GPTConfig(layers=args.layers, hidden=2048, heads=16, ffn_hidden=8192, max_seq_len=4096)
    torch.manual_seed(0)
    model = torch.nn.ModuleList([DecoderBlock(cfg) for _ in range(cfg.layers)]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    seq_lens = [1024] * 4  # 4096 tokens per micro-batch

    def step() -> None:
        for _ in range(args.microbatches):
            y = torch.randn(4096, cfg.hidden, device=dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                for layer in model:
                    y = layer(y, seq_lens)
            y.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    step()  # AdamW state exists from here on
    nbytes = sum(t.numel() * t.element_size() for _, t in state_tensors(model, opt))
    job = f"gpubench-{os.getpid()}"
    tier = MemoryTier(tier_dir(job, 0), 0)
    tier.check_capacity(2 * nbytes)
    ensure_keeper(tier.dir, owner=os.getpid())
    snap = Snapshotter(tier, every=1, timeout_s=120)
    disk = Path(tempfile.mkdtemp(prefix="gpubench-dcp-", dir=args.disk))
    step_no, last = [1], [-1]

    def window(arm: str) -> tuple[float, float | None]:
        _sync()
        t0 = time.perf_counter()
        blocked, n = None, len(snap.blocked_s)
        for i in range(args.window):
            step()
            step_no[0] += 1
            if i == args.window // 2:
                if arm == "snapshot":
                    snap.snapshot(step_no[0], model, opt, {"bench": 1})
                    last[0] = step_no[0]
                elif arm == "dcp":
                    shutil.rmtree(disk / "ckpt", ignore_errors=True)
                    b0 = time.perf_counter()
                    dcp.save(
                        dict(state_tensors(model, opt)),
                        checkpoint_id=str(disk / "ckpt"),
                        no_dist=True,
                    )
                    blocked = time.perf_counter() - b0
        if arm == "snapshot":
            snap.fence()
            blocked = sum(snap.blocked_s[n:])
        _sync()
        return time.perf_counter() - t0, blocked

    for arm in (
        "none",
        "snapshot",
        "snapshot",
        "dcp",
    ):  # warm-up: kernels, pinning, both slots, disk
        window(arm)
    runs = interleaved(window, ("none", "snapshot", "dcp"), args.rounds)
    times = {a: [t for t, _ in r] for a, r in runs.items()}
    blocked = {a: [b for _, b in r if b is not None] for a, r in runs.items()}
    copy_s, pinned = snap.copy_s[2:], snap.pinned
    snap.close()
    # the keeper publishes the last snapshot; its bytes must match the state it was taken of
    deadline = time.monotonic() + 120
    newest = None
    while time.monotonic() < deadline:
        heads = [h for h in tier.headers() if h.rank == 0]
        newest = max(heads, key=lambda h: h.step) if heads else None
        if newest is not None and newest.step == last[0]:
            break
        time.sleep(0.05)
    verified = newest is not None and tier.verify(newest)
    stop_keeper(tier.dir)
    shutil.rmtree(tier.dir, ignore_errors=True)
    shutil.rmtree(disk, ignore_errors=True)
    overhead = {
        a: [t - n for t, n in zip(times[a], times["none"], strict=True)]
        for a in ("snapshot", "dcp")
    }
    step_s = _median(times["none"]) / args.window
    return {
        "state_bytes": nbytes,
        "state_gib": round(nbytes / 2**30, 3),
        "params": sum(p.numel() for p in model.parameters()),
        "tokens_per_step": 4096 * args.microbatches,
        "window_steps": args.window,
        "rounds": args.rounds,
        "step_s": step_s,
        "pinned": pinned,
        "snapshot_blocked_s": _median(blocked["snapshot"]),
        "dcp_blocked_s": _median(blocked["dcp"]),
        "stall_ratio": _median(blocked["snapshot"]) / _median(blocked["dcp"]),
        "snapshot_copy_s": _median(copy_s) if copy_s else None,
        "copy_gb_per_s": nbytes / 1e9 / _median(copy_s) if copy_s else None,
        "snapshot_overhead_s": _median(overhead["snapshot"]),
        "dcp_overhead_s": _median(overhead["dcp"]),
        "snapshot_overhead_steps": _median(overhead["snapshot"]) / step_s,
        "overhead_ratio": _median(overhead["snapshot"]) / _median(overhead["dcp"]),
        "fence_waits": snap.fence_waits,
        "last_snapshot_verified_by_keeper": verified,
        "windows_s": times,
        "blocked_s": blocked,
    }


# --- attach ---------------------------------------------------------------------------------------
def attach(args: argparse.Namespace) -> dict:
    dev = torch.device("cuda")
    cfg = GPTConfig(layers=4, hidden=1024, heads=16, ffn_hidden=4096, vocab=32000, max_seq_len=2048)
    torch.manual_seed(0)
    model = GPTStage(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = np.random.default_rng(0)
    batches = [
        [int(n) for n in b]
        for b in packed_microbatches(resolve_source("code"), 64, 8192, cfg.max_seq_len, rng)
    ]
    ids = [torch.randint(0, cfg.vocab, (sum(b) + 1,), device=dev) for b in batches]
    counter = [0]

    def step(mon=None) -> torch.Tensor:
        k = counter[0] % len(batches)
        counter[0] += 1
        tokens, lens = ids[k], batches[k]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:-1], lens)
        loss = lm_loss(logits, tokens[1:]) / (len(tokens) - 1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    root = Path(tempfile.mkdtemp(prefix="gpubench-attach-"))

    def window(arm: str) -> tuple[float, float]:
        mon = None
        if arm != "plain":
            mon = resihp.attach(
                model,
                optimizer=opt,
                out=root / f"{arm}-{counter[0]}",
                gpu_timing=arm,
                log_level="WARNING",
                layers=cfg.layers,
                hidden=cfg.hidden,
                heads=cfg.heads,
                ffn_hidden=cfg.ffn_hidden,
            )
        _sync()
        t0 = time.perf_counter()
        for i in range(args.window):
            k = counter[0] % len(batches)
            if mon is None:
                loss = step()
            else:
                with mon.step(seq_lens=batches[k]):
                    loss = step()
            if i % 10 == 9:
                loss.item()  # a training loop's periodic loss log
        _sync()
        elapsed = time.perf_counter() - t0
        own = 0.0
        if mon is not None:
            own = mon.self_s
            mon.close()
        return elapsed / args.window, own / args.window

    for arm in ("plain", "events", "sync"):
        window(arm)
    runs = interleaved(window, ("plain", "events", "sync"), args.rounds)
    step_s = {a: [s for s, _ in r] for a, r in runs.items()}
    own_s = {a: [o for _, o in r] for a, r in runs.items()}
    # the rows an events-timed run recorded: every step, forward and backward, positive durations
    check = root / "check"
    mon = resihp.attach(model, optimizer=opt, out=check, log_level="WARNING")
    for _ in range(12):
        k = counter[0] % len(batches)
        with mon.step(seq_lens=batches[k]):
            step()
    mon.close()
    trace = mon.trace()
    per_op = trace.groupby("optype")["duration"].agg(["count", "median"]).to_dict("index")
    shutil.rmtree(root, ignore_errors=True)
    plain = _median(step_s["plain"])
    return {
        "model": cfg.to_dict(),
        "tokens_per_step": 8192,
        "window_steps": args.window,
        "rounds": args.rounds,
        "plain_step_s": plain,
        "events_step_s": _median(step_s["events"]),
        "sync_step_s": _median(step_s["sync"]),
        "events_ratio": _median(step_s["events"]) / plain,
        "sync_ratio": _median(step_s["sync"]) / plain,
        "paired_events_ratio": _median(
            [e / p for e, p in zip(step_s["events"], step_s["plain"], strict=True)]
        ),
        "paired_sync_ratio": _median(
            [s / p for s, p in zip(step_s["sync"], step_s["plain"], strict=True)]
        ),
        "resihp_python_s_per_step": {a: _median(own_s[a]) for a in ("events", "sync")},
        "events_trace": {
            k: {"count": int(v["count"]), "median_s": float(v["median"])} for k, v in per_op.items()
        },
        "step_s": step_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("snapshot")
    s.add_argument("--layers", type=int, default=4)
    s.add_argument("--microbatches", type=int, default=8)
    s.add_argument("--rounds", type=int, default=6)
    s.add_argument("--window", type=int, default=8)
    s.add_argument("--disk", default=None, help="folder for the dcp arm (default: the temp dir)")
    a = sub.add_parser("attach")
    a.add_argument("--rounds", type=int, default=10)
    a.add_argument("--window", type=int, default=40)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA device")
    t0 = time.perf_counter()
    result = snapshot(args) if args.what == "snapshot" else attach(args)
    result = {
        "benchmark": f"gpu-{args.what}",
        "env": measurement_env(torch.device("cuda")),
        "seconds": round(time.perf_counter() - t0, 1),
        **result,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
