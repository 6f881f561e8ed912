"""resihp's snapshots in a user's own training under torchrun (examples/ddp_resilient.py, the same
loop over a Hugging Face Llama in examples/hf_resilient.py, and the HF Trainer with
ResihpTrainerCallback in examples/hf_trainer_resilient.py, Lightning in
examples/lightning_resilient.py): a rank killed with SIGKILL (or hung, then killed; or after its
keeper was killed) is restarted by torchrun, restores from the memory
tier, and the per-step losses equal an uninterrupted run's, bit for bit."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from resihp.ckpt.keeper import keeper_pid, stop_keeper
from resihp.errors import InputError
from resihp.procinfo import pid_alive
from resihp.train import KEEPER_OWNER, RNG, Snapshots, flatten, unflatten
from tests.faults import descendants, wait_for  # noqa: F401

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STEPS = 10


def _needs(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"{module} missing")


# the user's loops under test: plain DDP, DDP over a Hugging Face Llama, the HF Trainer
DDP, HF, TRAINER = "ddp_resilient.py", "hf_resilient.py", "hf_trainer_resilient.py"
FAULTS = ["killed", "hung-then-killed", "keeper-killed-first"]
CASES = [
    *[(DDP, f) for f in FAULTS],
    *[pytest.param(HF, f, marks=_needs("transformers")) for f in FAULTS],
    pytest.param(TRAINER, "killed", marks=_needs("transformers")),
    pytest.param("lightning_resilient.py", "killed", marks=_needs("lightning")),
]


@pytest.fixture(scope="module")
def example(request) -> Path:
    """The example script a case runs (parametrized indirectly by name)."""
    return EXAMPLES / request.param


def _torchrun(example: Path, out: Path, shm: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RESIHP_SHM": str(shm)}
    env.pop("RESIHP_KEEPER_OWNER", None)  # the keeper is torchrun's agent's, as a user's would be
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "--monitor-interval",
            "0.2",
            str(example),
            "--out",
            str(out),
            "--steps",
            str(STEPS),
            *extra,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _records(out: Path, rank: int) -> list[dict]:
    path = out / f"losses.rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _losses(out: Path, rank: int) -> dict[int, float]:
    """Each step's loss, the last one written (a restarted rank writes the steps after its
    restore)."""
    return {r["step"]: r["loss"] for r in _records(out, rank) if "step" in r}


def _rank_pid(out: Path, rank: int) -> int:
    starts = [r for r in _records(out, rank) if "pid" in r]
    return starts[-1]["pid"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, example) -> dict[int, dict[int, float]]:
    base = tmp_path_factory.mktemp("reference")
    proc = _torchrun(example, base / "out", base / "shm")
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log
    return {r: _losses(base / "out", r) for r in (0, 1)}


def _keeper_pid(shm: Path) -> int | None:
    (tier,) = {p.parent for p in shm.glob("*/keeper.pid")}
    return keeper_pid(tier)


@pytest.mark.slow
@pytest.mark.parametrize(("example", "fault"), CASES, indirect=["example"])
def test_a_killed_rank_restores_from_memory_with_the_same_losses(
    tmp_path, example, reference, fault
):
    out, shm = tmp_path / "out", tmp_path / "shm"
    proc = _torchrun(example, out, shm, "--pace", "0.3")  # the kill lands mid-run
    try:
        if fault == "keeper-killed-first":  # the trainers start a new keeper and go on
            wait_for(lambda: len(_losses(out, 1)) >= 2, 240, "rank 1 to train 2 steps")
            keeper = _keeper_pid(shm)
            os.kill(keeper, signal.SIGKILL)
            wait_for(lambda: _keeper_pid(shm) not in (None, -1, keeper), 60, "a new keeper")
        # 5: Lightning's snapshots come every 2 steps, step 4's published by then
        wait_for(lambda: len(_losses(out, 1)) >= 5, 240, "rank 1 to train 5 steps")
        victim = _rank_pid(out, 1)
        if fault == "hung-then-killed":  # a hung rank, found and ended by whoever watches the job
            os.kill(victim, signal.SIGSTOP)
            time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        log, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            for pid in descendants(proc.pid) | {proc.pid}:
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, log
    for rank in (0, 1):
        starts = [r for r in _records(out, rank) if "start" in r]
        assert len(starts) == 2 and starts[1]["source"] == "memory", starts
        assert 4 <= starts[1]["start"] < STEPS, starts  # restored mid-run, and trained on
        assert _losses(out, rank) == reference[rank]  # bit for bit


def test_state_round_trips_through_the_flat_form_with_its_types():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.9))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {
        "model": model,
        "optimizer": opt,
        "extra": {"epoch": 3, "ratio": float("inf")},
        "rng": RNG(),
    }
    tensors, tree = flatten(state)
    json.dumps(tree)  # the tree is plain JSON
    back = unflatten(tree, {k: t.clone() for k, t in tensors})
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.9)  # a tuple again
    assert set(back["optimizer"]["state"]) == {0, 1}  # int keys again
    assert back["extra"] == {"epoch": 3, "ratio": float("inf")}
    assert torch.equal(back["model"]["weight"], model.weight)
    opt.load_state_dict(back["optimizer"])


def test_state_that_cannot_be_snapshot_is_one_line_naming_its_path():
    with pytest.raises(InputError, match=r"'extra.when'.*a object cannot be snapshot"):
        flatten({"extra": {"when": object()}})
    with pytest.raises(InputError, match=r"'extra'.*key \(1, 2\) is a tuple"):
        flatten({"extra": {(1, 2): 0}})


def test_a_new_process_state_restores_the_newest_snapshot_and_each_stall_is_counted(
    tmp_path, monkeypatch
):
    """Without a process group (one process): snapshots after three steps, then fresh objects (as
    a restarted trainer builds them) restore the newest from memory, bitwise."""
    monkeypatch.setenv("RESIHP_SHM", str(tmp_path / "shm"))
    monkeypatch.setenv(KEEPER_OWNER, str(os.getpid()))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    snaps = Snapshots({"model": model, "optimizer": opt}, job_id="one-process")
    try:
        for step in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            snaps.after_step(step)
        snaps.close()
        assert len(snaps.stall_s) == 3 and all(s >= 0 for s in snaps.stall_s)
        wait_for(
            lambda: 2 in [h.step for h in snaps.tier.held()], 30, "the keeper to publish step 2"
        )
        again = torch.nn.Linear(4, 3)
        again_opt = torch.optim.AdamW(again.parameters())
        restored = Snapshots(
            {"model": again, "optimizer": again_opt}, job_id="one-process"
        ).restore()
        assert restored is not None and (restored.step, restored.source) == (2, "memory")
        assert torch.equal(again.weight, model.weight) and torch.equal(again.bias, model.bias)
        assert torch.equal(
            again_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
        )
    finally:
        stop_keeper(snaps.dir)


def test_a_stopped_keeper_is_replaced_and_the_snapshots_go_on(tmp_path, monkeypatch):
    """The node's keeper is SIGSTOPped: the trainer, waiting for a slot, kills it after
    ``STOPPED_KEEPER_S`` and starts a new keeper, which publishes the newest step; before, every
    snapshot stalled until its timeout."""
    monkeypatch.setenv("RESIHP_SHM", str(tmp_path / "shm"))
    monkeypatch.setenv(KEEPER_OWNER, str(os.getpid()))
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    snaps = Snapshots({"model": model, "optimizer": opt}, job_id="stopped-keeper", timeout_s=30.0)
    stopped = None
    try:
        for step in range(6):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            snaps.after_step(step)
            if step == 1:
                wait_for(lambda: 1 in [h.step for h in snaps.tier.held()], 30, "step 1 published")
                stopped = keeper_pid(snaps.dir)
                os.kill(stopped, signal.SIGSTOP)
        snaps.close()
        wait_for(lambda: 5 in [h.step for h in snaps.tier.held()], 30, "the new keeper to publish")
        assert keeper_pid(snaps.dir) not in (None, -1, stopped)
        wait_for(lambda: not pid_alive(stopped), 10, "the stopped keeper gone")
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)
        stop_keeper(snaps.dir)
