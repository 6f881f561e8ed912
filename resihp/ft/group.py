"""This rank's cross-replica group: the ranks at its (stage, tensor-parallel rank) position in every
member replica, as a gloo process group built straight on the job's store (not through the
default world, which a lost replica leaves), one generation per membership. A group whose
members changed is dropped without a collective (it may hold a dead peer) and a new one formed
under a fresh store prefix."""

from __future__ import annotations

import datetime
import os

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

    def all_reduce(self, flat: torch.Tensor) -> None:
        """Sum ``flat`` over the members (in place)."""
        if self.pg is not None:
            self.pg.allreduce([flat]).wait()
