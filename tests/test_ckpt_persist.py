"""Universal checkpoints written by the node's keeper from the memory tier
(``resihp.ckpt.persist``), with a real keeper process: the checkpoint of a due step holds exactly
that step's state, older ones are pruned to ``keep``, a trainer waits for a slot the keeper still
reads (and not for a dead keeper's hold), and a keeper SIGKILLed while it writes leaves no
checkpoint half-written and the older ones whole."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from resihp.ckpt.integrity import candidates, problem
from resihp.ckpt.keeper import ensure_keeper, keeper_pid, request_flush, stop_keeper
from resihp.ckpt.memory import MemoryTier, tier_dir
from resihp.ckpt.persist import PersistRequest, blocks_of, write_checkpoint
from resihp.ckpt.snapshot import Snapshotter, state_tensors
from resihp.ckpt.universal import read_full, read_meta
from tests.faults import flip_bit


def _model(width: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt) -> None:
    model(torch.randn(4, model[0].in_features)).square().mean().backward()
    opt.step()


def _request(model, opt, root: Path, due: bool, keep: int = 0):
    meta = {"job_id": "job", "model_hash": "hash"}
    return lambda tensors: PersistRequest(
        str(root), keep, 1, True, blocks_of(model, opt, tensors, None, None, 0), meta, due
    ).to_dict()


def _wait_for(predicate, timeout_s: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _expected(model, opt) -> dict[str, torch.Tensor]:
    state = {k: v.clone() for k, v in state_tensors(model, opt)}
    out = {}
    for name, _ in model.named_parameters():
        out[f"model.{name}"] = state[f"model.{name}"]
        for k in ("step", "exp_avg", "exp_avg_sq"):
            out[f"optim.{name}.{k}"] = state[f"optim.{name}.{k}"]
    out["rng.torch.rank0"] = state["rng.torch"]
    return out


def _keeper_and_snapshots(tmp_path: Path) -> tuple[Path, Snapshotter, Path]:
    """A keeper that loads DCP as it starts, a rank's snapshots into its tier, a checkpoint root."""
    directory = tier_dir("job", 0)
    ensure_keeper(directory, os.getpid(), warm=True)
    return directory, Snapshotter(MemoryTier(directory, 0), every=1), tmp_path / "run" / "ckpt"


def test_the_keeper_writes_each_due_step_from_memory_and_keeps_the_newest(shm, tmp_path):
    model, opt = _model(256, 3)
    directory, snap, root = _keeper_and_snapshots(tmp_path)
    expected = {}
    try:
        for step in range(7):
            _train(model, opt)
            due = step % 3 == 1
            if due:
                expected[step] = _expected(model, opt)
            snap.snapshot(step, model, opt, {"job": "job"}, _request(model, opt, root, due, keep=2))
        snap.close()
        answer = request_flush(directory, newest=False)
        assert answer is not None and answer["error"] is None and answer["step"] is None
    finally:
        stop_keeper(directory)
    # steps 1 and 4 were due; keep=2 kept both (and nothing else was written)
    assert [p.name for p in candidates(root)] == ["step4", "step1"]
    for step in (1, 4):
        saved = read_full(root / f"step{step}")
        assert set(saved) == set(expected[step])
        for key, value in expected[step].items():
            assert torch.equal(saved[key], value), key
        meta = read_meta(root / f"step{step}")
        assert meta["step"] == step and meta["job_id"] == "job" and meta["format"] == 2
    # what the trainer waited for the keeper: measured, one entry per snapshot
    assert len(snap.held_s) == 7


def test_keep_prunes_older_checkpoints(shm, tmp_path):
    model, opt = _model(64, 1)
    directory, snap, root = _keeper_and_snapshots(tmp_path)
    try:
        for step in range(6):
            _train(model, opt)
            snap.snapshot(
                step, model, opt, {"job": "job"}, _request(model, opt, root, step % 2 == 1, keep=1)
            )
            snap.fence()
            if step % 2 == 1:  # each due checkpoint written before the next one is due
                _wait_for(
                    lambda s=step: (root / f"step{s}" / "manifest.json").exists(),
                    what=f"step{step}",
                )
        snap.close()
    finally:
        stop_keeper(directory)
    assert [p.name for p in candidates(root)] == ["step5"]


def test_a_trainer_waits_for_a_slot_the_keeper_holds_but_not_for_a_dead_keeper(shm):
    tier = MemoryTier(shm / "tier", 0)
    hold = tier.hold_path("A")
    hold.write_text(str(os.getpid()))  # held by a live process
    waited = []

    def release():
        time.sleep(0.3)
        hold.unlink()

    import threading

    t = threading.Thread(target=release)
    t.start()
    waited.append(tier.begin_write("A", timeout_s=10))
    t.join()
    assert waited[0] >= 0.25
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    hold.write_text(str(dead))  # held by a process that is gone: void
    assert tier.begin_write("A", timeout_s=10) < 1.0
    assert not hold.exists()


def test_a_keeper_killed_while_writing_leaves_no_torn_checkpoint(shm, tmp_path):
    model, opt = _model(2048, 3)  # 144 MiB of state: the write takes long enough to be caught
    directory = tier_dir("job", 0)
    ensure_keeper(directory, os.getpid(), warm=True)
    tier = MemoryTier(directory, 0)
    snap = Snapshotter(
        tier, every=1, keeper_alive=lambda: ensure_keeper(directory, os.getpid(), warm=True)
    )
    root = tmp_path / "run" / "ckpt"
    try:
        _train(model, opt)
        snap.snapshot(0, model, opt, {"job": "job"}, _request(model, opt, root, due=True))
        snap.fence()
        _wait_for(lambda: (root / "step0" / "manifest.json").exists(), what="the first checkpoint")
        _train(model, opt)
        snap.snapshot(1, model, opt, {"job": "job"}, _request(model, opt, root, due=True))
        snap.fence()
        _wait_for(
            lambda: (root / ".keeper-step1.partial").exists(), what="the second checkpoint to start"
        )
        os.kill(keeper_pid(directory), signal.SIGKILL)
        time.sleep(0.2)
        assert not (root / "step1").exists(), (
            "the keeper finished before the kill: make the state larger"
        )
        assert problem(root / "step0") is None  # the older checkpoint is whole
        # the launcher restarts a dead keeper (its supervisor's poll); the slot the dead one held
        # is free again, the trainer goes on, and the new keeper writes the next due step
        ensure_keeper(directory, os.getpid(), warm=True)
        for step in (2, 3):
            _train(model, opt)
            snap.snapshot(
                step, model, opt, {"job": "job"}, _request(model, opt, root, due=step == 3)
            )
        snap.close()
        answer = request_flush(directory, newest=False)
        assert answer is not None and answer["error"] is None
    finally:
        stop_keeper(directory)
    names = [p.name for p in candidates(root)]
    # step1 again only if the new keeper found its slot before the trainer wrote it over
    assert names in (["step3", "step0"], ["step3", "step1", "step0"])
    for path in candidates(root):
        assert problem(path) is None
    assert not list(root.glob(".keeper-*.partial"))  # the interrupted write's folder was cleaned up


def test_a_slot_that_went_bad_after_its_publication_is_not_written_to_disk(shm, tmp_path, capfd):
    model, opt = _model(64, 2)
    directory, snap, root = _keeper_and_snapshots(tmp_path)
    tier = MemoryTier(directory, 0)
    try:
        for step in range(2):  # slots A and B, neither due: the keeper leaves them in memory
            _train(model, opt)
            snap.snapshot(step, model, opt, {"job": "job"}, _request(model, opt, root, due=False))
            snap.fence()
        _wait_for(lambda: len(tier.headers()) == 2, what="both slots published")
        good, bad = sorted(tier.headers(), key=lambda h: h.step)
        flip_bit(tier.data_path(bad.slot), bad.shards[0].offset + 7)  # a parameter's bit goes bad
        assert write_checkpoint(directory, [bad]) is None
        assert not (root / f"step{bad.step}").exists()
        assert "no longer matches its checksums" in capfd.readouterr().err
        assert write_checkpoint(directory, [good]).step == good.step
        snap.close()
    finally:
        stop_keeper(directory)
    assert [p.name for p in candidates(root)] == [f"step{good.step}"]


def test_a_flush_waits_for_a_slot_pending_before_it_was_asked(tmp_path, monkeypatch):
    """The trainer's last slot is pending before its job asks for the flush; the keeper may look for
    pending slots and for the flush at moments between which both arrive. It reads the flush first,
    so it sees that slot and publishes (and writes) it before answering: here the slot lands just
    as the flush is read, and the flush stays unanswered while the slot is pending."""
    import resihp.ckpt.keeper as keeper_module

    directory = tmp_path / "tier"
    directory.mkdir()
    keeper = keeper_module.Keeper(directory, owner=None)
    (directory / keeper_module.FLUSH).write_text('{"id": "x", "newest": false}')
    read = keeper_module.read_json

    def trainer_publishes_meanwhile(path):
        if path.name == keeper_module.FLUSH:
            (directory / "rank0.pending.json").write_text("")  # being written: not yet readable
        return read(path)

    monkeypatch.setattr(keeper_module, "read_json", trainer_publishes_meanwhile)
    assert keeper.step() is True  # the pending slot was seen
    assert not (directory / keeper_module.FLUSHED).exists()  # no answer while it is pending


def test_a_keeper_starting_while_its_lock_is_probed_still_starts(shm):
    """``keeper_pid`` takes the tier's lock for an instant (the process that starts a keeper polls
    it): a keeper trying the lock in that instant waits it out instead of leaving as if another
    keeper held the tier (a CI run caught that race once). Here the probe is stretched to 0.6 s,
    over the keeper's start-up (about 0.2 s on this project's machines)."""
    import fcntl
    import subprocess
    import sys

    directory = shm / "probed"
    directory.mkdir()
    fd = os.open(directory / "keeper.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resihp.ckpt.keeper",
            "--dir",
            str(directory),
            "--owner",
            str(os.getpid()),
        ],
        start_new_session=True,
    )
    try:
        time.sleep(0.6)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        _wait_for(
            lambda: keeper_pid(directory) == proc.pid or proc.poll() is not None, 30, "the keeper"
        )
        assert proc.poll() is None and keeper_pid(directory) == proc.pid
    finally:
        stop_keeper(directory)
        proc.wait(timeout=30)
