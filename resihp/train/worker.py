"""The per-rank entry point that torchrun launches:

    torchrun --standalone --nproc-per-node 4 -m resihp.train.worker
        --dp 2 --pp 2 --steps 20 --out runs/x

Each rank trains its stage and sends its heartbeats and op records over the job's control plane
(``resihp.train.controlplane``, on the job's store). Under ``resihp run`` the launcher of node 0
reads them (live loop, run folder); under plain torchrun rank 0 reads them in a thread and writes
``OUT/ops.parquet``, the job meta ``OUT/job.yaml`` and ``OUT/summary.json`` itself, and local rank
0 of each node runs the node's heartbeat aggregator.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from resihp.ckpt.integrity import prune
from resihp.ckpt.memory import TierFull
from resihp.cli_options import add_arguments, from_command_line
from resihp.detect.heartbeat import HeartbeatSender, NodeAggregator
from resihp.errors import InputError, disk_full
from resihp.ft.quorum import Member
from resihp.opstrace import TRACE_STREAM, JobMeta, write_meta
from resihp.perf.device import this_device
from resihp.train.config import RunConfig
from resihp.train.controlplane import (
    PlanInbox,
    StepPublisher,
    StepReader,
    append_steps,
    heartbeat_prefix,
    mark_ended,
    node_ranks,
    report_error,
)
from resihp.train.engine import Engine
from resihp.train.engine_snapshots import BoundaryStop, MemorySnapshots
from resihp.train.inject import FaultInjector
from resihp.train.lifecycle import die_with_parent, enable_stack_dumps, start_time
from resihp.train.nodes import FIRST_RANK_ENV
from resihp.train.recorder import merge_streams
from resihp.train.rendezvous import attempt_prefix
from resihp.train.replica import ATTEMPT_ENV, GPU_OFFSET_ENV, REPLICA_ENV, run_replica

if TYPE_CHECKING:
    import pandas as pd


def parse_args(argv: list[str] | None = None) -> RunConfig:
    parser = argparse.ArgumentParser(prog="resihp.train.worker")
    parser.add_argument("--config", help="a RunConfig JSON; flags given here override it")
    add_arguments(parser, RunConfig)
    args = vars(parser.parse_args(argv))
    config = args.pop("config")
    base = RunConfig.from_json(config).flags() if config else {}
    given = from_command_line(RunConfig, {k: v for k, v in args.items() if v is not None})
    return RunConfig.from_flags(**{**base, **given})


def save_checkpoint(engine: Engine, cfg: RunConfig, directory: Path, step: int) -> None:
    """Collective: save the state after ``step`` as a universal checkpoint; rank 0 prunes old ones.

    One replica writes; rank 0 then keeps the newest ``--ckpt-keep`` checkpoints beside it (0: all).

    Args:
        engine: this rank's engine.
        cfg: the run's configuration.
        directory: the checkpoint's folder.
        step: the step just completed."""
    # deferred for start-up time: torch.distributed.checkpoint (~0.6 s) only for runs that
    # checkpoint
    from resihp.ckpt.universal import save
    from resihp.train.elastic import checkpoint_meta, rank_tensors

    with engine.rec.op("checkpoint-save"):
        save(
            directory,
            engine.model,
            engine.optimizer,
            step,
            checkpoint_meta(engine, cfg),
            engine.tp,
            engine.model_cfg,
            rank_tensors(engine),
            write=engine.dp_rank == 0,
        )  # one replica writes
    if engine.rank == 0:
        prune(directory.parent, cfg.checkpoint.ckpt_keep)


def _device(cfg: RunConfig) -> torch.device:
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise InputError("--device cuda: CUDA is not available on this machine")
    if use_cuda:
        # the replicas of one host are torchrun jobs of their own: replica d's ranks take the GPUs
        # after the replicas before it, wrapping round (ranks share a GPU) where the host has fewer
        index = (
            int(os.environ.get("LOCAL_RANK", "0")) + int(os.environ.get(GPU_OFFSET_ENV, "0"))
        ) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def step_table(trace: pd.DataFrame, complete_only: bool = True) -> pd.DataFrame:
    """Per step: the slowest rank's wall time, the global tokens and the loss.

    Complete steps only, unless ``complete_only`` is False: with replica-level fault tolerance a
    step may be trained by fewer replicas, and every step in the trace was committed."""
    steps = trace[trace.optype == "step"]
    table = steps.groupby("step").agg(
        wall_s=("duration", "max"),
        tokens=("tokens", "max"),
        loss=("loss", "max"),
        ranks=("rank", "nunique"),
    )
    return table[table.ranks == table.ranks.max()] if complete_only else table


def write_job_files(cfg: RunConfig, out: Path) -> dict:
    """Write the ops trace (from node 0's stream ``OUT/ops.jsonl``), the job meta and the summary.

    The launcher of node 0 writes them, or rank 0 under plain torchrun."""
    trace = merge_streams([out / TRACE_STREAM], out / "ops.parquet")
    dims = cfg.dims()
    write_meta(
        JobMeta(dims.dp, dims.pp, dims.tp, dims.world_size),
        out / "job.yaml",
        **cfg.model.to_dict(),
        schedule=cfg.parallel.schedule,
        source=cfg.data.source,
        global_tokens=cfg.data.global_tokens,
        budget=cfg.data.budget,
        layer_split=[b - a for a, b in cfg.stage_ranges()],
        seed=cfg.train.seed,
        device=this_device(
            "cuda"
            if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
            else "cpu",
            cfg.threads,
        ),
    )
    per_step = step_table(trace, complete_only=not cfg.faults.recovery.startswith("replica"))
    summary = {
        "job_id": cfg.job_id,
        "steps": int(per_step.shape[0]),
        "world_size": dims.world_size,
        "dp": dims.dp,
        "pp": dims.pp,
        "tp": dims.tp,
        "schedule": cfg.parallel.schedule,
        "injected": [f.to_dict() for f in cfg.fault_list()],
        "tokens_per_s": float(per_step.tokens.sum() / per_step.wall_s.sum())
        if len(per_step)
        else None,
        "loss_first": _finite(per_step.loss.iloc[0]) if len(per_step) else None,
        "loss_last": _finite(per_step.loss.iloc[-1]) if len(per_step) else None,
        # the global loss of every step this run trained, in step order, from first_step
        "first_step": int(per_step.index.min()) if len(per_step) else None,
        "losses": [_finite(v) for v in per_step.loss],
        "trace": str(out / "ops.parquet"),
        "meta": str(out / "job.yaml"),
    }
    if (
        cfg.checkpoint.resume and (out / "resume.json").exists()
    ):  # the checkpoint and each non-tensor key's rule
        summary["resume"] = json.loads((out / "resume.json").read_text())
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _finite(value: float) -> float | None:
    """A loss for JSON: NaN and infinities are not JSON numbers (null instead)."""
    return float(value) if math.isfinite(float(value)) else None


class JoinTimeout(RuntimeError):
    """The job could not be joined in time (its store, or the other workers)."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class NonFiniteLoss(RuntimeError):
    """The loss is NaN or infinite: the run stops (exit 1) and keeps its last good checkpoint."""


def resume_step(cfg: RunConfig, saved: dict) -> int:
    """The first step after checkpoint meta ``saved``, which must be of this run's model.

    Its layout may differ: checkpoints are universal."""
    if saved.get("model_hash") not in (None, cfg.model_hash()):
        raise InputError(
            f"{cfg.checkpoint.resume}: written for another model ({saved.get('model')}); this "
            f"run's model is {cfg.model.to_dict()}"
        )
    return int(saved["step"]) + 1


_report: list = []  # where main() sends a worker's reason to stop: the control plane, once joined


class TraceCollector(threading.Thread):
    """Under plain torchrun, rank 0 reads the job's op records from the store into the run folder.

    The job's own launcher does it under ``resihp run``."""

    def __init__(self, reader: StepReader, path: Path, poll_s: float = 0.2) -> None:
        super().__init__(name="resihp-trace", daemon=True)
        self.reader, self.path, self.poll_s = reader, path, poll_s
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.poll_s):
            append_steps(self.path, self.reader.complete_steps())

    def finish(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)
        append_steps(self.path, self.reader.complete_steps())


def _job_store(cfg: RunConfig, timeout: timedelta) -> tuple[dist.Store, int, int, int]:
    """Join the job: the control plane's store (the launcher's, else plain torchrun's agent
    store), this rank, the world size and this node."""
    node = _node()
    local, per_node = (
        int(os.environ.get("LOCAL_RANK", "0")),
        int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    )
    world = int(os.environ["WORLD_SIZE"])
    endpoint = os.environ.get("RESIHP_STORE")
    if endpoint:  # the launcher's store (resihp.train.store.JobStore)
        host, _, port = endpoint.rpartition(":")
        # the rank follows the node's place in the job (node i: ranks i*P .. i*P+P-1), not the
        # order in which torchrun's agents happened to join, so a layout means the same machines
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        except (RuntimeError, dist.DistError) as exc:
            raise JoinTimeout(
                f"cannot reach the job's store at {endpoint} ({_first_line(exc)})"
            ) from None
        return store, int(os.environ.get(FIRST_RANK_ENV, node * per_node)) + local, world, node
    # plain torchrun: its agent's store; started by hand (no agent): rank 0 hosts it
    host, port, rank = (
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["RANK"]),
    )
    hosting = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        store = dist.TCPStore(
            host, port, is_master=hosting, wait_for_workers=False, timeout=timeout
        )
    except (RuntimeError, dist.DistError) as exc:
        raise JoinTimeout(
            f"cannot reach the job's store at {host}:{port} ({_first_line(exc)})"
        ) from None
    return store, rank, world, node


def _node() -> int:
    """This worker's node: the launcher's numbering, else torchrun's group rank."""
    return int(os.environ.get("RESIHP_NODE", os.environ.get("GROUP_RANK", "0")))


def processes_file(out: str | Path) -> Path:
    """Where the workers of the run in ``out`` announce themselves (``announce``)."""
    return Path(out) / "logs" / "processes.jsonl"


def announce(out: Path) -> None:
    """One line in ``OUT/logs/processes.jsonl`` saying which process this worker is.

    It gives its PID, node, local rank, torchrun's restart count and, with ``--recovery replica``,
    its replica and launch attempt. Forked workers (``resihp.launch.agent``) share the agent's
    command line and initial environment (a spare agent's names no config), so this is where an
    operator (py-spy on a slow rank) or a fault test finds a rank's process. Best effort: a folder
    that cannot take the line does not stop the worker."""
    env = os.environ
    line = {
        "pid": os.getpid(),
        "node": _node(),
        "local_rank": int(env.get("LOCAL_RANK", "0")),
        "local_world_size": int(env.get("LOCAL_WORLD_SIZE", "1")),
        "restart": int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "replica": int(env[REPLICA_ENV]) if REPLICA_ENV in env else None,
        "attempt": int(env.get(ATTEMPT_ENV, "0")) if REPLICA_ENV in env else None,
        "started": round(time.time(), 3),
        "ticks": start_time(os.getpid()),
    }  # with the PID, this process and no later one of that PID
    path = processes_file(out)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def run(cfg: RunConfig) -> None:
    out = Path(cfg.out)
    announce(out)
    device = _device(cfg)
    torch.set_num_threads(cfg.threads)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=cfg.faults.timeout_s)
    store, rank, world, node = _job_store(cfg, timeout)
    if REPLICA_ENV in os.environ:  # --recovery replica: this torchrun job is one replica
        host, _, port = os.environ["RESIHP_STORE"].rpartition(":")
        member = Member(int(os.environ[REPLICA_ENV]), int(os.environ.get(ATTEMPT_ENV, "0")))
        connect = lambda: dist.TCPStore(host, int(port), is_master=False, timeout=timeout)  # noqa: E731
        run_replica(cfg, device, store, connect, member, _report)
        return
    # under resihp run the launchers aggregate heartbeats and read the trace; else the job does
    launched = os.environ.get("RESIHP_MANAGED") == "1"
    job_id = cfg.job_id or os.environ.get("TORCHELASTIC_RUN_ID", "job")
    _report.append(lambda kind, message: report_error(store, job_id, rank, kind, message))
    heart = HeartbeatSender(store, rank, node, prefix=heartbeat_prefix(job_id)).start()
    nodes = node_ranks(
        world // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    )
    aggregator = None
    if not launched and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        aggregator = NodeAggregator(
            store,
            node,
            nodes[node],
            prefix=heartbeat_prefix(job_id),
            timeout_s=max(3.0, 4 * heart.interval_s),
        ).start()
    try:
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(attempt_prefix(job_id), store),
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
    except (RuntimeError, dist.DistError) as exc:
        heart.finish("stopped")
        raise JoinTimeout(_first_line(exc)) from None
    out.mkdir(parents=True, exist_ok=True)
    engine = Engine(cfg, device, FaultInjector(cfg.fault_list(), rank))
    heart.follow(lambda: engine.rec.progress("train"))
    inbox = PlanInbox(store, job_id, cfg.live.replan) if rank == 0 else None
    results = []
    first_step = 0
    # with snapshots on one node, the keeper writes the universal checkpoints from them
    keeper_saves = bool(cfg.snapshot_interval() and cfg.checkpoint.ckpt_every and len(nodes) == 1)
    memory = (
        MemorySnapshots(
            cfg, engine, job_id, node, nodes[node], cfg.ckpt_root() if keeper_saves else None
        )
        if cfg.snapshot_interval()
        else None
    )
    restored = None
    if (
        memory is not None
    ):  # a restart in place: every rank's state from memory (its own or a peer's)
        with engine.rec.op("snapshot-restore"):
            restored = memory.restore()
        if restored is not None:
            first_step = restored.step + 1
            if rank == 0:
                (out / "restore.json").write_text(json.dumps(restored.to_dict()))
    if cfg.checkpoint.resume and restored is None:
        # deferred for start-up time (see save_checkpoint)
        from resihp.ckpt.universal import read_meta, resolve
        from resihp.train.elastic import resume

        source = resolve(
            cfg.checkpoint.resume
        )  # a run folder means its newest checkpoint that verifies
        first_step = resume_step(cfg, read_meta(source))
        engine.rec.begin_step(first_step)
        with engine.rec.op("checkpoint-load"):
            resumed = resume(
                engine, cfg, source, first_step
            )  # any layout; non-tensor state by rule
        if rank == 0:
            (out / "resume.json").write_text(json.dumps(resumed.to_dict()))
    if memory is not None:
        memory.discard_after(first_step - 1)
    publisher = StepPublisher(store, job_id, node, first_step if rank == 0 else None)
    collector = None
    if rank == 0 and not launched:
        (out / TRACE_STREAM).unlink(missing_ok=True)
        collector = TraceCollector(
            StepReader(store, job_id, nodes, first_step, owner=True), out / TRACE_STREAM
        )
        collector.start()
    phase = "stopped"
    boundary = BoundaryStop() if memory is not None else None
    try:
        for step in range(first_step, cfg.train.steps):
            engine.rec.begin_step(step)
            proposal = inbox.poll(step) if inbox else None
            if proposal is not None:
                proposal = {**proposal, "version": engine.plan_version + 1}
            engine.sync_plan(step, proposal)
            result = engine.train_step(step)
            results.append(result)
            if result.loss is not None and engine.dp_rank == 0:
                print(
                    f"step {step} loss {result.loss:.4f} tokens {result.tokens} "
                    f"wall {result.wall_s:.3f}s",
                    file=sys.stderr,
                    flush=True,
                )
            if result.loss is not None and not math.isfinite(result.loss):
                # before any checkpoint of this step: the last one written stays the last good one
                raise NonFiniteLoss(
                    f"non-finite loss ({result.loss}) at step {step}; stopped before "
                    f"checkpointing it (lower --lr, or resume from the last checkpoint)"
                )
            if (
                memory is not None
            ):  # the copy runs beside the next step, fenced before its optimizer step
                with engine.rec.op("snapshot"):
                    memory.after_step(step)
            if (
                cfg.checkpoint.ckpt_every
                and (step + 1) % cfg.checkpoint.ckpt_every == 0
                and not keeper_saves
            ):
                save_checkpoint(engine, cfg, cfg.ckpt_root() / f"step{step}", step)
            engine.injector.before_publish(step)
            publisher.publish(engine.rec.take_new())
            if boundary is not None:
                boundary.check()  # a SIGTERM during the step ends the rank here, its snapshot kept
        if memory is not None:
            memory.finish()
        phase = "done"
    finally:
        if memory is not None:
            memory.close()  # a stopping rank finishes the copy of its last complete step
        with contextlib.suppress(
            Exception
        ):  # what the rank did before it stopped (the store may be gone)
            publisher.publish(engine.rec.take_new())
        heart.finish(phase)
    with engine.rec.waiting("barrier"):
        dist.barrier()  # every rank's last snapshot is complete
    if memory is not None and rank == 0 and not launched:
        memory.drain()  # plain torchrun: no launcher waits for the keeper's last checkpoint
    if aggregator is not None:
        aggregator.stop()
    if rank == 0:
        (out / "plan_changes.json").write_text(json.dumps(engine.plan_changes))
        if collector is not None:
            collector.finish()
            mark_ended(store, job_id, "finished")
            collector.reader.wait_for_followers()
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
    enable_stack_dumps()  # the supervisor asks a rank it judges hung for its stacks
    die_with_parent()  # torchrun's death (even by SIGKILL) takes this worker with it
    if os.getppid() == 1:
        sys.exit(137)
    try:
        run(parse_args(argv))
    except InputError as exc:
        _tell("input", str(exc))
        print(f"resihp: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except (NonFiniteLoss, TierFull) as exc:
        _tell("stop", str(exc))
        print(f"resihp: stop: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    except JoinTimeout as exc:
        print(
            f"resihp: rank {rank}: not every worker joined within the timeout ({exc})",
            file=sys.stderr,
        )
        sys.exit(3)
    except (RuntimeError, dist.DistBackendError) as exc:
        _stop_if_disk_full(exc, rank)
        first = _first_line(exc)
        _tell("lost-peer", first)
        if "waiting for clients" in first:
            print(
                f"resihp: rank {rank}: not every worker joined within the timeout ({first})",
                file=sys.stderr,
            )
            sys.exit(3)
        print(
            f"resihp: rank {rank}: lost contact with a peer at "
            f"{time.strftime('%H:%M:%S')}: {first}",
            file=sys.stderr,
        )
        sys.exit(1)
    except Exception as exc:  # a crash: said over the control plane, the traceback kept in the log
        _stop_if_disk_full(exc, rank)
        _tell("crash", f"{type(exc).__name__}: {_first_line(exc)}")
        traceback.print_exc()
        print(
            f"resihp: rank {rank}: crashed: {type(exc).__name__}: {_first_line(exc)}",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)
    except BaseException as exc:  # DCP wraps a rank's write error in a BaseException
        _stop_if_disk_full(exc, rank)
        raise


def _tell(kind: str, message: str) -> None:
    """A worker's reason to stop, over the control plane when it has joined one."""
    for report in _report:
        with contextlib.suppress(Exception):  # the store may be gone with the job
            report(kind, message)


def _stop_if_disk_full(exc: BaseException, rank: str) -> None:
    """A full disk (however deep in the exception chain) is one line and exit 1."""
    full = disk_full(exc)
    if full is not None:
        line = (
            f"rank {rank}: disk full writing {getattr(full, 'filename', None) or 'its outputs'}"
            f" ({getattr(full, 'strerror', None) or 'No space left on device'}); what was written "
            f"before stays valid"
        )
        _tell("stop", line)
        print(f"resihp: stop: {line}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
