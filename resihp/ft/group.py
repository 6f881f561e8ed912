"""This rank's cross-replica groups, re-formed for each membership.

For each set of ranks that hold the same block of parameters in every member replica, a gloo process
group built straight on the job's store (not through the default world, which a lost replica
leaves), one set per membership (generation). A ``key`` is such a set: one job rank of each member
replica (``resihp.train.gradsync.Pieces``). When every replica has the same layout there is one key
per (stage, tensor-parallel rank) position; when replicas split their layers differently, or differ
in depth or tensor-parallel size, a block's holders sit at other positions, and each distinct key
has a group of its own, formed the first time it is summed. A rank's index in a group is its
replica's among the members. A group whose members changed is dropped without a collective (it may
hold a dead peer) and new ones formed under a fresh store prefix.

Every rank sums its keys in ascending order, so two ranks never wait on each other's later group
(a cycle would need one of them to go back to a smaller key).

A sum is waited on in slices, not by one blocking wait: when a member is lost, the survivors beside
it in a ring may not see the dead peer at all, only a survivor that left the sum on its own error
(its retired group keeps the connection open), and would wait for the group's timeout. ``abandon``
(the quorum decided the step without this rank's vote: an abort) lets them leave at once. The
slices end on the sum's completion (a callback on its future), not on a sleep, so a sum that
finishes is noticed at once. Forming a generation's groups is left the same way: a returning replica
admitted and lost before it reached the rendezvous would otherwise hold the survivors for the
group's whole timeout (each rendezvous runs on a thread, on a store client of its own).

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


def gloo_group(
    store: Store, prefix: str, rank: int, size: int, timeout_s: float
) -> dist.ProcessGroup:
    """A gloo group of ``size`` ranks on ``store`` under ``prefix`` (loopback when the job is).

    Args:
        store: the job's store the group rendezvouses on.
        prefix: the store prefix of this group's keys.
        rank: this process's index in the group.
        size: the group's ranks.
        timeout_s: the group's collective timeout in seconds.
    """
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    opts._devices = [
        dist.ProcessGroupGloo.create_device(interface=iface)
        if iface
        else dist.ProcessGroupGloo.create_default_device()
    ]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, opts)


class GroupAbandoned(RuntimeError):
    """The sum was left unfinished: the step it belongs to was already decided (aborted)."""


Key = tuple[int, ...]  # the ranks that sum a bucket: one (job rank) of each member replica


class ReplicaGroup:
    """This rank's cross-replica groups, one set per membership generation.

    ``connect``: a new client of the job's store, one per rendezvous. A TCPStore client is one
    socket behind one lock: a rendezvous blocked on a dead peer would hold up every other call
    through the client it uses, the quorum's ``decided`` that lets this rank leave it too."""

    def __init__(
        self, connect: Callable[[], Store], job_id: str, replica: int, timeout_s: float
    ) -> None:
        self.connect, self.job_id = connect, job_id
        self.replica, self.timeout_s = replica, timeout_s
        self.gen: int | None = None
        self.replicas: list[int] = []
        self.groups: dict[Key, dist.ProcessGroup] = {}
        self._retired: list[
            dist.ProcessGroup
        ] = []  # kept: a group with a dead peer is never waited on

    @property
    def size(self) -> int:
        """The member replicas of the generation formed last."""
        return len(self.replicas)

    def form(
        self,
        gen: Generation,
        keys: list[Key],
        abandon: Callable[[], bool] | None = None,
        check_s: float = 0.05,
    ) -> None:
        """Collective over the generation's members: start generation ``gen``.

        Nothing if it is the one in force; a later plan's new keys form as they are first summed.

        Args:
            gen: the generation to start.
            keys: the keys whose groups are formed now.
            abandon: as in ``all_reduce``: a member that died before it reached the rendezvous
                would hold the others for the group's whole timeout.
            check_s: seconds between the ``abandon`` checks.
        """
        if self.gen != gen.gen:
            self._retired += self.groups.values()
            self.groups, self.gen, self.replicas = {}, gen.gen, list(gen.replicas)
        if self.size > 1:
            for key in sorted(keys):
                self._group(key, abandon, check_s)

    def _group(
        self, key: Key, abandon: Callable[[], bool] | None, check_s: float
    ) -> dist.ProcessGroup:
        """Collective over the ranks of ``key``: this generation's group of them. The rendezvous
        runs on a thread of its own (gloo's constructor blocks in C++, without the GIL), left to
        time out where ``abandon`` says the step was decided without this rank."""
        if key in self.groups:
            return self.groups[key]
        name = "-".join(map(str, key))
        args = (
            self.connect(),
            f"resihp/{self.job_id}/ft/pg/{self.gen}/{name}",
            self.replicas.index(self.replica),
            self.size,
            self.timeout_s,
        )
        made: dict[str, object] = {}

        def rendezvous() -> None:
            try:
                made["group"] = gloo_group(*args)
            except (RuntimeError, dist.DistError) as exc:
                made["error"] = exc

        thread = threading.Thread(target=rendezvous, name="resihp-ft-form", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(check_s)
            if thread.is_alive() and abandon is not None and abandon():
                raise GroupAbandoned(
                    f"generation {self.gen}: the step was decided without this rank"
                )
        if "error" in made:
            raise made["error"]
        self.groups[key] = made["group"]
        return self.groups[key]

    def all_reduce(
        self,
        buckets: dict[Key, torch.Tensor],
        abandon: Callable[[], bool] | None = None,
        check_s: float = 0.05,
    ) -> None:
        """Sum each bucket over the ranks of its key (in place), keys in ascending order.

        Args:
            buckets: per key, the flat tensor summed over that key's group.
            abandon: asked every ``check_s`` while a sum is in flight; True leaves it with
                ``GroupAbandoned`` and the group is not used again (None: wait to the end).
            check_s: seconds between the ``abandon`` checks.
        """
        if self.size < 2:
            return
        for key in sorted(buckets):
            work = self._group(key, abandon, check_s).allreduce([buckets[key]])
            if abandon is not None:
                done = threading.Event()
                work.get_future().add_done_callback(lambda _, done=done: done.set())
                while not done.wait(check_s):
                    if abandon():
                        raise GroupAbandoned(
                            f"generation {self.gen}: the step was decided without this rank"
                        )
            work.wait()  # the sum's own error, if it failed
