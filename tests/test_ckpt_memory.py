"""The memory tier on its own (one process, a real keeper process): slots published only when
complete and checksummed, a snapshot that is not torn by the next optimizer step, a flipped byte
found, the keeper outliving its starter, the newest step complete for every rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from resihp.ckpt.keeper import ensure_keeper, keeper_pid, stop_keeper
from resihp.ckpt.memory import MemoryTier, SlotHeader, tier_dir
from resihp.ckpt.snapshot import Snapshotter, _load, find_latest, state_tensors
from resihp.errors import InputError


@pytest.fixture
def keeper(shm):
    directory = tier_dir("job", 0)
    pid = ensure_keeper(directory, os.getpid())
    yield directory, pid
    stop_keeper(directory)


# state on a GPU takes the side-stream copy into pinned slots (run where a GPU is: issue 18)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]


def _model(
    width: int = 1024, layers: int = 8, device: str = "cpu"
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    return model, opt


def _train(model, opt) -> None:
    first = model[0]
    model(torch.randn(4, first.in_features, device=first.weight.device)).square().mean().backward()
    opt.step()


def _wait_published(
    tier: MemoryTier, step: int, rank: int | None = None, timeout_s: float = 30.0
) -> SlotHeader:
    rank = tier.rank if rank is None else rank
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for h in tier.headers():
            if h.rank == rank and h.step == step and h.slot in ("A", "B"):
                return h
        time.sleep(0.01)
    raise AssertionError(f"step {step} of rank {rank} not published")


def _flat(tensors) -> dict[str, torch.Tensor]:
    return {k: t.detach().clone() for k, t in tensors}


@pytest.mark.parametrize("device", DEVICES)
def test_snapshot_is_not_torn_by_the_next_optimizer_step(keeper, device):
    directory, _ = keeper
    model, opt = _model(
        device=device
    )  # 8 x 1M parameters: 32 MiB of weights, 96 MiB with AdamW state
    tier = MemoryTier(directory, 0)
    snap = Snapshotter(tier, every=1)
    before = _flat(state_tensors(model, opt))
    snap.snapshot(0, model, opt, {"job_id": "job"})
    snap.attach(opt)
    # right after the snapshot call: the next optimizer step mutates every parameter in place
    _train(model, opt)
    after = _flat(state_tensors(model, opt))
    assert snap.fence_waits <= 1 and snap.blocked_s
    header = _wait_published(tier, 0)
    assert tier.verify(header)
    data = torch.from_numpy(tier.read(header, writable=True))
    changed = 0
    for s in header.shards:
        saved = data[s.offset : s.offset + s.nbytes]
        assert torch.equal(saved, before[s.key].cpu().reshape(-1).view(torch.uint8)), (
            f"{s.key} torn"
        )
        changed += not torch.equal(saved, after[s.key].cpu().reshape(-1).view(torch.uint8))
    assert changed > 0  # the step really changed the state the snapshot kept
    if device == "cuda":
        assert snap.pinned is not None
    snap.close()


@pytest.mark.parametrize("device", DEVICES)
def test_restore_loads_bitwise_and_a_flipped_byte_is_found(keeper, device):
    directory, _ = keeper
    model, opt = _model(256, 2, device)
    tier = MemoryTier(directory, 0)
    snap = Snapshotter(tier, every=1)
    saved = _flat(state_tensors(model, opt))
    snap.snapshot(3, model, opt, {"job_id": "job"})
    snap.close()
    header = _wait_published(tier, 3)
    other, other_opt = _model(256, 2, device)
    _train(other, other_opt)
    assert _load(header, tier.read(header, writable=True), dict(state_tensors(other, other_opt)))
    for key, t in state_tensors(other, other_opt):
        if key != "rng.torch":
            assert torch.equal(t, saved[key]), key
    # one flipped byte in the slot: the checksums say so, and the slot is not offered
    path = tier.data_path(header.slot)
    with open(path, "r+b") as f:
        f.seek(header.shards[0].offset + 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    assert not tier.verify(header)


def test_a_slot_cut_short_is_never_published(shm):
    # no keeper: the slot is written but not published; a write restarted unpublishes the header
    tier = MemoryTier(tier_dir("job", 0), 0)
    model, opt = _model(64, 1)
    snap = Snapshotter(tier, every=1, timeout_s=0.5)
    snap.snapshot(0, model, opt, {})
    snap.fence()
    assert tier.pending_path("A").exists() and not tier.headers()
    with pytest.raises(RuntimeError, match="keeper did not publish"):
        tier.begin_write("A", timeout_s=0.2)


def test_keeper_outlives_the_process_that_started_it(shm):
    directory = tier_dir("job2", 0)
    # a parent starts the keeper, then is SIGKILLed (as torchrun kills a worker)
    code = (
        "import os, sys, time; from resihp.ckpt.keeper import ensure_keeper; "
        f"print(ensure_keeper({str(directory)!r}, {os.getpid()}), flush=True); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    time.sleep(0.3)
    assert keeper_pid(directory) == pid
    (directory / "rank0.A.bin").write_bytes(b"x" * 64)
    # killed itself, the keeper leaves the files for the next one
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while keeper_pid(directory) is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (directory / "rank0.A.bin").exists()
    new = ensure_keeper(directory, os.getpid())
    assert new != pid
    os.kill(new, signal.SIGTERM)  # a SIGTERM that is not the job's end: the files stay too
    deadline = time.monotonic() + 5
    while keeper_pid(directory) is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert keeper_pid(directory) is None and (directory / "rank0.A.bin").exists()
    ensure_keeper(directory, os.getpid())
    stop_keeper(directory)  # the job's end: the tier goes
    assert not directory.exists()


def test_keeper_removes_the_tier_when_its_owner_is_gone(shm):
    directory = tier_dir("job3", 0)
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ensure_keeper(directory, owner.pid)
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 10
    while directory.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not directory.exists()


def test_capacity_is_checked_in_one_line(shm):
    tier = MemoryTier(tier_dir("job4", 0), 0)
    with pytest.raises(
        InputError, match=r"--snapshot-every: the memory tier needs .* MiB .* but .* MiB is free"
    ):
        tier.check_capacity(1 << 50, 4)


def _h(rank, holder, step, slot="A"):
    return {"rank": rank, "holder": holder, "step": step, "slot": slot}


def test_find_latest_counts_peers_and_copies():
    dp_peers = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}.get  # dp 2 x pp 2
    # rank 1 lost its newest slot (step 5): its DP peer rank 0 holds the same state
    inv = [
        [_h(0, 0, 5), _h(0, 0, 4, "B")],
        [_h(1, 1, 4, "B")],
        [_h(2, 2, 5), _h(2, 2, 4, "B")],
        [_h(3, 3, 5), _h(3, 3, 4, "B")],
    ]
    step, choice = find_latest(inv, dp_peers, 4)
    assert step == 5 and choice[1]["holder"] == 0 and choice[0]["holder"] == 0
    # dp 1 x pp 2 (no peers): rank 0's own slots are bad, rank 1 holds its copy
    alone = lambda r: [r]  # noqa: E731
    inv = [[_h(1, 0, 5, "copy"), _h(0, 0, 4, "B")], [_h(1, 1, 5), _h(0, 1, 5, "copy")]]
    step, choice = find_latest(inv, alone, 2)
    assert step == 5 and choice[0] == _h(0, 1, 5, "copy") and choice[1]["holder"] == 1
    # two ranks that are each other's only copy, both lost: no step is complete
    assert find_latest([[], [_h(1, 1, 5)]], alone, 2) is None


def _snapshot_of_one_rank(directory, step: int):
    """Rank 0's snapshot of a small model at ``step``, once the keeper has published it."""
    model, opt = _model(128, 1)
    tier = MemoryTier(directory, 0)
    snap = Snapshotter(tier, every=1)
    snap.snapshot(step, model, opt, {})
    snap.close()
    return tier, _wait_published(tier, step)


def test_ckpt_inspect_shows_the_memory_tier(keeper):
    import json

    from typer.testing import CliRunner

    from resihp.cli import app

    directory, pid = keeper
    tier, header = _snapshot_of_one_rank(directory, 7)
    result = CliRunner().invoke(app, ["ckpt", "inspect", str(directory), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)["memory"][0]
    assert info["keeper_pid"] == pid and info["pending"] == []
    assert info["slots"] == [
        {
            "rank": 0,
            "slot": header.slot,
            "step": 7,
            "holder": 0,
            "bytes": header.nbytes,
            "tensors": len(header.shards),
            "verified": True,
            "published_s": header.published_s,
        }
    ]
    text = CliRunner().invoke(app, ["ckpt", "inspect", str(directory)]).output
    assert "rank 0 slot A: step 7" in text and "checksums match" in text


def test_the_keepers_check_ahead_of_a_restore_is_used_only_for_that_slot(keeper):
    from resihp.ckpt.keeper import request_verify

    directory, _ = keeper
    tier, header = _snapshot_of_one_rank(directory, 1)
    assert tier.checked(header) is None  # not checked yet: the restoring rank checks it itself
    with open(tier.data_path(header.slot), "r+b") as f:
        f.write(b"\xff\xff")
    request_verify(directory)
    deadline = time.monotonic() + 10
    while (directory / "VERIFY").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tier.checked(header) is False
    snap = Snapshotter(tier, every=1)  # a slot published after the check has no verdict
    model, opt = _model(128, 1)
    snap.snapshot(3, model, opt, {})
    snap.close()
    again = _wait_published(tier, 3)
    assert tier.checked(again) is None and tier.verify(again)


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"recovery": "sometimes"},
            "faults.recovery (--recovery): expected one of auto, none, restart, replica, "
            "replica-drop, got 'sometimes'",
        ),
        (
            {"snapshot_every": -1},
            "checkpoint.snapshot_every (--snapshot-every): expected an integer >= 0, got -1",
        ),
    ],
)
def test_bad_snapshot_options_are_one_line(fields, message):
    from resihp.train.config import RunConfig

    with pytest.raises(InputError) as info:  # the CLI prints it as one line, exit 2
        RunConfig.from_flags(**fields)
    assert str(info.value) == message


def test_restart_snapshots_every_step_unless_told():
    from resihp.train.config import RunConfig

    assert RunConfig.from_flags(recovery="restart").snapshot_interval() == 1
    assert RunConfig.from_flags(recovery="restart", snapshot_every=3).snapshot_interval() == 3
    assert RunConfig().snapshot_interval() == 0
