"""Replica-level fault tolerance (``resihp run --recovery replica``) with real processes and real
signals: one rank of one replica is killed (SIGKILL) or hangs (its main thread blocked while its
heartbeat goes on, or SIGSTOP) at a random step; the other replicas are never restarted, the lost
replica is relaunched alone, catches up from a live peer and rejoins, and every step's loss equals
the failure-free run's within 1e-5 relative (zero-drift: the survivors train its micro-batches
while it is away). Also: a second failure of the returning replica, the loss of the replica that
serves the catch-up (nothing left to go on from: a one-line reason), drop mode (its losses equal
one process replaying the recorded membership), bad input."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch.distributed as dist

from resihp.ckpt.integrity import problem
from resihp.control import ControlConfig
from resihp.detect.records import SIGNATURE, signed_json
from resihp.ft.quorum import DecisionChain, Generation, Member, Quorum
from resihp.model.config import GPTConfig
from resihp.parallel import ParallelDims
from resihp.train.gradsync import Pieces
from resihp.train.replica import heal_source
from tests.faults import announced, children_map
from tests.gloo_ranks import spawn_ranks
from tests.replica_replay import ISSUE_STEPS, replay_membership


def unsigned(doc: dict) -> dict:
    """A signed record's fields (its signature left out)."""
    return {k: v for k, v in doc.items() if k != SIGNATURE}


SMALL = [
    "--layers",
    "2",
    "--hidden",
    "64",
    "--heads",
    "2",
    "--ffn-hidden",
    "128",
    "--vocab",
    "256",
    "--global-tokens",
    "2048",
    "--budget",
    "256",
    "--max-len",
    "256",
    "--json",
    "--timeout",
    "60",
    "--no-live",
]  # recovery alone; live re-planning in this mode has its own test below
# a lost replica rejoins about 5 steps after its failure (at step 5-19) here, its agent forked warm
# (``launch/warm.py``); 20-25 steps where the agent starts cold (a machine with a GPU)
STEPS = 50
TWICE_STEPS = 80  # two relaunches in a row
RTOL = 1e-5


def _run(out: Path, *args: str, timeout: float = 300) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "run", "-o", str(out), *SMALL, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    summary = (
        json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    )
    return proc.returncode, summary, proc.stderr


def _start(out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "resihp.cli", "run", "-o", str(out), *SMALL, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _pids(out: Path, replica: int, attempt: int) -> list[int]:
    """The worker processes of one launch of a replica of the run in ``out``."""
    return [e["pid"] for e in announced(out) if (e["replica"], e["attempt"]) == (replica, attempt)]


def _wait_pids(out: Path, replica: int, attempt: int, timeout_s: float = 120) -> list[int]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        pids = _pids(out, replica, attempt)
        if pids:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"replica {replica} attempt {attempt} never started")


def _same_losses(got: list, want: list, what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} steps, expected {len(want)}"
    for step, (a, b) in enumerate(zip(got, want)):
        assert a is not None and abs(a - b) <= RTOL * abs(b), f"{what}: step {step} loss {a} != {b}"


def _trained_every_step(out: Path, ranks: list[int], steps: int) -> None:
    """Each of ``ranks`` committed every step below ``steps`` exactly once (it never restarted or
    skipped one)."""
    rows = [json.loads(line) for line in (out / "ops.jsonl").read_text().splitlines()]
    for r in ranks:
        done = sorted(
            row["step"]
            for row in rows
            if row["rank"] == r and row["optype"] == "step" and row["step"] < steps
        )
        assert done == list(range(steps)), f"rank {r} trained steps {done[:5]}..., not each once"


# --- the quorum, on a real store (one client per rank, as in the job) -----------------------------
def test_the_supervisor_writes_the_commit_record_of_a_decider_that_died_after_its_decision():
    """The last voter of a step writes the decision, then the record of which replicas trained it;
    killed in between (a replica lost mid-commit), the record was never written and the launcher's
    trace reader waited for that step, and every later one, forever (the trace and the losses
    stopped there while the job trained on). The supervisor's walk along the decisions writes it."""
    import torch.distributed as dist

    class Dies:  # the decider's store: its process dies right after the decision is written
        def __init__(self, store):
            self.store = store

        def __getattr__(self, name):
            return getattr(self.store, name)

        def set(self, key, value):
            raise ConnectionError("the deciding rank was killed")

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def quorum():
        return Quorum(
            dist.TCPStore("127.0.0.1", host.port, is_master=False),
            "job",
            ranks_per_replica=1,
            timeout_s=5,
        )

    q, sup = [quorum(), quorum()], quorum()  # two ranks (one per replica) and the supervisor
    gen = q[0].start([Member(0), Member(1)], 0)
    chain = DecisionChain(sup, gen)
    q[1].store = Dies(q[1].store)
    assert q[0].vote(gen, 0, True) is None
    with pytest.raises(ConnectionError):
        q[1].vote(gen, 0, True)
    assert q[0].wait(gen, 0).commit and q[0].committed(0) is None  # decided, not recorded
    chain.advance()
    assert q[0].committed(0) == [0, 1] and chain.step == 1
    # a decision that admits a returning replica (a new generation): its admission and the
    # generation are written for a decider that died too, or the returning replica waits forever
    sup.evict(Member(1, 0), "exited")
    assert not chain.abort_for(Member(1, 0)).commit
    chain.advance()
    alone = chain.gen
    sup.set_replicas(2)
    joiner = Member(1, 1)
    sup.request_join(joiner)
    sup.report_held(joiner, 0, 0)
    q[0].store = Dies(q[0].store)
    with pytest.raises(ConnectionError):
        q[0].vote(alone, 1, True)
    assert sup.admitted(joiner) is None and sup.committed(1) is None
    chain.advance()
    admitted = sup.admitted(joiner)
    assert admitted is not None and admitted.replicas == [0, 1] and admitted.from_step == 2
    assert sup.committed(1) == [0] and chain.gen == admitted


def test_a_replica_admitted_after_its_eviction_is_aborted_by_the_supervisor():
    """A returning replica is killed while the last survivor decides the step that admits it: the
    decider read its join before the eviction and writes after it, and the supervisor's abort came
    first and found the chain before that decision (nothing to abort). The next generation names a
    dead replica, the survivors wait on it (a CI-like run judged them hung); the supervisor's walk
    aborts that attempt without it."""
    import torch.distributed as dist

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def quorum():
        return Quorum(
            dist.TCPStore("127.0.0.1", host.port, is_master=False),
            "job",
            ranks_per_replica=1,
            timeout_s=5,
        )

    survivor, sup = quorum(), quorum()
    gen = survivor.start([Member(0)], 0)
    sup.set_replicas(2)
    chain = DecisionChain(sup, gen)
    joiner = Member(1, 1)
    sup.request_join(joiner)
    sup.report_held(joiner, 0, 0)
    sup.evict(joiner, "exited")
    assert chain.abort_for(joiner) is None  # not a member of the attempt in flight
    # the decider's look at the join came before the eviction: it admits the evicted replica
    is_evicted = survivor.is_evicted
    survivor.is_evicted = lambda m: False
    decision = survivor.vote(gen, 0, True) or survivor.wait(gen, 0)
    survivor.is_evicted = is_evicted
    assert decision.commit and joiner in decision.next.members
    chain.advance()
    assert joiner in chain.gen.members and chain.step == 1
    chain.abort_evicted()
    # step 1 under the generation that names it: aborted, redone by the survivor alone
    assert not survivor.decision(decision.next.gen, 1).commit
    assert chain.gen.members == (Member(0),) and chain.step == 1, chain.gen


def test_quorum_commits_only_a_full_vote_and_aborts_on_eviction():
    import torch.distributed as dist

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = lambda: dist.TCPStore("127.0.0.1", host.port, is_master=False)  # noqa: E731
    q = [Quorum(client(), "job", ranks_per_replica=2, timeout_s=5) for _ in range(4)]
    gen = q[0].start([Member(0), Member(1)], 0)
    assert [q[i].vote(gen, 0, True) for i in range(3)] == [None] * 3  # not everyone yet
    last = q[3].vote(gen, 0, True)
    assert last.commit and (last.next.gen, last.next.members) == (gen.gen, gen.members)
    assert last.next.from_step == 1 and q[0].wait(gen, 0) == last
    assert q[0].committed(0) == [0, 1]
    # step 1: a rank's sum failed; nothing commits until the supervisor evicts its replica
    q[0].vote(gen, 1, True)
    q[2].vote(gen, 1, False)
    chain = DecisionChain(q[0], gen)  # the supervisor's
    q[0].evict(Member(1, 0), "exited")
    assert chain.abort_for(Member(1, 0)) is not None
    aborted = q[1].wait(gen, 1)
    assert not aborted.commit and aborted.next.replicas == [0] and aborted.next.from_step == 1
    assert q[0].wait(gen, 1) == aborted  # the same decision for every rank (written once)
    # the relaunched replica is admitted once all its ranks hold the state after step - 1
    q[0].set_replicas(2)
    joiner = Member(1, 1)
    q[2].request_join(joiner)
    q[2].report_held(joiner, 0, 1)
    nxt = aborted.next
    for i in range(2):
        d = q[i].vote(nxt, 1, True)
    assert (
        d.commit and d.joined == () and d.next.members == nxt.members
    )  # a joiner rank is not there yet
    q[3].report_held(joiner, 1, 1)
    for i in range(2):
        d = q[i].vote(nxt, 2, True)
    assert (
        d.commit and d.joined == (joiner,) and d.next.replicas == [0, 1] and d.next.from_step == 3
    )
    assert q[2].admitted(joiner) == d.next
    # an eviction after the step in flight committed aborts the next one instead
    q[0].evict(Member(1, 1), "hang")
    d = chain.abort_for(Member(1, 1))
    assert not d.commit and d.step == 3 and d.next.replicas == [0]
    assert chain.abort_for(Member(1, 1)) is None  # already out


def test_commits_carry_the_newest_plan_change_and_a_joiner_gets_its_admitting_one():
    import torch.distributed as dist

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = lambda: dist.TCPStore("127.0.0.1", host.port, is_master=False)  # noqa: E731
    q = [
        Quorum(client(), "job", ranks_per_replica=1, timeout_s=5, plan_key="plan") for _ in range(2)
    ]
    gen = q[0].start([Member(0), Member(1)], 0)
    q[0].vote(gen, 0, True)
    assert q[1].vote(gen, 0, True).plan is None  # nothing posted yet
    host.set("plan", signed_json({"id": 1, "dp_weights": [2.0, 1.0]}))
    q[0].vote(gen, 1, True)
    d1 = q[1].vote(gen, 1, True)
    assert unsigned(d1.plan) == {"id": 1, "dp_weights": [2.0, 1.0]} and q[0].wait(gen, 1) == d1
    q[0].evict(Member(1, 0), "exited")
    q[0].vote(gen, 2, True)
    aborted = DecisionChain(q[0], gen).abort_for(Member(1, 0))
    assert not aborted.commit and aborted.plan is None  # an abort carries no plan
    host.set("plan", signed_json({"id": 2, "dp_weights": [1.0, 1.0]}))
    q[0].set_replicas(2)
    q[1].request_join(Member(1, 1))
    q[1].report_held(Member(1, 1), 0, 1)
    d2 = q[0].vote(aborted.next, 2, True)
    assert d2.commit and d2.joined == (Member(1, 1),) and d2.plan["id"] == 2
    assert q[1].admitting(q[1].admitted(Member(1, 1))) == d2
    assert [(d.step, d.commit, (d.plan or {}).get("id")) for d in q[0].decisions(gen)] == [
        (0, True, None),
        (1, True, 1),
        (2, False, None),
        (2, True, 2),
    ]


def test_an_unchanged_job_commits_on_the_fast_path_and_any_change_takes_the_full_one():
    """A commit that follows the previous one with the store's change count unchanged skips the
    eviction, join and plan look-ups; every eviction, join request, held report and plan post bumps
    the count, so the next commit looks again."""
    import torch.distributed as dist

    from resihp.train.controlplane import plan_key, post_change

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = lambda: dist.TCPStore("127.0.0.1", host.port, is_master=False)  # noqa: E731
    q = [
        Quorum(client(), "job", ranks_per_replica=1, timeout_s=5, plan_key=plan_key("job"))
        for _ in range(2)
    ]
    q[0].set_replicas(2)
    gen = q[0].start([Member(0), Member(1)], 0)

    def commit(step: int, previous):
        now = previous.next if previous else gen
        votes = [q[r].vote(now, step, True, previous) for r in now.replicas]
        d = votes[-1]  # the last voter decides
        assert votes[:-1] == [None] * (len(votes) - 1) and d.commit and q[0].wait(now, step) == d
        return d

    d0 = commit(0, None)
    d1 = commit(1, d0)
    assert (d1.next, d1.seen, d1.plan) == (replace(gen, from_step=2), d0.seen, None)
    # a key written without the count's bump is not looked for: the fast path was taken
    host.set(
        "resihp/job/ft/evicted/1/0", signed_json({"replica": 1, "attempt": 0, "reason": "by hand"})
    )
    d2 = commit(2, d1)
    assert d2.next.replicas == [0, 1]
    post_change(host, "job", {"id": 7, "dp_weights": [2.0, 1.0]})
    d3 = commit(3, d2)
    plan = dict(d3.plan)
    assert plan.pop("sig")  # signed with the job's secret where it was posted
    assert plan == {"id": 7, "dp_weights": [2.0, 1.0]} and d3.seen == d2.seen + 1
    assert d3.next.replicas == [0]  # the full path saw the hand-written eviction with the post
    d4 = commit(4, d3)
    assert d4.plan == d3.plan and d4.seen == d3.seen  # a fast commit carries the plan in force
    # a returning replica: its request and held report each bump the count
    q[1].request_join(Member(1, 1))
    q[1].report_held(Member(1, 1), 0, 4)
    d5 = commit(5, d4)
    assert d5.joined == (Member(1, 1),) and d5.next.replicas == [0, 1] and d5.seen == d4.seen + 2


def test_generation_round_trips():
    g = Generation(3, (Member(0, 0), Member(2, 1)), 17, "rejoined 2")
    assert Generation.from_dict(json.loads(json.dumps(g.to_dict()))) == g


def test_cross_replica_sums_follow_each_layer_to_its_holder_in_every_replica():
    """Each key holds one rank of each member replica: the one holding the block, whatever the
    replica's layer split, depth or tensor-parallel size."""
    cfg = GPTConfig(layers=4, hidden=64, heads=2, ffn_hidden=128, vocab=256)
    # three replicas of two one-rank stages (ranks 0-5), each splitting its 4 layers its own way
    pipes = [[(0,), (1,)], [(2,), (3,)], [(4,), (5,)]]
    ranges = [[(0, 2), (2, 4)], [(0, 1), (1, 4)], [(0, 3), (3, 4)]]
    pieces = Pieces(pipes, ranges, cfg)
    key = lambda name: {m for m, _, _ in pieces.of(name)}  # noqa: E731
    assert key("embed.weight") == key("layers.0.ln1.weight") == {(0, 2, 4)}
    assert key("layers.1.ln1.weight") == {(0, 3, 4)}
    assert key("layers.2.ln1.weight") == {(1, 3, 4)} and key("ln_f.weight") == {(1, 3, 5)}
    # replica 1 away: the members' holders only
    assert {
        m
        for m, _, _ in Pieces([pipes[0], pipes[2]], [ranges[0], ranges[2]], cfg).of(
            "layers.3.ln1.weight"
        )
    } == {(1, 5)}
    # a tp-2 replica beside one left at tp 1 (its other rank a hot spare): a sharded weight is
    # summed in halves, each with the tp-1 rank's matching rows; a replicated one in two lanes
    mixed = Pieces([[(0, 1)], [(2,)]], [[(0, 4)], [(0, 4)]], cfg)
    rows = [(m, start, n) for m, start, n in mixed.of("layers.0.fc1.weight")]
    assert (
        [m for m, _, _ in rows] == [(0, 2), (1, 2)] and rows[0][1] == 0 and rows[1][1] == rows[0][2]
    )
    assert [m for m, _, _ in mixed.of("ln_f.weight")] == [(0, 2), (1, 2)]


def _heal_stream(rank: int, world: int, tmp: str) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    from resihp.ft.heal import GRAD, STATE, HealSource, HealTarget
    from resihp.train.nodes import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=30))
    source = HealSource(
        lambda: dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30)
        ),
        "t/heal",
        30,
    )
    source.push(STATE, 4, torch.arange(6.0), [2, 2])
    source.push(GRAD, 5, torch.ones(6))
    source.push(STATE, 5, torch.arange(4.0), [1, 3])  # a plan moved the source's layers
    source.start()
    target = HealTarget(store, "t/heal", 30)
    got = [target.next() for _ in range(3)]
    source.close(5)
    got.append(target.next())
    source.join(10)
    return {
        "got": [
            (kind, step, None if flat is None else flat.tolist(), split)
            for kind, step, flat, split in got
        ],
        "sent": source.sent_bytes,
        "received": target.received_bytes,
    }


def test_the_catch_up_stream_carries_each_states_layer_split(tmp_path):
    from resihp.ft.heal import END, GRAD, STATE

    (result,) = spawn_ranks(_heal_stream, 1, tmp_path)
    assert result["got"] == [
        (STATE, 4, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [2, 2]),
        (GRAD, 5, [1.0] * 6, []),
        (STATE, 5, [0.0, 1.0, 2.0, 3.0], [1, 3]),
        (END, 5, None, []),
    ]
    assert result["sent"] == result["received"] == 4 * (6 + 6 + 4)


def _form_without_a_dead_peer(rank: int, world: int, tmp: str) -> dict:
    import datetime
    import time

    import torch
    import torch.distributed as dist

    from resihp.ft.group import GroupAbandoned, ReplicaGroup

    port = int((Path(tmp) / "store-port").read_text())

    def connect() -> dist.Store:
        return dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120)
        )

    store = connect()  # this rank's client, as a replica's rank reads the quorum through
    group = ReplicaGroup(connect, "job", rank, timeout_s=120)
    both = Generation(1, (Member(0), Member(1)), 0)
    group.form(both, [(0, 0)], abandon=lambda: False)
    flat = torch.ones(3)
    group.all_reduce({(0, 0): flat}, abandon=lambda: False)
    dist.barrier()
    if rank == 1:  # lost: it never reaches the next rendezvous; the step is decided without it
        time.sleep(0.5)
        store.set("decided", "abort")
        dist.barrier()
        return {"sum": flat.tolist()}
    again = Generation(2, (Member(0), Member(1, 1)), 5)  # admitted, then killed before it formed
    t0 = time.monotonic()
    try:
        group.form(again, [(0, 0)], abandon=lambda: store.check(["decided"]))
        left = None
    except GroupAbandoned as exc:
        left = str(exc)
    out = {"sum": flat.tolist(), "abandoned": left, "left_after_s": time.monotonic() - t0}
    dist.barrier()
    return out


def test_forming_a_group_with_a_peer_lost_before_the_rendezvous_is_left_when_the_step_is_decided(
    tmp_path,
):
    # a returning replica admitted and killed before it formed the new generation's groups: the
    # survivor must leave the rendezvous when the supervisor aborts the step (read through its own
    # store client, which the rendezvous must not hold), not wait out the group's timeout (120 s
    # here) while the monitor judges it hung
    # the job's store is the launcher's in a run, and outlives the ranks: so here. Hosted by a rank,
    # it went down as that rank ended, and the abandoned rendezvous, still waiting in it, woke
    # with an error while its process was finalizing: SIGABRT (once in a CI dry run)
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    (tmp_path / "store-port").write_text(str(host.port))
    first, second = spawn_ranks(_form_without_a_dead_peer, 2, tmp_path)
    assert first["sum"] == second["sum"] == [2.0, 2.0, 2.0]
    assert first["abandoned"] and "generation 2" in first["abandoned"], first
    assert first["left_after_s"] < 60, first


# --- real runs -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ft") / "reference"
    rc, summary, err = _run(
        out, "--dp", "2", "--pp", "2", "--steps", str(TWICE_STEPS), "--recovery", "replica"
    )
    assert rc == 0, err[-2000:]
    assert summary["recovery"] is None
    return summary["losses"]


def _lose_rank_3(out: Path, steps: int, fault: str, cause: str, reference: list) -> dict:
    """A DP 2 x PP 2 run in replica mode whose rank 3 ``fault`` takes out (``cause``): it ends well,
    replica 1 is lost, replica 0's ranks trained every step and the losses are the failure-free
    run's. Its summary."""
    rc, summary, err = _run(
        out,
        "--dp",
        "2",
        "--pp",
        "2",
        "--steps",
        str(steps),
        "--recovery",
        "replica",
        "--inject",
        fault,
    )
    assert rc == 0, f"{fault}: {err[-2000:]}"
    rec = summary["recovery"]
    assert rec["lost_replica"] == 1 and rec["cause"] == cause and rec["rank"] == 3, rec
    _trained_every_step(out, [0, 2], steps)
    _same_losses(summary["losses"], reference[:steps], fault)
    return summary


def _survivor_slow(dims: ParallelDims, lost: int, step: int) -> list[str]:
    # a survivor's compute stretched 3x (a sleep) from the failure on: steps long enough, on any
    # machine, for the lost replica to come back before the end (the steps before it run at speed)
    return ["--inject", f"slow:rank={dims.rank_of(1 - lost, 0, 0)},factor=3,step={step}"]


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["hang"])
def test_a_lost_replica_rejoins_and_the_losses_equal_the_failure_free_run(
    fault, reference, tmp_path
):
    """A hung rank, any rank at any step 5-19, judged by the launcher's hang watch in a real job:
    its replica is stopped, relaunched and caught up from the survivors, which trained every step,
    and every loss is the failure-free run's. (A killed rank's rejoin: the both-replicas test.)"""
    dims = ParallelDims(2, 2)
    rng = random.Random()
    rank, step = rng.randrange(dims.world_size), rng.randrange(5, 20)
    lost = dims.coords(rank).dp_rank
    what = f"{fault}:rank={rank},step={step}"
    # no --recovery: with --dp 2 on one node replica-level recovery is the default
    rc, summary, err = _run(
        tmp_path / "run",
        "--dp",
        "2",
        "--pp",
        "2",
        "--steps",
        str(STEPS),
        "--inject",
        what,
        *_survivor_slow(dims, lost, step),
    )
    assert rc == 0, f"{what}: {err[-2000:]}"
    rec = summary["recovery"]
    assert rec["mode"] == "replica" and rec["lost_replica"] == lost, what
    assert rec["cause"] == ("exited" if fault == "stop" else "hang"), what
    assert "failures" not in rec, f"{what}: more than one failure: {rec}"
    assert rec["rejoined_step"] is not None and step < rec["rejoined_step"] < STEPS, what
    assert rec["source"] == "peer" and rec["catchup_s"] is not None, what
    survivors = [r for r in range(dims.world_size) if dims.coords(r).dp_rank != lost]
    _trained_every_step(tmp_path / "run", survivors, STEPS)
    _same_losses(summary["losses"], reference[:STEPS], what)
    if fault == "hang":  # the rank judged hung left its stacks in the log before it was stopped
        log = (tmp_path / "run" / "logs" / "workers.log").read_text()
        assert f"resihp: rank {rec['rank']} judged hung" in log, what
        assert "most recent call first" in log and (
            "in begin_step" in log or rec["rank"] != rank
        ), what


@pytest.mark.slow
def test_a_python_exception_in_a_rank_takes_out_its_replica_only(reference, tmp_path):
    """A rank's Python exception, said over a real job's control plane, evicts its replica at
    once; the survivors are not restarted and train every step at the failure-free losses."""
    # the crashed rank says so over the control plane: its replica is evicted at once (the
    # survivors were found hung, and then every replica lost, when only its exit told)
    rec = _lose_rank_3(tmp_path / "run", 20, "error:rank=3,step=10", "exception", reference)[
        "recovery"
    ]
    assert "failures" not in rec and not rec["survivors_restarted"], rec


@pytest.mark.slow
def test_a_replica_killed_after_a_commit_before_publishing_loses_no_step_of_the_trace(
    reference, tmp_path
):
    """A rank killed between the quorum's commit and its records: the launcher's trace reader, the
    losses and the summary still have every step (only a real job has that window)."""
    # rank 3 is killed after step 10's update, which the quorum committed with its replica, and
    # before it published step 10's records: the launcher's reader used to wait for them forever,
    # and the trace, the losses and the live loop stopped at step 9
    summary = _lose_rank_3(
        tmp_path / "run", 20, "stop:rank=3,step=10,during=publish", "exited", reference
    )
    assert summary["members"][10] == [0, 1], summary["members"][:12]  # it died after the commit
    rows = [json.loads(line) for line in (tmp_path / "run" / "ops.jsonl").read_text().splitlines()]
    assert not [r for r in rows if r["rank"] == 3 and r["step"] == 10]  # and before publishing
    assert summary["steps"] == 20 and summary["first_step"] == 0


@pytest.mark.slow
def test_dp3_tp2_a_killed_tensor_parallel_rank_takes_out_its_replica_only(reference, tmp_path):
    """Three replicas of tensor-parallel pairs over gloo: a killed rank's peer and its replica
    leave, the two survivors' cross-replica sums go on without waiting out a group timeout."""
    dims = ParallelDims(3, 1, 2)
    rank = 3  # replica 1, tensor-parallel rank 1
    steps = 20  # the rejoin is shown in DP2 x PP2 above; here: the survivors and the losses
    # three replicas: a survivor in a cross-replica sum may wait on another survivor, not on the
    # lost rank, and leaves it once the step is aborted (it used to wait out the group's timeout:
    # hung)
    rc, summary, err = _run(
        tmp_path / "run",
        "--dp",
        "3",
        "--pp",
        "1",
        "--tp",
        "2",
        "--steps",
        str(steps),
        "--recovery",
        "replica",
        "--inject",
        "stop:rank=3,step=8",
    )
    assert rc == 0, err[-2000:]
    rec = summary["recovery"]
    assert rec["lost_replica"] == dims.coords(rank).dp_rank == 1 and not rec["survivors_restarted"]
    _trained_every_step(tmp_path / "run", [0, 1, 4, 5], steps)
    # the same global batch, in another layout: the same losses up to reduction order
    _same_losses(summary["losses"], reference[:steps], "dp3 x tp2")


@pytest.mark.slow
def test_a_second_failure_of_the_returning_replica_is_relaunched_again(reference, tmp_path):
    """The relaunched replica SIGKILLed while it starts or catches up (a moment only a real job
    has): it is relaunched again and rejoins, the survivors train every step, the losses kept."""
    out = tmp_path / "run"
    proc = _start(
        out,
        "--dp",
        "2",
        "--pp",
        "2",
        "--steps",
        str(TWICE_STEPS),
        "--recovery",
        "replica",
        "--inject",
        "stop:rank=1,step=6",
        *_survivor_slow(ParallelDims(2, 2), 1, 6),
    )
    try:
        pids = _wait_pids(out, 1, 1)  # the relaunch, starting or catching up
        time.sleep(random.uniform(0.0, 2.0))
        os.kill(pids[0], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    fails = summary["recovery"]["failures"]
    assert [(f["lost_replica"], f["attempt"]) for f in fails] == [(1, 0), (1, 1)]
    assert fails[-1]["rejoined_step"] is not None
    _trained_every_step(out, [0, 2], TWICE_STEPS)
    _same_losses(summary["losses"], reference, "second failure")


@pytest.mark.slow
def test_failures_of_both_replicas_in_turn_recover_and_the_job_ends_well(reference, tmp_path):
    """Replica 1 is lost and comes back; later replica 0 is lost and comes back from replica 1:
    every step trained, the failure-free run's losses, and the job ends with status 0 (each
    replica was relaunched on the way, so neither first launch finished it)."""
    out = tmp_path / "run"
    rc, summary, err = _run(
        out,
        "--dp",
        "2",
        "--pp",
        "2",
        "--steps",
        str(TWICE_STEPS),
        "--recovery",
        "replica",
        "--inject",
        "stop:rank=1,step=6",
        "--inject",
        "stop:rank=0,step=45",
        *_survivor_slow(ParallelDims(2, 2), 1, 6),
    )
    assert rc == 0, err[-2000:]
    fails = summary["recovery"]["failures"]
    assert [(f["lost_replica"], f["attempt"]) for f in fails] == [(1, 0), (0, 0)], fails
    # a killed rank's exit is found and its replica relaunched; replica 1 is back, caught up from
    # replica 0, before replica 0 is lost, and replica 0 trained every step until then
    assert all(f["cause"] == "exited" and f["relaunched"] for f in fails), fails
    first = fails[0]
    assert first["mode"] == "replica" and 6 < (first["rejoined_step"] or 0) <= 45, first
    assert first["source"] == "peer" and first["catchup_s"] is not None, first
    _trained_every_step(out, [0, 2], 45)
    _same_losses(summary["losses"], reference, "both replicas in turn")


def _warm_server(launcher: int) -> int:
    """The warm-agent server of the launcher ``launcher`` (multiprocessing's forkserver, its
    child)."""
    servers = [
        p
        for p in children_map().get(launcher, [])
        if b"multiprocessing.forkserver" in Path(f"/proc/{p}/cmdline").read_bytes()
    ]
    assert len(servers) == 1, f"launcher {launcher}: warm-agent servers {servers}"
    return servers[0]


@pytest.mark.slow
def test_a_killed_warm_agent_server_leaves_every_replica_training_and_a_relaunch_starts_cold(
    reference, tmp_path
):
    """The warm-agent server only starts processes: killed (SIGKILL) mid-run, the replicas train on
    (each forked agent died with it: every replica lost, exit 1). Replica 1 lost later is relaunched
    cold, the launcher says so in one line, and every step's loss is the failure-free run's."""
    out = tmp_path / "run"
    # a cold agent imports torch first (6 s on a loaded 2-core machine): the survivors' steps are
    # stretched 6x from the failure on, for it to be back before the end
    proc = _start(
        out,
        "--dp",
        "2",
        "--pp",
        "2",
        "--steps",
        str(TWICE_STEPS),
        "--recovery",
        "replica",
        "--inject",
        "stop:rank=3,step=12",
        "--inject",
        "slow:rank=0,factor=6,step=12",
    )
    try:
        _wait_pids(out, 1, 0)
        server = _warm_server(proc.pid)
        os.kill(server, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-2000:]
    said = [ln for ln in stderr.splitlines() if "warm-agent server" in ln]
    assert said == [
        f"resihp: the warm-agent server (process {server}) is gone; launches start their "
        "agents cold from now on"
    ], stderr[-2000:]
    rec = json.loads((out / "summary.json").read_text())["recovery"]
    assert "failures" not in rec and rec["lost_replica"] == 1 and rec["cause"] == "exited", rec
    assert rec["rejoined_step"] is not None, rec
    _trained_every_step(out, [0, 2], TWICE_STEPS)
    _same_losses(
        json.loads((out / "summary.json").read_text())["losses"], reference, "cold relaunch"
    )


@pytest.mark.slow
def test_losing_the_replica_that_serves_the_catch_up_stops_with_one_line(tmp_path):
    """The only live peer killed while it serves a returning replica's catch-up: the job ends
    with one line, no traceback and no hang (the catch-up stream's loss, in real processes)."""
    out = tmp_path / "run"
    proc = _start(
        out,
        "--dp",
        "2",
        "--pp",
        "2",
        "--steps",
        str(STEPS),
        "--recovery",
        "replica",
        "--inject",
        "stop:rank=1,step=6",
        *_survivor_slow(ParallelDims(2, 2), 1, 6),
    )
    try:
        _wait_pids(out, 1, 1)
        os.kill(_pids(out, 0, 0)[0], signal.SIGKILL)  # the only live peer
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1
    lines = [ln for ln in stderr.splitlines() if ln.startswith("resihp:")]
    assert lines == [lines[0]] and "every replica was lost" in lines[0], stderr[-2000:]
    assert "Traceback" not in stderr


@pytest.mark.slow
def test_drop_mode_skips_the_lost_replicas_batches(reference, tmp_path):
    """``--recovery replica-drop`` in a real job: the steps without the lost replica train on the
    survivor's half of the batch, exactly as one process replaying the recorded membership."""
    rc, summary, err = _run(
        tmp_path / "run",
        "--dp",
        "2",
        "--pp",
        "2",
        "--steps",
        "24",
        "--recovery",
        "replica-drop",
        "--inject",
        "stop:rank=3,step=8",
    )
    assert rc == 0, err[-2000:]
    rec = summary["recovery"]
    losses = summary["losses"]
    first = rec["failed_step"]
    _same_losses(losses[:first], reference[:first], "drop mode before the failure")
    # the steps it was away trained on replica 0's half of the batch: other numbers
    assert any(abs(a - b) > RTOL * abs(b) for a, b in zip(losses[first:], reference[first:24]))
    # ... and exactly those of one process replaying the recorded membership
    members = summary["members"]
    assert len(members) == 24 and [1] not in members and [0] in members[first:], members
    flags = dict(
        layers=2,
        hidden=64,
        heads=2,
        ffn_hidden=128,
        vocab=256,
        global_tokens=2048,
        budget=256,
        max_len=256,
        dp=2,
        pp=2,
        steps=24,
    )
    _same_losses(
        losses, replay_membership(flags, members, tmp_path / "replay"), "drop mode vs its replay"
    )


@pytest.mark.slow
def test_a_member_replica_writes_each_checkpoint_and_it_resumes_in_other_layouts(tmp_path):
    """--ckpt-every in replica mode: each checkpoint is written by the lowest replica that trained
    its step. Replica 0 is killed during step 6, so replica 1 alone trains step 7 and writes
    ``step7`` (a relaunch takes seconds, steps a fraction of one); the checkpoint verifies, records
    the job's layout, and ``--resume`` continues it in other layouts (no replicas; replicas of one
    stage, one of them lost again) with the replica run's losses. What only a job shows: the
    checkpoint a lone surviving replica writes is whole. (Resuming into tensor parallel:
    test_reshard_cli.)"""
    run = tmp_path / "run"
    rc, summary, err = _run(
        run,
        "--dp",
        "2",
        "--pp",
        "2",
        "--steps",
        "12",
        "--recovery",
        "replica",
        "--ckpt-every",
        "4",
        "--inject",
        "stop:rank=0,step=6",
    )
    assert rc == 0, err[-2000:]
    assert summary["members"][7] == [1] and summary["recovery"]["lost_replica"] == 0, summary[
        "members"
    ]
    ckpt = run / "ckpt" / "step7"
    assert problem(ckpt) is None and (run / "ckpt" / "step11").exists()
    meta = json.loads((ckpt / "meta.json").read_text())
    assert (meta["dp"], meta["pp"], meta["layer_splits"]) == (2, 2, [[1, 1], [1, 1]]), meta
    rc, resumed, err = _run(
        tmp_path / "dp1-pp2",
        *("--dp", "1", "--pp", "2", "--steps", "12", "--recovery", "none", "--resume", str(ckpt)),
    )
    assert rc == 0, err[-2000:]
    assert resumed["first_step"] == 8, resumed.get("first_step")
    _same_losses(resumed["losses"], summary["losses"][8:], "resumed without replicas")
    rc, resumed, err = _run(
        tmp_path / "replicas",
        "--dp",
        "2",
        "--pp",
        "1",
        "--steps",
        "12",
        "--recovery",
        "replica",
        "--resume",
        str(ckpt),
        "--inject",
        "stop:rank=1,step=9",
    )
    assert rc == 0, err[-2000:]
    assert resumed["first_step"] == 8 and resumed["resume"]["first_step"] == 8, resumed.get(
        "resume"
    )
    assert resumed["members"][0] == [0, 1] and resumed["recovery"]["lost_replica"] == 1, resumed[
        "members"
    ]
    _same_losses(resumed["losses"], summary["losses"][8:], "resumed in replica mode")


@pytest.mark.slow
def test_every_replica_lost_restarts_the_job_from_its_newest_checkpoint(reference, tmp_path):
    """Both replicas killed in step 9 (no live peer is left to catch up from): with --ckpt-every
    the job is relaunched whole from ``step7``, the faults that took it down not repeated, and
    every step's loss equals the failure-free run's."""
    out = tmp_path / "run"
    rc, summary, err = _run(
        out,
        "--dp",
        "2",
        "--pp",
        "2",
        "--steps",
        "16",
        "--recovery",
        "replica",
        "--ckpt-every",
        "4",
        "--inject",
        "stop:rank=0,step=9",
        "--inject",
        "stop:rank=1,step=9",
    )
    assert rc == 0, err[-2000:]
    restart = summary["restart"]
    assert (
        restart["restarted"]
        and restart["resumed_step"] == 8
        and restart["restart_from"].endswith("step7")
    ), restart
    assert summary["steps"] == 16 and summary["after_restart"]["first_step"] == 8
    _same_losses(summary["losses"], reference[:16], "restarted after every replica was lost")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dp", "1", "--pp", "2"], "faults.recovery (--recovery replica): needs --dp 2 or more"),
        (
            ["--dp", "2", "--pp", "1", "--snapshot-every", "2"],
            "--snapshot-every is not combined with it",
        ),
    ],
)
def test_bad_replica_recovery_input_is_one_line(args, message, tmp_path):
    rc, _, err = _run(tmp_path / "bad", "--steps", "2", "--recovery", "replica", *args, timeout=60)
    assert rc == 2 and message in err and "Traceback" not in err, err


LIVE = dict(
    layers=4,
    hidden=64,
    heads=2,
    ffn_hidden=256,
    vocab=512,
    global_tokens=4096,
    budget=512,
    max_len=512,
    dp=2,
    pp=2,
)


@pytest.mark.slow
def test_live_replanning_reaches_every_replica_and_a_returning_one_takes_its_split(tmp_path):
    """A slow rank found live: the commit before one step boundary carries the new plan to every
    rank; the slow rank's replica gets no more micro-batches and is re-planned on its own ranks
    (``applied: true``): its slow stage sheds layers to the other stage, or its groups are re-formed
    without the slow rank (a hot spare from then on), as the planner prices the slowdown it
    measured; every step still trains the whole global batch once (zero drift). Then a rank of the
    other replica is killed (SIGKILL): relaunched, it catches up from the slow replica (the only
    survivor) in that one's split, or in that one's groups' shape on its own ranks, and moves back
    to its own groups and split as it rejoins. Every step's loss equals one process training the
    same batches within 1e-4 relative (the issue's tolerance: shares moved between replicas
    reorder the sums)."""
    out, steps = tmp_path / "run", 60
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in LIVE.items()]
    # the detector's default 20-step baseline: on 8 steps a CI dry run found the 3x slowdown one
    # step after its onset, in the backward pass alone (1.5x of the rank's step), and the planner
    # kept the plan in force for that
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resihp.cli",
            "run",
            "-o",
            str(out),
            *flags,
            "--steps",
            str(steps),
            "--recovery",
            "replica",
            "--json",
            "--timeout",
            "60",
            "--inject",
            "slow:rank=1,factor=3,step=20",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    trace = out / "ops.jsonl"
    try:
        end = time.monotonic() + 300
        while time.monotonic() < end and proc.poll() is None:
            if trace.exists() and (
                '"replan-layers"' in (text := trace.read_text()) or '"replan-layout"' in text
            ):
                break
            time.sleep(0.1)
        # rank 2: replica 0, stage 1 (rank 1, the slow one, is replica 1's stage 0)
        killed = next(
            e["pid"]
            for e in announced(out)
            if (e["replica"], e["attempt"], e["local_rank"]) == (0, 0, 1)
        )
        os.kill(killed, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [e["rank"] for e in summary["events"] if e["kind"] == "fail-slow"][:1] == [1]
    change = summary["plan_changes"][0]
    at = change["applied_step"]
    assert change["applied"] is True and at is not None, change
    assert change["moved_bytes"] > 0 and change["move_s"] > 0, (
        change
    )  # replica 1's layer, sent once
    weights = change["dp_weights"]
    assert weights[1] <= weights[0], (
        change
    )  # the slow replica never gets more (8 micro-batches: 5:3 or 4:4)
    pipes = change["layout"]["pipelines"]
    assert pipes[0] == [[0], [2]] and change["layer_splits"][0] == [2, 2], (
        change
    )  # replica 0 untouched
    assert {r for stage in pipes[1] for r in stage} <= {1, 3}, change  # replica 1 on its own ranks
    reformed = pipes[1] != [[1], [3]]
    assert reformed or change["layer_splits"][1][0] < 2, change  # the slow stage sheds layers
    assert not reformed or (
        change["spares"] == [1] and 0 < change["minimum_bytes"] <= change["moved_bytes"]
    ), change
    rows = [json.loads(line) for line in (out / "ops.jsonl").read_text().splitlines()]
    # at one step boundary on every rank: the shares on all four, replica 1's groups or layers on
    # its two
    moving = "replan-layout" if reformed else "replan-layers"
    assert sorted(
        (r["step"], r["rank"]) for r in rows if r["optype"] == moving and r["step"] == at
    ) == [(at, 1), (at, 3)]
    assert {
        r["rank"] for r in rows if r["optype"] == "replan-microbatches" and r["step"] == at
    } == {0, 1, 2, 3}
    rec = summary["recovery"]
    assert rec["lost_replica"] == 0 and rec["rank"] == 2 and rec["rejoined_step"] is not None, rec
    back = rec["rejoined_step"]
    assert at < rec["failed_step"] < back < steps, rec
    # the returning replica caught up in replica 1's split (or groups) and moved back as it rejoined
    assert {r["rank"] for r in rows if r["optype"] == moving and r["step"] == back} == {0, 2}
    if reformed:  # the spare trains nothing from the change on
        assert not any(
            r["rank"] == 1 and r["step"] >= at for r in rows if r["optype"] == "forward-compute"
        )
    firsts = [r for r in rows if r["optype"] == "forward-compute" and r["stage"] == 0]
    for step in range(steps):
        ids = sorted(r["mb_id"] for r in firsts if r["step"] == step)
        assert ids == list(range(len(ids))), f"step {step}: micro-batches {ids}"

    # each step packs its own number of micro-batches: the slow replica's fraction of them drops
    def share(step, d):
        return sum(1 for r in firsts if r["step"] == step and r["dp_rank"] == d) / sum(
            1 for r in firsts if r["step"] == step
        )

    if weights[1] < weights[0]:
        assert share(at, 1) < share(at - 1, 1)
    want = replay_membership({**LIVE, "steps": steps}, [[0, 1]] * steps, tmp_path / "replay")
    assert len(summary["losses"]) == steps
    for step, (a, b) in enumerate(zip(summary["losses"], want)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: loss {a} != {b}"


def test_a_returning_replica_is_served_by_the_lowest_member_in_its_launch_layout():
    launch = [[(0, 1)], [(2, 3)], [(4, 5)]]
    regrouped = [[(0,), (1,)], [(2, 3)], [(4, 5)]]  # replica 0 re-formed around its slow rank 1
    assert heal_source([0, 1, 2], launch, launch) == 0
    assert heal_source([0, 2], regrouped, launch) == 2
    assert heal_source([0], regrouped, launch) == 0  # the returning replica mirrors its groups


@pytest.mark.slow
def test_the_issues_run_re_forms_the_slow_ranks_group_inside_its_replica_live(
    tmp_path, issue_run_losses
):
    """The issue's run (DP 2 x TP 2, rank 1 slow from step 10) in replica mode, where each replica
    is a job of its own: the planner re-forms replica 0's tensor-parallel group from its own ranks
    (rank 1 left out as a hot spare, or given a stage of its own with fewer layers), which replica
    0's ranks apply live (a new generation of its process groups, its state resharded from memory)
    while replica 1 keeps its group; the cross-replica sums follow each block to its new holder (a
    tp-1 rank beside a tp-2 group), and every step's loss equals one process training the same
    batches. The detector calibrates on the 8 steps before the fault (a baseline the fault falls
    into measures it low, see ``tests/test_reshard_live.py``). The slowdown ends at step 17: a rank
    left out re-checks itself with backoff as a hot spare of its replica and a later plan takes it
    back once a probe measures it healthy (32 steps: probes 1, 2, 4 and 8 steps apart leave two
    chances after 17; three ranks training on two cores can hold a healthy spare's probes above
    that)."""
    out, steps = tmp_path / "run", ISSUE_STEPS  # 32
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resihp.cli",
            "run",
            "-o",
            str(out),
            "--dp",
            "2",
            "--pp",
            "1",
            "--tp",
            "2",
            "--global-tokens",
            "4096",
            "--steps",
            str(steps),
            "--timeout",
            "120",
            "--calibration-steps",
            "8",
            "--inject",
            "slow:rank=1,factor=6,step=10,until=17",
            "--json",
            # a 6x rank on a loaded machine can pass the default hang timeout (5 steps)
            "--hang-timeout",
            "120",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["live_error"] is None and summary["recovery"] is None, (
        summary
    )  # nothing was lost
    # (a loaded machine can add findings of a few percent on other ranks: each is planned too)
    change = next(
        (
            c
            for c in summary["plan_changes"]
            if c["reason"].get("rank") == 1
            and (c.get("spares") or [len(s) for p in c["layout"]["pipelines"] for s in p] != [2, 2])
        ),
        None,
    )
    assert change is not None and change["applied"] is True, summary["plan_changes"]
    assert 10 <= change["applied_step"] < steps, change
    pipes = change["layout"]["pipelines"]
    own = [{0}, {2, 3}] if change["spares"] else [{0, 1}, {2, 3}]  # each replica on its own ranks
    assert [{r for s in p for r in s} for p in pipes] == own, pipes
    assert 0 < change["minimum_bytes"] <= change["moved_bytes"] and change["relayout_s"] > 0, change
    rows = [json.loads(line) for line in (out / "ops.jsonl").read_text().splitlines()]
    at = change["applied_step"]
    assert {r["rank"] for r in rows if r["optype"] == "replan-layout" and r["step"] == at} == {0, 1}
    compute = {(r["rank"], r["step"]) for r in rows if r["optype"] == "forward-compute"}
    if 1 in change["spares"]:  # left out: it trains nothing until a plan takes it back
        assert any(r["optype"] == "probe" and r["rank"] == 1 and r["step"] > at for r in rows)
        back = next(
            (
                c
                for c in summary["plan_changes"]
                if c["reason"]["kind"] == "recovered" and c["reason"]["rank"] == 1
            ),
            None,
        )
        # taken back once a probe after the slowdown measures it healthy; three ranks training on
        # two cores can keep a healthy spare's probes above that (a CI dry run: 1.54x and 1.49x,
        # timed in the process's CPU time, other threads included; the probe's own thread's since)
        probes = json.loads((out / "live.json").read_text())["spare_probes"]
        healthy = [
            p["step"]
            for p in probes
            if p["rank"] == 1 and p["step"] >= 17 and p["slowdown"] < 1 / ControlConfig().healthy
        ]
        if any(
            step <= steps - 5 for step in healthy
        ):  # seen healthy with steps left to take it back
            assert back is not None, (probes, summary["plan_changes"])
        if back is not None:
            assert healthy, (probes, back)
            assert back["applied"] is True, summary["plan_changes"]
            assert (
                1 in {r for p in back["layout"]["pipelines"] for s in p for r in s}
                and back["spares"] == []
            ), back
            assert back["reason"]["detected_step"] >= 17 and at < back["applied_step"] < steps, back
        # rank 1 trains from the first applied plan whose layout has it again (the recovery's, or
        # one a later finding made on a loaded machine, which plans every healthy rank)
        # (``applied`` is True, or a string saying why nothing changed)
        again = next(
            (
                c
                for c in summary["plan_changes"]
                if c.get("applied") is True
                and c.get("layout")
                and c["applied_step"] > at
                and 1 in {r for p in c["layout"]["pipelines"] for s in p for r in s}
            ),
            None,
        )
        trained = set(range(again["applied_step"], steps)) if again is not None else set()
        assert {step for rank, step in compute if rank == 1 and step >= at} == trained
    for rank in (0, 2, 3):
        assert {step for r, step in compute if r == rank} == set(range(steps)), rank
    want = issue_run_losses  # one process training the same batches (``tests/conftest.py``)
    assert len(summary["losses"]) == len(want) == steps
    for step, (a, b) in enumerate(zip(summary["losses"], want)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: loss {a} != {b}"
