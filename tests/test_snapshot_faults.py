"""Fault matrix of the memory tier, with real processes and real signals (``resihp run`` with
torchrun workers on gloo, CPU, fixed seed): after each fault the run restarts in place and its
per-step losses from the resumed step on are bitwise those of an uninterrupted run.

- SIGKILL of a trainer rank (``stop``), with the keeper SIGKILLed earlier in the run: restored from
  each rank's own memory, no step lost;
- SIGTERM of a trainer rank: the rank finishes its snapshot copy on its way out;
- SIGSTOP of a trainer rank (``hang:how=stop``) in a dp = 1 layout, its own slots corrupted (a
  flipped byte each) while it is stopped: found by the checksums, restored from the explicit copy
  the other rank keeps (over gloo);
- SIGSTOP of the only rank, both its slots corrupted: no step complete in memory, restored from
  the newest disk checkpoint of the job;
- SIGKILL during the snapshot copy: the slot being written is never published, the previous one
  stays whole;
- a Python exception in a trainer rank (``error``): the rank is the fail-stop (cause
  ``exception``), restored from memory, no step lost;
- SIGKILL of a rank in the middle of the restore (``stop:during=restore``, after the ranks agreed
  what to load): that relaunch fails as well, the next one restores from memory;
- every rank of a simulated node SIGKILLed and that node's memory tier lost (two launchers, one
  rank each): node 0 relaunches the job in place on both nodes, and the lost rank's state comes
  from its data-parallel peer on the other node, over gloo;
- SIGTERM of the job with the keeper writing the checkpoints: the newest step in memory is written
  to disk at the breakpoint, and a resumed run from it trains the same losses.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resihp.detect.records import JOB_SECRET_ENV
from tests.faults import flip_bit

pytestmark = pytest.mark.slow

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
    "1024",
    "--budget",
    "256",
    "--max-len",
    "256",
    "--steps",
    "6",
    "--no-live",
    "--json",
    "--heartbeat-timeout",
    "3",
    "--timeout",
    "60",
]


# every step slowed (a rank's compute stretched 30x), so that a signal sent from the test lands
# before the run ends, also on a fast machine
SLOW = ["--inject", "slow:rank=0,factor=30,step=0"]
SECRET = secrets.token_hex(32)  # a job's nodes share one


def _env(shm: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "RESIHP_SHM": str(shm), JOB_SECRET_ENV: SECRET}


def _start(out: Path, shm: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "resihp.cli", "run", "-o", str(out), *SMALL, *args],
        env=_env(shm),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 240) -> dict:
    stdout, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture
def shm(tmp_path):
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    root = root / f"resihp-faults-{os.getpid()}-{time.monotonic_ns()}"
    root.mkdir()
    yield root
    import shutil

    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs (no snapshots) of the two layouts."""
    base = tmp_path_factory.mktemp("reference")
    procs = {
        name: _start(base / name, base, "--recovery", "none", *layout)
        for name, layout in (
            ("dp2", ["--dp", "2", "--pp", "1"]),
            ("pp2", ["--dp", "1", "--pp", "2"]),
            ("one", ["--dp", "1", "--pp", "1"]),
        )
    }
    return {name: _finish(p)["losses"] for name, p in procs.items()}


def _tier(shm: Path, proc: subprocess.Popen, timeout_s: float = 120) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [p for p in shm.glob("resihp-*-n0") if p.is_dir()]
        if found:
            return found[0]
        _running(proc)
        time.sleep(0.05)
    raise AssertionError(f"no memory tier appeared under {shm}")


def _running(proc: subprocess.Popen) -> None:
    """Fail now, with what the run said, if it ended while the test waits for it."""
    if proc.poll() is not None:
        _, stderr = proc.communicate()
        raise AssertionError(f"the run ended early (exit {proc.returncode}): {stderr[-3000:]}")


def _published(
    tier: Path, rank: int, step: int, proc: subprocess.Popen, timeout_s: float = 120
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _running(proc)
        for path in tier.glob(f"rank{rank}.[AB].json"):
            try:
                if json.loads(path.read_text())["step"] >= step:
                    return
            except (OSError, ValueError):
                pass
        time.sleep(0.02)
    raise AssertionError(f"rank {rank} never published step {step}")


def _worker_pid(tier: Path, rank: int) -> int:
    """The trainer process of ``rank``: the one that has its slot file open."""
    target = str(tier / f"rank{rank}.A.bin")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            maps = (proc / "maps").read_text().splitlines()
            cmd = (
                proc / "cmdline"
            ).read_bytes()  # a worker, forked from an agent or not; not the keeper
            if any(ln.rstrip().endswith(target) for ln in maps) and (
                b"resihp.train.worker" in cmd or b"resihp.launch.agent" in cmd
            ):
                return int(proc.name)
        except OSError:
            continue
    raise AssertionError(f"no worker maps {target}")


def _check(
    summary: dict, reference: list, source: str | tuple[str, ...], max_lost: int = 0
) -> None:
    rec = summary["recovery"]
    assert rec["mode"] == "restart" and rec["source"] in (
        (source,) if isinstance(source, str) else source
    ), rec
    assert rec["lost_steps"] <= max_lost, rec
    assert summary["first_step"] == 0 and summary["losses"] == reference, (
        summary["losses"],
        reference,
    )
    for key in ("detected_s", "restore_s", "stall_s"):
        assert rec[key] is None or rec[key] >= 0


def test_sigkill_of_a_rank_after_the_keeper_was_killed_restores_from_memory(
    reference, shm, tmp_path
):
    """A real SIGKILL of the keeper, then of a rank: the launcher starts another keeper over the
    same files and the restart in place restores from memory at the failure-free losses."""
    proc = _start(
        tmp_path / "run",
        shm,
        "--dp",
        "2",
        "--pp",
        "1",
        "--recovery",
        "restart",
        "--inject",
        "stop:rank=1,step=4",
        *SLOW,
    )
    tier = _tier(shm, proc)
    _published(tier, 0, 0, proc)
    keeper = int((tier / "keeper.pid").read_text())
    os.kill(keeper, signal.SIGKILL)  # the launcher starts another; the files stay
    summary = _finish(proc)
    # its own slot, or (killed inside its last snapshot copy) its data-parallel peer's of that step
    _check(summary, reference["dp2"], ("memory", "peer"))
    assert summary["recovery"]["resumed_step"] == 4
    assert not tier.exists()  # the job is over: its keeper removed the tier


def test_sigterm_of_a_rank_keeps_its_last_snapshot(reference, shm, tmp_path):
    """A rank ended by SIGTERM (its handler runs, unlike SIGKILL) leaves its last snapshot
    published: the restart restores it from memory at the failure-free losses."""
    proc = _start(tmp_path / "run", shm, "--dp", "2", "--pp", "1", "--recovery", "restart", *SLOW)
    tier = _tier(shm, proc)
    _published(tier, 1, 1, proc)
    os.kill(_worker_pid(tier, 1), signal.SIGTERM)
    summary = _finish(proc)
    _check(summary, reference["dp2"], "memory")


def test_sigstop_with_corrupted_own_slots_restores_from_the_peer_copy(reference, shm, tmp_path):
    """A stopped rank (SIGSTOP, judged hung) whose own slots are corrupted on /dev/shm: the restore
    verifies them, rejects both and takes the keeper's copy held beside its pipeline peer."""
    proc = _start(
        tmp_path / "run",
        shm,
        "--dp",
        "1",
        "--pp",
        "2",
        "--recovery",
        "restart",
        "--inject",
        "hang:rank=0,step=3,how=stop",
    )
    tier = _tier(shm, proc)
    _published(tier, 0, 2, proc)
    _published(tier, 1, 2, proc)
    deadline = time.monotonic() + 60  # the keeper's copy of rank 0's newest slot, held by rank 1
    while not (tier / "rank0.copy.json").exists() or list(tier.glob("*.pending.json")):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    for slot in ("A", "B"):  # rank 0 is stopped: flip a byte in each of its own slots
        _flip(tier, 0, slot)
    summary = _finish(proc)
    _check(summary, reference["pp2"], "peer")
    assert summary["recovery"]["cause"] == "hang"


def _flip(tier: Path, rank: int, slot: str) -> None:
    header = json.loads((tier / f"rank{rank}.{slot}.json").read_text())
    flip_bit(tier / f"rank{rank}.{slot}.bin", header["shards"][0]["offset"] + 7)


def test_no_good_slot_anywhere_falls_back_to_the_disk_checkpoint(reference, shm, tmp_path):
    """No slot verifies and no peer holds a copy: the restart falls back to the checkpoint the
    keeper wrote to disk, one tier down, at the failure-free losses."""
    proc = _start(
        tmp_path / "run",
        shm,
        "--dp",
        "1",
        "--pp",
        "1",
        "--recovery",
        "restart",
        "--ckpt-every",
        "2",
        "--inject",
        "hang:rank=0,step=4,how=stop",
    )
    tier = _tier(shm, proc)
    _published(tier, 0, 3, proc)
    # the keeper writes step 3's checkpoint from its slot; corrupting the slot under that write
    # would (rightly) leave no checkpoint of step 3
    done = tmp_path / "run" / "ckpt" / "step3" / "manifest.json"
    deadline = time.monotonic() + 60
    while list(tier.glob("*.pending.json")) or not done.exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    for slot in ("A", "B"):  # the only rank is stopped: both its slots corrupted, no peer, no copy
        _flip(tier, 0, slot)
    summary = _finish(proc)
    _check(summary, reference["one"], "disk")
    assert summary["recovery"]["resumed_step"] == 4  # the checkpoint of step 3


def test_sigkill_during_the_snapshot_copy_never_publishes_the_slot(shm):
    """A process SIGKILLed in the middle of its snapshot copy: the keeper never publishes the
    half-written slot and the older one still verifies."""
    code = f"""
import os, signal, torch
from resihp.ckpt.keeper import ensure_keeper
from resihp.ckpt.memory import MemoryTier, tier_dir
from resihp.ckpt.snapshot import Snapshotter
d = tier_dir("kill", 0)
ensure_keeper(d, {os.getpid()})
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 1024)).sum().backward(); opt.step()
snap = Snapshotter(MemoryTier(d, 0), every=1)
snap.snapshot(0, model, opt, {{}}); snap.fence()
while not (d / "rank0.A.json").exists(): pass
opt.step()
snap.snapshot(1, model, opt, {{}})
os.kill(os.getpid(), signal.SIGKILL)  # in the middle of the copy of step 1
"""
    subprocess.run([sys.executable, "-c", code], env=_env(shm), timeout=120)
    from resihp.ckpt.keeper import stop_keeper
    from resihp.ckpt.memory import MemoryTier

    tier_dir = shm / "resihp-kill-n0"
    time.sleep(0.5)  # the keeper would have published a complete slot by now
    tier = MemoryTier(tier_dir, 0)
    headers = tier.headers()
    assert [h.step for h in headers] == [0] and tier.verify(headers[0])
    assert not (tier_dir / "rank0.B.json").exists()
    stop_keeper(tier_dir)


def test_python_exception_in_a_rank_restarts_from_memory(reference, shm, tmp_path):
    """A rank's Python exception in a real job is a crash (cause ``exception``): the job restarts in
    place from the memory tier at the step it failed in."""
    summary = _finish(
        _start(
            tmp_path / "run",
            shm,
            "--dp",
            "2",
            "--pp",
            "1",
            "--recovery",
            "restart",
            "--inject",
            "error:rank=1,step=3",
        )
    )
    rec = summary["recovery"]
    assert rec["cause"] == "exception" and rec["rank"] == 1 and rec["resumed_step"] == 3, rec
    _check(summary, reference["dp2"], "memory")


def test_sigkill_during_the_restore_restarts_again_from_memory(reference, shm, tmp_path):
    """A rank SIGKILLed inside the restore, after every rank agreed what to load: that relaunch
    fails too, and the next one restores from memory (the tier survived the half-done restore)."""
    # rank 1 dies at step 3; in the relaunch, rank 0 is SIGKILLed inside the restore, after every
    # rank agreed what to load: that relaunch fails too, and the next one restores from memory
    summary = _finish(
        _start(
            tmp_path / "run",
            shm,
            "--dp",
            "2",
            "--pp",
            "1",
            "--recovery",
            "restart",
            "--inject",
            "stop:rank=1,step=3",
            "--inject",
            "stop:rank=0,during=restore",
        )
    )
    rec = summary["recovery"]
    assert len(rec["restarts"]) == 2, rec
    first, second = rec["restarts"]
    assert first["rank"] == 1 and first["cause"] == "exited", first
    assert second["cause"] == "exited" and second["rank"] == 0, second
    # rank 1 died before its copy of step 2 was complete: its data-parallel peer's slot (same node)
    _check(summary, reference["dp2"], ("memory", "peer"))
    assert rec["resumed_step"] == 3


def test_a_whole_node_lost_with_its_memory_restores_from_the_other_node(reference, shm, tmp_path):
    """Two launchers, one rank each: node 1's rank, keeper and tier are lost; node 1 rejoins the
    relaunch and its rank's state comes over gloo from the other node's tier."""
    # two simulated nodes, one rank each (data-parallel peers): every rank of node 1 is SIGKILLed
    # and node 1's memory tier is lost with it (its keeper killed, its files gone); node 0
    # relaunches the job in place, node 1's launcher joins the relaunch, and rank 1 receives rank
    # 0's slot over gloo from the other node
    from resihp.train.nodes import free_port

    port = free_port()
    multi = [
        "--dp",
        "2",
        "--pp",
        "1",
        "--recovery",
        "restart",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        *SLOW,
    ]
    node0 = _start(tmp_path / "node0", shm, *multi, "--node-rank", "0")
    node1 = _start(tmp_path / "node1", shm, *multi, "--node-rank", "1")
    deadline = time.monotonic() + 120
    while not (found := [p for p in shm.glob("resihp-*-n1") if p.is_dir()]):
        assert time.monotonic() < deadline, "node 1 has no memory tier"
        time.sleep(0.05)
    tier1 = found[0]
    _published(tier1, 1, 2, node1)
    worker = _worker_pid(tier1, 1)
    keeper = int((tier1 / "keeper.pid").read_text())
    os.kill(worker, signal.SIGKILL)
    os.kill(keeper, signal.SIGKILL)
    import shutil

    shutil.rmtree(tier1)
    summary = _finish(node0)
    stdout, stderr = node1.communicate(timeout=240)
    assert node1.returncode == 0, stderr[-3000:]
    assert json.loads(stdout.strip().splitlines()[-1])["error"] is None
    rec = summary["recovery"]
    assert rec["rank"] == 1 and rec["cause"] == "exited", rec
    restored = json.loads((tmp_path / "node0" / "restart" / "restore.json").read_text())
    assert restored["sources"] == ["memory", "peer"], restored  # rank 1's state came from node 0
    _check(summary, reference["dp2"], "peer", max_lost=1)


def test_sigterm_of_the_job_leaves_its_newest_snapshot_on_disk_to_resume_from(
    reference, shm, tmp_path
):
    """SIGTERM of the whole job (exit 143): the newest snapshot in memory is written to disk on the
    way out, and ``--resume`` continues from it at the failure-free losses."""
    # the keeper writes the checkpoints (--ckpt-every with snapshots); none is due before the
    # SIGTERM, so the one the job can resume from is the newest step in memory, written at the end
    out = tmp_path / "run"
    proc = _start(
        out,
        shm,
        "--dp",
        "2",
        "--pp",
        "1",
        "--snapshot-every",
        "1",
        "--ckpt-every",
        "100",
        "--recovery",
        "none",
        *SLOW,
    )
    _published(_tier(shm, proc), 0, 1, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 143, stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert run["state"] == "interrupted", run
    resumable = run["resumable"]
    assert resumable["checkpoint"] is not None and resumable["next_step"] >= 2, run
    log = [json.loads(line) for line in (out / "ckpt" / "persist.jsonl").read_text().splitlines()]
    assert [e["reason"] for e in log] == ["breakpoint"]
    assert resumable["next_step"] < 6, "the run ended before the signal: slow it further"
    resumed = _finish(
        _start(
            tmp_path / "resumed",
            shm,
            "--dp",
            "2",
            "--pp",
            "1",
            "--recovery",
            "none",
            "--resume",
            str(out),
        )
    )
    assert resumed["first_step"] == resumable["next_step"]
    assert resumed["losses"] == reference["dp2"][resumable["next_step"] :]
