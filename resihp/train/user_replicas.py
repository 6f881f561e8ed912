"""Replica-level fault tolerance for the user's own training loop, shaped as torchft's Manager.

Each data-parallel replica is a torchrun job of its own, all on the job's store (``resihp
replicas``, ``resihp.launch.user_replicas``). ``Replicas`` wraps the user's model, optimizer and
other state and drives resihp's own protocol over them: per step it names the global batch's
shares (one per launched replica) this replica trains, in zero-drift mode the absent replicas'
too; it sums their gradients across the live replicas weighted by tokens, votes and commits on the
quorum (``resihp.ft.quorum``), so an aborted step is redone by the next membership; a relaunched
replica catches up from a live peer (``resihp.ft.heal``) before it trains.

The sum is exact whatever the membership: each share's gradient is a row of its own in the
buffer summed across replicas (the other rows zero, so the sum only moves rows), and every rank
combines the rows in share order. A share's forward runs under torch's generator seeded from the
step and the share, so dropout draws the same numbers whichever replica trains it. With zero-drift
the losses and weights are bitwise those of the failure-free run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from resihp.errors import InputError
from resihp.ft.group import ReplicaGroup
from resihp.ft.heal import (
    END,
    GRAD,
    STATE,
    HealSource,
    HealTarget,
    close_sources,
    flatten,
    heal_prefix,
    unflatten,
)
from resihp.ft.quorum import Decision, Evicted, Generation, Member, Quorum
from resihp.train.replica import ATTEMPT_ENV, REPLICA_ENV
from resihp.train.state import flatten as state_flatten
from resihp.train.state import unflatten as state_unflatten

JOB_ENV, REPLICAS_ENV, STORE_ENV = "RESIHP_JOB", "RESIHP_REPLICAS", "RESIHP_STORE"


def _not_launched(what: str) -> SystemExit:
    """The one line a script started without ``resihp replicas`` stops with (status 2)."""
    print(
        f"resihp: error: Replicas: {what} (run the script under `resihp replicas`)",
        file=sys.stderr,
        flush=True,
    )
    return SystemExit(2)


def _env_int(name: str, low: int) -> int:
    value = os.environ.get(name, "")
    if not value.isdigit() or int(value) < low:
        raise _not_launched(f"environment {name}={value!r}: expected an integer >= {low}")
    return int(value)


def _pack(tensors: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list]:
    """The tensors' bytes as one float32 vector (sent bit for bit), and each one's key, dtype,
    shape."""
    parts = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for _, t in tensors]
    raw = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    pad = (-raw.numel()) % 4
    raw = torch.cat([raw, torch.zeros(pad, dtype=torch.uint8)])
    meta = [[k, str(t.dtype).removeprefix("torch."), list(t.shape)] for k, t in tensors]
    return raw.view(torch.float32), meta


def _unpack(flat: torch.Tensor, meta: list) -> dict[str, torch.Tensor]:
    raw, out, offset = flat.view(torch.uint8), {}, 0
    for key, dtype, shape in meta:
        dt = getattr(torch, dtype)
        n = dt.itemsize * int(torch.Size(shape).numel())
        out[key] = raw[offset : offset + n].clone().view(dt).reshape(shape)
        offset += n
    return out


class Replicas:
    """One rank's part in replica-level fault tolerance over the user's model and optimizer.

    Iterate it for the steps this replica trains (an aborted step comes again); in each, train the
    shares ``shares()`` names, calling ``add(loss, tokens)`` after each share's backward, then
    ``commit()``: it sums, votes and, on a commit, steps the optimizer and the schedulers.

    Args:
        model: the module trained (the whole model on every rank; not wrapped in DDP).
        optimizer: its optimizer, stepped by ``commit``.
        steps: the steps of the job.
        schedulers: LR schedulers stepped after each optimizer step.
        state: further state (anything with ``state_dict``/``load_state_dict``) the same on every
            replica, copied to a returning one with the model and optimizer.
        seed: the seed of each share's generator (with the step and the share).
        drop: leave an absent replica's shares out (the global batch shrinks) instead of
            zero-drift.
        timeout_s: the protocol's and the cross-replica groups' timeout in seconds.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        steps: int,
        schedulers: Sequence[Any] = (),
        state: Mapping[str, Any] | None = None,
        seed: int = 0,
        drop: bool = False,
        timeout_s: float = 60.0,
    ) -> None:
        host, _, port = os.environ.get(STORE_ENV, "").rpartition(":")
        if not host or not port.isdigit():
            raise _not_launched(
                f"environment {STORE_ENV}={os.environ.get(STORE_ENV, '')!r}: expected HOST:PORT "
                "of the job's store"
            )
        job = os.environ.get(JOB_ENV, "")
        if not job:
            raise _not_launched(f"environment {JOB_ENV} unset: expected the job's id")
        self.member = Member(_env_int(REPLICA_ENV, 0), _env_int(ATTEMPT_ENV, 0))
        self.replicas = _env_int(REPLICAS_ENV, 1)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.per_replica = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.model, self.optimizer, self.steps = model, optimizer, steps
        self.schedulers, self.seed, self.drop = list(schedulers), seed, drop
        self.state = {
            "model": model,
            "optimizer": optimizer,
            **{f"scheduler{i}": s for i, s in enumerate(self.schedulers)},
            **(state or {}),
        }
        timeout = timedelta(seconds=timeout_s)
        self.connect = lambda: dist.TCPStore(host, int(port), is_master=False, timeout=timeout)  # noqa: E731
        self.store = self.connect()
        self.job, self.timeout_s = job, timeout_s
        if not dist.is_initialized():  # the replica's own group: its ranks, on the job's store
            prefix = f"resihp/{job}/r{self.member.replica}/a{self.member.attempt}"
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore(prefix, self.store),
                rank=self.local_rank,
                world_size=self.per_replica,
                timeout=timeout,
            )
        self.quorum = Quorum(self.store, job, self.per_replica, timeout_s)
        self.group = ReplicaGroup(self.connect, job, self.member.replica, timeout_s)
        self.gen: Generation | None = None
        self.decision: Decision | None = None
        self.step = -1
        self.catchup: dict | None = None  # what a relaunched replica's catch-up took
        self.sources: dict[Member, HealSource] = {}
        self._rows: dict[int, tuple[torch.Tensor, float, float]] = {}
        self._committed = False
        self._share: int | None = None

    # --- the steps -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        try:
            if self.member.attempt == 0:
                self.gen = self.quorum.generation(0)
            else:
                self.catchup = self._catch_up()
            step = self.gen.from_step
            while step < self.steps:
                self.step, self._committed, self._rows = step, False, {}
                yield step
                if self._committed:
                    step += 1
            if self.local_rank == 0 and self.member.replica == min(self.gen.replicas):
                self.quorum.finish(self.steps - 1)
        except Evicted as exc:
            print(f"resihp: replica {self.member.replica}: {exc}", file=sys.stderr, flush=True)
        finally:
            self._finish_serving()

    def owned(self) -> list[int]:
        """The shares this replica trains this step.

        Its own and, in zero-drift mode, those of the absent replicas (share L goes to member
        L mod the member count)."""
        members = self.gen.replicas
        if self.drop:
            return [self.member.replica]
        return [
            r
            for r in range(self.replicas)
            if (r if r in members else members[r % len(members)]) == self.member.replica
        ]

    def shares(self) -> Iterator[int]:
        """The shares of this step this replica trains, each under a generator of its own."""
        for share in self.owned():
            torch.manual_seed(
                (self.seed * 1_000_003 + self.step * 10_007 + share * 101 + self.local_rank) % 2**63
            )
            self._share = share
            yield share

    def add(self, loss: torch.Tensor | float, tokens: int) -> None:
        """After the backward of the share ``shares()`` gave last: keep its gradients, zeroed.

        Args:
            loss: the share's loss, the mean over its ``tokens`` (its gradients are of it).
            tokens: the tokens the loss averages.
        """
        if self._share is None:
            raise InputError("Replicas.add: called outside `for share in replicas.shares()`")
        grads = [
            p.grad if p.grad is not None else torch.zeros_like(p) for p in self.model.parameters()
        ]
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        self._rows[self._share] = (flatten(grads, "cpu"), value, float(tokens))
        self._share = None
        self.optimizer.zero_grad(set_to_none=False)

    def commit(self) -> float | None:
        """Sum the shares across the live replicas, vote; on a commit step the optimizer.

        Returns the step's loss over the whole batch trained, or None where the step was aborted (a
        replica was lost inside it: the loop trains it again)."""
        params = list(self.model.parameters())
        n = sum(p.numel() for p in params)
        rows = self.replicas * self.per_replica
        buf = torch.zeros(rows, n + 2)
        for share, (grad, loss, tokens) in self._rows.items():
            row = share * self.per_replica + self.local_rank
            buf[row, :n], buf[row, n], buf[row, n + 1] = grad, loss, tokens
        ok = True
        gen, step = self.gen, self.step
        try:
            if self.per_replica > 1:
                dist.all_reduce(buf)
            key = tuple(d * self.per_replica + self.local_rank for d in gen.replicas)

            def decided() -> bool:  # the step was decided without this rank's vote: an abort
                return self.quorum.decided(gen, step)

            if self.group.gen != gen.gen:
                self.group.form(gen, [key], abandon=decided)
            self.group.all_reduce({key: buf}, abandon=decided)
        except (RuntimeError, dist.DistError):
            ok = False  # a member was lost inside the sum: the vote says so, nothing is applied
        decision = self.quorum.vote(gen, step, ok, previous=self.decision) or self.quorum.wait(
            gen, step
        )
        self.decision = decision
        if self.member not in decision.next.members:
            raise Evicted(f"replica {self.member.replica} was evicted at step {step}")
        self.gen = decision.next
        if not decision.commit:
            self.optimizer.zero_grad(set_to_none=False)
            return None
        total, weighted = _combine(buf, n)
        for source in self.sources.values():  # returning ranks replay this step's gradients
            source.push(GRAD, step, total)
        self._apply(total)
        self._committed = True
        self._serve(step)
        return weighted

    def _apply(self, total: torch.Tensor) -> None:
        params = list(self.model.parameters())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        unflatten(total, [p.grad for p in params])
        self.optimizer.step()
        for s in self.schedulers:
            s.step()
        self.optimizer.zero_grad(set_to_none=False)

    # --- serving a returning replica -------------------------------------------------------------
    def _serve(self, step: int) -> None:
        """After the optimizer step of ``step``: end the streams of replicas admitted now and, on
        the lowest member, start one for each new join request."""
        nxt = self.decision.next
        for m in self.decision.joined:
            if m in self.sources:
                self.sources.pop(m).close(step)
        for m in [m for m, s in self.sources.items() if s.done]:
            self.sources.pop(m)  # its returning rank was lost
        if self.member.replica != min(nxt.replicas):
            return
        for replica in range(self.replicas):
            if replica in nxt.replicas:
                continue
            m = self.quorum.join_request(replica)
            if m is None or m in self.sources or self.quorum.is_evicted(m):
                continue
            for old in [o for o in self.sources if o.replica == replica]:
                self.sources.pop(old).close(-1)
            prefix = heal_prefix(self.job, m.replica, m.attempt, f"0.{self.local_rank}")
            tensors, tree = state_flatten(self.state)
            flat, meta = _pack(tensors)
            self.store.set(f"{prefix}/tree/{step}", json.dumps({"tree": tree, "meta": meta}))
            self.quorum.set_heal_shape(m, [self.per_replica])
            source = HealSource(self.connect, prefix, self.timeout_s)
            source.push(STATE, step, flat)
            source.start()
            self.sources[m] = source

    def _finish_serving(self) -> None:
        close_sources(self.sources.values())

    # --- catching up -----------------------------------------------------------------------------
    def _catch_up(self) -> dict:
        """A relaunched replica's rank: a live peer's state, then the summed gradients of each step
        the survivors commit, until the quorum admits this replica. Returns what it took."""
        t0 = time.time()
        self.quorum.request_join(self.member)
        end = time.monotonic() + self.timeout_s
        while self.quorum.heal_shape(self.member) is None:
            if self.quorum.finished():
                raise Evicted("the job finished before it rejoined")
            if time.monotonic() > end:
                raise RuntimeError(f"catch-up: no replica served this one in {self.timeout_s:g} s")
            time.sleep(0.01)
        prefix = heal_prefix(
            self.job, self.member.replica, self.member.attempt, f"0.{self.local_rank}"
        )
        target = HealTarget(self.store, prefix, self.timeout_s)
        held, state_step, replayed = None, None, 0
        while True:
            kind, step, flat, _ = target.next()
            if kind == STATE:
                doc = json.loads(self.store.get(f"{prefix}/tree/{step}"))
                tensors = _unpack(flat, doc["meta"])
                for name, value in self.state.items():
                    value.load_state_dict(state_unflatten(doc["tree"][name], tensors))
                held, state_step, replayed = step, step, 0
            elif kind == GRAD:
                if held is None or step != held + 1:
                    raise RuntimeError(f"catch-up: gradients of step {step} after state {held}")
                self._apply(flat)
                held, replayed = step, replayed + 1
            elif kind == END:
                break
            self.quorum.report_held(self.member, self.local_rank, held)
        gen = None
        end = time.monotonic() + self.timeout_s
        while gen is None and step >= 0 and time.monotonic() < end:
            gen = self.quorum.admitted(self.member)
            if gen is None:
                time.sleep(0.01)
        if gen is None:
            raise Evicted("the job finished before it rejoined")
        if held != gen.from_step - 1:
            raise RuntimeError(f"catch-up: holds step {held}, admitted at step {gen.from_step}")
        self.gen, self.decision = gen, self.quorum.admitting(gen)
        return {
            "state_step": state_step,
            "replayed_steps": replayed,
            "from_step": gen.from_step,
            "bytes": target.received_bytes,
            "seconds": round(time.time() - t0, 3),
        }


def _combine(buf: torch.Tensor, n: int) -> tuple[torch.Tensor, float]:
    """The rows' gradients weighted by their tokens, in row order, and the batch's loss."""
    tokens = buf[:, n + 1]
    total = torch.zeros(n)
    for row in range(buf.shape[0]):
        if tokens[row] > 0:
            total += buf[row, :n] * tokens[row]
    weight = float(tokens.double().sum())
    loss = sum(float(buf[r, n]) * float(tokens[r]) for r in range(buf.shape[0])) / max(weight, 1.0)
    return total / max(weight, 1.0), loss
