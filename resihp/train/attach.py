"""``resihp.attach``: instrument a user's own training loop in a few lines, without touching the
model.

    mon = resihp.attach(model, optimizer=opt, out="runs/myjob")
    for batch in loader:
        with mon.step(seq_lens=batch.seq_lens):
            loss = model(batch.x).loss; loss.backward(); opt.step(); opt.zero_grad()
    mon.close()

Forward and module-output hooks time each forward (one micro-batch per forward call); the backward
runs from the first gradient reaching the module's output to the last parameter gradient
accumulated; optimizer hooks time ``optimizer.step``. Under torchrun, rows and heartbeats go over
the job's control plane, as the built-in engine's (``resihp.train.controlplane``, on torchrun's
agent store: nothing shared between nodes but the network; rank 0 writes the run folder, local
rank 0 of each node aggregates its node's heartbeats, ``resihp follow --store`` follows it from
any machine); in a process started otherwise, rows go to a per-rank JSON-lines stream in ``out``.

Detection runs either beside the job (``resihp follow OUT``, or ``resihp detect OUT`` afterwards)
or, with ``detect=True``, in a thread of rank 0 (``resihp.train.follow.Follower``): then
``monitor.report()`` gives the current stragglers, ``on_event`` is called with each finding, and
``on_fault`` acts on a device fault at the next step boundary on every rank alike ("stop" raises
``DeviceFault`` out of ``monitor.step``; a callable, e.g. one saving a checkpoint, is called with
the event). attach records and detects; it does not re-plan the user's job (``resihp run`` does).
Records go to the ``resihp`` logger (``OUT/logs/rank<R>.log``, rank-prefixed lines on stderr).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from resihp.detect.config import DetectorConfig
from resihp.detect.events import DEVICE_FAULTS
from resihp.detect.heartbeat import HeartbeatSender, NodeAggregator
from resihp.errors import InputError
from resihp.opstrace import TRACE_STREAM, JobMeta, validate_ops_trace, write_meta, write_ops_trace
from resihp.train import logs
from resihp.train.controlplane import (
    StepPublisher,
    StepReader,
    announce_job,
    append_steps,
    heartbeat_prefix,
    mark_ended,
    node_ranks,
)
from resihp.train.follow import Follower
from resihp.train.gpu_timing import EventTimer
from resihp.train.metrics import Metrics
from resihp.train.recorder import OpRecorder

log = logging.getLogger("resihp.attach")


class DeviceFault(RuntimeError):
    """Raised out of ``monitor.step`` on every rank when a device fault is found.

    Only with ``on_fault="stop"``; ``event`` is the finding (the DESIGN event JSON)."""

    def __init__(self, event: dict) -> None:
        super().__init__(
            f"resihp: {event['kind']} on rank {event.get('rank')} (x{event['slowdown']:.2f}"
            f" from step {event['onset_step']}); stopping as asked (on_fault='stop')"
        )
        self.event = event


def _dist_rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _accounted(method):
    def wrapper(self, *args):
        t0 = time.perf_counter()
        method(self, *args)
        self.self_s += time.perf_counter() - t0

    return wrapper


GPU_TIMINGS = ("events", "sync")


class Monitor:
    def __init__(
        self,
        model: nn.Module,
        out: Path,
        optimizer: torch.optim.Optimizer | None,
        rank: int,
        dp_rank: int,
        stage: int,
        tp_rank: int,
        heartbeat_s: float,
        gpu_timing: str = "events",
    ) -> None:
        on_gpu = next(model.parameters()).is_cuda
        # on a GPU, CUDA events (durations read a step later) unless synchronising is asked for
        self.events = EventTimer() if on_gpu and gpu_timing == "events" else None
        sync = torch.cuda.synchronize if on_gpu and self.events is None else None
        self.follower: Follower | None = None
        self.on_fault: str | Callable[[dict], None] | None = None
        self.metrics: Metrics | None = None
        self._group = None
        self._handled = 0  # device faults acted on
        self._step_t0: float | None = None
        self.rec = OpRecorder(rank, dp_rank, stage, tp_rank)
        self._sync = sync or (lambda: None)
        self.out = out
        (out / "ranks").mkdir(parents=True, exist_ok=True)
        self.stream = out / "ranks" / f"rank{rank}.jsonl"
        self.stream.unlink(missing_ok=True)
        (out / "ranks" / f"rank{rank}.done").unlink(missing_ok=True)
        self.plane = _ControlPlane.join(self.rec, rank, heartbeat_s)
        self._step = -1
        self._mb = 0
        self._seq_lens: list[Sequence[int] | None] = []
        # optype -> (start_ts, clock: perf_counter seconds or a CUDA event, mb)
        self._open: dict[str, tuple[float, float | torch.cuda.Event, int]] = {}
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._grads_left = 0
        self._tokens: dict[int, int | None] = {}  # step -> tokens, for steps timed by events
        self.self_s = 0.0  # time spent in resihp's own code, for the overhead benchmark
        self._handles = [
            model.register_forward_pre_hook(self._fwd_start),
            model.register_forward_hook(self._fwd_end),
            *[p.register_post_accumulate_grad_hook(self._grad_done) for p in self._params],
        ]
        if optimizer is not None:
            self._handles += [
                optimizer.register_step_pre_hook(self._opt_start),
                optimizer.register_step_post_hook(self._opt_end),
            ]

    # --- hooks ----------------------------------------------------------------------------------
    def _begin(self, optype: str, mb: int = -1) -> None:
        self._sync()
        clock = self.events.mark() if self.events is not None else time.perf_counter()
        self._open[optype] = (time.time(), clock, mb)

    def _end(self, optype: str) -> None:
        if optype not in self._open or self._step < 0:
            return
        self._sync()
        start_ts, clock, mb = self._open.pop(optype)
        seq_lens = self._seq_lens[mb] if 0 <= mb < len(self._seq_lens) else None
        row = {
            "step": self._step,
            **self.rec.ids,
            "optype": optype,
            "start_ts": start_ts,
            "duration": None,
            "seq_id": self.rec._seq[optype],
            "mb_id": mb if mb >= 0 else None,
            "seq_lens": list(seq_lens) if seq_lens else None,
            "tokens": int(sum(seq_lens)) if seq_lens else None,
            "loss": None,
        }
        self.rec._seq[optype] += 1
        if self.events is not None:
            self.events.stop(self._step, row, clock)
        else:
            row["duration"] = time.perf_counter() - clock
            self.rec.rows.append(row)

    @_accounted
    def _fwd_start(self, module, args) -> None:
        self._begin("forward-compute", self._mb)

    @_accounted
    def _fwd_end(self, module, args, output) -> None:
        self._end("forward-compute")
        self._mb += 1
        out = _first_grad_tensor(output)
        if out is not None:  # the module's backward starts when its output's gradient arrives
            out.register_hook(self._bwd_start)

    @_accounted
    def _bwd_start(self, grad: torch.Tensor) -> None:
        if "backward-compute" not in self._open:
            self._begin("backward-compute", self._mb - 1)
            self._grads_left = len(self._params)

    @_accounted
    def _grad_done(self, param) -> None:
        self._grads_left -= 1
        if self._grads_left == 0:
            self._end("backward-compute")

    def _opt_start(self, optimizer, args, kwargs) -> None:
        self.optimizer_step_begins()

    def _opt_end(self, optimizer, args, kwargs) -> None:
        self.optimizer_step_ends()

    @_accounted
    def optimizer_step_begins(self) -> None:
        """Mark the start of the optimizer's update.

        The optimizer's hooks call this; frameworks that run the forward and backward inside
        ``optimizer.step(closure)``, like Lightning, call it after the closure."""
        self._end("backward-compute")  # parameters the backward did not reach
        self._begin("optimizer")

    @_accounted
    def optimizer_step_ends(self) -> None:
        self._end("optimizer")

    # --- public ---------------------------------------------------------------------------------
    @contextmanager
    def step(
        self,
        seq_lens: Sequence[int] | Sequence[Sequence[int]] | None = None,
        step: int | None = None,
    ) -> Iterator[None]:
        """Time one training step (a context manager around its forward, backward and update).

        Args:
            seq_lens: the packed sequence lengths of the step's micro-batch, or a list of them, one
                per forward call (gradient accumulation); None: no lengths recorded.
            step: the step's number (default: the previous step's plus one).
        """
        if self.on_fault is not None:
            self._act_on_faults()
        t0 = time.perf_counter()
        self._step = self._step + 1 if step is None else step
        self.rec.begin_step(self._step)
        if seq_lens is not None and len(seq_lens) and not isinstance(seq_lens[0], (list, tuple)):
            seq_lens = [seq_lens]
        self._seq_lens = [list(map(int, s)) for s in seq_lens] if seq_lens is not None else []
        self._mb = 0
        tokens = sum(sum(s) for s in self._seq_lens) or None
        self.self_s += time.perf_counter() - t0
        if self.events is not None:
            self._open["step"] = (time.time(), self.events.mark(), -1)
            self._tokens[self._step] = tokens
            yield
            self._end("backward-compute")
            self._end("step")
            t0 = time.perf_counter()
            self._take_timed(self._step)  # the earlier steps' rows, complete on the device by now
        else:
            with self.rec.op("step", tokens=tokens) as row:
                yield
                self._end("backward-compute")
            t0 = time.perf_counter()
            if self.metrics is not None:
                self.metrics.step(self._step, row.get("duration"), tokens)
            log.debug("step %d: %.4f s, %s tokens", self._step, row.get("duration", 0.0), tokens)
        if self.plane is not None:
            self.plane.publisher.publish(self.rec.take_new())
            self.plane.collect(
                self.out
            )  # rank 0: the steps every rank finished, into the run folder
        else:
            self.rec.flush(self.stream)
        self.self_s += time.perf_counter() - t0

    def _take_timed(self, before_step: int | None) -> None:
        """Rows timed by CUDA events whose steps (before ``before_step``; all with None) have
        completed on the device, into the recorder in order; a step row closes each step."""
        for row in self.events.completed(before_step):
            if row["optype"] == "step":
                row["tokens"] = self._tokens.pop(row["step"], None)
                self.rec.finished += 1
                if self.metrics is not None:
                    self.metrics.step(row["step"], row["duration"], row["tokens"])
                log.debug("step %d: %.4f s, %s tokens", row["step"], row["duration"], row["tokens"])
            self.rec.rows.append(row)

    def note_lengths(self, seq_lens: Sequence[int]) -> None:
        """Record the sequence lengths of the next forward call's micro-batch.

        For loops that do not pass them to ``step`` (integrations read them from the batch in a
        forward pre-hook)."""
        self._seq_lens.append([int(x) for x in seq_lens])

    def report(self) -> dict:
        """What the in-process detector holds now (``detect=True``, rank 0).

        ``stragglers`` (device faults still open: rank, kind, slowdown, onset_step, detected_step,
        phase), every ``event``, ``steps`` judged and each rank's ``noise`` with its smallest
        detectable slowdown. Elsewhere: an empty report saying why."""
        if self.follower is None:
            why = (
                "detection runs on rank 0"
                if self.rec.ids["rank"] != 0
                else "attach(..., detect=True) runs the detector in the job; or run resihp follow "
                f"{self.out} beside it"
            )
            return {"stragglers": [], "events": [], "steps": 0, "noise": {}, "note": why}
        return self.follower.report()

    def _act_on_faults(self) -> None:
        """At a step boundary: the device faults found since the last one, the same on every rank
        (rank 0's detector decides; a gloo broadcast carries it)."""
        new = None
        if self.follower is not None:
            faults = [e for e in self.follower.report()["events"] if e["kind"] in DEVICE_FAULTS]
            new = faults[self._handled] if len(faults) > self._handled else None
        if self._group is not None:
            box = [new]
            dist.broadcast_object_list(box, src=0, group=self._group)
            new = box[0]
        if new is None:
            return
        self._handled += 1
        log.warning(
            "acting on %s of rank %s (on_fault=%s)",
            new["kind"],
            new.get("rank"),
            "stop" if self.on_fault == "stop" else getattr(self.on_fault, "__name__", "callable"),
        )
        if self.on_fault == "stop":
            raise DeviceFault(new)
        self.on_fault(new)

    def trace(self) -> pd.DataFrame:
        """Everything recorded so far; also written to ``OUT/ops.parquet`` by ``close``."""
        return validate_ops_trace(self.rec.frame(), source=str(self.stream))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        if self.events is not None:
            self._take_timed(None)
        if self.plane is not None:
            self.plane.close(self.rec.take_new(), self.out)
        else:
            self.rec.flush(self.stream)
            (self.out / "ranks" / f"rank{self.rec.ids['rank']}.done").touch()  # for resihp follow
        if self.rec.rows:
            write_ops_trace(self.trace(), self.out / f"ops.rank{self.rec.ids['rank']}.parquet")
        if self.follower is not None:
            self.follower.stop()
            report = self.follower.report()
            (self.out / "live.json").write_text(json.dumps(report, indent=1, default=str))
            stragglers = report["stragglers"]
            log.info(
                "detector: %d step(s) judged, %d event(s), %d straggler(s) now%s",
                report["steps"],
                len(report["events"]),
                len(stragglers),
                "".join(
                    f"; rank {s['rank']} x{s['slowdown']:.2f} from step {s['onset_step']}"
                    for s in stragglers
                ),
            )
        if self.metrics is not None:
            self.metrics.close()
        logs.close()


class _ControlPlane:
    """attach's part of the job's control plane under torchrun (its agent store): this rank's
    heartbeat and step records; local rank 0's node aggregator; rank 0's trace collector."""

    def __init__(self, store, job_id: str, rec: OpRecorder, rank: int, heartbeat_s: float) -> None:
        node, per_node = (
            int(os.environ.get("GROUP_RANK", 0)),
            int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        )
        world = int(os.environ.get("WORLD_SIZE", 1))
        self.store, self.job_id, self.rank = store, job_id, rank
        self.nodes = node_ranks(max(1, world // per_node), per_node)
        hb = heartbeat_prefix(job_id)
        self.heart = HeartbeatSender(
            store, rank, node, heartbeat_s, prefix=hb, progress=lambda: rec.progress("train")
        ).start()
        self.aggregator = (
            NodeAggregator(
                store, node, self.nodes.get(node, [rank]), heartbeat_s, prefix=hb
            ).start()
            if int(os.environ.get("LOCAL_RANK", 0)) == 0
            else None
        )
        self.publisher = StepPublisher(store, job_id, node, 0 if rank == 0 else None)
        self.collector: StepReader | None = None

    @classmethod
    def join(cls, rec: OpRecorder, rank: int, heartbeat_s: float) -> _ControlPlane | None:
        """Under torchrun (its agent store is the job's), else None (no store to join)."""
        if (
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or "MASTER_PORT" not in os.environ
        ):
            return None
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=60),
        )
        return cls(store, os.environ.get("TORCHELASTIC_RUN_ID", "job"), rec, rank, heartbeat_s)

    def lead(self, out: Path, meta: dict) -> None:
        """Rank 0: announce the job (``resihp follow --store``) and collect the trace into
        ``out``."""
        announce_job(self.store, self.job_id, None, len(self.nodes), len(self.nodes[0]), meta=meta)
        endpoint = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        (out / "controlplane.json").write_text(
            json.dumps({"store": endpoint, "job_id": self.job_id})
        )
        log.info(
            "control plane on torchrun's store %s: resihp follow --store %s", endpoint, endpoint
        )
        (out / TRACE_STREAM).unlink(missing_ok=True)
        self.collector = StepReader(self.store, self.job_id, self.nodes, 0, owner=True)

    def collect(self, out: Path) -> None:
        if self.collector is not None:
            append_steps(out / TRACE_STREAM, self.collector.complete_steps())

    def close(self, rows: list[dict], out: Path) -> None:
        self.publisher.publish(rows)
        self.heart.finish("done")
        if self.collector is not None:
            end = time.monotonic() + 30  # the other ranks' last steps
            while time.monotonic() < end:
                self.collect(out)
                if self._all_done():
                    self.collect(out)
                    break
                time.sleep(0.1)
            for ranks in self.nodes.values():  # for resihp follow on the run folder
                for r in ranks:
                    (out / "ranks" / f"rank{r}.done").touch()
            mark_ended(self.store, self.job_id, "finished")
            self.collector.wait_for_followers()
        if self.aggregator is not None:
            self.aggregator.stop()

    def _all_done(self) -> bool:
        keys = [
            f"{heartbeat_prefix(self.job_id)}/n{n}/r{r}" for n, rs in self.nodes.items() for r in rs
        ]
        if not self.store.check(keys):
            return False
        return all(json.loads(v)["phase"] == "done" for v in self.store.multi_get(keys))


def _first_grad_tensor(output: object) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, dict) else output
    if isinstance(values, (list, tuple)) or hasattr(values, "__iter__"):
        for value in values:
            found = (
                _first_grad_tensor(value)
                if isinstance(value, (torch.Tensor, list, tuple, dict))
                else None
            )
            if found is not None:
                return found
    return None


def attach(
    model: nn.Module,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    out: str | Path = "runs/attached",
    rank: int | None = None,
    dp_rank: int | None = None,
    stage: int = 0,
    tp_rank: int = 0,
    dp_size: int | None = None,
    pp_size: int = 1,
    tp_size: int = 1,
    heartbeat_s: float = 0.5,
    detect: bool = False,
    on_event: Callable[[dict], None] | None = None,
    on_fault: str | Callable[[dict], None] | None = None,
    detector_config: DetectorConfig | None = None,
    tensorboard: bool = False,
    log_level: int | str = logging.INFO,
    gpu_timing: str = "events",
    **meta: object,
) -> Monitor:
    """Start recording ``model``'s per-op timings into ``out``.

    Each rank writes its ops-trace rows and heartbeats, rank 0 the job meta. Ranks default to
    torch.distributed's (or ``RANK``/``WORLD_SIZE``); with no other hint every rank is its own
    data-parallel replica.

    Args:
        model: the module whose forward and backward are timed.
        optimizer: the optimizer whose ``step`` is timed as the ``optimizer`` op (None: no hooks;
            the loop may call ``optimizer_step_begins`` and ``optimizer_step_ends`` itself).
        out: the run folder the trace, ``job.yaml`` and logs go to.
        rank: this process's global rank (default: torch.distributed's, else ``RANK``).
        dp_rank: this rank's data-parallel replica (default: ``rank``).
        stage: this rank's pipeline stage.
        tp_rank: this rank's index in its tensor-parallel group.
        dp_size: data-parallel replicas (default: world size / (``pp_size`` x ``tp_size``)).
        pp_size: pipeline stages.
        tp_size: tensor-parallel group size.
        heartbeat_s: seconds between heartbeats.
        detect: run the detector in a thread of rank 0 (``monitor.report()``, ``on_event``).
        on_event: called on rank 0 with each event (the DESIGN event JSON) the detector finds.
        on_fault: ``"stop"`` (``DeviceFault`` out of ``monitor.step`` on every rank) or a callable
            given the event on every rank (e.g. saving a checkpoint), at the step boundary after a
            device fault is found (implies ``detect``).
        detector_config: the in-process detector's settings (default: ``DetectorConfig()``).
        tensorboard: step time, tokens/s and events as TensorBoard scalars under
            ``OUT/tensorboard`` (rank 0; needs the ``tensorboard`` extra).
        log_level: the ``logging`` level of the ``resihp`` loggers.
        gpu_timing: for a model on a GPU, ``"events"`` times ops with CUDA events and records each
            step's rows once the next step starts, never stalling the GPU; ``"sync"``
            synchronises around every op (rows at once, at a measured cost:
            ``benchmarks/gpu.py``).
        **meta: written to ``job.yaml`` (e.g. ``layers``, ``hidden``, ``heads``, ``ffn_hidden``
            let the detector weigh each step's sequence lengths by the model's FLOPs).
    """
    if on_fault is not None and on_fault != "stop" and not callable(on_fault):
        raise InputError(f"attach: on_fault must be 'stop' or a callable, got {on_fault!r}")
    if gpu_timing not in GPU_TIMINGS:
        raise InputError(
            f"attach: gpu_timing must be one of {', '.join(GPU_TIMINGS)}, got {gpu_timing!r}"
        )
    out = Path(out)
    dist_rank, world = _dist_rank_world()
    rank = dist_rank if rank is None else rank
    logs.setup(out, rank, log_level)
    dp_size = dp_size or max(1, world // (pp_size * tp_size))
    monitor = Monitor(
        model,
        out,
        optimizer,
        rank,
        rank if dp_rank is None else dp_rank,
        stage,
        tp_rank,
        heartbeat_s,
        gpu_timing,
    )
    if rank == 0:
        (out / "job.yaml").unlink(missing_ok=True)
        (out / "live.json").unlink(missing_ok=True)
        job = JobMeta(dp_size, pp_size, tp_size, dp_size * pp_size * tp_size)
        write_meta(job, out / "job.yaml", **meta)
        if monitor.plane is not None:
            monitor.plane.lead(out, {**job.to_dict(), **meta})
        if tensorboard:
            monitor.metrics = Metrics(out / "tensorboard")
        if detect or on_fault is not None:
            callback = on_event
            if monitor.metrics is not None:

                def callback(event: dict, user=on_event, metrics=monitor.metrics) -> None:
                    metrics.event(event)
                    if user is not None:
                        user(event)

            monitor.follower = Follower(out, detector_config, callback)
            monitor.follower.start()
    if on_fault is not None:
        monitor.on_fault = on_fault
        monitor._group = _fault_group(world)
    log.info(
        "attached: rank %d of %d, recording into %s%s",
        rank,
        world,
        out,
        " (detecting in-process)" if monitor.follower is not None else "",
    )
    return monitor


def _fault_group(world: int):
    """A gloo group over every rank for the per-step fault decision (whatever the job's backend),
    or None in a one-process job."""
    if world <= 1:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise InputError(
            "attach: on_fault in a multi-process job needs torch.distributed "
            "initialised first (every rank must agree to stop)"
        )
    return dist.new_group(backend="gloo")
