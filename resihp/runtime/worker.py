"""The per-rank entry point that torchrun launches:

    torchrun --standalone --nproc-per-node 4 -m resihp.runtime.worker --dp 2 --pp 2 --steps 20 --out runs/x

Each rank trains its stage and writes its part of the ops trace under ``OUT/ranks/``; rank 0 merges
them into ``OUT/ops.parquet`` with the job meta ``OUT/job.yaml`` and ``OUT/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from dataclasses import MISSING, fields
from datetime import timedelta
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

from resihp.errors import InputError, disk_full
from resihp.opstrace import JobMeta, write_meta
from resihp.perf.device import this_device
from resihp.runtime.config import RunConfig
from resihp.runtime.control import ControlInbox
from resihp.runtime.engine import Engine
from resihp.runtime.heartbeat import HeartbeatWriter
from resihp.runtime.inject import FaultInjector
from resihp.runtime.lifecycle import die_with_parent
from resihp.runtime.recorder import merge_streams


def parse_args(argv: list[str] | None = None) -> RunConfig:
    parser = argparse.ArgumentParser(prog="resihp.runtime.worker")
    parser.add_argument("--config", help="a RunConfig JSON; flags given here override it")
    for f in fields(RunConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name in ("replan", "resume"):
            continue  # only through --config
        if f.name in ("layer_split", "dp_weights", "inject"):
            parser.add_argument(flag, default=None, help=f"{f.name} (comma-separated; inject repeatable)",
                                action="append" if f.name == "inject" else "store")
        else:
            default = f.default if f.default is not MISSING else None
            parser.add_argument(flag, type=type(default) if default is not None else str, default=None)
    args = vars(parser.parse_args(argv))
    base = RunConfig.from_json(args.pop("config")).__dict__ if args.get("config") else {}
    args.pop("config", None)
    given = {k: v for k, v in args.items() if v is not None}
    try:
        if "layer_split" in given:
            given["layer_split"] = [int(x) for x in given["layer_split"].split(",")]
        if "dp_weights" in given:
            given["dp_weights"] = [float(x) for x in given["dp_weights"].split(",")]
    except ValueError:
        raise InputError("--layer-split / --dp-weights: expected comma-separated numbers") from None
    return RunConfig(**{**base, **given})


def save_checkpoint(engine: Engine, cfg: RunConfig, directory: Path, step: int) -> None:
    # deferred for start-up time: torch.distributed.checkpoint (~0.6 s) only for runs that checkpoint
    from resihp.ckpt.universal import save

    meta = {"dp": cfg.dp, "pp": cfg.pp, "tp": cfg.tp,
            "layer_splits": [[b - a for a, b in ranges] for ranges in engine.replica_ranges],
            "model": cfg.model_config().to_dict(), "seed": cfg.seed, "source": cfg.source,
            "job_id": cfg.job_id, "model_hash": cfg.model_hash()}
    with engine.rec.op("checkpoint-save"):
        save(directory, engine.model, engine.optimizer, step, meta, engine.coords.tp_rank, cfg.tp)


def _device(cfg: RunConfig) -> torch.device:
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise InputError("--device cuda: CUDA is not available on this machine")
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def step_table(trace: pd.DataFrame) -> pd.DataFrame:
    """Per step: the slowest rank's wall time, the global tokens and the loss (complete steps only)."""
    steps = trace[trace.optype == "step"]
    table = steps.groupby("step").agg(wall_s=("duration", "max"), tokens=("tokens", "max"),
                                      loss=("loss", "max"), ranks=("rank", "nunique"))
    return table[table.ranks == table.ranks.max()]


def write_job_files(cfg: RunConfig, out: Path) -> dict:
    """Merge rank parts, write the job meta and the run summary (rank 0, or the launcher)."""
    trace = merge_streams(sorted((out / "ranks").glob("rank*.jsonl")), out / "ops.parquet")
    dims = cfg.dims()
    write_meta(JobMeta(dims.dp, dims.pp, dims.tp, dims.world_size), out / "job.yaml",
               **cfg.model_config().to_dict(), schedule=cfg.schedule, source=cfg.source,
               global_tokens=cfg.global_tokens, budget=cfg.budget, layer_split=[
                   b - a for a, b in cfg.stage_ranges()], seed=cfg.seed,
               device=this_device("cuda" if cfg.device == "cuda" or (
                   cfg.device == "auto" and torch.cuda.is_available()) else "cpu", cfg.threads))
    per_step = step_table(trace)
    summary = {"steps": int(per_step.shape[0]), "world_size": dims.world_size,
               "dp": dims.dp, "pp": dims.pp, "tp": dims.tp, "schedule": cfg.schedule,
               "injected": [f.to_dict() for f in cfg.faults()],
               "tokens_per_s": float(per_step.tokens.sum() / per_step.wall_s.sum()) if len(per_step) else None,
               "loss_first": _finite(per_step.loss.iloc[0]) if len(per_step) else None,
               "loss_last": _finite(per_step.loss.iloc[-1]) if len(per_step) else None,
               # the global loss of every step this run trained, in step order, from first_step
               "first_step": int(per_step.index.min()) if len(per_step) else None,
               "losses": [_finite(v) for v in per_step.loss],
               "trace": str(out / "ops.parquet"), "meta": str(out / "job.yaml")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _finite(value: float) -> float | None:
    """A loss for JSON: NaN and infinities are not JSON numbers (null instead)."""
    return float(value) if math.isfinite(float(value)) else None


class NonFiniteLoss(RuntimeError):
    """The loss is NaN or infinite: the run stops (exit 1) and keeps its last good checkpoint."""


def resume_step(cfg: RunConfig, saved: dict) -> int:
    """The first step after checkpoint meta ``saved``, which must be of this run's model (its
    layout may differ: checkpoints are universal)."""
    if saved.get("model_hash") not in (None, cfg.model_hash()):
        raise InputError(f"{cfg.resume}: written for another model ({saved.get('model')}); this run's "
                         f"model is {cfg.model_config().to_dict()}")
    return int(saved["step"]) + 1


def run(cfg: RunConfig) -> None:
    out = Path(cfg.out)
    device = _device(cfg)
    torch.set_num_threads(cfg.threads)
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = os.environ.get("RESIHP_STORE")
    if store:  # the launcher's store, bound to loopback (resihp.runtime.launch.LoopbackStore)
        host, _, port = store.rpartition(":")
        client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=cfg.timeout_s))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"resihp/{cfg.job_id}/{attempt}", client),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timedelta(seconds=cfg.timeout_s))
    else:
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout_s))
    rank = dist.get_rank()
    (out / "ranks").mkdir(parents=True, exist_ok=True)
    part = out / "ranks" / f"rank{rank}.jsonl"
    part.unlink(missing_ok=True)
    heart = HeartbeatWriter(out / "heartbeats", rank).start()
    engine = Engine(cfg, device, FaultInjector(cfg.faults(), rank))
    heart.phase = "train"
    inbox = ControlInbox(out, cfg.replan) if rank == 0 else None
    results = []
    first_step = 0
    if cfg.resume:
        # deferred for start-up time (see save_checkpoint)
        from resihp.ckpt.universal import load, read_meta

        first_step = resume_step(cfg, read_meta(cfg.resume))
        engine.rec.begin_step(first_step)
        with engine.rec.op("checkpoint-load"):
            load(cfg.resume, engine.model, engine.optimizer, engine.coords.tp_rank, cfg.tp)
    try:
        for step in range(first_step, cfg.steps):
            heart.at_step(step)
            proposal = inbox.poll(step) if inbox else None
            if proposal is not None:
                proposal = {**proposal, "version": engine.plan_version + 1}
            engine.sync_plan(step, proposal)
            result = engine.train_step(step)
            results.append(result)
            if result.loss is not None and engine.dp_rank == 0:
                print(f"step {step} loss {result.loss:.4f} tokens {result.tokens} "
                      f"wall {result.wall_s:.3f}s", file=sys.stderr, flush=True)
            if result.loss is not None and not math.isfinite(result.loss):
                # before any checkpoint of this step: the last one written stays the last good one
                raise NonFiniteLoss(f"non-finite loss ({result.loss}) at step {step}; stopped before "
                                    f"checkpointing it (lower --lr, or resume from the last checkpoint)")
            if cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0:
                save_checkpoint(engine, cfg, out / "ckpt" / f"step{step}", step)
            engine.rec.flush(part)
    finally:
        engine.rec.flush(part)
        heart.stop("done")
    dist.barrier()
    if rank == 0:
        (out / "plan_changes.json").write_text(json.dumps(engine.plan_changes))
        summary = write_job_files(cfg, out)
        print(json.dumps(summary), flush=True)
    dist.destroy_process_group()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # torchrun stops the surviving workers with SIGTERM when one fails: unwind so that each
    # writes its trace part (``finally`` in ``run``)
    raise SystemExit(143)


def main(argv: list[str] | None = None) -> None:
    rank = os.environ.get("RANK", "?")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    die_with_parent()  # torchrun's death (even by SIGKILL) takes this worker with it
    if os.getppid() == 1:
        sys.exit(137)
    try:
        run(parse_args(argv))
    except InputError as exc:
        print(f"resihp: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteLoss as exc:
        print(f"resihp: stop: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    except (RuntimeError, dist.DistBackendError) as exc:
        _stop_if_disk_full(exc, rank)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "waiting for clients" in first:
            print(f"resihp: rank {rank}: not every worker joined within the timeout ({first})",
                  file=sys.stderr)
            sys.exit(3)
        print(f"resihp: rank {rank}: lost contact with a peer at {time.strftime('%H:%M:%S')}: {first}",
              file=sys.stderr)
        sys.exit(1)
    except BaseException as exc:  # DCP wraps a rank's write error in a BaseException
        _stop_if_disk_full(exc, rank)
        raise


def _stop_if_disk_full(exc: BaseException, rank: str) -> None:
    """A full disk (however deep in the exception chain) is one line and exit 1."""
    full = disk_full(exc)
    if full is not None:
        print(f"resihp: stop: rank {rank}: disk full writing {getattr(full, 'filename', None) or 'its outputs'}"
              f" ({getattr(full, 'strerror', None) or 'No space left on device'}); what was written "
              f"before stays valid", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
