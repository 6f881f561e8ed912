"""This rank's cross-replica group: the ranks at its (stage, tensor-parallel rank) position in every
member replica, as a gloo process group built straight on the job's store (not through the
default world, which a lost replica leaves), one generation per membership. A group whose
members changed is dropped without a collective (it may hold a dead peer) and a new one formed
under a fresh store prefix.

A sum is waited on in slices, not by one blocking wait: when a member is lost, the survivors beside
it in a ring may not see the dead peer at all, only a survivor that left the sum on its own error
(its retired group keeps the connection open), and would wait for the group's timeout. ``abandon``
(the quorum decided the step without this rank's vote: an abort) lets them leave at once. The
slices end on the sum's completion (a callback on its future), not on a sleep, so a sum that
finishes is noticed at once.

On a GPU the group is still gloo (it stages CUDA tensors through host memory): a NCCL group with a
dead peer must be aborted, not dropped, and several ranks of one host may share a GPU here."""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import Store

from resihp.ft.quorum import Generation


def gloo_group(store: Store, prefix: str, rank: int, size: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of ``size`` ranks on ``store`` under ``prefix`` (loopback when the job is)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    opts._devices = [dist.ProcessGroupGloo.create_device(interface=iface) if iface
                     else dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, opts)


class GroupAbandoned(RuntimeError):
    """The sum was left unfinished: the step it belongs to was already decided (aborted)."""


class ReplicaGroup:
    def __init__(self, store: Store, job_id: str, position: str, replica: int, timeout_s: float) -> None:
        self.store, self.job_id, self.position = store, job_id, position
        self.replica, self.timeout_s = replica, timeout_s
        self.gen: int | None = None
        self.pg: dist.ProcessGroup | None = None
        self.size = 0
        self._retired: list[dist.ProcessGroup] = []  # kept: a group with a dead peer is never waited on

    def form(self, gen: Generation) -> None:
        """Collective over the generation's members at this position (a no-op if already formed)."""
        if self.gen == gen.gen:
            return
        if self.pg is not None:
            self._retired.append(self.pg)
        self.pg, self.gen = None, None
        replicas = gen.replicas
        self.size = len(replicas)
        if self.size > 1:
            self.pg = gloo_group(self.store, f"resihp/{self.job_id}/ft/pg/{gen.gen}/{self.position}",
                                 replicas.index(self.replica), self.size, self.timeout_s)
        self.gen = gen.gen

    def all_reduce(self, flat: torch.Tensor, abandon: Callable[[], bool] | None = None,
                   check_s: float = 0.05) -> None:
        """Sum ``flat`` over the members (in place). ``abandon`` (asked every ``check_s`` while the
        sum is in flight): True leaves it with ``GroupAbandoned``; the group is not used again."""
        if self.pg is None:
            return
        work = self.pg.allreduce([flat])
        if abandon is not None:
            done = threading.Event()
            work.get_future().add_done_callback(lambda _: done.set())
            while not done.wait(check_s):
                if abandon():
                    raise GroupAbandoned(f"generation {self.gen}: the step was decided without this rank")
        work.wait()  # the sum's own error, if it failed
