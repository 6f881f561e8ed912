"""Issue 20: a run cleans up after itself and never trusts the wrong state. Real ``resihp run``
processes, real signals (by PID, only to processes these tests started), /proc to see what is
left."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from resihp.errors import InputError
from tests.faults import (
    alive,
    can_mount_tmpfs,
    descendants,
    enospc,
    fill,
    inject_signal,
    listening_ports,
    parent_of,
    raise_at,
    small_disk,
    wait_for,
    wait_gone,
    worker_pids,
)

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
    "20",
    "--heartbeat-timeout",
    "3",
    "--recovery",
    "none",
]  # a lost worker ends the job (replica-level recovery: test_replica_ft)
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def start(out, *extra, steps=100000, args=None):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resihp.cli",
            "run",
            *(args or SMALL),
            "--steps",
            str(steps),
            "--out",
            str(out),
            "--json",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


def job_pids(proc, out, world=2) -> set[int]:
    """Every process of the job started by ``proc``: the CLI, the torchrun agent and its workers
    (forked from the agent on CPU: each worker's parent is the agent, forked in turn by the
    warm-agent server, whose command line preloads ``resihp.launch.agent``)."""
    workers = worker_pids(out, world)
    pids = {proc.pid} | descendants(proc.pid)
    assert set(workers.values()) <= pids, (workers, pids)
    for pid in workers.values() if not torch.cuda.is_available() else ():
        assert b"resihp.launch.agent" in Path(f"/proc/{parent_of(pid)}/cmdline").read_bytes()
    return pids


def finish(proc, timeout=60):
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"resihp run did not end within {timeout} s: {stderr[-2000:]}"
        ) from None
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
    left = wait_gone(pids, 2.0)
    for pid in left:  # clean up what this test started, by PID, before failing
        os.kill(pid, signal.SIGKILL)
    assert left == set(), f"left running after {sig.name}: {left}"
    assert proc.returncode == 1, stderr[-2000:]
    assert "Traceback" not in stderr
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
@pytest.mark.parametrize("recovery", ["none", "replica"])
def test_sigkill_of_the_supervisor_takes_the_workers_with_it(tmp_path, recovery):
    """Even a hung (stopped) worker, and its peer blocked on it, which no broken pipe would end;
    with replica-level recovery (the default here) every replica's torchrun as well."""
    out = tmp_path / "run"
    proc = start(out, "--recovery", recovery)
    pids = job_pids(proc, out)
    inject_signal(worker_pids(out, 2)[1], signal.SIGSTOP)
    inject_signal(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    left = wait_gone(pids, 5.0)
    for pid in left:  # clean up what this test started, by PID, before failing
        os.kill(pid, signal.SIGKILL)
    assert left == set(), "torchrun or workers outlived a SIGKILLed resihp run"


# --- a run folder belongs to one job --------------------------------------------------------------
HOLD = (
    "import sys, time; from resihp.train.lifecycle import RunFolder; "
    "f = RunFolder(sys.argv[1], 'holder-job').acquire(); print('held', flush=True); time.sleep(60)"
)


def test_second_job_into_a_busy_run_folder_exits_2_or_takes_a_fresh_subfolder(
    tmp_path, monkeypatch, capsys
):
    from resihp.cli import main
    from resihp.train.lifecycle import RunFolder

    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True
    )
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
    from resihp.train.lifecycle import ProcessTracker

    script = (
        "import os, subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import "
        "time; time.sleep(600)'], start_new_session=True); print(c.pid, flush=True); "
        "time.sleep(600)"
    )
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


# --- fail loudly ----------------------------------------------------------------------------------
ONE_RANK = [*SMALL[: SMALL.index("--dp")], "--dp", "1", "--pp", "1", "--no-live", "--timeout", "20"]


@pytest.mark.slow
def test_non_finite_loss_stops_with_exit_1_one_line_and_keeps_the_last_good_checkpoint(tmp_path):
    from resihp.ckpt.integrity import problem

    out = tmp_path / "nan"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resihp.cli",
            "run",
            *ONE_RANK,
            "--steps",
            "20",
            "--ckpt-every",
            "1",
            "--lr",
            "1e30",
            "--out",
            str(out),
            "--json",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=180,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("resihp: non-finite loss (nan) at step ") and "Traceback" not in proc.stderr
    )
    summary = json.loads(proc.stdout)  # strict JSON: no bare NaN
    bad_step = int(last.split("at step ")[1].split(";")[0])
    assert summary["loss_last"] is None and summary["steps"] == bad_step + 1
    kept = sorted((out / "ckpt").iterdir())  # no half-written .stepN.partial either
    assert [p.name for p in kept] == [f"step{s}" for s in range(bad_step)]  # none of the bad step
    assert all(problem(p) is None for p in kept)
    assert summary["resumable"]["checkpoint"] == str(out / "ckpt" / f"step{bad_step - 1}")


def _outputs_are_valid(out):
    """Whatever a failed run left is whole: trace, summary, checkpoints (none half-written)."""
    from resihp.ckpt.integrity import problem
    from resihp.opstrace import read_ops_trace

    if (out / "ops.parquet").exists():
        read_ops_trace(out / "ops.parquet")
    for name in ("summary.json", "run.json"):
        if (out / name).exists():
            json.loads((out / name).read_text())
    for ckpt in (out / "ckpt").glob("step*"):
        assert problem(ckpt) is None, ckpt


@pytest.mark.slow
@pytest.mark.skipif(
    not can_mount_tmpfs(),
    reason="needs root to mount a small tmpfs (the ENOSPC variant below runs everywhere)",
)
def test_disk_full_during_a_run_is_one_line_and_leaves_valid_outputs():
    with small_disk("16m") as disk:
        out = disk / "run"
        proc = start(out, "--ckpt-every", "2", args=ONE_RANK)
        job_pids(proc, out, world=1)
        wait_for(
            lambda: (out / "ckpt" / "step1" / "manifest.json").exists(), 60, "a first checkpoint"
        )
        fill(disk)
        stdout, stderr = finish(proc)
        assert proc.returncode == 1, stderr[-2000:]
        assert "Traceback" not in stderr
        assert "disk full" in stderr.strip().splitlines()[-1], stderr[-3000:]
        _outputs_are_valid(out)


def test_disk_full_writing_a_trace_keeps_the_previous_one_and_is_one_line(
    tmp_path, monkeypatch, capsys
):
    """ENOSPC simulated by an injected OSError (the tmpfs test above does it for real, as root)."""
    import pandas as pd

    from resihp.cli import main
    from resihp.opstrace import read_ops_trace, write_ops_trace

    trace = pd.DataFrame(
        {
            "step": [0],
            "rank": [0],
            "dp_rank": [0],
            "stage": [0],
            "optype": ["forward-compute"],
            "duration": [0.1],
        }
    )
    path = tmp_path / "ops.parquet"
    write_ops_trace(trace, path)
    with raise_at(monkeypatch, "pandas.DataFrame.to_parquet", enospc(str(path))):
        with pytest.raises(OSError):
            write_ops_trace(pd.concat([trace, trace]), path)
        assert len(read_ops_trace(path)) == 1 and sorted(p.name for p in tmp_path.iterdir()) == [
            "ops.parquet"
        ]
    # the CLI turns it into one line and exit 1, whichever verb was writing
    monkeypatch.setattr("resihp.cli.app", lambda **_: (_ for _ in ()).throw(enospc(str(path))))
    with pytest.raises(SystemExit) as info:
        main()
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.strip() == (
        f"resihp: disk full writing {path} (No space left on device); free space and run again"
    )


def test_resume_crosses_layouts_never_models():
    from resihp.train.config import RunConfig
    from resihp.train.worker import resume_step

    cfg = RunConfig.from_flags(dp=1, pp=2, resume="runs/x/ckpt/step9")
    other = RunConfig.from_flags(hidden=64, dp=2, pp=2)
    assert (
        resume_step(
            cfg,
            {"step": 9, "dp": 2, "pp": 2, "model_hash": RunConfig.from_flags(dp=2).model_hash()},
        )
        == 10
    )
    with pytest.raises(InputError, match=r"step9: written for another model"):
        resume_step(cfg, {"step": 9, "model_hash": other.model_hash(), "model": {"hidden": 64}})


def test_human_summary_of_a_run_stopped_by_a_non_finite_loss(capsys):
    from resihp.launch.commands import _print_human
    from resihp.launch.summary import json_safe as _json_safe

    summary = _json_safe(
        {"steps": 2, "loss_first": 4.2, "loss_last": float("nan"), "losses": [4.2, float("inf")]}
    )
    assert summary["loss_last"] is None and summary["losses"] == [4.2, None]
    _print_human(summary)
    assert "loss 4.2000 -> not finite" in capsys.readouterr().out


def test_disk_full_is_found_inside_a_checkpoint_exception_and_arrow_text():
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from resihp.errors import disk_full

    wrapped = CheckpointException("save failed", {1: _wrap_exception(enospc("ckpt/__1_0.distcp"))})
    assert disk_full(wrapped).filename == "ckpt/__1_0.distcp"
    try:
        try:
            raise OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")
        except OSError as inner:
            raise RuntimeError("merge failed") from inner
    except RuntimeError as exc:
        assert disk_full(exc) is not None
    assert (
        disk_full(RuntimeError("peer closed")) is None and disk_full(OSError(13, "denied")) is None
    )


def test_a_keeper_that_cannot_start_is_one_line_and_the_run_folder_says_failed(
    tmp_path, monkeypatch, capsys
):
    # the memory tier's lock path is taken by a folder: the keeper process exits at its start
    from resihp.ckpt import keeper
    from resihp.cli import main
    from resihp.errors import SetupError

    broken = tmp_path / "tier"
    (broken / keeper.LOCK).mkdir(parents=True)
    with pytest.raises(SetupError, match=r"keeper exited with status 1 \(see .*keeper.log\)"):
        keeper.ensure_keeper(broken, os.getpid(), timeout_s=30)
    assert (broken / "keeper.log").read_text().strip()  # its traceback is kept for the user

    real = keeper.ensure_keeper
    monkeypatch.setattr(
        "resihp.train.engine_snapshots.ensure_keeper",
        lambda directory, owner, warm=False: real(broken, owner, timeout_s=30, warm=warm),
    )
    out = tmp_path / "run"
    monkeypatch.setattr(
        sys,
        "argv",
        ["resihp", "run", *SMALL, "--steps", "3", "--snapshot-every", "1", "--out", str(out)],
    )
    with pytest.raises(SystemExit) as info:
        main()
    err = capsys.readouterr().err.strip()
    assert (
        info.value.code == 1 and len(err.splitlines()) == 1 and "keeper exited with status 1" in err
    ), err
    run = json.loads((out / "run.json").read_text())
    assert run["state"] == "failed" and "keeper exited" in run["error"], run


def test_a_worker_asked_for_its_stacks_writes_every_thread_even_one_blocked_in_a_call(tmp_path):
    """``dump_stacks``: a line in the log, then the worker's threads' stacks through its stderr,
    a thread blocked inside a C call (a lock wait here, as a collective or a store wait)
    included."""
    from resihp.train.lifecycle import dump_stacks

    code = (
        "import threading, time\n"
        "from resihp.train.lifecycle import enable_stack_dumps\n"
        "enable_stack_dumps()\n"
        "def blocked_in_a_call():\n"
        "    lock = threading.Lock()\n"
        "    lock.acquire()\n"
        "    print('ready', flush=True)\n"  # from inside: its frame is on the stack from here on
        "    lock.acquire()\n"
        "running = threading.Event()\n"
        "def beside():\n"
        "    running.set()\n"
        "    time.sleep(60)\n"
        "threading.Thread(target=beside, daemon=True).start()\n"
        "running.wait()\n"
        "blocked_in_a_call()\n"
    )
    log = tmp_path / "workers.log"
    with open(log, "a") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err, text=True
        )
        try:
            assert proc.stdout.readline().strip() == "ready"
            assert dump_stacks(proc.pid, log, "rank 1 judged hung")
            text = log.read_text()
            assert text.startswith(
                f"resihp: rank 1 judged hung; its stacks (process {proc.pid}) follow\n"
            )
            assert "in blocked_in_a_call" in text and "in beside" in text, text
            assert proc.poll() is None  # asking stopped nothing
        finally:
            proc.kill()
            proc.wait()
    assert not dump_stacks(proc.pid, log, "gone")


def test_a_rank_judged_hung_on_this_node_is_killed_outright_one_elsewhere_is_left_to_its_node():
    """``end_hung``: a process that ignores SIGTERM (a hung rank: the job's SIGTERM would only
    cost the whole grace before the SIGKILL) is ended by SIGKILL at once where it runs on this
    launcher's node; a rank of another node is its own launcher's to stop, and a stopped process
    (SIGSTOP) is left to the SIGCONT and SIGTERM that stop the job."""
    from types import SimpleNamespace

    from resihp.launch.supervisor import end_hung

    code = (
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', "
        "flush=True)\ntime.sleep(60)\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "ready"
        monitor = SimpleNamespace(
            views={
                1: SimpleNamespace(pid=procs[0].pid, node=0, stopped=False),
                3: SimpleNamespace(pid=procs[1].pid, node=1, stopped=False),
                2: SimpleNamespace(pid=procs[2].pid, node=0, stopped=True),
            }
        )
        ours = {proc.pid for proc in procs}  # the processes this "launcher" started
        for rank in (1, 3, 2, 7):  # 7: a rank the monitor has no view of, nothing to do
            end_hung(monitor, rank, node=0, owns=ours.__contains__)
        assert procs[0].wait(timeout=10) == -signal.SIGKILL
        time.sleep(0.2)
        assert procs[1].poll() is None and procs[2].poll() is None
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_rank_judged_hung_leaves_its_stacks_in_the_log_before_it_is_stopped(tmp_path):
    out = tmp_path / "run"
    proc = start(out, "--inject", "hang:rank=1,step=3", steps=8)
    _, stderr = finish(proc)
    assert proc.returncode == 1 and stderr.strip().splitlines()[-1].startswith("resihp: rank 1"), (
        stderr[-2000:]
    )
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["failure"]["rank"], summary["failure"]["cause"]) == (1, "hang"), summary[
        "failure"
    ]
    log = (out / "logs" / "workers.log").read_text()
    assert "resihp: rank 1 judged hung" in log and "most recent call first" in log
    assert "in begin_step" in log  # where the injected hang holds it (train/inject.py)
