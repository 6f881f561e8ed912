"""The hybrid-parallel training engine of one rank, every op timed into the ops trace.

It holds the rank's stage model, its pipeline schedule over point-to-point sends and receives, the
data-parallel gradient all-reduce and the optimizer step.

Why not ``torch.distributed.pipelining``: its stages allocate receive buffers from shapes fixed
once, while packed micro-batches change their token count ``T`` (and ``seq_lens``) every time; and
re-planning needs per-op timings and layer ranges that change between steps. Here every rank
derives each micro-batch's ``seq_lens`` from the shared seed, so the receiver knows the shape of
every message without a header, and the schedule is plain data (``resihp.train.schedule``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from resihp.model.gpt import GPTStage, init_by_name, lm_loss
from resihp.model.tensor_parallel import TPContext, WaitClock
from resihp.parallel import ParallelDims, Placement
from resihp.train.config import RunConfig
from resihp.train.data import DataSource, MicroBatch, StepData, replica_microbatches
from resihp.train.gradsync import GradSync, pipelines_of
from resihp.train.inject import FaultInjector
from resihp.train.layout import balanced_layers
from resihp.train.planchange import PlanChange
from resihp.train.recorder import OpRecorder
from resihp.train.replan import relayout, repartition, retire_groups
from resihp.train.schedule import schedule_for

PROBE_MAX_GAP = 16  # steps between a hot spare's probes, at most
PROBE_REPEATS = 3  # runs of the probe's compute per probe; the fastest is its time
REFERENCE_PROBES = (
    3  # steps a rank probes first, placed: the fastest is its reference (``LiveLoop``)
)


@dataclass
class StepResult:
    step: int
    loss: float | None  # global mean token loss, known on last-stage ranks
    tokens: int  # global tokens of the step
    wall_s: float


class Engine:
    """One rank of a DP x PP (x TP) job.

    Construct after ``dist.init_process_group``."""

    def __init__(
        self, cfg: RunConfig, device: torch.device, injector: FaultInjector | None = None
    ) -> None:
        self.cfg, self.device = cfg, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        cfg.dims().check_world(self.world)
        self.model_cfg = cfg.model
        self.weights = cfg.weights()
        self.replica_ranges = [cfg.stage_ranges() for _ in range(cfg.parallel.dp)]
        self.generation = 0  # the process groups' generation: a live layout change starts a new one
        self.form_groups(pipelines_of(cfg.dims()))
        self.build_stage(*self.ranges[self.stage])
        # plan changes travel over their own gloo group, whatever the training backend
        self.control_group = dist.new_group(list(range(self.world)), backend="gloo")
        self.plan_version = 0
        self.plan_changes: list[dict] = []
        self.data = DataSource(
            cfg.data.source,
            cfg.data.global_tokens,
            cfg.data.budget,
            cfg.model.max_seq_len,
            cfg.train.seed,
        )
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.rec = OpRecorder(self.rank, self.dp_rank, self.stage, self.tp.rank, sync=sync)
        self.injector = injector or FaultInjector([], self.rank)
        self._pending: list[dist.Work] = []
        # the first REFERENCE_PROBES steps probe the device where it trains: its own reference, the
        # fastest of them (one rank's first timed probe ran 2.8x its peers', and as a spare at a
        # third of its speed it then looked recovered)
        self._reference_steps = 0
        self._warmed = False  # the probe's compute ran once, untimed

    def form_groups(self, pipelines: Sequence[Sequence[Sequence[int]]]) -> None:
        """Collective over the world: this rank's place in a layout, and the layout's groups.

        The layout is given as pipelines of world ranks (replica -> stage -> that stage's
        tensor-parallel group; replicas may differ in depth and tensor-parallel size; a world rank
        in none is a hot spare); its groups are the tensor-parallel and gradient groups. Inside a
        group world ranks ascend with the tp rank (the group's own rank order). Every rank creates
        every group, in the same order."""
        self.placement = Placement.of([sorted(stage) for stage in p] for p in pipelines)
        self.pipelines = [list(p) for p in self.placement.pipelines]
        self.active = self.placement.ranks
        place = self.placement.coords().get(self.rank)
        spare = place is None
        d, s, t = (-1, -1, 0) if spare else (place.dp_rank, place.stage, place.tp_rank)
        mine = [(self.rank,)] if spare else self.pipelines[d]
        self.coords = place
        self._probe_gap, self._next_probe = 1, 0  # a new spare is probed at once, then with backoff
        self.dp_rank, self.stage, self.pp = d, s, len(mine)
        tp_group = None
        for p in self.pipelines:
            for stage in p:
                group = dist.new_group(list(stage)) if len(stage) > 1 else None
                if self.rank in stage:
                    tp_group = group
        self.tp = TPContext(len(mine[s]), t, tp_group)
        self.dims = self.placement.dims
        # neighbouring stages may differ in tensor-parallel size: a stage's output (and its input's
        # gradient) is whole on each rank of its group, so rank j of a stage of size b takes it from
        # rank j mod a of the neighbour of size a, which sends it to every such j
        here = len(mine[s])
        self.prev = mine[s - 1][t % len(mine[s - 1])] if not spare and s > 0 else None
        self.next = mine[s + 1][t % len(mine[s + 1])] if not spare and s < self.pp - 1 else None
        self.send_prev = (
            [r for i, r in enumerate(mine[s - 1]) if i % here == t] if self.prev is not None else []
        )
        self.send_next = (
            [r for j, r in enumerate(mine[s + 1]) if j % here == t] if self.next is not None else []
        )
        self.grad_sync = GradSync(
            self.pipelines, tied=self.model_cfg.tie_embeddings, cfg=self.model_cfg
        )
        self.grad_sync.prepare(self.replica_ranges, self.model_cfg.layers)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """The layer ranges of this rank's pipeline."""
        return self.replica_ranges[self.dp_rank]

    def build_stage(self, first: int, last: int, init: bool = True) -> None:
        """Build this rank's stage model of layers ``[first, last)`` and its AdamW optimizer.

        Args:
            first: the stage's first layer.
            last: the layer after its last one.
            init: initialise its parameters from the run's seed (False: left as built)."""
        self.first, self.last = first, last
        self.model = GPTStage(self.model_cfg, first, last, self.tp)
        if init:
            init_by_name(self.model, self.cfg.train.seed, self.tp, self.model_cfg.heads)
        self.model.to(self.device)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.cfg.train.lr, weight_decay=0.0
        )

    def _probe(self) -> None:
        """A small fixed compute, timed as op ``probe`` and stretched as any compute op is by an
        injected slowdown. Every rank records one in each of its first ``REFERENCE_PROBES`` steps
        where it trains (the fastest is its own reference); a hot spare records more, with backoff,
        so the live loop can tell when it is healthy again."""
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(256, 256, generator=gen).to(self.device)  # ~0.27 GFLOP whatever the model
        w = torch.randn(256, 256, generator=gen).to(self.device) / 16

        def compute() -> None:
            y = x
            for _ in range(8):
                y = torch.tanh(y @ w)
            self.rec.sync()

        if not self._warmed:
            self._warmed = True
            # untimed once: the first matmuls of a process (thread pools, allocator, kernels
            # loading) took 4x as long here, and a reference that slow makes a spare still
            # running at a third of its speed look recovered
            compute()
        # the CPU time of the probe's own thread where torch computes on it alone: the process's
        # other threads (heartbeats, the store's clients, gloo's) are not the device's speed
        cpu_clock = time.thread_time if torch.get_num_threads() == 1 else time.process_time
        with self.rec.op("probe") as row:
            walls, busy = 0.0, float("inf")
            for _ in range(
                PROBE_REPEATS
            ):  # the fastest of a few: a moment's contention is not speed
                start, cpu = time.perf_counter(), cpu_clock()
                compute()
                wall = time.perf_counter() - start
                # on a CPU shared by more ranks than cores, the time the probe waited for a core is
                # not the device's speed (a healthy spare probing beside busy ranks measured 2x its
                # reference): kept apart as the op's wait, as inside tensor-parallel collectives
                busy = min(
                    busy, min(wall, cpu_clock() - cpu) if self.device.type == "cpu" else wall
                )
                walls += wall
            self.injector.stretch(busy)
            row["wait_s"] = (
                walls - busy
            )  # the op's duration less this is the fastest run, stretched

    def job_rank(self, rank: int) -> int:
        """The job rank of ``rank`` of this engine's process groups (the fault injector names them).

        The same rank here, where the default group is the job's."""
        return rank

    def _after_collective(self, members: tuple[int, ...], seconds: float, nbytes: int) -> None:
        self.injector.collective(tuple(self.job_rank(m) for m in members), seconds, nbytes)

    # --- point-to-point -------------------------------------------------------------------------
    def _recv(
        self, shape: tuple[int, ...], src: int, tag: int, optype: str, mb: MicroBatch
    ) -> torch.Tensor:
        buf = torch.empty(shape, device=self.device)
        with self.rec.op(optype, mb.mb_id, mb.seq_lens):
            start = time.perf_counter()
            dist.recv(buf, src, tag=tag)
            # an injected slow link delivers the data later, in proportion to the transfer
            self.injector.received(
                self.job_rank(src), time.perf_counter() - start, buf.numel() * buf.element_size()
            )
        return buf

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, optype: str, mb: MicroBatch) -> None:
        # asynchronous, so that neighbouring stages never wait on each other's sends (1F1B)
        with self.rec.op(optype, mb.mb_id, mb.seq_lens):
            self._pending.append(dist.isend(tensor.contiguous(), dst, tag=tag))

    def _compute(self, optype: str, mb: MicroBatch, fn) -> object:
        with self.rec.op(optype, mb.mb_id, mb.seq_lens) as row:
            start, waited = time.perf_counter(), WaitClock.seconds
            result = fn()
            self.rec.sync()
            self.injector.stretch(time.perf_counter() - start)
            if self.tp.size > 1:  # time inside tensor-parallel collectives, waiting for the group
                row["wait_s"] = WaitClock.seconds - waited
        return result

    # --- plan changes -----------------------------------------------------------------------------
    def sync_plan(self, step: int, proposal: dict | None) -> dict | None:
        """Agree on the step's plan change, apply it and return it; every rank calls it first.

        ``proposal`` (a plan change dict) counts only on rank 0, which broadcasts it; every rank
        checks it (``PlanChange.parse``: a bad one stops every rank alike) and applies it before the
        step."""
        version = torch.tensor(
            [proposal["version"] if proposal and self.rank == 0 else self.plan_version]
        )
        with self.rec.waiting("plan-sync"):
            dist.broadcast(version, 0, group=self.control_group)
        if int(version) == self.plan_version:
            return None
        box = [proposal if self.rank == 0 else None]
        with self.rec.waiting("plan-sync"):
            dist.broadcast_object_list(box, 0, group=self.control_group)
        change = PlanChange.parse(
            box[0],
            self.dims or ParallelDims(len(self.pipelines), 1),
            self.model_cfg.layers,
            world=self.world,
            depths=[len(p) for p in self.pipelines],
        )
        self.apply(step, change)
        self.plan_version = int(version)
        return change.to_dict()

    def apply(self, step: int, change: PlanChange) -> None:
        self.rec.begin_step(step)
        if change.layout is not None:
            with self.rec.op("replan-layout") as row:
                moved = self._relayout(change)
                row["bytes"] = moved["moved_bytes"]
            self.plan_changes.append({"step": step, **change.to_dict(), **moved})
            return
        if change.dp_weights is not None:
            with self.rec.op("replan-microbatches"):
                self.weights = list(change.dp_weights)
        new = change.replica_ranges(self.model_cfg.layers)
        if new is not None and new != self.replica_ranges:
            with self.rec.op("replan-layers") as row:
                row["bytes"] = (
                    self._repartition(new[self.dp_rank]) if new[self.dp_rank] != self.ranges else 0
                )
                self.replica_ranges = new
                self.grad_sync.prepare(new, self.model_cfg.layers)
        self.plan_changes.append({"step": step, **change.to_dict()})

    def _relayout(self, change: PlanChange) -> dict:
        """A new generation of process groups for ``change.layout``; parameters and AdamW state
        resharded into it by global name from memory (``replan.relayout``)."""
        new = change.layout
        layers = self.model_cfg.layers
        ranges = change.replica_ranges(layers) or [
            balanced_layers(layers, len(p)) for p in new.pipelines
        ]
        weights = (
            list(change.dp_weights) if change.dp_weights is not None else [1.0] * len(new.pipelines)
        )
        for p in new.pipelines:  # checked on every rank alike before anything changes
            self.cfg.model.check_tp(len(p[0]))

        def rebuild() -> tuple[torch.nn.Module, torch.optim.Optimizer, TPContext] | None:
            self._retired = self.reform(new.pipelines, ranges, weights)
            return None if self.coords is None else (self.model, self.optimizer, self.tp)

        moved = relayout(
            self.model,
            self.optimizer,
            self.tp,
            self.model_cfg,
            rebuild,
            self.control_group,
            self.cfg.out,
            write=self.dp_rank == 0,
        )
        retire_groups(self._retired)
        return {
            **moved,
            "generation": self.generation,
            "spares": [r for r in range(self.world) if r not in self.active],
        }

    def reform(
        self,
        pipelines: Sequence[Sequence[Sequence[int]]],
        ranges: list[list[tuple[int, int]]],
        weights: list[float],
    ) -> list:
        """Collective over the world: a new generation of process groups and this rank's stage.

        The stage is built in it, its values not kept (``_relayout`` moves them in). Returns the
        groups it retires (``replan.retire_groups``).

        Args:
            pipelines: the new layout as pipelines of world ranks (replica -> stage -> that
                stage's tensor-parallel group), as in ``form_groups``.
            ranges: per replica, each stage's layer range ``(first, last)``.
            weights: each replica's share of the micro-batches."""
        old_groups = [self.tp.group, *self.grad_sync.groups.values()]
        self.replica_ranges, self.weights = ranges, weights
        self.form_groups(pipelines)
        self.generation += 1
        if self.coords is None:
            self.model = self.optimizer = None
        else:
            self.build_stage(*self.ranges[self.stage], init=False)
            self.rec.ids.update(dp_rank=self.dp_rank, stage=self.stage, tp_rank=self.tp.rank)
        return old_groups

    def _repartition(self, new_ranges: list[tuple[int, int]]) -> int:
        self.model, self.optimizer, sent = repartition(
            self.model,
            self.optimizer,
            self.model_cfg,
            self.tp,
            self.ranges,
            new_ranges,
            self.stage,
            lambda stage: self.pipelines[self.dp_rank][stage][self.tp.rank],
            self.cfg.train.lr,
            self.device,
        )
        self.first, self.last = new_ranges[self.stage]
        return sent

    # --- one training step ----------------------------------------------------------------------
    def train_step(self, step: int) -> StepResult:
        self.injector.begin_step(step)
        self.rec.begin_step(step)
        data = self.data.step(step)
        global_tokens = self.loss_tokens(data)
        if self._reference_steps < REFERENCE_PROBES:
            if self.coords is not None:  # while it trains
                self._probe()
            self._reference_steps += 1
        if self.coords is None:  # a hot spare: no part in this layout; it keeps step with the job
            with self.rec.op("step", tokens=global_tokens) as step_row:
                step_row["spare"] = True
            if step >= self._next_probe:  # re-checked with backoff: 1, 2, 4, ... steps apart
                self._probe()
                self._next_probe = step + self._probe_gap
                self._probe_gap = min(2 * self._probe_gap, PROBE_MAX_GAP)
            return StepResult(step, None, global_tokens, step_row["duration"])
        mbs = self.microbatches(data)
        hidden = self.model_cfg.hidden
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        loss_sum = torch.zeros((), device=self.device)
        with self.rec.op("step", tokens=global_tokens) as step_row:
            for action in schedule_for(self.cfg.parallel.schedule, self.pp, self.stage, len(mbs)):
                mb = mbs[action.mb]
                tag = 2 * mb.mb_id + (action.kind == "B")
                if action.kind == "F":
                    inputs, targets = self.data.tokens(step, mb, self.model_cfg.vocab)
                    if self.prev is None:
                        x = inputs.to(self.device)
                    else:
                        x = self._recv((mb.tokens, hidden), self.prev, tag, "forward-recv", mb)
                        x.requires_grad_()

                    def forward(x=x, mb=mb, targets=targets):
                        out = self.model(x, mb.seq_lens)
                        if self.next is None:
                            out = lm_loss(out, targets.to(self.device)) / global_tokens
                        return out

                    out = self._compute("forward-compute", mb, forward)
                    if self.next is None:
                        loss_sum += out.detach()
                    for dst in self.send_next:
                        self._send(out.detach(), dst, tag, "forward-send", mb)
                    saved[action.mb] = (x if self.prev is not None else None, out)
                else:
                    x, out = saved.pop(action.mb)
                    grad = (
                        None
                        if self.next is None
                        else self._recv((mb.tokens, hidden), self.next, tag, "backward-recv", mb)
                    )
                    self._compute(
                        "backward-compute", mb, lambda out=out, grad=grad: out.backward(grad)
                    )
                    for dst in self.send_prev:
                        self._send(x.grad, dst, tag, "backward-send", mb)
            with self.rec.waiting("send-wait"):
                for work in self._pending:
                    work.wait()
            self._pending.clear()
            loss = self._all_reduce_grads(loss_sum)
            with self.rec.op("optimizer"):
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
            step_row["loss"] = loss
        return StepResult(step, loss, global_tokens, step_row["duration"])

    def microbatches(self, data: StepData) -> list[MicroBatch]:
        """The micro-batches this rank's replica trains in a step."""
        return replica_microbatches(data, self.dp_rank, self.weights)

    def loss_tokens(self, data: StepData) -> int:
        """The tokens the step's loss is averaged over (the global batch's)."""
        return data.tokens

    def _all_reduce_grads(self, loss_sum: torch.Tensor) -> float | None:
        """Sum gradients over the data-parallel replicas (the loss is already divided by the
        global token count). The last stage's loss rides in the head's bucket: no extra
        collective."""
        loss = loss_sum.reshape(1).clone() if self.next is None else None
        # a tied embedding is summed over its first- and last-stage copies even with one replica
        if len(self.pipelines) > 1 or (self.model_cfg.tie_embeddings and self.pp > 1):
            with self.rec.op("grads-all-reduce"):
                self.grad_sync.all_reduce(
                    self.model, self.coords.tp_rank, loss, after=self._after_collective
                )
        return float(loss) if loss is not None else None
