"""The launcher's reader of the control plane, when a replica dies after the quorum committed a step
and before its ranks published that step's records: the step is taken with what the survivors sent
(their rows carry the step's global loss), and the reader goes on instead of waiting forever."""

from __future__ import annotations

import torch.distributed as dist

from resihp.train.controlplane import StepPublisher, StepReader

JOB = "reader-lost"
NODES = {0: [0, 2], 1: [1, 3]}  # replica -> its ranks (DP 2 x PP 2, node = replica)


def _publish(store, node: int, rank: int, step: int) -> None:
    row = {
        "step": step,
        "rank": rank,
        "dp_rank": node,
        "stage": rank // 2,
        "tp_rank": 0,
        "optype": "step",
        "start_ts": float(step),
        "duration": 0.5,
        "tokens": 100,
        "loss": 3.0 - 0.1 * step,
    }
    StepPublisher(store, JOB, node).publish([row])


def test_a_replica_lost_after_a_commit_does_not_stop_the_reader():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set(f"resihp/{JOB}/cp/ops/first", "0")
    committed = {
        0: [0, 1],
        1: [0, 1],
        2: [0, 1],
        3: [0],
        4: [0, 1],
    }  # replica 1 relaunched at step 4
    reader = StepReader(store, JOB, NODES, owner=True, members=committed.get)
    for step in range(5):
        for node in committed[step]:
            for rank in NODES[node]:
                if (step, rank) != (
                    2,
                    3,
                ):  # rank 3 was killed after step 2's commit, before publishing
                    _publish(store, node, rank, step)
    # a follower (``resihp follow --store``) reads the same steps
    follower = StepReader(store, JOB, NODES, members=committed.get)
    for r in (reader, follower):
        assert [s.step for s in r.complete_steps()] == [
            0,
            1,
        ]  # step 2 lacks rank 3: not complete yet
        assert r.complete_steps() == []
    reader.lost(1, before_step=3)  # the supervisor: replica 1's attempt trained no step from 3 on
    for r in (reader, follower):  # the follower learns it from the owner, on the store
        steps = r.complete_steps()
        assert [s.step for s in steps] == [2, 3, 4]
        # step 2 with every part that was sent (rank 1's too), step 4 with the relaunched replica's
        assert sorted(p.rank for p in steps[0].parts) == [0, 1, 2]
        assert sorted(p.rank for p in steps[2].parts) == [0, 1, 2, 3]
    assert follower.skipped == 0


def test_the_relaunched_replicas_steps_are_still_waited_for():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set(f"resihp/{JOB}/cp/ops/first", "0")
    committed = {0: [0, 1], 1: [0], 2: [0, 1]}
    reader = StepReader(store, JOB, NODES, owner=True, members=committed.get)
    reader.lost(1, before_step=1)
    for step, nodes in committed.items():
        for node in nodes:
            for rank in NODES[node]:
                if not (
                    step == 2 and rank == 3
                ):  # the relaunch's rank 3 has not published step 2 yet
                    _publish(store, node, rank, step)
    assert [s.step for s in reader.complete_steps()] == [0, 1]
    _publish(store, 1, 3, 2)
    assert [s.step for s in reader.complete_steps()] == [2]
