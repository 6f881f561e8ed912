"""Two nodes simulated on this machine: two ``resihp run`` launchers with torchrun's multi-node
options on one loopback endpoint, each with its own run folder (nothing shared on disk). Node 0
hosts the job's store, judges every rank's heartbeats and runs the live loop; node 1 runs its
workers and its heartbeat aggregator."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resihp.ckpt.integrity import problem
from resihp.runtime.nodes import free_port
from tests.faults import descendants

DEMO = ["--layers", "4", "--hidden", "64", "--heads", "2", "--ffn-hidden", "256", "--vocab", "512",
        "--global-tokens", "8192", "--budget", "512", "--max-len", "512", "--dp", "2", "--pp", "2"]
FAST = ["--heartbeat-timeout", "3", "--timeout", "30"]


def _node(tmp: Path, port: int, rank: int, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "resihp.cli", "run", *DEMO, *FAST, "--json",
                             "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "2",
                             "--rdzv-endpoint", f"127.0.0.1:{port}", "--out", str(tmp / f"node{rank}"),
                             *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _two_nodes(tmp: Path, *args: str, port: int | None = None) -> tuple[subprocess.Popen, subprocess.Popen]:
    port = port or free_port()
    return _node(tmp, port, 0, *args), _node(tmp, port, 1, *args)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=timeout)
    return (json.loads(out) if out.strip() else {}), err


def _no_workers_left(tmp: Path) -> None:
    left = subprocess.run(["pgrep", "-f", str(tmp)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes of the job still alive: {left}"


@pytest.mark.slow
def test_slow_rank_on_node_1_is_detected_and_replanned_by_node_0(tmp_path):
    port = free_port()
    node0, node1 = _two_nodes(tmp_path, "--steps", "34", "--inject", "slow:rank=3,factor=3,step=24", port=port)
    # a third machine follows the job through its store alone (no run folder)
    follower = subprocess.Popen([sys.executable, "-m", "resihp.cli", "follow", "--store", f"127.0.0.1:{port}",
                                 "--json", "--start-timeout", "120"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    s0, err0 = _finish(node0)
    s1, err1 = _finish(node1)
    report, ferr = _finish(follower, timeout=60)
    assert follower.returncode == 0, ferr[-2000:]
    assert report["steps"] >= 30 and any(e["kind"] == "fail-slow" and e["rank"] == 3 for e in report["events"])
    assert node0.returncode == 0 and node1.returncode == 0, (err0[-2000:], err1[-2000:])
    assert s0["steps"] == 34 and len(s0["losses"]) == 34
    slow = [e for e in s0["events"] if e["kind"] == "fail-slow" and e["rank"] == 3]
    assert slow and slow[0]["detected_step"] - 24 <= 5, s0["events"]
    assert any(c.get("applied_step") is not None for c in s0["plan_changes"]), s0["plan_changes"]
    assert s1["ranks"] == [2, 3] and s1["error"] is None
    # nothing of the job's trace is on node 1's disk: node 0 has it all
    assert (tmp_path / "node0" / "ops.parquet").exists() and not (tmp_path / "node1" / "ops.parquet").exists()
    _no_workers_left(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("fault,cause", [("stop:rank=2,step=4", "exited"), ("hang:rank=3,step=4", "hang")])
def test_killed_or_hung_rank_on_node_1_is_a_fail_stop_on_node_0(tmp_path, fault, cause):
    """Checkpoints of a job on two nodes go to one folder both write (``--ckpt-dir``): each is
    whole (every rank's shards), and the job's survivors resume from it in any layout. Node 0 does
    not relaunch them itself (its launcher holds only its own node's devices): it names the
    checkpoint."""
    t0 = time.time()
    shared = tmp_path / "shared-ckpt"
    node0, node1 = _two_nodes(tmp_path, "--steps", "40", "--inject", fault, "--ckpt-every", "2",
                              "--ckpt-dir", str(shared))
    s0, err0 = _finish(node0)
    s1, err1 = _finish(node1)
    failure = s0["failure"]
    assert failure["rank"] == int(fault.split("rank=")[1].split(",")[0]) and failure["cause"] == cause, err0[-2000:]
    assert failure["step"] >= 4 and failure["node"] == 1
    assert node0.returncode == 1 and err0.strip().splitlines()[-1].startswith("resihp: rank")
    assert "Traceback" not in err0 and "Traceback" not in err1
    # node 1 ends too, with one line (node 0's reason, or its own torchrun's if it saw it first)
    assert node1.returncode == 1 and err1.strip().splitlines()[-1].startswith("resihp: ")
    rec = s0["recovery"]
    assert rec["restarted"] is False and "resihp run --resume" in rec["reason"], rec
    ckpt = Path(rec["checkpoint"])
    assert ckpt.parent == shared and s0["resumable"]["checkpoint"] == s1["resumable"]["checkpoint"] == str(ckpt)
    assert problem(ckpt) is None and len(list(ckpt.glob("*.distcp"))) == 4  # every rank's shards
    assert time.time() - t0 < 200
    _no_workers_left(tmp_path)
    if cause == "exited":  # the survivors' resume, on one node in another layout (the folder: its newest)
        first = int(ckpt.name.removeprefix("step")) + 1
        resumed = _run(*DEMO[:-4], "--dp", "1", "--pp", "3", "--steps", str(first + 2), "--resume", str(shared),
                       "--out", str(tmp_path / "resumed"), "--json")
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        summary = json.loads(resumed.stdout)
        assert summary["first_step"] == first and len(summary["losses"]) == 2


@pytest.mark.slow
def test_node_1_launcher_killed_node_0_ends_cleanly_with_one_line(tmp_path):
    node0, node1 = _two_nodes(tmp_path, "--steps", "200")
    stream = tmp_path / "node0" / "ops.jsonl"
    end = time.time() + 120
    while not (stream.exists() and stream.stat().st_size > 0) and time.time() < end:
        time.sleep(0.2)
    assert stream.exists(), "the job did not start"
    workers1 = descendants(node1.pid)
    node1.send_signal(signal.SIGKILL)
    node1.wait(timeout=10)
    s0, err0 = _finish(node0)
    assert node0.returncode == 1
    last = err0.strip().splitlines()[-1]
    assert last.startswith("resihp: node 1") and "stopped answering" in last, err0[-2000:]
    assert s0["failure"]["cause"] == "node"
    deadline = time.time() + 15
    while any(Path(f"/proc/{p}").exists() for p in workers1) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(Path(f"/proc/{p}").exists() for p in workers1), "node 1's workers outlived it"
    _no_workers_left(tmp_path)


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resihp.cli", "run", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("args,expect", [
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1"], "--node-rank 2: out of range"),
    (["--nnodes", "3"], "--nnodes 3: expected a positive divisor"),
    (["--nnodes", "2"], "--rdzv-endpoint HOST:PORT is required"),
    (["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "nonsense"], "expected HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--ckpt-every", "2"], "expected --ckpt-dir DIR"),
])
def test_bad_multinode_options_are_one_line(tmp_path, args, expect):
    proc = _run("--dp", "2", "--pp", "2", "--steps", "2", "--out", str(tmp_path / "x"), *args)
    assert proc.returncode == 2 and expect in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_unreachable_endpoint_and_disagreeing_nodes_are_one_line(tmp_path):
    port = free_port()
    proc = _run(*DEMO, "--steps", "2", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--timeout", "3", "--out", str(tmp_path / "n1"))
    assert proc.returncode == 2 and "cannot reach the job's store" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    node0 = _node(tmp_path, port, 0, "--steps", "50")
    try:
        time.sleep(3)
        other = _run(*[a if a != "64" else "128" for a in DEMO], *FAST, "--steps", "50", "--nnodes", "2",
                     "--node-rank", "1", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
                     "--out", str(tmp_path / "n1b"))
        assert other.returncode == 2 and "configuration differs" in other.stderr and "hidden" in other.stderr
        second = _run(*DEMO, "--steps", "2", "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "2",
                      "--rdzv-endpoint", f"127.0.0.1:{port}", "--out", str(tmp_path / "second"))
        assert second.returncode == 2 and "cannot listen there" in second.stderr
    finally:
        node0.send_signal(signal.SIGTERM)
        node0.communicate(timeout=60)
    _no_workers_left(tmp_path)
