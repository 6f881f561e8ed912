"""Which recovery a launch's typed outcome calls for (``resihp.launch.recovery``), decided alone:
the end-to-end relaunches themselves are proved by test_runtime_cli, test_snapshot_faults and
test_replica_ft."""

from __future__ import annotations

import pytest

from resihp.launch.recovery import (
    STRATEGIES,
    ExcludeRank,
    LaunchResult,
    RelaunchReplicas,
    RestartInPlace,
    recovery_for,
)
from resihp.launch.supervisor import Outcome, fail_stop
from resihp.parallel import ParallelDims
from resihp.train.config import RunConfig
from resihp.train.nodes import Nodes


def _result(outcome: Outcome, nnodes: int = 1, **flags) -> LaunchResult:
    cfg = RunConfig.from_flags(dp=2, pp=2, steps=20, **flags)
    nodes = Nodes(nnodes=nnodes, node_rank=0, nproc_per_node=4 // nnodes)
    return LaunchResult(cfg, outcome, {}, nodes)


def _lost(rank: int = 1) -> Outcome:
    return Outcome(returncode=1, failure=fail_stop(ParallelDims(2, 2), rank, 5, "exited"))


def test_a_lost_rank_is_restarted_in_place_under_recovery_restart():
    assert isinstance(recovery_for(_result(_lost(), recovery="restart")), RestartInPlace)


def test_a_lost_rank_with_checkpoints_is_excluded_outside_replica_mode():
    assert isinstance(recovery_for(_result(_lost(), recovery="none", ckpt_every=5)), ExcludeRank)


def test_every_replica_lost_relaunches_them_from_the_checkpoint_on_one_node_only():
    gone = Outcome(returncode=1, all_replicas_lost=True)
    flags = {"recovery": "replica", "ckpt_every": 5}
    assert isinstance(recovery_for(_result(gone, **flags)), RelaunchReplicas)
    assert recovery_for(_result(gone, nnodes=2, **flags)) is None


@pytest.mark.parametrize(
    "outcome, flags",
    [
        (Outcome(returncode=0), {"recovery": "restart"}),  # it finished
        (_lost(), {"recovery": "none"}),  # no checkpoint to go on from
        (_lost(), {"recovery": "replica", "ckpt_every": 5}),  # the other replicas trained on
        (Outcome(returncode=1, interrupted="SIGTERM"), {"recovery": "restart"}),
        (Outcome(returncode=2, input_error=True, error="bad"), {"recovery": "restart"}),
        (Outcome(returncode=1, errors=[{"kind": "stop"}]), {"recovery": "restart"}),
    ],
)
def test_no_recovery_where_the_outcome_does_not_call_for_one(outcome, flags):
    assert recovery_for(_result(outcome, **flags)) is None


def test_an_interrupted_launch_is_never_recovered_by_any_strategy():
    outcome = _lost()
    outcome.interrupted = "SIGINT"
    for flags in ({"recovery": "restart"}, {"recovery": "none", "ckpt_every": 5}):
        assert not any(s.applies(_result(outcome, **flags)) for s in STRATEGIES)
