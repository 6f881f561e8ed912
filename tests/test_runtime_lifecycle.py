"""Issue 20: a run cleans up after itself and never trusts the wrong state. Real ``resihp run``
processes, real signals (by PID, only to processes these tests started), /proc to see what is left."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from resihp.errors import InputError
from tests.faults import (
    alive,
    descendants,
    inject_signal,
    listening_ports,
    wait_for,
    wait_gone,
    worker_pids,
)

SMALL = ["--layers", "2", "--hidden", "32", "--heads", "2", "--ffn-hidden", "64", "--vocab", "128",
         "--global-tokens", "512", "--budget", "256", "--max-len", "256", "--dp", "2", "--pp", "1",
         "--no-live", "--timeout", "20", "--heartbeat-timeout", "3"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def start(out, *extra, steps=100000):
    return subprocess.Popen([sys.executable, "-m", "resihp.cli", "run", *SMALL, "--steps", str(steps),
                             "--out", str(out), "--json", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def job_pids(proc, out, world=2) -> set[int]:
    """Every process of the job started by ``proc``: the CLI, torchrun and its workers."""
    workers = worker_pids(out, world)
    pids = {proc.pid} | descendants(proc.pid)
    assert set(workers.values()) <= pids, (workers, pids)
    return pids


def finish(proc, timeout=60):
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"resihp run did not end within {timeout} s: {stderr[-2000:]}") from None
    return stdout, stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP])
def test_a_signalled_worker_leaves_no_process_of_the_run(tmp_path, sig):
    out = tmp_path / "run"
    proc = start(out)
    pids = job_pids(proc, out)
    victim = worker_pids(out, 2)[1]
    inject_signal(victim, sig)  # SIGSTOP: a hung worker (it keeps its PID but stops beating)
    stdout, stderr = finish(proc)
    assert proc.returncode == 1, stderr[-2000:]
    assert "Traceback" not in stderr
    assert wait_gone(pids, 2.0) == set(), f"left running after {sig.name}: {wait_gone(pids, 0)}"
    summary = json.loads(stdout)
    if sig != signal.SIGTERM:
        assert summary["failure"]["rank"] == 1 and summary["failure"]["kind"] == "fail-stop"


@pytest.mark.slow
def test_sigterm_to_the_supervisor_stops_the_job_keeps_its_trace_and_marks_it_resumable(tmp_path):
    from resihp.opstrace import read_ops_trace

    out = tmp_path / "run"
    proc = start(out, "--ckpt-every", "2")
    pids = job_pids(proc, out)
    wait_for(lambda: (out / "ckpt" / "step1" / "manifest.json").exists(), 60, "a first checkpoint")
    pids |= descendants(proc.pid)
    # bound to loopback: no process of the job listens beyond 127.0.0.1
    ports = listening_ports(pids)
    assert ports and all(addr in ("127.0.0.1", "::ffff:127.0.0.1") for addr, _, _ in ports), ports
    inject_signal(proc.pid, signal.SIGTERM)
    stdout, stderr = finish(proc)
    assert proc.returncode == 143, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == "resihp: stopped by SIGTERM; all workers were stopped"
    assert wait_gone(pids, 2.0) == set()
    summary = json.loads(stdout)
    run = json.loads((out / "run.json").read_text())
    assert summary["interrupted"] == "SIGTERM" and run["state"] == "interrupted"
    ckpt = summary["resumable"]["checkpoint"]
    assert ckpt and ckpt == run["resumable"]["checkpoint"] and os.path.isdir(ckpt)
    assert summary["resumable"]["next_step"] == int(ckpt.rsplit("step", 1)[1]) + 1
    trace = read_ops_trace(out / "ops.parquet")  # the trace written so far is kept, and valid
    assert summary["steps"] >= 2 and set(trace["rank"]) == {0, 1}


@pytest.mark.slow
def test_sigkill_of_the_supervisor_takes_the_workers_with_it(tmp_path):
    out = tmp_path / "run"
    proc = start(out)
    pids = job_pids(proc, out)
    inject_signal(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert wait_gone(pids, 5.0) == set(), "torchrun or workers outlived a SIGKILLed resihp run"


# --- a run folder belongs to one job --------------------------------------------------------------
HOLD = ("import sys, time; from resihp.runtime.lifecycle import RunFolder; "
        "f = RunFolder(sys.argv[1], 'holder-job').acquire(); print('held', flush=True); time.sleep(60)")


def test_second_job_into_a_busy_run_folder_exits_2_or_takes_a_fresh_subfolder(tmp_path, monkeypatch, capsys):
    from resihp.cli import main
    from resihp.runtime.lifecycle import RunFolder

    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(sys, "argv", ["resihp", "run", *SMALL, "--out", str(out)])
        with pytest.raises(SystemExit) as info:
            main()
        err = capsys.readouterr().err
        assert info.value.code == 2 and len(err.strip().splitlines()) == 1
        assert f"--out {out}: run folder in use by job holder-job (pid {holder.pid})" in err
        with pytest.raises(InputError, match="in use by job holder-job"):
            RunFolder(out).acquire()
        fresh = RunFolder(out).acquire("subfolder")
        assert fresh.out == out / fresh.job_id and fresh.out.is_dir()
        fresh.release()
    finally:
        holder.kill()
        holder.wait()
    with RunFolder(out).acquire() as folder:  # the kernel dropped the lock with the holder
        assert folder.out == out


def test_tracker_ends_a_whole_process_tree_even_when_stopped_and_regrouped(tmp_path):
    """A hung (SIGSTOPped) child in a session of its own, with a grandchild: all are ended."""
    from resihp.runtime.lifecycle import ProcessTracker

    script = ("import os, subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
              "print(c.pid, flush=True); time.sleep(600)")
    root = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(root.stdout.readline())
    tracker = ProcessTracker(root.pid)
    tracker.scan()
    assert child in tracker.known
    os.kill(child, signal.SIGSTOP)
    t0 = time.time()
    left = tracker.end_all(grace_s=1.0, wait=root.poll)
    root.wait()
    assert left == [] and not alive(child) and time.time() - t0 < 10
