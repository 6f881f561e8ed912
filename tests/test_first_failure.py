"""Which rank died first when node 0 finds several of another node's ranks gone in one look: that
node's torchrun stops a dead rank's peers within its monitor interval, so the lowest rank found is
not necessarily the one that died. torchrun's own first observed failure settles it; the node's
launcher publishes it on the job's store (a real TCPStore here)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from resihp.launch import supervisor
from resihp.launch.supervisor import _first_gone, fail_stop, torchrun_first_failure
from resihp.parallel import ParallelDims
from resihp.train.controlplane import publish_first_failure, report_error

DIMS = ParallelDims(dp=2, pp=2)


def _torchrun_output(tmp_path) -> list[str]:
    """What torchrun prints on node 1 (ranks 2 and 3 of the job) when its local rank 1 is killed
    and it then stops local rank 0: torch's own message. torchrun's global ranks follow its
    rendezvous order: node 1 joined first here, so they are 0 and 1, not the job's 2 and 3."""
    killed = ProcessFailure(
        local_rank=1, pid=4242, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none")
    )
    stopped = ProcessFailure(
        local_rank=0, pid=4241, exitcode=-signal.SIGTERM, error_file=str(tmp_path / "none")
    )
    stopped.timestamp = killed.timestamp + 1  # stopped after the kill was observed
    error = ChildFailedError("resihp.train.worker", {0: stopped, 1: killed})
    return ["some worker output", *error.format_msg().splitlines(), "more output"]


def test_torchrun_first_failure_names_the_jobs_rank_from_the_local_rank(tmp_path):
    lines = _torchrun_output(tmp_path)
    assert torchrun_first_failure(lines, first_rank=2) == (3, -signal.SIGKILL)
    assert torchrun_first_failure(["no failure here"], first_rank=2) is None


@pytest.fixture
def store():
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield host
    del host


def _watch(store) -> SimpleNamespace:
    return SimpleNamespace(store=store, cfg=SimpleNamespace(job_id="job"))


def _both_gone() -> list:
    return [
        fail_stop(DIMS, 2, 4, "exited", 0.5, node=1),
        fail_stop(DIMS, 3, 4, "exited", 0.9, node=1),
    ]


def test_several_ranks_of_another_node_found_gone_together_take_that_nodes_first_failure(
    store, tmp_path
):
    node1 = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    first = torchrun_first_failure(_torchrun_output(tmp_path), first_rank=2)
    publish_first_failure(node1, "job", 1, *first)
    assert _first_gone(_both_gone(), _watch(store)).rank == 3


def test_without_a_published_first_failure_the_lowest_rank_is_taken_after_a_bounded_wait(
    store, monkeypatch
):
    monkeypatch.setattr(supervisor, "FIRST_FAILURE_WAIT_S", 0.3)
    assert _first_gone(_both_gone(), _watch(store)).rank == 2
    # one rank gone, or ranks of node 0 (its own torchrun output settles those): no wait, no store
    one = [fail_stop(DIMS, 3, 4, "exited", node=1)]
    assert _first_gone(one, SimpleNamespace(store=None, cfg=None)).rank == 3
    local = [fail_stop(DIMS, 0, 4, "exited", node=0), fail_stop(DIMS, 1, 4, "exited", node=0)]
    assert _first_gone(local, SimpleNamespace(store=None, cfg=None)).rank == 0


def test_a_first_failure_of_a_rank_not_among_those_found_is_not_taken(store):
    publish_first_failure(store, "job", 1, 7, -9)  # a stale or unrelated record
    assert _first_gone(_both_gone(), _watch(store)).rank == 2


def test_a_rank_that_reported_losing_its_peer_is_not_the_one_that_died(store, tmp_path):
    """Node 0's own ranks 2 and 3 found gone in one look (CI saw it: rank 3 killed, rank 2's receive
    from it failed within milliseconds): torchrun stamps failures in whole seconds, so its first
    observed failure names the lower local rank, exit 1. Its table also lists rank 3, killed by a
    signal, which is taken; and rank 2 said on the control plane that it lost a peer."""
    killed = ProcessFailure(
        local_rank=3, pid=4243, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none")
    )
    lost = ProcessFailure(local_rank=2, pid=4242, exitcode=1, error_file=str(tmp_path / "none"))
    lost.timestamp = killed.timestamp  # the same second
    lines = ChildFailedError("resihp.train.worker", {2: lost, 3: killed}).format_msg().splitlines()
    assert torchrun_first_failure(lines, first_rank=0) == (
        3,
        -signal.SIGKILL,
    )  # not rank 2's exit 1
    both = [
        fail_stop(DIMS, 2, 4, "exited", 0.1, node=0),
        fail_stop(DIMS, 3, 4, "exited", 0.2, node=0),
    ]
    assert _first_gone(both, _watch(store)).rank == 2  # nothing said yet: the lowest
    report_error(store, "job", 2, "lost-peer", "Connection closed by peer [127.0.0.1]:29500")
    assert _first_gone(both, _watch(store)).rank == 3
    # every rank found gone said it lost a peer (the dead one is not among them): the lowest
    report_error(store, "job", 3, "lost-peer", "Connection closed by peer")
    assert _first_gone(both, _watch(store)).rank == 2
