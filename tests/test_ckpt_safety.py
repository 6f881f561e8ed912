"""A crafted checkpoint never runs code: DCP's non-tensor (bytes) items are unpickled by DCP with an
unrestricted ``torch.load``, so a checkpoint naming one is refused, by ``resihp run --resume``,
``resihp ckpt convert`` and ``inspect``, in one line with exit 2, even when its manifest was
rewritten to match the payload."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resihp.ckpt.integrity import read_manifest, write_manifest
from resihp.ckpt.single import single_process
from resihp.ckpt.universal import convert, inspect, load, read_full
from resihp.errors import InputError

TINY = [
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "4",
    "--ffn-hidden",
    "64",
    "--vocab",
    "61",
    "--global-tokens",
    "1024",
    "--budget",
    "256",
    "--max-len",
    "256",
    "--timeout",
    "60",
    "--no-live",
    "--json",
    "--dp",
    "1",
    "--pp",
    "1",
    "--tp",
    "1",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "resihp.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )


class Payload:
    """Unpickled, it runs a shell command (writes the marker file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A real run's folder: 4 steps, a checkpoint after step 1 (``ckpt/step1``)."""
    out = tmp_path_factory.mktemp("safety") / "run"
    proc = cli("run", *TINY, "--steps", "4", "--ckpt-every", "2", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


def craft(run_folder, tmp_path, marker):
    """A copy of the run folder whose newest checkpoint holds one optimizer step counter as a
    pickled payload (a DCP bytes item), the manifest rewritten to match the new files."""
    out = tmp_path / "crafted"
    shutil.copytree(run_folder, out)
    ckpt = max((out / "ckpt").glob("step*"), key=lambda p: int(p.name[4:]))
    state = read_full(ckpt)
    key = next(k for k in sorted(state) if k.endswith(".step"))
    state[key] = Payload(marker)
    identity = {k: v for k, v in read_manifest(ckpt).items() if k not in ("format", "files")}
    meta = (ckpt / "meta.json").read_text()
    shutil.rmtree(ckpt)
    with single_process():
        dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "meta.json").write_text(meta)
    write_manifest(ckpt, identity)
    return out, ckpt


def one_line_refusal(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    return proc.stderr.strip()


@pytest.mark.slow
def test_resume_from_a_crafted_checkpoint_is_refused_and_runs_no_code(run_folder, tmp_path):
    marker = tmp_path / "pwned"
    out, ckpt = craft(run_folder, tmp_path, marker)
    proc = cli("run", *TINY, "--steps", "6", "--resume", str(ckpt), "-o", str(tmp_path / "again"))
    line = one_line_refusal(proc)
    assert str(ckpt) in line and "expected a tensor" in line and "pickled" in line
    assert not marker.exists()


@pytest.mark.slow
def test_convert_and_inspect_of_a_crafted_checkpoint_refuse_it_and_run_no_code(
    run_folder, tmp_path
):
    marker = tmp_path / "pwned"
    out, ckpt = craft(run_folder, tmp_path, marker)
    for dst in ("folder", "model.pt"):
        line = one_line_refusal(cli("ckpt", "convert", str(ckpt), str(tmp_path / dst)))
        assert "expected a tensor" in line and not (tmp_path / dst).exists()
    line = one_line_refusal(cli("ckpt", "inspect", str(ckpt)))
    assert "expected a tensor" in line and "every file matches" not in line
    # a run folder means its newest checkpoint that verifies: the crafted one is skipped, named
    proc = cli("ckpt", "inspect", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["meta"]["step"] < int(ckpt.name[4:])
    assert not marker.exists()


@pytest.mark.slow
def test_the_reader_refuses_a_bytes_item_even_past_the_metadata_check(
    run_folder, tmp_path, monkeypatch
):
    """Two layers: were the metadata check gone, DCP's reader still never unpickles an item."""
    import resihp.ckpt.integrity as integrity
    from resihp.model.config import GPTConfig
    from resihp.model.gpt import GPTStage

    marker = tmp_path / "pwned"
    _, ckpt = craft(run_folder, tmp_path, marker)
    monkeypatch.setattr(integrity, "_check_items", lambda path, metadata, tensors_only=True: None)
    meta = json.loads((ckpt / "meta.json").read_text())
    cfg = GPTConfig(
        **{k: v for k, v in meta["model"].items() if k in GPTConfig.__dataclass_fields__}
    )
    model = GPTStage(cfg)
    for use in (
        lambda: read_full(ckpt),
        lambda: load(ckpt, model, torch.optim.AdamW(model.parameters()), cfg=cfg),
        lambda: convert(ckpt, tmp_path / "c"),
    ):
        with pytest.raises(InputError, match="expected a tensor, got a pickled object"):
            use()
    assert not marker.exists()
    assert inspect(ckpt)["verified"] is True  # only the metadata check would have refused it here


class Position:
    """A data source's position: a Stateful whose state is a plain int (a DCP bytes item)."""

    def __init__(self, position: int) -> None:
        self.position = position

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def test_a_user_checkpoint_loads_plain_values_and_refuses_a_pickled_object(tmp_path, monkeypatch):
    """resihp.train's DCP checkpoints hold the user's plain values (pickled by DCP): they load
    through the weights-only unpickler; a crafted object in their place is refused, never run."""
    from resihp.ckpt.keeper import stop_keeper
    from resihp.train import KEEPER_OWNER, Snapshots

    monkeypatch.setenv("RESIHP_SHM", str(tmp_path / "shm"))
    monkeypatch.setenv(KEEPER_OWNER, str(os.getpid()))
    model, data = torch.nn.Linear(3, 2), Position(7)
    snaps = Snapshots({"model": model, "data": data}, dcp_dir=tmp_path / "dcp", job_id="safety")
    marker = tmp_path / "pwned"
    try:
        with single_process():
            path = snaps.save(0)
            data.position = 0
            snaps.load(path)
            assert data.position == 7
            crafted = tmp_path / "dcp" / "step1"
            dcp.save(
                {"model": model.state_dict(), "data": {"position": Payload(marker)}},
                checkpoint_id=str(crafted),
                no_dist=True,
            )
            with pytest.raises(InputError, match="'data.position'.*weights-only loader refuses"):
                snaps.load(crafted)
        assert not marker.exists() and data.position == 7
    finally:
        snaps.close()
        stop_keeper(snaps.dir)
