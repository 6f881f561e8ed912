"""The hybrid-parallel training engine: one rank's stage model, its pipeline schedule over
point-to-point sends and receives, the data-parallel gradient all-reduce and the optimizer step,
every op timed into the ops trace.

Why not ``torch.distributed.pipelining``: its stages allocate receive buffers from shapes fixed
once, while packed micro-batches change their token count ``T`` (and ``seq_lens``) every time; and
re-planning needs per-op timings and layer ranges that change between steps. Here every rank
derives each micro-batch's ``seq_lens`` from the shared seed, so the receiver knows the shape of
every message without a header, and the schedule is plain data (``resihp.runtime.schedule``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from resihp.model.gpt import GPTStage, init_by_name, lm_loss
from resihp.model.tensor_parallel import TPContext
from resihp.runtime.config import RunConfig
from resihp.runtime.data import DataSource, MicroBatch, replica_microbatches
from resihp.runtime.gradsync import GradSync
from resihp.runtime.inject import FaultInjector
from resihp.runtime.planchange import PlanChange
from resihp.runtime.recorder import OpRecorder
from resihp.runtime.replan import repartition
from resihp.runtime.schedule import schedule_for


@dataclass
class StepResult:
    step: int
    loss: float | None  # global mean token loss, known on last-stage ranks
    tokens: int  # global tokens of the step
    wall_s: float


class Engine:
    """One rank of a DP x PP (x TP) job. Construct after ``dist.init_process_group``."""

    def __init__(self, cfg: RunConfig, device: torch.device, injector: FaultInjector | None = None) -> None:
        self.cfg, self.device = cfg, device
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.dims = cfg.dims()
        self.dims.check_world(world)
        self.coords = self.dims.coords(self.rank)
        self.stage, self.dp_rank = self.coords.stage, self.coords.dp_rank
        self.pp = self.dims.pp
        # every rank creates every group, in the same order (a torch.distributed requirement)
        tp_group = None
        for dp_rank in range(self.dims.dp):
            for stage in range(self.pp):
                ranks = self.dims.tp_group_ranks(dp_rank, stage)
                group = dist.new_group(ranks) if self.dims.tp > 1 else None
                if self.rank in ranks:
                    tp_group = group
        self.tp = TPContext(self.dims.tp, self.coords.tp_rank, tp_group)
        self.prev = self.dims.rank_of(self.dp_rank, self.stage - 1, self.coords.tp_rank) if self.stage > 0 else None
        self.next = (self.dims.rank_of(self.dp_rank, self.stage + 1, self.coords.tp_rank)
                     if self.stage < self.pp - 1 else None)
        self.model_cfg = cfg.model_config()
        self.weights = cfg.weights()
        self.replica_ranges = [cfg.stage_ranges() for _ in range(self.dims.dp)]
        self.build_stage(*self.ranges[self.stage])
        self.grad_sync = GradSync(self.dims, tied=self.model_cfg.tie_embeddings)
        self.grad_sync.prepare(self.replica_ranges, self.model_cfg.layers)
        # plan changes travel over their own gloo group, whatever the training backend
        self.control_group = dist.new_group(list(range(world)), backend="gloo")
        self.plan_version = 0
        self.plan_changes: list[dict] = []
        self.data = DataSource(cfg.source, cfg.global_tokens, cfg.budget, cfg.max_len, cfg.seed)
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.rec = OpRecorder(self.rank, self.dp_rank, self.stage, self.coords.tp_rank, sync=sync)
        self.injector = injector or FaultInjector([], self.rank)
        self._pending: list[dist.Work] = []

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """The layer ranges of this rank's pipeline."""
        return self.replica_ranges[self.dp_rank]

    def build_stage(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.model = GPTStage(self.model_cfg, first, last, self.tp)
        init_by_name(self.model, self.cfg.seed, self.tp, self.model_cfg.heads)
        self.model.to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr, weight_decay=0.0)

    # --- point-to-point -------------------------------------------------------------------------
    def _recv(self, shape: tuple[int, ...], src: int, tag: int, optype: str, mb: MicroBatch) -> torch.Tensor:
        buf = torch.empty(shape, device=self.device)
        with self.rec.op(optype, mb.mb_id, mb.seq_lens):
            dist.recv(buf, src, tag=tag)
        return buf

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, optype: str, mb: MicroBatch) -> None:
        # asynchronous, so that neighbouring stages never wait on each other's sends (1F1B)
        with self.rec.op(optype, mb.mb_id, mb.seq_lens):
            self._pending.append(dist.isend(tensor.contiguous(), dst, tag=tag))

    def _compute(self, optype: str, mb: MicroBatch, fn) -> object:
        with self.rec.op(optype, mb.mb_id, mb.seq_lens):
            start = time.perf_counter()
            result = fn()
            self.rec.sync()
            self.injector.stretch(time.perf_counter() - start)
        return result

    # --- plan changes -----------------------------------------------------------------------------
    def sync_plan(self, step: int, proposal: dict | None) -> dict | None:
        """Called by every rank at the start of a step; ``proposal`` (a plan change dict) counts
        only on rank 0, which broadcasts it; every rank checks it (``PlanChange.parse``: a bad one
        stops every rank alike) and applies it before the step. Returns it."""
        version = torch.tensor([proposal["version"] if proposal and self.rank == 0 else self.plan_version])
        with self.rec.waiting("plan-sync"):
            dist.broadcast(version, 0, group=self.control_group)
        if int(version) == self.plan_version:
            return None
        box = [proposal if self.rank == 0 else None]
        with self.rec.waiting("plan-sync"):
            dist.broadcast_object_list(box, 0, group=self.control_group)
        change = PlanChange.parse(box[0], self.dims, self.model_cfg.layers)
        self.apply(step, change)
        self.plan_version = int(version)
        return change.to_dict()

    def apply(self, step: int, change: PlanChange) -> None:
        self.rec.begin_step(step)
        if change.dp_weights is not None:
            with self.rec.op("replan-microbatches"):
                self.weights = list(change.dp_weights)
        new = change.replica_ranges(self.model_cfg.layers, self.pp)
        if new is not None and new != self.replica_ranges:
            with self.rec.op("replan-layers") as row:
                row["bytes"] = self._repartition(new[self.dp_rank]) if new[self.dp_rank] != self.ranges else 0
                self.replica_ranges = new
                self.grad_sync.prepare(new, self.model_cfg.layers)
        self.plan_changes.append({"step": step, **change.to_dict()})

    def _repartition(self, new_ranges: list[tuple[int, int]]) -> int:
        self.model, self.optimizer, sent = repartition(
            self.model, self.optimizer, self.model_cfg, self.tp, self.ranges, new_ranges, self.stage,
            lambda stage: self.dims.rank_of(self.dp_rank, stage, self.coords.tp_rank), self.cfg.lr,
            self.device)
        self.first, self.last = new_ranges[self.stage]
        return sent

    # --- one training step ----------------------------------------------------------------------
    def train_step(self, step: int) -> StepResult:
        self.injector.begin_step(step)
        self.rec.begin_step(step)
        data = self.data.step(step)
        global_tokens = data.tokens
        mbs = replica_microbatches(data, self.dp_rank, self.weights)
        hidden = self.model_cfg.hidden
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        loss_sum = torch.zeros((), device=self.device)
        with self.rec.op("step", tokens=global_tokens) as step_row:
            for action in schedule_for(self.cfg.schedule, self.pp, self.stage, len(mbs)):
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
                    else:
                        self._send(out.detach(), self.next, tag, "forward-send", mb)
                    saved[action.mb] = (x if self.prev is not None else None, out)
                else:
                    x, out = saved.pop(action.mb)
                    grad = (None if self.next is None else
                            self._recv((mb.tokens, hidden), self.next, tag, "backward-recv", mb))
                    self._compute("backward-compute", mb, lambda out=out, grad=grad: out.backward(grad))
                    if x is not None:
                        self._send(x.grad, self.prev, tag, "backward-send", mb)
            for work in self._pending:
                work.wait()
            self._pending.clear()
            loss = self._all_reduce_grads(loss_sum)
            with self.rec.op("optimizer"):
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
            step_row["loss"] = loss
        return StepResult(step, loss, global_tokens, step_row["duration"])

    def _all_reduce_grads(self, loss_sum: torch.Tensor) -> float | None:
        """Sum gradients over the data-parallel replicas (the loss is already divided by the
        global token count). The last stage's loss rides in the head's bucket: no extra collective."""
        loss = loss_sum.reshape(1).clone() if self.next is None else None
        # a tied embedding is summed over its first- and last-stage copies even with one replica
        if self.dims.dp > 1 or (self.model_cfg.tie_embeddings and self.pp > 1):
            with self.rec.op("grads-all-reduce"):
                self.grad_sync.all_reduce(self.model, self.coords.tp_rank, loss)
        return float(loss) if loss is not None else None
