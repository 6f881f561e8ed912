"""What a job reads from its store is input: garbage, truncated, oversized and hostile values in
every key family are dropped with one warning per key, never a traceback or a crash."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from resihp.detect.heartbeat import (
    HeartbeatMonitor,
    NodeAggregator,
    connect_store,
    node_key,
    rank_key,
    start_local_store,
)
from resihp.detect.records import JOB_SECRET_ENV, MAX_RECORD_BYTES, RECORDS, checked_int, sign
from resihp.errors import InputError
from resihp.ft.quorum import Member, Quorum, changes_key
from resihp.launch.supervisor import await_relaunch
from resihp.train import controlplane as cp
from resihp.train.nodes import Nodes

BAD = {
    "garbage": b"{not json",
    "truncated": b'{"c": 3, "pid": 12, "step": 1, "pha',
    "oversized": b'"' + b"x" * (MAX_RECORD_BYTES + 8) + b'"',
    "hostile": json.dumps(
        {
            "c": True,
            "pid": -1,
            "step": "0; rm -rf /",
            "phase": ["train"],
            "ops": 1e308,
            "wait": None,
            "beat": {},
            "ranks": [1],
            "attempt": "9",
            "relaunch": 1,
            "rank": [0],
            "why": 3,
            "exitcode": "x",
            "ids": "x",
            "kind": "crash",
        }
    ).encode(),
    "binary": bytes(range(256)),
}
JOB = "trust"


@pytest.fixture
def store():
    s, _ = start_local_store()
    yield s


@pytest.fixture(autouse=True)
def fresh_records():
    RECORDS.warned.clear()
    yield


def _put(store, key: str, raw: bytes, append: bool = False) -> None:
    """``raw`` at ``key``, in appends the store takes (it refuses a message over 8 MiB)."""
    if not append:
        store.delete_key(key)
    for i in range(0, max(1, len(raw)), 6 << 20):
        store.append(key, raw[i : i + (6 << 20)])


def _dropped(caplog, key: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.getMessage().startswith(f"store key {key}:")
    ]


@pytest.mark.parametrize("kind", sorted(BAD))
def test_every_reader_drops_a_bad_record_with_one_warning_per_key(store, caplog, kind):
    raw = BAD[kind]
    pre = cp.prefix_of(JOB)
    hb = cp.heartbeat_prefix(JOB)
    caplog.set_level(logging.WARNING, "resihp.store")
    # heartbeats: a rank's beat, read by its node's aggregator
    _put(store, rank_key(hb, 0, 0), raw)
    agg = NodeAggregator(store, 0, [0], prefix=hb, check_pids=False)
    for _ in range(3):
        assert agg.snapshot()["0"]["seen"] is False
    # node aggregates, read by the monitor
    _put(store, node_key(hb, 0), raw)
    monitor = HeartbeatMonitor(store, {0: [0]}, prefix=hb)
    for _ in range(3):
        assert monitor.poll() == [] and monitor.views[0].seen is False
    # op records: a bad line beside a good one, and a bad first step
    reader = cp.StepReader(store, JOB, {0: [0]}, owner=True)
    _put(store, f"{pre}/ops/first", raw)
    assert reader.complete_steps() == [] and reader.next_step is None
    store.set(f"{pre}/ops/first", "0")
    good = cp.encode_rows(
        [
            {
                "step": 0,
                "rank": 0,
                "dp_rank": 0,
                "stage": 0,
                "tp_rank": 0,
                "start_ts": 1.0,
                "duration": 0.5,
                "optype": "forward",
                "mb_id": 0,
                "seq_lens": [4],
            }
        ]
    )
    _put(store, f"{pre}/ops/n0/s0", raw.replace(b"\n", b" ") + b"\n" + good + b"\n")
    steps = reader.complete_steps()
    assert [s.step for s in steps] == [0] and steps[0].rows[0]["optype"] == "forward"
    # plan changes, read by rank 0
    _put(store, cp.plan_key(JOB), raw)
    inbox = cp.PlanInbox(store, JOB, [])
    assert inbox.poll(0) is None and inbox.poll(1) is None
    # workers' errors: the good line kept
    _put(store, f"{pre}/errors", raw.replace(b"\n", b" ") + b"\n")
    cp.report_error(store, JOB, 1, "stop", "a real one")
    assert cp.read_errors(store, JOB) == [{"rank": 1, "kind": "stop", "message": "a real one"}]
    # replica orders, stacks requests, first failures, attempts, reasons
    for key in (
        "replica/0/order",
        "stacks/0",
        "first-failure/0",
        "replica/0/launched",
        "ended",
        "stopping",
    ):
        _put(store, f"{pre}/{key}", raw)
    assert cp.replica_order(store, JOB, 0) is None
    assert cp.stacks_asked(store, JOB, 0) is None
    assert cp.first_failure(store, JOB, 0) is None
    assert cp.replica_attempt(store, JOB, 0, "launched") is None
    assert cp.stopping(store, JOB) is None
    # the job's announcement: the job cannot go on without it, so one line (InputError, exit 2)
    _put(store, cp.JOB_KEY, raw)
    with pytest.raises(
        InputError, match=f"store key {cp.JOB_KEY}: expected the job's announcement"
    ):
        cp.read_job(store, timeout_s=0.3, poll_s=0.1)
    keys = [
        rank_key(hb, 0, 0),
        node_key(hb, 0),
        f"{pre}/ops/first",
        f"{pre}/ops/n0/s0",
        cp.plan_key(JOB),
        f"{pre}/errors",
        f"{pre}/replica/0/order",
        f"{pre}/stacks/0",
        f"{pre}/first-failure/0",
        f"{pre}/replica/0/launched",
        f"{pre}/ended",
        f"{pre}/stopping",
        cp.JOB_KEY,
    ]
    for key in keys:
        lines = _dropped(caplog, key)
        assert len(lines) == 1, (key, lines)
        assert "\n" not in lines[0] and len(lines[0]) < 400


def test_a_foreign_op_record_is_dropped_and_the_step_still_completes(store, caplog):
    caplog.set_level(logging.WARNING, "resihp.store")
    pre = cp.prefix_of(JOB)
    store.set(f"{pre}/ops/first", "0")
    row = {
        "step": 0,
        "rank": 0,
        "dp_rank": 0,
        "stage": 0,
        "tp_rank": 0,
        "start_ts": 1.0,
        "duration": 0.5,
        "optype": "forward",
        "mb_id": 0,
        "seq_lens": [4],
        "loss": 2.5,
    }
    forged = cp.encode_rows([{**row, "loss": 99.0, "rank": 7}])  # a rank this node does not have
    early = cp.encode_rows([{**row, "loss": 99.0, "step": 3}])  # another step's, under this one
    store.append(f"{pre}/ops/n0/s0", forged + b"\n" + early + b"\n" + cp.encode_rows([row]) + b"\n")
    steps = cp.StepReader(store, JOB, {0: [0]}, owner=True).complete_steps()
    assert [r["loss"] for r in steps[0].rows] == [2.5]
    assert len(_dropped(caplog, f"{pre}/ops/n0/s0")) == 1


def test_a_job_announcement_that_is_well_formed_after_a_bad_one_is_read(store):
    store.set(cp.JOB_KEY, b"{bad")
    cp.announce_job(store, JOB, {}, 1, 2)
    assert cp.read_job(store, timeout_s=1.0)["job_id"] == JOB


# --- a running job ------------------------------------------------------------------------------
SMALL = [
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "2",
    "--ffn-hidden",
    "64",
    "--vocab",
    "128",
    "--global-tokens",
    "512",
    "--budget",
    "256",
    "--max-len",
    "256",
    "--dp",
    "2",
    "--pp",
    "1",
    "--no-live",
    "--timeout",
    "30",
    "--heartbeat-timeout",
    "10",
    "--recovery",
    "none",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
STEPS = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(out, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resihp.cli",
            "run",
            *SMALL,
            "--steps",
            str(STEPS),
            "--seed",
            "3",
            "--out",
            str(out),
            "--json",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


def _poison(port: int, until_s: float, job_proc: subprocess.Popen) -> list[str]:
    """Write bad values into every key family of the job on ``port`` while it runs."""
    end = time.monotonic() + 60  # the launcher listens once it has started (torch imported)
    while True:  # a client refused at first backs off for up to 30 s: connect once it listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < end and job_proc.poll() is None, (
                "the job's store never listened"
            )
            time.sleep(0.1)
    store = connect_store("127.0.0.1", port, timeout_s=30)
    end = time.monotonic() + 60
    while not store.check([cp.JOB_KEY]):
        assert time.monotonic() < end, "the job never announced itself"
        time.sleep(0.1)
    job = json.loads(store.get(cp.JOB_KEY))["job_id"]
    pre, hb = cp.prefix_of(job), cp.heartbeat_prefix(job)
    keys = [
        rank_key(hb, 0, 1),
        node_key(hb, 0),
        cp.plan_key(job),
        f"{pre}/stacks/0",
        f"{pre}/first-failure/0",
    ]
    _put(store, f"{pre}/errors", BAD["oversized"] + b"\n", append=True)
    values = [v for k, v in BAD.items() if k != "oversized"]
    stop = time.monotonic() + until_s
    i = 0
    while time.monotonic() < stop and job_proc.poll() is None:
        raw = values[i % len(values)]
        try:
            for key in keys:
                store.set(key, raw)
            line = raw.replace(b"\n", b" ") + b"\n"
            store.append(f"{pre}/errors", line)
            for step in range(STEPS):
                store.append(f"{pre}/ops/n0/s{step}", line)
        except RuntimeError:  # DistNetworkError: the job ended and its store with it
            break
        i += 1
        time.sleep(0.05)
    assert i > 10, "the job ended before it was poisoned"
    return keys


@pytest.mark.slow
def test_a_running_job_poisoned_in_every_key_trains_the_same_losses(tmp_path):
    clean = tmp_path / "clean"
    proc = _run(clean, _free_port())
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    clean_losses = json.loads(out)["losses"]
    assert len(clean_losses) == STEPS
    port = _free_port()
    proc = _run(tmp_path / "poisoned", port)
    try:
        keys = _poison(port, until_s=8.0, job_proc=proc)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    assert json.loads(out)["losses"] == clean_losses
    dropped = [line for line in err.splitlines() if "record dropped" in line]
    # the heartbeat keys this launcher reads: each warned about at most once, and at least one of
    # them read while it was poisoned (on a loaded machine a rank's beat can miss the window)
    counts = [sum(f"store key {key}:" in line for line in dropped) for key in keys[:2]]
    assert max(counts) == 1 and min(counts) >= 0, (counts, dropped)


def test_a_plan_change_is_taken_only_with_the_jobs_signature(store, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, "resihp.store")
    monkeypatch.setenv(JOB_SECRET_ENV, "a" * 64)
    inbox = cp.PlanInbox(store, JOB, [])
    forged = {"id": "x", "version": 9, "dp_weights": [1.0, 0.0]}
    store.set(cp.plan_key(JOB), json.dumps(forged))  # unsigned
    assert inbox.poll(0) is None
    store.set(cp.plan_key(JOB), json.dumps(sign(forged, "b" * 64)))  # another secret's
    assert inbox.poll(1) is None
    signed = sign(forged, "a" * 64)
    store.set(
        cp.plan_key(JOB), json.dumps({**signed, "dp_weights": [0.0, 1.0]})
    )  # altered after signing
    assert inbox.poll(2) is None
    lines = _dropped(caplog, cp.plan_key(JOB))
    assert len(lines) == 1 and "refused: not signed with the job's secret" in lines[0]
    cp.post_change(store, JOB, forged)  # the job's own launcher signs with the job's secret
    assert inbox.poll(3) == forged
    # a process without the secret takes no posted change at all
    monkeypatch.delenv(JOB_SECRET_ENV)
    assert cp.PlanInbox(store, JOB, []).poll(4) is None


# --- authority: what steers the job is taken only with the job's signature ----------------------
OTHER = "b" * 64  # a secret that is not the job's


def _forgeries(doc: dict) -> list[bytes]:
    """``doc`` unsigned, signed with another secret, and signed then altered."""
    good = sign(doc, os.environ[JOB_SECRET_ENV])
    altered = {**good, next(iter(doc)): "x"}
    return [
        json.dumps(doc).encode(),
        json.dumps(sign(doc, OTHER)).encode(),
        json.dumps(altered).encode(),
    ]


def test_every_record_that_carries_authority_is_taken_only_with_the_jobs_signature(
    store, caplog, monkeypatch
):
    caplog.set_level(logging.WARNING, "resihp.store")
    monkeypatch.setenv(JOB_SECRET_ENV, "a" * 64)
    pre = cp.prefix_of(JOB)
    q = Quorum(store, JOB, ranks_per_replica=1, timeout_s=1.0, plan_key=cp.plan_key(JOB))
    m = Member(1, 0)
    # (key, a forged record, the reader, what it reads with nothing there, the writer of the job)
    cases = [
        (
            f"{pre}/ended",
            {"job_id": JOB, "reason": "finished"},
            lambda: cp.ended(store, JOB),
            None,
            lambda: cp.mark_ended(store, JOB, "finished"),
            "finished",
        ),
        (
            f"{pre}/stopping",
            {"job_id": JOB, "reason": "rank 1 hung"},
            lambda: cp.stopping(store, JOB),
            None,
            lambda: cp.mark_stopping(store, JOB, "rank 1 hung"),
            "rank 1 hung",
        ),
        (
            f"{pre}/replica/1/order",
            {"replica": 1, "attempt": 5, "relaunch": True},
            lambda: cp.replica_order(store, JOB, 1),
            None,
            lambda: cp.order_replica(store, JOB, 1, 5, True),
            (5, True),
        ),
        (
            f"{pre}/replica/1/done",
            {"replica": 1, "state": "done", "attempt": 0},
            lambda: cp.replica_attempt(store, JOB, 1, "done"),
            None,
            lambda: cp.replica_state(store, JOB, 1, 0, "done"),
            0,
        ),
        (
            f"{pre}/stacks/1",
            {"node": 1, "rank": 3, "why": "hung"},
            lambda: cp.stacks_asked(store, JOB, 1),
            None,
            lambda: cp.ask_for_stacks(store, JOB, 1, 3, "hung"),
            (3, "hung"),
        ),
        (
            f"{pre}/first-failure/1",
            {"node": 1, "rank": 3, "exitcode": 9},
            lambda: cp.first_failure(store, JOB, 1),
            None,
            lambda: cp.publish_first_failure(store, JOB, 1, 3, 9),
            (3, 9),
        ),
        (
            "resihp/trust/ft/evicted/1/0",
            {"replica": 1, "attempt": 0, "reason": "forged"},
            lambda: q.is_evicted(m),
            False,
            lambda: q.evict(m, "exited"),
            True,
        ),
        (
            "resihp/trust/ft/join/1",
            {"replica": 1, "attempt": 0},
            lambda: q.join_request(1),
            None,
            lambda: q.request_join(m),
            m,
        ),
        (
            "resihp/trust/ft/held/1/0/0",
            {"replica": 1, "attempt": 0, "rank": 0, "step": 7},
            lambda: q.held(m),
            None,
            lambda: q.report_held(m, 0, 7),
            7,
        ),
    ]
    for key, doc, read, absent, write, taken in cases:
        for raw in _forgeries(doc):
            _put(store, key, raw)
            assert read() == absent, (key, raw)
        lines = _dropped(caplog, key)
        assert len(lines) == 1 and "refused" in lines[0], (key, lines)
        write()
        assert read() == taken, key
        if key.endswith("/ended"):
            store.delete_key(key)  # stopping() says first why the job ended
    # a record of the job's copied to another key (another replica's, another node's) is refused
    store.set(f"{pre}/replica/0/order", store.get(f"{pre}/replica/1/order"))
    assert cp.replica_order(store, JOB, 0) is None
    store.set(f"{pre}/stacks/0", store.get(f"{pre}/stacks/1"))
    assert cp.stacks_asked(store, JOB, 0) is None
    # the job's announcement: a node joining or waiting for a relaunch ends with one line
    for raw in _forgeries({"job_id": JOB, "nnodes": 2, "nproc_per_node": 1, "attempt": 1}):
        _put(store, cp.JOB_KEY, raw)
        with pytest.raises(
            InputError, match=f"store key {cp.JOB_KEY}: .*refused.*{JOB_SECRET_ENV} the same"
        ):
            cp.read_job(store, timeout_s=0.2, poll_s=0.1)
    cp.announce_job(store, JOB, {}, 2, 1, attempt=1)
    assert cp.read_job(store, timeout_s=0.2, attempt=1)["job_id"] == JOB
    # a follower, which steers nothing, reads what is there without the secret
    cp.mark_ended(store, JOB, "finished")
    monkeypatch.delenv(JOB_SECRET_ENV)
    assert cp.read_job(store, timeout_s=0.2, verify=False)["job_id"] == JOB
    assert cp.ended(store, JOB) is None and cp.ended(store, JOB, verify=False) == "finished"


def test_forged_quorum_decisions_plans_and_heartbeats_are_refused(store, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, "resihp.store")
    monkeypatch.setenv(JOB_SECRET_ENV, "a" * 64)
    q = Quorum(store, JOB, ranks_per_replica=1, timeout_s=1.0, plan_key=cp.plan_key(JOB))
    gen = q.start([Member(0), Member(1)], 0)
    # a decision written ahead of the job's, evicting replica 1: the job's decider replaces it
    for step, raw in enumerate(
        _forgeries(
            {
                "gen": 0,
                "step": 0,
                "commit": True,
                "joined": [],
                "seen": 0,
                "next": {"gen": 1, "members": [[0, 0]], "from_step": 1},
            }
        )
    ):
        store.set(f"resihp/{JOB}/ft/decision/0/{step}", raw)
        assert q.decision(0, step) is None
        assert q.vote(gen, step, True) is None
        d = q.vote(gen, step, True)
        assert d.commit and d.next.replicas == [0, 1] and q.wait(gen, step) == d
    # a forged plan change is not carried by a commit: the plan in force stays
    cp.post_change(store, JOB, {"id": 1, "dp_weights": [2.0, 1.0]})
    q.vote(gen, 3, True)
    d3 = q.vote(gen, 3, True)
    assert d3.plan["id"] == 1
    for i, raw in enumerate(_forgeries({"id": 2, "dp_weights": [0.0, 1.0]})):
        store.set(cp.plan_key(JOB), raw)
        q.vote(gen, 4 + i, True)
        d = q.vote(gen, 4 + i, True, previous=d3)
        assert d.commit and d.plan == d3.plan
    # a node aggregate saying a rank is gone, and a rank's beat, not signed by the job: not read
    hb = cp.heartbeat_prefix(JOB)
    monitor = HeartbeatMonitor(store, {0: [0]}, prefix=hb, timeout_s=30)
    agg = NodeAggregator(store, 0, [0], prefix=hb, check_pids=False)
    gone = {
        "beat": 1,
        "ranks": {
            "0": {
                "seen": True,
                "silent_s": 0.0,
                "phase": "train",
                "step": 1,
                "pid": os.getpid(),
                "exited": True,
            }
        },
    }
    for raw in _forgeries(gone):
        store.set(node_key(hb, 0), raw)
        assert monitor.poll() == [] and monitor.views[0].seen is False
    for raw in _forgeries(
        {"c": 1, "pid": os.getpid(), "step": 1, "phase": "train", "ops": 1, "wait": ""}
    ):
        store.set(rank_key(hb, 0, 0), raw)
        assert agg.snapshot()["0"]["seen"] is False
    store.set(node_key(hb, 0), json.dumps(sign(gone, "a" * 64)))
    assert [e.cause for e in monitor.poll()] == ["exited"]  # the job's own is read
    for key in (
        f"resihp/{JOB}/ft/decision/0/0",
        cp.plan_key(JOB),
        node_key(hb, 0),
        rank_key(hb, 0, 0),
    ):
        lines = _dropped(caplog, key)
        assert len(lines) == 1 and "refused" in lines[0], (key, lines)


def test_a_node_waiting_for_a_relaunch_takes_no_forged_announcement(monkeypatch):
    monkeypatch.setenv(JOB_SECRET_ENV, "a" * 64)
    port = _free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    nodes = Nodes(2, 1, 1, f"127.0.0.1:{port}")
    host.set(
        cp.JOB_KEY,
        json.dumps(
            sign(
                {"job_id": JOB, "config": {}, "nnodes": 2, "nproc_per_node": 1, "attempt": 1}, OTHER
            )
        ),
    )
    assert await_relaunch(nodes, 1, timeout_s=2.0) is None
    cp.announce_job(host, JOB, {}, 2, 1, attempt=1)
    assert await_relaunch(nodes, 1, timeout_s=5.0)["job_id"] == JOB


def test_a_job_on_several_nodes_needs_the_same_secret_on_each(tmp_path):
    env = {k: v for k, v in ENV.items() if k != JOB_SECRET_ENV}
    for secret in (None, "short"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "resihp.cli",
                "run",
                *SMALL,
                "--steps",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--rdzv-endpoint",
                "127.0.0.1:1",
                "--out",
                str(tmp_path / "o"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**env, **({JOB_SECRET_ENV: secret} if secret else {})},
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = [x for x in proc.stderr.splitlines() if x.strip()]
        assert (
            len(lines) == 1
            and f"--nnodes 2: expected the job's secret in {JOB_SECRET_ENV}" in lines[0]
        ), lines
        assert not (tmp_path / "o").exists()


# --- a running job on two nodes: forged authority and garbage in every key family --------------
REPLICA = [
    *SMALL[: SMALL.index("--recovery")],
    "--recovery",
    "replica",
    "--steps",
    "40",
    "--seed",
    "3",
    "--json",
    "--inject",
    "slow:rank=0,factor=3,step=0",
]  # steps long enough to poison on any machine


def _replica_job(out, port: int | None, node: int | None, secret: str) -> subprocess.Popen:
    nodes = (
        []
        if node is None
        else [
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--nproc-per-node",
            "1",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
        ]
    )
    return subprocess.Popen(
        [sys.executable, "-m", "resihp.cli", "run", *REPLICA, *nodes, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**ENV, JOB_SECRET_ENV: secret},
    )


def _forge_and_poison(port: int, node0: subprocess.Popen, until_s: float) -> dict[str, list[str]]:
    """Once both nodes train, write forged orders (unsigned, or signed with another secret) to end,
    stop, evict, relaunch, re-plan and kill, and garbage into every other key family."""
    _listens(port, node0)
    store = connect_store("127.0.0.1", port, timeout_s=30)
    end = time.monotonic() + 120
    while not store.check([cp.JOB_KEY]):
        assert time.monotonic() < end and node0.poll() is None, "the job never announced itself"
        time.sleep(0.1)
    job = json.loads(store.get(cp.JOB_KEY))["job_id"]
    pre, hb, ft = cp.prefix_of(job), cp.heartbeat_prefix(job), f"resihp/{job}/ft"
    while not store.check([node_key(hb, 1), f"{pre}/ops/n1/s1"]):  # node 1 joined and trains
        assert time.monotonic() < end and node0.poll() is None, "node 1 never trained"
        time.sleep(0.1)
    gone = {
        "seen": True,
        "silent_s": 0.0,
        "phase": "train",
        "step": 2,
        "pid": os.getpid(),
        "exited": True,
    }
    # what each would do if taken: node 1 ends or stops; a replica is evicted, relaunched ...
    forged = {
        f"{pre}/ended": {"job_id": job, "reason": "finished"},
        f"{pre}/stopping": {"job_id": job, "reason": "forged"},
        f"{pre}/replica/1/order": {"replica": 1, "attempt": 1, "relaunch": True},
        f"{pre}/replica/0/order": {"replica": 0, "attempt": 1, "relaunch": False},
        f"{pre}/replica/1/done": {"replica": 1, "state": "done", "attempt": 0},
        f"{pre}/stacks/1": {"node": 1, "rank": 1, "why": "forged"},
        f"{ft}/evicted/1/0": {"replica": 1, "attempt": 0, "reason": "forged"},
        cp.plan_key(job): {"id": "forged", "dp_weights": [3.0, 1.0]},
        node_key(hb, 1): {"beat": 10**6, "ranks": {"1": gone}},
        cp.JOB_KEY: {
            "job_id": job,
            "nnodes": 2,
            "nproc_per_node": 1,
            "attempt": 1,
            "no_relaunch": "forged",
        },
    }
    # decisions evicting replica 1, written once, ahead of the steps the job will decide
    for s in range(8, 40):
        doc = {
            "gen": 0,
            "step": s,
            "commit": True,
            "joined": [],
            "seen": 0,
            "next": {"gen": 1, "members": [[0, 0]], "from_step": s + 1},
        }
        store.set(f"{ft}/decision/0/{s}", json.dumps(sign(doc, "b" * 64) if s % 2 else doc))
    beats = {rank_key(hb, 0, 0), rank_key(hb, 1, 1), node_key(hb, 0), node_key(hb, 1)}
    garbage = [
        rank_key(hb, 0, 0),
        rank_key(hb, 1, 1),
        node_key(hb, 0),
        f"{pre}/first-failure/1",
        f"{ft}/join/1",
        f"{ft}/held/1/1/0",
        f"{ft}/replicas",
        f"{ft}/gen/latest",
        f"{ft}/heal-shape/1/1",
    ]
    _put(store, f"{pre}/errors", BAD["oversized"] + b"\n", append=True)
    values = [v for k, v in BAD.items() if k != "oversized"]
    stop, i = time.monotonic() + until_s, 0
    try:
        # until the job's last steps (its own end announcement is not overwritten)
        while time.monotonic() < stop and node0.poll() is None and _last_step(store, pre) < 30:
            secret = None if i % 2 == 0 else "b" * 64  # unsigned, then another secret's
            # heartbeats a few times a second: the job's own ones are read between
            for key, doc in forged.items():
                if key not in beats or i % 5 == 0:
                    store.set(key, json.dumps(sign(doc, secret) if secret else doc))
            store.add(
                changes_key(job), 1
            )  # the quorum looks for changes (an eviction, a plan post)
            raw = values[i % len(values)]
            for key in garbage:
                if key not in beats or i % 5 == 0:
                    store.set(key, raw)
            line = raw.replace(b"\n", b" ") + b"\n"
            store.append(f"{pre}/errors", line)
            for n in (0, 1):
                for step in range(40):
                    store.append(f"{pre}/ops/n{n}/s{step}", line)
            i += 1
            time.sleep(0.05)
    except RuntimeError:  # DistNetworkError: the job ended and its store with it
        pass
    assert i > 10, "the job ended before it was poisoned"
    return {"forged": list(forged), "garbage": garbage}


def _last_step(store, pre: str) -> int:
    """The last step node 0 read the records of (-1: none yet)."""
    key = f"{pre}/ops/last"
    last = checked_int(store.get(key), key) if store.check([key]) else None
    return -1 if last is None else last


def _listens(port: int, proc: subprocess.Popen) -> bool:
    end = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            assert time.monotonic() < end and proc.poll() is None, "the job's store never listened"
            time.sleep(0.1)


@pytest.mark.slow
def test_a_two_node_job_refuses_forged_orders_and_trains_on_through_garbage_with_the_same_losses(
    tmp_path,
):
    """Replica mode, one replica per node. While it trains, another process that reaches the
    store writes, over and over: the job ended, node 0 is stopping, evict replica 1 (the quorum's
    eviction, decisions ahead of the job's, a node aggregate saying its rank exited), relaunch or
    stop each replica, a replica finished, a plan change, a stacks request (which kills the rank),
    a relaunch announcement; each unsigned or signed with another secret. Garbage, truncated,
    oversized and hostile values go into every other key family. Nothing is taken: no replica is
    lost and every loss equals the one-node run's."""
    secret = "c" * 64
    ref = _replica_job(tmp_path / "ref", None, None, secret)
    out, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err[-2000:]
    want = json.loads(out)["losses"]
    port = _free_port()
    node0 = _replica_job(tmp_path / "node0", port, 0, secret)
    node1 = _replica_job(tmp_path / "node1", port, 1, secret)
    try:
        keys = _forge_and_poison(port, node0, until_s=30.0)
        out0, err0 = node0.communicate(timeout=300)
        out1, err1 = node1.communicate(timeout=300)
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert node0.returncode == 0 and node1.returncode == 0, (err0[-3000:], err1[-3000:])
    s0, s1 = json.loads(out0), json.loads(out1)
    assert s1 == {"node_rank": 1, "nnodes": 2, "ranks": [1], "error": None}, s1
    assert s0["recovery"] is None and all(m == [0, 1] for m in s0["members"]), (
        s0["recovery"],
        s0["members"],
    )
    assert s0["losses"] == want
    logs = (
        err0
        + err1
        + "".join((tmp_path / n / "logs" / "workers.log").read_text() for n in ("node0", "node1"))
    )
    assert "Traceback" not in logs, logs[-3000:]
    job = s0["job_id"]
    pre = cp.prefix_of(job)
    # what node 1's launcher reads at each poll: refused, one line each
    for key in (f"{pre}/ended", f"{pre}/replica/1/order", f"{pre}/stacks/1"):
        lines = [x for x in err1.splitlines() if f"store key {key}: record dropped:" in x]
        assert len(lines) == 1 and "refused" in lines[0], (key, lines)
    # the evictions and decisions read by node 0 and the ranks: each refused at most once per
    # process
    refused = [x for x in logs.splitlines() if "record dropped" in x and "refused" in x]
    assert any(f"resihp/{job}/ft/decision/0/8:" in x for x in refused), refused
    assert keys["forged"] and keys["garbage"]
