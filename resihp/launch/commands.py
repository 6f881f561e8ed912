"""CLI verbs of the runtime: ``resihp run`` and ``resihp demo``."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from resihp.ckpt.integrity import verify
from resihp.cli_options import tree_from_options, tree_options
from resihp.errors import InputError
from resihp.launch.summary import live_fields, live_loop, replica_fields, run_summary, write_summary
from resihp.launch.warm import CHECKPOINTING, WARM_AGENTS, agent_env
from resihp.progress import progress_bar
from resihp.train.config import RunConfig, check_memory
from resihp.train.nodes import Nodes, check_secret
from resihp.workload.lengths import resolve_source

# Imports inside the verbs are deferred for start-up time: ``resihp`` imports every commands module
# to build its help, and the verbs' work pulls in torch, lightgbm, OR-Tools or matplotlib.


@tree_options(RunConfig)
def run_cmd(
    if_busy: Annotated[
        str,
        typer.Option(
            metavar="fail|subfolder",
            help="When another job holds --out: fail (exit 2) or subfolder "
            "(write into a fresh OUT/<job id>)",
        ),
    ] = "fail",
    tensorboard: Annotated[
        bool,
        typer.Option(
            help="Write step time, tokens/s, events and plan "
            "changes as TensorBoard scalars under OUT/tensorboard "
            "(needs the tensorboard extra)"
        ),
    ] = False,
    nnodes: Annotated[
        int,
        typer.Option(
            help="Nodes in the job (torchrun's option): run this command "
            "once per node, each with the same RESIHP_JOB_SECRET",
            rich_help_panel="Multi-node",
        ),
    ] = 1,
    node_rank: Annotated[
        int,
        typer.Option(
            help="This node's rank, 0..nnodes-1; node 0 hosts the "
            "job's store, runs the live loop and writes the summary",
            rich_help_panel="Multi-node",
        ),
    ] = 0,
    nproc_per_node: Annotated[
        int,
        typer.Option(
            help="Workers on this node (default: dp x pp x tp / nnodes)",
            rich_help_panel="Multi-node",
        ),
    ] = None,
    rdzv_endpoint: Annotated[
        str,
        typer.Option(
            help="HOST:PORT of node 0, where it hosts the job's store (bound to HOST)",
            rich_help_panel="Multi-node",
        ),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the JSON summary")] = False,
    **options: Any,
) -> None:
    """Train the GPT model under DP x PP (x TP) on this machine's CPUs or GPUs, faults injected.

    The options are the run configuration's fields (resihp.train.config.RunConfig), grouped by
    section. The run folder belongs to this job while it runs (a second job into it exits 2);
    SIGTERM or SIGINT stops the workers within a grace period, keeps the trace and summary written
    so far and marks the run resumable in OUT/run.json (exit 143 / 130).
    \f
    Args:
        if_busy: when another job holds --out: fail (exit 2) or subfolder (write into a fresh
            OUT/<job id>).
        tensorboard: write step time, tokens/s, events and plan changes as TensorBoard scalars under
            OUT/tensorboard (needs the tensorboard extra).
        nnodes: nodes in the job (torchrun's option): run this command once per node, each with the
            same RESIHP_JOB_SECRET.
        node_rank: this node's rank, 0..nnodes-1; node 0 hosts the job's store, runs the live loop
            and writes the summary.
        nproc_per_node: workers on this node (default: dp x pp x tp / nnodes).
        rdzv_endpoint: HOST:PORT of node 0, where it hosts the job's store (bound to HOST).
        json_out: print the JSON summary.
        **options: the run configuration's fields (``RunConfig``), by their flags.
    """
    if if_busy not in ("fail", "subfolder"):
        raise InputError(f"--if-busy: expected fail or subfolder, got {if_busy!r}")
    cfg = tree_from_options(RunConfig, options)
    world = cfg.dims().world_size
    if nnodes < 1 or (nproc_per_node is None and world % nnodes):
        raise InputError(
            f"--nnodes {nnodes}: expected a positive divisor of the world size {world} "
            "(or give --nproc-per-node)"
        )
    nodes = Nodes(nnodes, node_rank, nproc_per_node or world // nnodes, rdzv_endpoint)
    nodes.check(world)
    check_secret(nodes)
    check_memory(cfg, nodes.nproc_per_node)
    resolve_source(
        cfg.data.source, "--source"
    )  # before the run folder is taken: bad input changes nothing
    with _warm_agents(cfg):
        _run(cfg, nodes, if_busy, tensorboard, json_out)


def _run(cfg: RunConfig, nodes: Nodes, if_busy: str, tensorboard: bool, json_out: bool) -> None:
    from resihp.launch.recovery import NODE0_FINISHED, LaunchResult, follow_relaunches, recover
    from resihp.launch.supervisor import supervise
    from resihp.model.attention import check_attention
    from resihp.train.engine_snapshots import start_keeper
    from resihp.train.lifecycle import RunFolder

    nnodes, node_rank = nodes.nnodes, nodes.node_rank
    if cfg.checkpoint.resume is not None:
        cfg = cfg.updated(resume=str(_resume_source(Path(cfg.checkpoint.resume), cfg.train.steps)))
    gpus = cfg.device == "cuda" or (cfg.device == "auto" and _cuda_available())
    cfg = cfg.updated(recovery=cfg.resolved_recovery(nnodes, gpus))
    out, steps = Path(cfg.out), cfg.train.steps
    replicas = cfg.faults.recovery.startswith("replica")
    if nnodes > 1 and cfg.checkpoint.ckpt_every and not cfg.checkpoint.ckpt_dir:
        raise InputError(
            f"--ckpt-every on {nnodes} nodes: expected --ckpt-dir DIR, one folder every node "
            "writes to (a shared filesystem); each node's own OUT/ckpt holds only its ranks' shards"
        )
    if gpus:
        _check_gpus(cfg, nodes.nproc_per_node)
    check_attention(cfg.model.attention, "cuda" if gpus else "cpu")
    with RunFolder(out).acquire(if_busy) as folder:
        out = folder.out
        folder.retire_previous()
        cfg = replace(cfg, out=str(out), job_id=folder.job_id)
        folder.record(state="running", model_hash=cfg.model_hash(), started=time.time())
        loop = live_loop(cfg) if node_rank == 0 else None
        keeper = start_keeper(
            cfg, node_rank
        )  # the memory tier's keeper (--snapshot-every), restarted if it dies
        with progress_bar("training", steps, enabled=not json_out) as advance:
            if replicas:
                from resihp.launch.replicas import supervise_replicas

                outcome = supervise_replicas(
                    cfg,
                    on_step=lambda s: advance(s + 1),
                    on_steps=loop.on_steps if loop else None,
                    nodes=nodes,
                )
            else:
                outcome = supervise(
                    cfg,
                    on_step=lambda s: advance(s + 1),
                    on_steps=loop.on_steps if loop else None,
                    nodes=nodes,
                    on_poll=keeper,
                )
        if outcome.input_error:
            folder.record(state="failed", error=outcome.error)
            raise InputError(outcome.error)
        if (
            node_rank != 0 and cfg.faults.recovery == "restart"
        ):  # node 0 may relaunch the job in place
            outcome, nodes = follow_relaunches(cfg, outcome, nodes, reformed=False)
        elif (
            node_rank != 0
            and cfg.checkpoint.ckpt_every
            and not cfg.snapshot_interval()
            and not replicas
        ):
            outcome, nodes = follow_relaunches(
                cfg, outcome, nodes, reformed=True
            )  # node 0 may re-form it
        if node_rank != 0:  # node 0 writes the job's summary; this node says how its part ended
            if replicas:
                from resihp.launch.replica_launch import node_replicas, replica_ranks

                ranks = sorted(r for d in node_replicas(cfg, nodes) for r in replica_ranks(cfg)[d])
            else:
                ranks = nodes.ranks
            summary = {
                "node_rank": node_rank,
                "nnodes": nnodes,
                "ranks": ranks,
                "error": None if outcome.error == NODE0_FINISHED else outcome.error,
            }
            outcome.error = summary["error"]
            # the job's checkpoints carry node 0's job id (this node's run folder has its own)
            _finish(folder, cfg, outcome, summary, job_id=outcome.job_id)
            if json_out:
                print(json.dumps(summary))
            if outcome.error:
                print(f"resihp: {outcome.error}", file=sys.stderr)
                raise typer.Exit(1)
            return
        summary = run_summary(cfg, outcome)
        if replicas:
            replica_fields(out, outcome, summary)
        if outcome.control_plane is not None:
            summary["control_plane"] = {
                **outcome.control_plane,
                "lag_s": loop.lag_summary() if loop is not None else None,
            }
        from resihp.launch.report import oversubscription  # deferred: torch (start-up time)

        summary.update(
            oversubscription(cfg.dims().world_size, "cuda" if cfg.device == "cuda" else "cpu")
        )
        if loop is not None and not outcome.interrupted:
            summary.update(live_fields(cfg, loop, summary))
            write_summary(out, summary)
        ended = recover(LaunchResult(cfg, outcome, summary, nodes, json_out, keeper))
        summary, outcome = ended.summary, ended.outcome
        _finish(folder, cfg, outcome, summary)
        if tensorboard:
            from resihp.train.metrics import write_run  # deferred: tensorboard, an optional extra

            write_run(out, summary)
    if json_out:
        print(json.dumps(summary))
    else:
        _print_human(summary)
    if outcome.error:
        print(f"resihp: {outcome.error}", file=sys.stderr)
        signum = getattr(signal, outcome.interrupted or "", None)
        raise typer.Exit(128 + int(signum) if signum else 1)


@contextlib.contextmanager
def _warm_agents(cfg: RunConfig) -> Iterator[None]:
    """The warm-agent server for the run's launches where its agents fork their workers, started
    now so that its imports and this process's overlap; its agents ended on the way out."""
    if _forks_agents(cfg):
        WARM_AGENTS.start(agent_env(), CHECKPOINTING if cfg.checkpointing() else ())
    try:
        yield
    finally:
        WARM_AGENTS.close()


def _forks_agents(cfg: RunConfig) -> bool:
    """Whether the run's agents fork their workers (a CPU run on a machine with no GPU,
    ``launch.forks_workers``), told here without importing torch."""
    return cfg.device != "cuda" and not Path("/dev/nvidiactl").exists()


def _cuda_available() -> bool:
    import torch  # deferred for start-up time (the live loop imports it anyway)

    return torch.cuda.is_available()


def _check_gpus(cfg: RunConfig, nproc_per_node: int) -> None:
    """NCCL refuses two ranks of one group on one GPU: each rank of a node needs a GPU of its own,
    except that replicas (``--recovery replica``) may share GPUs, since their sums go over gloo."""
    import torch  # deferred, as above

    replicas = cfg.faults.recovery.startswith("replica")
    need = cfg.parallel.pp * cfg.parallel.tp if replicas else nproc_per_node
    have = torch.cuda.device_count()
    if need > have:
        raise InputError(
            f"--device cuda: {need} ranks {'per replica' if replicas else 'on this node'} "
            f"need a GPU each (NCCL), this node has {have}"
            + (
                ""
                if replicas or cfg.parallel.dp < 2
                else "; --recovery replica lets replicas share GPUs"
            )
        )


def _resume_source(path: Path, steps: int) -> Path:
    """The checkpoint ``--resume`` names (a run folder: its newest that verifies), checked up
    front."""
    from resihp.ckpt.universal import read_meta, resolve  # deferred: torch.distributed.checkpoint

    source = resolve(path).resolve()
    step = read_meta(source)["step"]
    verify(source)  # before any worker reads a byte of it
    if step + 1 >= steps:
        raise InputError(
            f"--steps {steps}: the checkpoint {source} is at step {step}; --steps is the run's "
            f"total step count, so give more than {step + 1}"
        )
    return source


def _finish(folder, cfg, outcome, summary: dict, job_id: str | None = None) -> None:
    """Record how the job ended in OUT/run.json (and the summary): done, failed, or interrupted
    with the checkpoint of this job (``job_id``, else ``cfg``'s) it can resume from."""
    from resihp.ckpt.integrity import newest_good
    from resihp.train.engine_snapshots import stop_keepers

    state = "interrupted" if outcome.interrupted else "failed" if outcome.error else "done"
    # the job is over: checkpoints owed written, memory tiers gone
    lost = stop_keepers(cfg, breakpoint=state != "done")
    if (
        lost is not None
    ):  # a checkpoint the keeper could not write (a full disk): never a silent "done"
        good, _ = newest_good(cfg.ckpt_root(), job_id or cfg.job_id, cfg.model_hash())
        why = "disk full" if lost.get("disk_full") else "failed"
        said = (
            f"checkpoint of step {lost.get('step')} not written ({why}: {lost.get('error')}); "
            f"newest good checkpoint: {good if good else 'none'}"
        )
        outcome.error = f"{outcome.error}; {said}" if outcome.error else said
        state = "interrupted" if outcome.interrupted else "failed"
    fields: dict = {"state": state, "ended": time.time(), "error": outcome.error}
    if state != "done":  # the newest good checkpoint of this job is where it can go on from
        ckpt, _ = newest_good(cfg.ckpt_root(), job_id or cfg.job_id, cfg.model_hash())
        fields["resumable"] = summary["resumable"] = {
            "checkpoint": str(ckpt) if ckpt else None,
            "next_step": int(ckpt.name.removeprefix("step")) + 1 if ckpt else 0,
        }
        if outcome.interrupted:
            summary["interrupted"] = outcome.interrupted
        write_summary(folder.out, summary)
    folder.record(**fields)


def demo_cmd(
    out: Annotated[Path, typer.Option("-o", "--out", help="Run folder")] = Path("runs/demo"),
    steps: Annotated[
        int, typer.Option(help="Training steps (default: the fault's step + 20)")
    ] = None,
    inject: Annotated[
        str,
        typer.Option(
            help="The fault to inject, slow:rank=R,factor=F,step=S "
            "(default: rank 1, x3, 4 steps after the detector's "
            "calibration)"
        ),
    ] = None,
    plot: Annotated[
        Path, typer.Option(help="Plot of throughput per step (default OUT/demo.png)")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the JSON summary")] = False,
) -> None:
    """4 CPU processes (DP 2 x PP 2) train with a fail-slow injected, found and planned around live.

    The live detector finds it, the planner re-plans and the job applies the new plan while it
    keeps training.
    \f
    Args:
        out: run folder.
        steps: training steps (default: the fault's step + 20).
        inject: the fault to inject, slow:rank=R,factor=F,step=S (default: rank 1, x3, 4 steps after
            the detector's calibration).
        plot: plot of throughput per step (default OUT/demo.png).
        json_out: print the JSON summary.
    """
    with _warm_agents(RunConfig()):  # the demo trains on the default device
        _demo(out, steps, inject, plot, json_out)


def _demo(
    out: Path, steps: int | None, inject: str | None, plot: Path | None, json_out: bool
) -> None:
    from resihp.detect.config import DetectorConfig
    from resihp.launch.demo import RunFailed, run_demo
    from resihp.train.inject import parse_fault

    inject = inject or f"slow:rank=1,factor=3,step={DetectorConfig().calibration_steps + 4}"
    steps = steps or (parse_fault(inject).step or 0) + 20
    from resihp.train.lifecycle import RunFolder

    with (
        RunFolder(out).acquire() as folder,
        progress_bar("demo", steps, enabled=not json_out) as advance,
    ):
        folder.record(state="running", started=time.time())
        try:
            summary = run_demo(
                out, steps, inject, plot, on_step=lambda s: advance(s + 1), job_id=folder.job_id
            )
        except RunFailed as exc:
            folder.record(state="failed", error=str(exc), ended=time.time())
            print(f"resihp: {exc}", file=sys.stderr)
            raise typer.Exit(1) from None
        folder.record(state="done", ended=time.time())
    if json_out:
        print(json.dumps(summary))
        return
    b, d, a = (summary[f"tokens_per_s_{k}"] for k in ("before", "during", "after"))
    print(f"fault: {inject}")
    print(
        f"detected at step {summary['detected_step']} "
        f"(delay {summary['detection_delay_steps']} steps)"
    )
    for c in summary["plan_changes"]:
        print(
            f"plan change at step {c['applied_step']}: dp_weights {c.get('dp_weights')} "
            f"layer_splits {c.get('layer_splits')} (applied: {c['applied']}, solved in "
            f"{c['solve_s']} s)"
        )
    fmt = lambda v: f"{v:.0f}" if v else "-"  # noqa: E731
    rf = summary["recovered_fraction"]
    print(
        f"tokens/s before {fmt(b)}  during {fmt(d)}  after {fmt(a)}; recovered fraction "
        + (f"{rf:.2f}" if rf else "-")
    )
    print(f"plot {summary['plot']}  summary {out / 'demo.json'}  trace {out / 'ops.parquet'}")


def _print_human(summary: dict) -> None:
    tps = summary.get("tokens_per_s")
    print(
        f"steps {summary.get('steps')}  dp {summary.get('dp')} pp {summary.get('pp')} "
        f"tp {summary.get('tp')}  tokens/s {tps:.0f}"
        if tps
        else f"steps {summary.get('steps')}"
    )
    if summary.get("loss_first") is not None:
        last = summary.get("loss_last")
        print(
            f"loss {summary['loss_first']:.4f} -> "
            + (f"{last:.4f}" if last is not None else "not finite")
        )
    print(f"trace {summary.get('trace')}  meta {summary.get('meta')}")
    if summary.get("oversubscribed"):
        print(f"note: {summary['oversubscribed_note']}")


ckpt_app = typer.Typer(help="Universal (reshardable) checkpoints.", no_args_is_help=True)


@ckpt_app.command("inspect")
def ckpt_inspect_cmd(
    directory: Annotated[
        Path,
        typer.Argument(
            help="A checkpoint folder (OUT/ckpt/stepN), a run "
            "folder (its newest checkpoint that verifies, and its "
            "job's memory tier while it has one), or a memory tier "
            "(/dev/shm/resihp-<job>-n<node>)"
        ),
    ],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
) -> None:
    """Verify a checkpoint against its manifest and show what it holds.

    One line says what is wrong if it does not verify; else its step, the layout and job that wrote
    it, its layers and tensors; and the memory tier's snapshot slots (each one's rank, step, holder
    and whether its bytes match its checksums)."""
    from resihp.ckpt.keeper import find_tiers, inspect_tier
    from resihp.ckpt.universal import inspect

    memory = [inspect_tier(t) for t in find_tiers(directory)]
    try:
        info = inspect(directory)
    except InputError:
        if not memory:
            raise
        info = {}
    if memory:
        info["memory"] = memory
    if json_out:
        print(json.dumps(info))
        return
    for tier in memory:
        print(
            f"{tier['dir']}: keeper {tier['keeper_pid'] or 'not running'}; pending "
            f"{tier['pending'] or '-'}"
        )
        for s in tier["slots"]:
            print(
                f"  rank {s['rank']} slot {s['slot']}: step {s['step']}, held by rank "
                f"{s['holder']}, {s['bytes'] / 2**20:.1f} MiB, {s['tensors']} tensors, "
                + ("checksums match" if s["verified"] else "CHECKSUM MISMATCH")
            )
    if "meta" not in info:
        return
    meta = info["meta"]
    print(
        f"{directory}: step {meta.get('step')}, written by dp {meta.get('dp')} pp {meta.get('pp')} "
        f"tp {meta.get('tp')} (job {meta.get('job_id') or '-'}); {info['tensors']} tensors; layers "
        f"{info['layers']}; every file matches its manifest"
    )


@ckpt_app.command("convert")
def ckpt_convert_cmd(
    src: Annotated[Path, typer.Argument(help="A checkpoint folder")],
    dst: Annotated[
        Path,
        typer.Argument(
            help="Where to write: a folder (a tp-1 checkpoint any resihp "
            "layout loads), or one consolidated file NAME.pt / "
            "NAME.safetensors for use outside resihp"
        ),
    ],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
) -> None:
    """Every tensor as one whole tensor in the model's own shape, in a folder or one file.

    A tp-1 checkpoint folder, or one consolidated .pt / .safetensors file (checkpoints load into
    any layout without this).
    \f
    Args:
        src: a checkpoint folder.
        dst: where to write: a folder (a tp-1 checkpoint any resihp layout loads), or one
            consolidated file NAME.pt / NAME.safetensors for use outside resihp.
        json_out: print JSON.
    """
    from resihp.ckpt.universal import convert

    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise InputError(
            f"{dst}: destination exists" + (" and is not empty" if dst.is_dir() else "")
        )
    result = convert(src, dst)
    print(
        json.dumps(result)
        if json_out
        else (
            f"{dst}: {result['tensors']} tensors "
            f"({result['joined']} joined from tensor-parallel shards)"
        )
    )


def replicas_cmd(
    script: Annotated[
        Path, typer.Argument(help="The training script (it uses resihp.train.Replicas)")
    ],
    args: Annotated[list[str] | None, typer.Argument(help="The script's arguments")] = None,
    replicas: Annotated[int, typer.Option(help="Data-parallel replicas, one torchrun each")] = 2,
    nproc_per_replica: Annotated[int, typer.Option(help="Ranks of each replica")] = 1,
    max_restarts: Annotated[
        int, typer.Option(help="Relaunches per replica; one lost more often is left out")
    ] = 3,
    timeout_s: Annotated[
        float, typer.Option("--timeout-s", help="The quorum's and the groups' timeout (s)")
    ] = 60.0,
    stopped_s: Annotated[
        float,
        typer.Option("--stopped-s", help="Seconds a replica's process may stay stopped (SIGSTOP)"),
    ] = 5.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the outcome as JSON")] = False,
) -> None:
    """Run your own training script with replica-level fault tolerance.

    One torchrun per data-parallel replica on a job store on 127.0.0.1; a lost replica is
    relaunched alone and catches up from a live peer while the others train on.
    \f
    Args:
        script: the training script (it uses ``resihp.train.Replicas``).
        args: the script's arguments.
        replicas: data-parallel replicas, one torchrun each.
        nproc_per_replica: ranks of each replica.
        max_restarts: relaunches per replica.
        timeout_s: the quorum's and the groups' timeout in seconds.
        stopped_s: seconds a replica's process may stay stopped before the replica is lost.
        json_out: print the outcome as JSON.
    """
    from resihp.launch.user_replicas import run_user_replicas  # deferred: torch, for start-up time

    if stopped_s <= 0 or timeout_s <= 0:
        raise InputError(
            f"--stopped-s {stopped_s:g} --timeout-s {timeout_s:g}: expected seconds > 0"
        )
    outcome = run_user_replicas(
        script,
        list(args or []),
        replicas,
        nproc_per_replica,
        max_restarts,
        timeout_s,
        stopped_s=stopped_s,
    )
    if json_out:
        print(json.dumps(outcome.__dict__))
    if outcome.error:
        print(f"resihp: error: {outcome.error}", file=sys.stderr)
    raise typer.Exit(outcome.returncode)


def register(app: typer.Typer) -> None:
    app.command("run")(run_cmd)
    app.command(
        "replicas",
        context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    )(replicas_cmd)
    app.command("demo")(demo_cmd)
    app.add_typer(ckpt_app, name="ckpt")
