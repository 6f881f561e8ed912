"""A rank of a job run with replica-level fault tolerance (``--recovery replica``).

Each data-parallel replica is a torchrun job of its own (its pipeline and tensor-parallel ranks,
with a default process group of just them), launched, watched and relaunched alone by the supervisor
(``resihp.launch.replicas``). Across replicas a rank sums gradients over its position's group of the
current generation (``resihp.ft.group``), votes, and commits only what every member summed
(``resihp.ft.quorum``); an aborted step is redone by the survivors. In zero-drift mode the survivors
also train the absent replicas' micro-batches, so the global batch never changes. A relaunched
replica catches up from a live peer (``resihp.ft.heal``) and joins at a step boundary. The live
planner's micro-batch shares and per-replica layer splits reach every rank with the commit before
the step they apply to (``Decision.plan``): each replica moves layers between its own stages
(``Engine._repartition``), and the cross-replica sums follow each layer to the stage holding it in
every replica (``_buckets``). A returning replica catches up in its source replica's split and takes
the plan of the commit that admitted it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import Store

from resihp.ckpt.integrity import prune
from resihp.detect.heartbeat import HeartbeatSender
from resihp.errors import InputError
from resihp.ft.group import Key, ReplicaGroup
from resihp.ft.heal import (
    GRAD,
    STATE,
    HealSource,
    HealTarget,
    close_sources,
    flatten,
    heal_prefix,
    heal_tensors,
    unflatten,
)
from resihp.ft.quorum import Decision, Evicted, Generation, Member, Quorum
from resihp.parallel import Placement
from resihp.train.config import RunConfig
from resihp.train.controlplane import StepPublisher, heartbeat_prefix, plan_key, report_error
from resihp.train.data import MicroBatch, StepData, replica_microbatches
from resihp.train.engine import Engine, StepResult
from resihp.train.gradsync import Pieces, pipelines_of
from resihp.train.inject import FaultInjector
from resihp.train.layout import balanced_layers, ranges_from_counts
from resihp.train.planchange import PlanChange
from resihp.train.replan import retire_groups

REPLICA_ENV, ATTEMPT_ENV = "RESIHP_REPLICA", "RESIHP_ATTEMPT"
GPU_OFFSET_ENV = "RESIHP_GPU_OFFSET"  # the first GPU of a replica's local rank 0 on its host
BEAT_S = 0.25  # heartbeat interval: a hung replica is judged within a few beats


class StepAborted(RuntimeError):
    """The quorum did not commit this step (a member was lost inside it): redo it."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(f"step {decision.step} aborted")
        self.decision = decision


class ReplicaEngine(Engine):
    """The engine of one rank of one replica.

    The default process group is the replica's own (pipeline x tensor ranks); gradients are summed
    across replicas by the quorum's group."""

    def __init__(
        self,
        cfg: RunConfig,
        device: torch.device,
        member: Member,
        store: Store,
        connect: Callable[[], Store],
        drop: bool = False,
    ) -> None:
        local = cfg.updated(dp=1, dp_weights=None, inject=[], replan=[], recovery="none")
        self.full = cfg
        global_rank = cfg.dims().rank_of(
            member.replica, dist.get_rank() // cfg.parallel.tp, dist.get_rank() % cfg.parallel.tp
        )
        faults = (
            cfg.fault_list() if member.attempt == 0 else []
        )  # an injected fault strikes the first launch only
        super().__init__(local, device, FaultInjector(faults, global_rank))
        self.member, self.global_rank, self.drop = member, global_rank, drop
        self.rec.ids.update(rank=global_rank, dp_rank=member.replica)
        self.position = f"{self.stage}.{self.tp.rank}"
        self.store, self.connect = store, connect
        self.quorum = Quorum(
            store,
            cfg.job_id,
            cfg.parallel.pp * cfg.parallel.tp,
            cfg.faults.timeout_s,
            plan_key=plan_key(cfg.job_id),
        )
        self.group = ReplicaGroup(connect, cfg.job_id, member.replica, cfg.faults.timeout_s)
        self.gen: Generation | None = None
        self.decision: Decision | None = None
        self.sources: dict[Member, HealSource] = {}
        self.full_weights = cfg.weights()
        self.full_ranges = [
            self.ranges for _ in range(cfg.parallel.dp)
        ]  # every replica's layer ranges
        # every replica's groups (job ranks), as launched and as in force: the live planner may
        # re-form a replica's groups from its own ranks (a slow one left out as a hot spare)
        self.launch = [[tuple(s) for s in p] for p in pipelines_of(cfg.dims())]
        self.full_pipelines = [list(p) for p in self.launch]
        self._local = {
            g: s * cfg.parallel.tp + t
            for s, group in enumerate(self.launch[member.replica])
            for t, g in enumerate(group)
        }  # job rank -> rank in this replica's group
        self._pieces: tuple[tuple, Pieces] | None = None
        self.plan_id: object = None  # the plan change in force (its id)

    def job_rank(self, rank: int) -> int:
        """The job rank of ``rank`` of this replica's own process group."""
        tp = self.full.parallel.tp
        return self.full.dims().rank_of(self.member.replica, rank // tp, rank % tp)

    # --- which micro-batches --------------------------------------------------------------------
    def _owned(self) -> list[int]:
        """The replicas whose micro-batches this replica trains: its own, and in zero-drift mode
        those of absent replicas (replica L goes to member L mod the member count)."""
        members = self.gen.replicas
        if self.drop:
            return [self.member.replica]
        return [
            r
            for r in range(self.full.parallel.dp)
            if (r if r in members else members[r % len(members)]) == self.member.replica
        ]

    def microbatches(self, data: StepData) -> list[MicroBatch]:
        return [
            mb for r in self._owned() for mb in replica_microbatches(data, r, self.full_weights)
        ]

    def take_plan(self, step: int) -> None:
        """Before ``step``: apply the plan change the last commit carried, if it is new.

        Every rank of every replica applies it alike: the micro-batch shares, each replica's groups
        (a replica whose groups the plan re-forms builds them from its own ranks and reshards its
        state from memory, a left-out rank becoming a hot spare) and each replica's layer split
        (its ranks move layers between its stages); a returning peer this rank serves gets the state
        anew."""
        plan = self.decision.plan if self.decision is not None and self.decision.commit else None
        if plan is None or plan.get("id") == self.plan_id:
            return
        layers = self.model_cfg.layers
        change = PlanChange.parse(
            plan,
            self.full.dims(),
            layers,
            "plan",
            world=self.full.dims().world_size,
            depths=[len(p) for p in self.full_pipelines],
        )
        if change.dp_weights is not None:
            with self.rec.op("replan-microbatches"):
                self.full_weights = list(change.dp_weights)
        pipes = self.full_pipelines
        if change.layout is not None:
            pipes = [list(p) for p in change.layout.pipelines]
            self._check_within(pipes)
        new = change.replica_ranges(layers)
        if new is None and pipes != self.full_pipelines:
            new = [balanced_layers(layers, len(p)) for p in pipes]
        replica = self.member.replica
        relaid = pipes[replica] != self.full_pipelines[replica]
        if relaid:
            ranges = (new or self.full_ranges)[replica]
            local = Placement(
                (tuple(tuple(self._local[g] for g in stage) for stage in pipes[replica]),)
            )
            with self.rec.op("replan-layout") as row:
                done = self._relayout(
                    PlanChange(None, (tuple(b - a for a, b in ranges),), {}, local)
                )
                row["bytes"] = (
                    done["moved_bytes"] if dist.get_rank() == 0 else 0
                )  # the replica's total, once
            self.rec.ids.update(
                dp_rank=replica
            )  # the engine's own layout has one replica: this one
            self.position = f"{self.stage}.{self.tp.rank}"
            spares = [g for g, r in self._local.items() if r in done["spares"]]
            self.plan_changes.append({"step": step, **change.to_dict(), **done, "spares": spares})
            if dist.get_rank() == 0:  # the replica's totals (``relayout`` sums them over its ranks)
                self.quorum.report_relayout(
                    plan.get("id"),
                    replica,
                    {
                        k: done[k]
                        for k in (
                            "moved_bytes",
                            "written_bytes",
                            "read_bytes",
                            "minimum_bytes",
                            "relayout_s",
                        )
                    },
                )
            for source in self.sources.values():  # served position by position: those are gone
                source.close(-1)
            self.sources.clear()
        elif new is not None and new[replica] != self.ranges and self.coords is not None:
            with self.rec.op("replan-layers") as row:
                row["bytes"] = self._repartition(new[replica])
                self.replica_ranges = [new[replica]]
                self.grad_sync.prepare([new[replica]], layers)
            for source in self.sources.values():  # its state in the new split, as of the last step
                source.push(
                    STATE,
                    step - 1,
                    flatten(heal_tensors(self.model, self.optimizer), "cpu"),
                    self._split(),
                )
        self.full_pipelines = pipes
        if new is not None:
            self.full_ranges = new
        self.plan_id = plan.get("id")
        if not relaid:
            self.plan_changes.append({"step": step, **change.to_dict()})

    def _check_within(self, pipes: list[list[tuple[int, ...]]]) -> None:
        """A plan's layout keeps every replica on ranks it was launched with (each replica is a job
        of its own: no rank can join another's process groups)."""
        if len(pipes) != len(self.launch) or any(
            not {g for s in p for g in s} <= {g for s in home for g in s}
            for p, home in zip(pipes, self.launch)
        ):
            raise InputError(
                f"plan layout: expected each of the {len(self.launch)} replicas on its own "
                f"ranks {[[list(s) for s in p] for p in self.launch]}, got {pipes}"
            )

    def _split(self) -> list[int]:
        return [b - a for a, b in self.ranges]

    def _buckets(self, loss: torch.Tensor | None) -> dict[Key, list[torch.Tensor]]:
        """This rank's gradient pieces (and the loss, with the final norm's) by the ranks of the
        member replicas that sum them (``gradsync.Pieces``: any layer split, depth and
        tensor-parallel size per replica)."""
        members = self.gen.replicas
        layout = (
            tuple(members),
            tuple(tuple(self.full_pipelines[d]) for d in members),
            tuple(tuple(self.full_ranges[d]) for d in members),
        )
        if self._pieces is None or self._pieces[0] != layout:
            self._pieces = (
                layout,
                Pieces(
                    [self.full_pipelines[d] for d in members],
                    [self.full_ranges[d] for d in members],
                    self.model_cfg,
                ),
            )
        entries = self._pieces[1].entries(self.model, self.global_rank, loss)
        return {key: [t for _, _, t in pieces] for key, pieces in entries.items()}

    def loss_tokens(self, data: StepData) -> int:
        if not self.drop:
            return data.tokens
        return sum(
            mb.tokens
            for r in self.gen.replicas
            for mb in replica_microbatches(data, r, self.full_weights)
        )

    # --- the cross-replica sum and the vote -----------------------------------------------------
    def _all_reduce_grads(self, loss_sum: torch.Tensor) -> float | None:
        loss = loss_sum.reshape(1).clone() if self.next is None else None
        step = self.rec.step
        if self.model_cfg.tie_embeddings and self.pp > 1:  # the tied copies, inside the replica
            with self.rec.op("grads-all-reduce"):
                self.grad_sync.all_reduce(self.model, self.coords.tp_rank, None)
        params = list(self.model.parameters())
        ok = True
        try:
            buckets = self._buckets(loss)
            gen = self.gen

            def decided() -> bool:  # the step was decided without this rank's vote: an abort
                return self.quorum.decided(gen, step)

            if self.group.gen != self.gen.gen:
                with self.rec.op("ft-regroup"):
                    self.group.form(self.gen, list(buckets), abandon=decided)
            if self.group.size > 1:
                flats = {key: flatten(tensors) for key, tensors in buckets.items()}
                with self.rec.op("grads-all-reduce"):
                    for key in sorted(flats):  # one at a time: an injected slow link times each
                        start = time.perf_counter()
                        self.group.all_reduce({key: flats[key]}, abandon=decided)
                        nbytes = flats[key].numel() * flats[key].element_size()
                        self.injector.collective(key, time.perf_counter() - start, nbytes)
                for key, tensors in buckets.items():
                    unflatten(flats[key], tensors)
        except (RuntimeError, dist.DistError):
            ok = False  # a member was lost inside the sum: the vote says so, nothing is applied
            self.rec.active = None
        self._commit(step, ok)
        if self.sources:  # returning ranks replay this step's summed gradients
            grads = flatten([p.grad for p in params])
            for source in self.sources.values():
                source.push(GRAD, step, grads)
        return float(loss) if loss is not None else None

    def _commit(self, step: int, ok: bool) -> None:
        """This rank's vote on ``step`` and the quorum's decision (raises on an abort or
        eviction)."""
        with self.rec.waiting("ft-commit"):
            decision = self.quorum.vote(
                self.gen, step, ok, previous=self.decision
            ) or self.quorum.wait(self.gen, step)
        self.decision = decision
        if self.member not in decision.next.members:
            raise Evicted(f"replica {self.member.replica} was evicted at step {step}")
        if not decision.commit:
            raise StepAborted(decision)

    def train_step(self, step: int) -> StepResult:
        result = super().train_step(step)
        if self.coords is None:  # a hot spare of its replica trains nothing, but votes every step
            self._commit(step, True)
        return result

    def abandon_step(self) -> None:
        """An aborted attempt: its gradients and records go; the step is trained again."""
        if self.optimizer is not None:  # None: a hot spare, which holds nothing
            self.optimizer.zero_grad(set_to_none=False)
        self._pending.clear()
        del self.rec.rows[self.rec._flushed :]
        self.rec.active = None

    # --- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, directory: Path, step: int) -> None:
        """Collective over this replica's ranks: save the state after ``step`` as a checkpoint.

        The model and AdamW state go into a universal checkpoint (any layout loads it), the job's
        layout into its meta: every replica's layer split and micro-batch share. Its layout names
        replicas, which no other mode's does, so a resume re-derives the torch generators (none is
        written)."""
        # deferred for start-up time, as in worker.save_checkpoint: torch.distributed.checkpoint
        from resihp.ckpt.universal import save
        from resihp.train.elastic import checkpoint_meta, run_state

        full = self.full
        splits = [[b - a for a, b in ranges] for ranges in self.full_ranges]
        state = {
            **run_state(self, full),
            "data.dp_weights": list(self.full_weights),
            "layer_splits": splits,
            "layout": {
                "replicas": full.parallel.dp,
                "pp": full.parallel.pp,
                "tp": full.parallel.tp,
            },
        }
        meta = {
            **checkpoint_meta(self, full),
            "dp": full.parallel.dp,
            "layer_splits": splits,
            "state": state,
        }
        with self.rec.op("checkpoint-save"):
            save(directory, self.model, self.optimizer, step, meta, self.tp, self.model_cfg)
        if dist.get_rank() == 0:
            prune(directory.parent, full.checkpoint.ckpt_keep)

    def resume(self, source: Path, first_step: int) -> None:
        """Collective over this replica's ranks: load its state from checkpoint ``source``.

        The model and AdamW state are loaded before ``first_step`` (any layout wrote it; non-tensor
        state by its rule). Replica 0's first rank records the decisions in ``OUT/resume.json``."""
        from resihp.train.elastic import resume  # deferred, as save_checkpoint's imports

        self.rec.begin_step(first_step)
        with self.rec.op("checkpoint-load"):
            resumed = resume(self, self.full, source, first_step)
        if self.member.replica == 0 and dist.get_rank() == 0:
            (Path(self.full.out) / "resume.json").write_text(json.dumps(resumed.to_dict()))

    # --- serving returning replicas -------------------------------------------------------------
    def after_commit(self, step: int) -> None:
        """After the optimizer step of ``step``: close the streams of replicas admitted now.

        Also start one for each new request if this rank's replica is the source."""
        nxt = self.decision.next
        for m in self.decision.joined:
            if m in self.sources:
                self.sources.pop(m).close(step)
        for m in [m for m, s in self.sources.items() if s.done]:
            self.sources.pop(m)  # its returning rank was lost
        if self.coords is None or self.member.replica != heal_source(
            nxt.replicas, self.full_pipelines, self.launch
        ):
            return
        for replica in range(self.full.parallel.dp):
            if replica in nxt.replicas:
                continue
            m = self.quorum.join_request(replica)
            if m is None or m in self.sources or self.quorum.is_evicted(m):
                continue
            for old in [o for o in self.sources if o.replica == replica]:
                self.sources.pop(old).close(-1)
            # the returning replica forms its groups in this one's shape before it listens
            self.quorum.set_heal_shape(m, [len(stage) for stage in self.pipelines[0]])
            source = HealSource(
                self.connect,
                heal_prefix(self.full.job_id, m.replica, m.attempt, self.position),
                self.full.faults.timeout_s,
            )
            source.push(
                STATE, step, flatten(heal_tensors(self.model, self.optimizer), "cpu"), self._split()
            )
            source.start()
            self.sources[m] = source

    def finish_serving(self) -> None:
        close_sources(self.sources.values())

    # --- catching up ------------------------------------------------------------------------------
    def _source_shape(self) -> list[int]:
        """The groups of the replica that serves this returning one (tensor-parallel size per
        stage), once it starts serving."""
        end = time.monotonic() + self.full.faults.timeout_s
        while (shape := self.quorum.heal_shape(self.member)) is None:
            if self.quorum.finished():
                raise Evicted(f"replica {self.member.replica}: the job finished before it rejoined")
            if time.monotonic() > end:
                raise RuntimeError(
                    f"catch-up: no replica served replica {self.member.replica} "
                    f"in {self.full.faults.timeout_s:g} s"
                )
            time.sleep(0.01)
        if sum(shape) > self.world:
            raise RuntimeError(
                f"catch-up: the serving replica's groups {shape} need more than this "
                f"replica's {self.world} ranks"
            )
        return shape

    def _mirror(self, shape: list[int]) -> None:
        """Served by a peer whose groups were re-formed: this replica's groups formed in the same
        shape (stage s: the next ``shape[s]`` of its ranks in order, the rest hot spares), so each
        rank takes the state of the peer's rank at its position; its plan's groups follow as it
        rejoins (``take_plan``)."""
        ranks = iter(range(self.world))
        local = [tuple(next(ranks) for _ in range(n)) for n in shape]
        layers = self.model_cfg.layers
        retire_groups(self.reform([local], [balanced_layers(layers, len(local))], [1.0]))
        self.rec.ids.update(dp_rank=self.member.replica)
        self.position = f"{self.stage}.{self.tp.rank}"
        job_rank = {r: g for g, r in self._local.items()}
        self.full_pipelines[self.member.replica] = [
            tuple(job_rank[r] for r in stage) for stage in local
        ]
        self.full_ranges[self.member.replica] = balanced_layers(layers, len(local))

    def _follow_peers(self, local_rank: int, t0: float) -> dict:
        """A returning rank left out of the groups its replica mirrors: it holds nothing, and
        reports each step its peers hold until the quorum admits the replica."""
        active = sorted(r for p in self.pipelines for stage in p for r in stage)
        reported = None
        end = time.monotonic() + self.full.faults.timeout_s
        while (gen := self.quorum.admitted(self.member)) is None:
            if self.quorum.finished():
                raise Evicted(f"replica {self.member.replica}: the job finished before it rejoined")
            held = self.quorum.held(self.member, active)
            if held is not None and held != reported:
                self.quorum.report_held(self.member, local_rank, held)
                reported, end = held, time.monotonic() + self.full.faults.timeout_s
            if time.monotonic() > end:
                raise RuntimeError(f"catch-up: replica {self.member.replica} was not admitted")
            time.sleep(0.01)
        self.gen = gen
        self.decision = self.quorum.admitting(gen)
        return {
            "state_step": None,
            "requested_ts": t0,
            "state_ts": None,
            "admitted_ts": time.time(),
            "from_step": gen.from_step,
            "replayed_steps": 0,
            "bytes": 0,
        }

    def catch_up(self, local_rank: int) -> dict:
        """A relaunched replica's rank: catch up with the survivors until the quorum admits it.

        It takes the survivors' state from a live peer, then their summed gradients step by step.
        Returns what it took."""
        t0 = time.time()
        self.quorum.request_join(self.member)
        shape = self._source_shape()
        if shape != [len(stage) for stage in self.launch[self.member.replica]]:
            self._mirror(shape)
        if self.coords is None:
            return self._follow_peers(local_rank, t0)
        target = HealTarget(
            self.store,
            heal_prefix(self.full.job_id, self.member.replica, self.member.attempt, self.position),
            self.full.faults.timeout_s,
        )
        state_at = held = None
        replayed = 0
        while True:
            kind, step, flat, split = target.next()
            if kind == STATE:
                ranges = ranges_from_counts(
                    split, self.model_cfg.layers, self.pp, source="catch-up split"
                )
                if ranges != self.ranges:  # its source replica's split: rebuilt to take the state
                    self.replica_ranges = [ranges]
                    self.build_stage(*ranges[self.stage], init=False)
                    self.grad_sync.prepare([ranges], self.model_cfg.layers)
                unflatten(flat, heal_tensors(self.model, self.optimizer))
                state_at, held, replayed = time.time(), step, 0
            elif kind == GRAD:
                params = list(self.model.parameters())
                if held is None or step != held + 1:
                    raise RuntimeError(
                        f"catch-up: gradients of step {step} after the state of step {held}"
                    )
                unflatten(flat, _grads(params))
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                held, replayed = step, replayed + 1
            else:
                break
            self.quorum.report_held(self.member, local_rank, held)
        gen = None
        end = time.monotonic() + self.full.faults.timeout_s
        while gen is None and step >= 0 and time.monotonic() < end:
            gen = self.quorum.admitted(self.member)
            if gen is None:
                time.sleep(0.01)
        if gen is None:
            raise Evicted(f"replica {self.member.replica}: the job finished before it rejoined")
        if held != gen.from_step - 1:
            raise RuntimeError(f"catch-up: holds step {held}, admitted at step {gen.from_step}")
        self.gen = gen
        self.decision = self.quorum.admitting(gen)  # its plan is the survivors' from here
        return {
            "state_step": None if state_at is None else gen.from_step - 1 - replayed,
            "requested_ts": t0,
            "state_ts": state_at,
            "admitted_ts": time.time(),
            "from_step": gen.from_step,
            "replayed_steps": replayed,
            "bytes": target.received_bytes,
        }


def heal_source(
    members: list[int], pipelines: list[list[tuple[int, ...]]], launch: list[list[tuple[int, ...]]]
) -> int | None:
    """The replica that serves a returning one (None: no member).

    It is the lowest member whose groups in force are its launch groups, as the returning replica's
    are (it takes the state position by position); where every member was re-formed, the lowest
    member (the returning replica then forms its groups in that one's shape,
    ``ReplicaEngine._mirror``).

    Args:
        members: the replicas in the quorum.
        pipelines: each replica's groups in force, stage by stage.
        launch: each replica's launch groups, stage by stage."""
    same = [d for d in members if pipelines[d] == launch[d]]
    return min(same) if same else min(members, default=None)


def _grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]


def run_replica(
    cfg: RunConfig,
    device: torch.device,
    store: Store,
    connect: Callable[[], Store],
    member: Member,
    tell: list,
) -> None:
    """One rank of replica ``member``: train, commit step by step, serve returning peers.

    A first launch trains from the quorum's generation; a relaunch catches up and joins first.

    Args:
        cfg: the run's configuration.
        device: the rank's device.
        store: the job's store.
        connect: opens another connection to the job's store.
        member: this rank's replica and attempt in the quorum.
        tell: the caller's list, to which this appends ``tell(kind, message)``: report this
            rank's reason to stop on the store."""
    local, per_replica = int(os.environ.get("LOCAL_RANK", "0")), cfg.parallel.pp * cfg.parallel.tp
    job_id = cfg.job_id
    dims = cfg.dims()
    global_rank = dims.rank_of(member.replica, local // cfg.parallel.tp, local % cfg.parallel.tp)
    tell.append(lambda kind, message: report_error(store, job_id, global_rank, kind, message))
    # its own store client: the main thread blocks in store waits (the quorum's decision,
    # rendezvous)
    heart = HeartbeatSender(
        connect(), global_rank, member.replica, interval_s=BEAT_S, prefix=heartbeat_prefix(job_id)
    ).start()
    timeout = timedelta(seconds=cfg.faults.timeout_s)
    # on GPUs each rank of a replica has one of its own (resihp run checks before launching)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.PrefixStore(f"resihp/{job_id}/r{member.replica}/a{member.attempt}", store),
        rank=local,
        world_size=per_replica,
        timeout=timeout,
    )
    engine = ReplicaEngine(
        cfg, device, member, store, connect, drop=cfg.faults.recovery == "replica-drop"
    )
    phase = "stopped"
    publisher = StepPublisher(store, job_id, member.replica)
    try:
        if member.attempt == 0:
            engine.gen = engine.quorum.generation(
                0
            )  # from the step after the checkpoint it resumes
            if cfg.checkpoint.resume:
                engine.resume(Path(cfg.checkpoint.resume), engine.gen.from_step)
        else:
            heart.follow(lambda: engine.rec.progress("join"))
            joined = engine.catch_up(local)
            if local == 0:
                store.set(
                    f"{engine.quorum.prefix}/catchup/{member.replica}/{member.attempt}",
                    json.dumps(joined),
                )
        heart.follow(lambda: engine.rec.progress("train"))
        step = engine.gen.from_step
        while step < cfg.train.steps:
            engine.rec.begin_step(step)
            engine.take_plan(step)
            try:
                result = engine.train_step(step)
            except StepAborted as exc:
                lost = time.time() - _attempt_start(engine)
                engine.abandon_step()
                engine.gen = exc.decision.next
                with engine.rec.op("ft-abort") as row:
                    row["wait_s"] = lost  # the attempt's time, lost to the failure
                continue
            trained = engine.gen  # the members that trained the step committed now
            engine.gen = engine.decision.next
            engine.after_commit(step)
            every = cfg.checkpoint.ckpt_every
            if every and (step + 1) % every == 0 and member.replica == min(trained.replicas):
                engine.save_checkpoint(cfg.ckpt_root() / f"step{step}", step)  # one member writes
            if (
                result.loss is not None
                and member.replica == min(engine.gen.replicas)
                and engine.tp.rank == 0
            ):
                print(
                    f"step {step} loss {result.loss:.4f} tokens {result.tokens} wall "
                    f"{result.wall_s:.3f}s",
                    file=sys.stderr,
                    flush=True,
                )
            if result.loss is not None and not math.isfinite(result.loss):
                raise RuntimeError(f"non-finite loss ({result.loss}) at step {step}")
            engine.injector.before_publish(step)  # committed: a kill here leaves its records unsent
            publisher.publish(engine.rec.take_new())
            step += 1
        phase = "done"
        if local == 0 and member.replica == min(engine.gen.replicas):
            engine.quorum.finish(cfg.train.steps - 1)
    except Evicted as exc:
        print(f"resihp: replica {member.replica}: {exc}", file=sys.stderr, flush=True)
        phase = "evicted"
    finally:
        engine.finish_serving()
        with contextlib.suppress(Exception):
            publisher.publish(engine.rec.take_new())
        heart.finish(phase)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _attempt_start(engine: ReplicaEngine) -> float:
    """When the aborted attempt began (its first row this step), for the time it lost."""
    rows = engine.rec.rows[engine.rec._flushed :]
    return min((r["start_ts"] for r in rows), default=time.time())
