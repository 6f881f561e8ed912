"""Two nodes simulated on this machine: two ``resihp run`` launchers with torchrun's multi-node
options on one loopback endpoint, each with its own run folder (nothing shared on disk). Node 0
hosts the job's store, judges every rank's heartbeats and runs the live loop; node 1 runs its
workers and its heartbeat aggregator."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resihp.ckpt.integrity import problem
from resihp.detect.records import JOB_SECRET_ENV
from resihp.launch.replica_launch import node_replicas, replica_ranks
from resihp.train.config import RunConfig
from resihp.train.nodes import Nodes, free_port
from tests.faults import announced, descendants

DEMO = [
    "--layers",
    "4",
    "--hidden",
    "64",
    "--heads",
    "2",
    "--ffn-hidden",
    "256",
    "--vocab",
    "512",
    "--global-tokens",
    "8192",
    "--budget",
    "512",
    "--max-len",
    "512",
    "--dp",
    "2",
    "--pp",
    "2",
]
FAST = ["--heartbeat-timeout", "3", "--timeout", "30"]
# every node of a job is launched with the same secret (what steers the job is signed with it)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", JOB_SECRET_ENV: secrets.token_hex(32)}


def _node(tmp: Path, port: int, rank: int, *args: str) -> subprocess.Popen:
    env = ENV
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resihp.cli",
            "run",
            *DEMO,
            *FAST,
            "--json",
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--nproc-per-node",
            "2",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--out",
            str(tmp / f"node{rank}"),
            *args,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _two_nodes(
    tmp: Path, *args: str, port: int | None = None
) -> tuple[subprocess.Popen, subprocess.Popen]:
    port = port or free_port()
    return _node(tmp, port, 0, *args), _node(tmp, port, 1, *args)


def _listening(port: int, timeout_s: float = 60.0) -> None:
    """Wait until node 0's store listens on ``port``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on {port}")


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=timeout)
    return (json.loads(out) if out.strip() else {}), err


def _no_workers_left(tmp: Path, wait_s: float = 5.0) -> None:
    """No process of the job is left: none whose command line names its folder, and no worker that
    announced itself in a node's ``processes.jsonl`` (a forked worker's command line is its warm
    agent server's, which names no folder)."""
    end = time.monotonic() + wait_s
    while True:
        left = subprocess.run(
            ["pgrep", "-f", str(tmp)], capture_output=True, text=True
        ).stdout.split()
        left += [str(e["pid"]) for node in ("node0", "node1") for e in announced(tmp / node)]
        if not left or time.monotonic() > end:
            break
        time.sleep(0.1)
    assert left == [], f"processes of the job still alive: {left}"


def _kill_node_1_once_started(tmp: Path, node1: subprocess.Popen) -> list[int]:
    """SIGKILL node 1's launcher once node 0 has the job's first step; the PIDs it had below it."""
    stream = tmp / "node0" / "ops.jsonl"
    end = time.time() + 120
    while not (stream.exists() and stream.stat().st_size > 0) and time.time() < end:
        time.sleep(0.1)
    assert stream.exists(), "the job did not start"
    workers = descendants(node1.pid)
    node1.send_signal(signal.SIGKILL)
    node1.wait(timeout=10)
    return workers


def _all_gone(pids: list[int], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.time() + timeout_s
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(Path(f"/proc/{p}").exists() for p in pids), what


@pytest.mark.slow
def test_slow_rank_on_node_1_is_detected_and_replanned_by_node_0(tmp_path):
    port = free_port()
    node0, node1 = _two_nodes(
        tmp_path, "--steps", "34", "--inject", "slow:rank=3,factor=3,step=24", port=port
    )
    # a third machine follows the job through its store alone (no run folder)
    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resihp.cli",
            "follow",
            "--store",
            f"127.0.0.1:{port}",
            "--json",
            "--start-timeout",
            "120",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    s0, err0 = _finish(node0)
    s1, err1 = _finish(node1)
    report, ferr = _finish(follower, timeout=60)
    assert follower.returncode == 0, ferr[-2000:]
    assert report["steps"] >= 30 and any(
        e["kind"] == "fail-slow" and e["rank"] == 3 for e in report["events"]
    )
    assert node0.returncode == 0 and node1.returncode == 0, (err0[-2000:], err1[-2000:])
    assert s0["steps"] == 34 and len(s0["losses"]) == 34
    slow = [e for e in s0["events"] if e["kind"] == "fail-slow" and e["rank"] == 3]
    assert slow and slow[0]["detected_step"] - 24 <= 5, s0["events"]
    assert any(c.get("applied_step") is not None for c in s0["plan_changes"]), s0["plan_changes"]
    assert s1["ranks"] == [2, 3] and s1["error"] is None
    # nothing of the job's trace is on node 1's disk: node 0 has it all
    assert (tmp_path / "node0" / "ops.parquet").exists() and not (
        tmp_path / "node1" / "ops.parquet"
    ).exists()
    _no_workers_left(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("fault,cause", [("hang:rank=3,step=4", "hang")])
def test_killed_or_hung_rank_on_node_1_is_a_fail_stop_on_node_0(tmp_path, fault, cause):
    """(A killed rank on node 1: the re-formed relaunch below starts from that failure.) The hung
    rank's stacks are in node 1's log."""
    t0 = time.time()
    node0, node1 = _two_nodes(tmp_path, "--steps", "40", "--inject", fault)
    s0, err0 = _finish(node0)
    s1, err1 = _finish(node1)
    failure = s0["failure"]
    assert (
        failure["rank"] == int(fault.split("rank=")[1].split(",")[0]) and failure["cause"] == cause
    ), err0[-2000:]
    assert failure["step"] >= 4 and failure["node"] == 1
    assert node0.returncode == 1 and err0.strip().splitlines()[-1].startswith("resihp: rank")
    assert "Traceback" not in err0 and "Traceback" not in err1
    # node 1 ends too, with one line (node 0's reason, or its own torchrun's if it saw it first)
    assert node1.returncode == 1 and err1.strip().splitlines()[-1].startswith("resihp: ")
    # node 0 asked node 1's launcher, which can signal it, for the hung rank's stacks
    log = (tmp_path / "node1" / "logs" / "workers.log").read_text()
    assert "resihp: rank 3 judged hung" in log and "in begin_step" in log, log[-2000:]
    assert time.time() - t0 < 200
    _no_workers_left(tmp_path)


@pytest.mark.slow
def test_a_rank_lost_on_node_1_is_re_formed_around_with_every_survivor_on_its_node(
    tmp_path, replica_reference
):
    """Rank 3 (node 1) dies at step 5 of a job that checkpoints to one folder both nodes write
    (``--ckpt-dir``): each checkpoint is whole (every rank's shards), node 0 re-forms the survivors
    as the planner says and relaunches its two ranks, node 1's launcher joins with its one (ranks
    per node 2 and 1), and every step's loss equals the failure-free run's."""
    shared = tmp_path / "shared-ckpt"
    node0, node1 = _two_nodes(
        tmp_path,
        "--steps",
        "10",
        "--inject",
        "stop:rank=3,step=4",
        "--ckpt-every",
        "2",
        "--ckpt-dir",
        str(shared),
        "--no-live",
    )
    s0, err0 = _finish(node0)
    s1, err1 = _finish(node1)
    assert node0.returncode == 0 and node1.returncode == 0, (err0[-2000:], err1[-2000:])
    assert s1["error"] is None and s1["ranks"] == [2] and "Traceback" not in err0 + err1
    failure = s0["failure"]  # found by node 0 on node 1
    assert (failure["rank"], failure["cause"], failure["node"], failure["step"]) == (
        3,
        "exited",
        1,
        4,
    ), failure
    change = s0["plan_changes"][0]
    assert change["kind"] == "exclude" and change["rank"] == 3 and change["ranks"] == [0, 1, 2], (
        change
    )
    assert Path(change["restart_from"]).parent == shared and problem(change["restart_from"]) is None
    assert len(list(Path(change["restart_from"]).glob("*.distcp"))) == 4  # every rank's shards
    # the relaunch: ranks 0 and 1 on node 0, rank 2 on node 1 (the survivor of node 1)
    placed = {
        node: [
            json.loads(line)
            for line in (tmp_path / node / "restart" / "logs" / "processes.jsonl")
            .read_text()
            .splitlines()
        ]
        for node in ("node0", "node1")
    }
    assert [len(placed["node0"]), len(placed["node1"])] == [2, 1], placed
    # the failure-free run's: the first 10 steps of the one-node run of the same job below (replica
    # mode: the same global batches, the same losses up to reduction order)
    want = replica_reference[:10]
    assert s0["steps"] == 10 and len(s0["losses"]) == 10
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(s0["losses"], want)), (
        s0["losses"],
        want,
    )
    _no_workers_left(tmp_path)


def test_each_node_runs_whole_replicas_in_order():
    """Replica mode on several nodes: node n runs replicas n k .. n k + k - 1 (k per node), whose
    ranks are not contiguous (stage-major): node 1 of a DP 4 x PP 2 job on two nodes runs replicas
    2 and 3, ranks 2, 6, 3 and 7."""
    cfg = RunConfig.from_flags(dp=4, pp=2, recovery="replica")
    ranks = replica_ranks(cfg)
    assert ranks == {0: [0, 4], 1: [1, 5], 2: [2, 6], 3: [3, 7]}
    layout = {n: node_replicas(cfg, Nodes(2, n, 4, "127.0.0.1:1")) for n in (0, 1)}
    assert layout == {0: [0, 1], 1: [2, 3]}
    assert node_replicas(cfg, Nodes(4, 3, 2, "127.0.0.1:1")) == [3]


@pytest.fixture(scope="module")
def replica_reference(tmp_path_factory):
    """The failure-free losses of the replica-mode job below, on one node (``REPLICA_STEPS``); its
    first 10 are the re-formed job's above too."""
    out = tmp_path_factory.mktemp("replica-ref")
    ref = _run(
        *DEMO,
        "--steps",
        str(REPLICA_STEPS),
        "--recovery",
        "replica",
        "--out",
        str(out / "ref"),
        "--json",
    )
    assert ref.returncode == 0, ref.stderr[-2000:]
    return json.loads(ref.stdout)["losses"]


REPLICA_STEPS = (
    16  # a lost replica is back 2-3 steps after its failure (at step 4) with warm agents
)


@pytest.mark.slow
@pytest.mark.parametrize("fault,cause", [("stop", "exited"), ("hang", "hang")])
def test_replica_mode_on_two_nodes_relaunches_a_lost_replica_on_its_node_and_the_losses_are_kept(
    tmp_path, replica_reference, fault, cause
):
    """--recovery replica with one replica per node: rank 3 (replica 1, node 1) is killed or hangs
    at step 4. Node 0 judges it and evicts the replica; node 1's launcher stops it and relaunches
    it alone (a hung rank's stacks in node 1's log first); it catches up from replica 0 and rejoins,
    and every step's loss equals the failure-free run's. Replica 0's ranks are slowed from the
    fault on so that the relaunched replica is back before the end on any machine."""
    node0, node1 = _two_nodes(
        tmp_path,
        "--steps",
        str(REPLICA_STEPS),
        "--recovery",
        "replica",
        "--inject",
        f"{fault}:rank=3,step=4",
        "--inject",
        "slow:rank=0,factor=3,step=4",
        "--inject",
        "slow:rank=2,factor=3,step=4",
    )
    s0, err0 = _finish(node0)
    s1, err1 = _finish(node1)
    assert node0.returncode == 0 and node1.returncode == 0, (err0[-2000:], err1[-2000:])
    assert s1 == {"node_rank": 1, "nnodes": 2, "ranks": [1, 3], "error": None}, (
        s1
    )  # replica 1's ranks
    rec = s0["recovery"]
    assert (rec["lost_replica"], rec["rank"], rec["cause"], rec["relaunched"]) == (
        1,
        3,
        cause,
        True,
    ), rec
    assert rec["rejoined_step"] is not None and rec["source"] == "peer", rec
    assert all(0 in m for m in s0["members"]) and [1] not in s0["members"], s0["members"]
    # each node ran its own replica, the relaunch too (each worker says which it is)
    ran = {
        n: {
            (w["replica"], w["attempt"])
            for line in (tmp_path / n / "logs" / "processes.jsonl").read_text().splitlines()
            for w in [json.loads(line)]
        }
        for n in ("node0", "node1")
    }
    assert ran == {"node0": {(0, 0)}, "node1": {(1, 0), (1, 1)}}, ran
    if fault == "hang":
        log = (tmp_path / "node1" / "logs" / "workers.log").read_text()
        assert "resihp: rank 3 judged hung" in log and "in begin_step" in log, log[-2000:]
    assert len(s0["losses"]) == REPLICA_STEPS
    want = replica_reference
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(s0["losses"], want)), (
        s0["losses"],
        want,
    )
    _no_workers_left(tmp_path)


@pytest.mark.slow
def test_replica_mode_trains_on_when_a_whole_node_is_lost(tmp_path, replica_reference):
    """--recovery replica, one replica per node: node 1's launcher is killed (SIGKILL; its workers
    die with it). Node 0 finds node 1 silent, evicts its replica (not relaunched: nobody is left
    there to do it) and trains every step with replica 0, at the failure-free run's losses."""
    slow = [
        "--inject",
        "slow:rank=0,factor=2,step=1",
    ]  # steps long enough to see it go on any machine
    node0, node1 = _two_nodes(
        tmp_path, "--steps", str(REPLICA_STEPS), "--recovery", "replica", *slow
    )
    workers1 = _kill_node_1_once_started(tmp_path, node1)
    s0, err0 = _finish(node0)
    assert node0.returncode == 0, err0[-2000:]
    rec = s0["recovery"]
    assert (rec["lost_replica"], rec["cause"], rec["relaunched"]) == (1, "node", False), rec
    assert s0["members"][-1] == [0] and len(s0["losses"]) == REPLICA_STEPS
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(s0["losses"], replica_reference))
    _all_gone(workers1, "node 1's workers outlived it")
    _no_workers_left(tmp_path)


@pytest.mark.slow
def test_a_node_left_with_no_rank_is_not_relaunched_and_its_launcher_is_told_at_once(tmp_path):
    """One rank per node; node 1's only rank dies: no re-formed relaunch keeps every survivor on
    its node, so node 0 names the newest whole checkpoint and tells node 1's launcher, which ends
    with node 0's reason rather than after its wait for a relaunch."""
    shared = tmp_path / "shared-ckpt"
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "resihp.cli",
                "run",
                *DEMO[:-4],
                "--dp",
                "2",
                "--pp",
                "1",
                *FAST,
                "--json",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--nproc-per-node",
                "1",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--out",
                str(tmp_path / f"node{rank}"),
                "--steps",
                "10",
                "--ckpt-every",
                "2",
                "--ckpt-dir",
                str(shared),
                "--no-live",
                "--inject",
                "stop:rank=1,step=4",
            ],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    s0, err0 = _finish(procs[0])
    s1, err1 = _finish(procs[1])
    assert procs[0].returncode == 1 and procs[1].returncode == 1
    rec = s0["recovery"]
    assert rec["restarted"] is False and rec["reason"] == "a node has no device left", rec
    assert Path(rec["checkpoint"]).parent == shared and problem(rec["checkpoint"]) is None
    assert "node 0 does not relaunch it: a node has no device left" in s1["error"], s1
    _no_workers_left(tmp_path)


@pytest.mark.slow
def test_node_1_launcher_killed_node_0_ends_cleanly_with_one_line(tmp_path):
    node0, node1 = _two_nodes(tmp_path, "--steps", "200")
    workers1 = _kill_node_1_once_started(tmp_path, node1)
    s0, err0 = _finish(node0)
    assert node0.returncode == 1
    last = err0.strip().splitlines()[-1]
    assert last.startswith("resihp: node 1") and "stopped answering" in last, err0[-2000:]
    assert s0["failure"]["cause"] == "node"
    _all_gone(workers1, "node 1's workers outlived it")
    _no_workers_left(tmp_path)


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "resihp.cli", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )


@pytest.mark.parametrize(
    "args,expect",
    [
        (
            ["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1"],
            "--node-rank 2: out of range",
        ),
        (["--nnodes", "3"], "--nnodes 3: expected a positive divisor"),
        (["--nnodes", "2"], "--rdzv-endpoint HOST:PORT is required"),
        (
            ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "nonsense"],
            "expected HOST:PORT",
        ),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--ckpt-every", "2"],
            "expected --ckpt-dir DIR",
        ),
        (
            ["--nnodes", "4", "--rdzv-endpoint", "127.0.0.1:1", "--recovery", "replica"],
            "each node holds whole replicas",
        ),
    ],
)
def test_bad_multinode_options_are_one_line(tmp_path, args, expect):
    proc = _run("--dp", "2", "--pp", "2", "--steps", "2", "--out", str(tmp_path / "x"), *args)
    assert proc.returncode == 2 and expect in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_unreachable_endpoint_and_disagreeing_nodes_are_one_line(tmp_path):
    port = free_port()
    proc = _run(
        *DEMO,
        "--steps",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--nproc-per-node",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--timeout",
        "3",
        "--out",
        str(tmp_path / "n1"),
    )
    assert proc.returncode == 2 and "cannot reach the job's store" in proc.stderr, proc.stderr[
        -2000:
    ]
    assert "Traceback" not in proc.stderr
    node0 = _node(tmp_path, port, 0, "--steps", "50")
    try:
        _listening(port)
        other = _run(
            *[a if a != "64" else "128" for a in DEMO],
            *FAST,
            "--steps",
            "50",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--nproc-per-node",
            "2",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--out",
            str(tmp_path / "n1b"),
        )
        assert (
            other.returncode == 2
            and "configuration differs" in other.stderr
            and "hidden" in other.stderr
        )
        second = _run(
            *DEMO,
            "--steps",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--nproc-per-node",
            "2",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--out",
            str(tmp_path / "second"),
        )
        assert second.returncode == 2 and "cannot listen there" in second.stderr
    finally:
        node0.send_signal(signal.SIGTERM)
        node0.communicate(timeout=60)
    _no_workers_left(tmp_path)
