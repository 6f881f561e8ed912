"""Universal checkpoints: save tensor-parallel shards, join them, load into another layout."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resihp.ckpt.integrity import write_manifest
from resihp.ckpt.universal import convert, inspect, load, state_of
from resihp.errors import InputError
from resihp.model.gpt import GPTConfig, GPTStage, init_by_name, lm_loss
from resihp.model.tensor_parallel import TPContext

CFG = GPTConfig(layers=2, hidden=32, heads=4, ffn_hidden=64, vocab=50, max_seq_len=64)


def trained(tp_rank: int = 0, tp: int = 1):
    """A stage after one AdamW step (so the optimizer has state) on tensor-parallel rank tp_rank."""
    ctx = TPContext(tp, tp_rank)
    model = GPTStage(CFG, tp=ctx)
    init_by_name(model, 3, ctx, CFG.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():  # a deterministic, layout-independent "gradient": the param itself
        p.grad = p.detach().clone()
    opt.step()
    return model, opt


def test_tp_shards_join_into_a_universal_checkpoint_any_layout_loads(tmp_path):
    # two tensor-parallel ranks' shards in one checkpoint (what a tp=2 job writes)
    shards = [trained(r, 2) for r in range(2)]
    state = {**state_of(*shards[0], 0, 2), **state_of(*shards[1], 1, 2)}
    dcp.save(state, checkpoint_id=str(tmp_path / "tp2"))
    (tmp_path / "tp2" / "meta.json").write_text('{"step": 0, "tp": 2, "model": {"heads": 4}}')
    write_manifest(tmp_path / "tp2")
    with pytest.raises(InputError, match="resihp ckpt convert"):
        load(tmp_path / "tp2", *trained(), tp_rank=0, tp=1)

    result = convert(tmp_path / "tp2", tmp_path / "universal")
    assert result["joined"] > 0
    info = inspect(tmp_path / "universal")
    assert info["meta"]["tp"] == 1 and info["layers"] == [0, 1]

    # the whole model, trained the same way without tensor parallelism, equals the joined one
    reference, ref_opt = trained()
    fresh = GPTStage(CFG)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    load(tmp_path / "universal", fresh, fresh_opt)
    for (name, a), b in zip(reference.named_parameters(), fresh.parameters()):
        torch.testing.assert_close(a, b, msg=name)
        torch.testing.assert_close(ref_opt.state[a]["exp_avg_sq"], fresh_opt.state[b]["exp_avg_sq"])

    # and a tensor-parallel rank of another job loads its slice of it
    part = GPTStage(CFG, tp=TPContext(2, 1))
    part_opt = torch.optim.AdamW(part.parameters(), lr=0.01)
    load(tmp_path / "universal", part, part_opt, tp_rank=1, tp=2)
    for (name, a), b in zip(shards[1][0].named_parameters(), part.parameters()):
        torch.testing.assert_close(a, b, msg=name)
    ids = torch.arange(10)
    torch.testing.assert_close(lm_loss(fresh(ids, [10]), ids), lm_loss(reference(ids, [10]), ids))


def test_ckpt_cli_bad_input(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "resihp.cli", "ckpt", "inspect", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and "not a resihp checkpoint (no meta.json)" in proc.stderr
    assert "Traceback" not in proc.stderr


# --- integrity (issue 20) -------------------------------------------------------------------------
def saved_run(tmp_path, steps=(1, 3), job="jobA", model_hash="m1"):
    """A run folder with real checkpoints written by ``save`` (manifest last, renamed into place)."""
    from resihp.ckpt.universal import save

    out = tmp_path / "run"
    model, opt = trained()
    for step in steps:
        save(out / "ckpt" / f"step{step}", model, opt, step,
             {"dp": 1, "pp": 1, "tp": 1, "model": {"heads": 4}, "job_id": job, "model_hash": model_hash})
    return out, model


def shard_of(directory):
    return next(p for p in directory.iterdir() if p.suffix == ".distcp")


def test_checkpoint_has_a_manifest_written_last_and_no_partial_folder_is_left(tmp_path):
    from resihp.ckpt.integrity import problem, read_manifest

    out, _ = saved_run(tmp_path)
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["step1", "step3"]  # no .partial
    manifest = read_manifest(out / "ckpt" / "step3")
    assert manifest["job_id"] == "jobA" and manifest["model_hash"] == "m1"
    assert {".metadata", "meta.json"} <= set(manifest["files"])
    assert problem(out / "ckpt" / "step3") is None
    assert inspect(out / "ckpt" / "step3")["verified"] is True


@pytest.mark.parametrize("damage, message", [
    ("flip", "does not match its sha256"),
    ("delete", "is missing"),
    ("truncate", "bytes, the manifest says"),
    ("no-manifest", "no manifest.json"),
])
def test_damaged_checkpoint_is_refused_and_the_previous_good_one_is_used(tmp_path, damage, message):
    from resihp.ckpt.integrity import newest_good
    from tests.faults import corrupt_bytes, truncate

    out, model = saved_run(tmp_path)
    newest = out / "ckpt" / "step3"
    if damage == "flip":
        corrupt_bytes(shard_of(newest))
    elif damage == "delete":
        shard_of(newest).unlink()
    elif damage == "truncate":
        truncate(shard_of(newest))
    else:
        (newest / "manifest.json").unlink()
    with pytest.raises(InputError, match=message) as info:  # inspect says what is wrong
        inspect(newest)
    assert "previous good checkpoint" in str(info.value) and "step1" in str(info.value)
    with pytest.raises(InputError, match=message):  # restore refuses it
        load(newest, *trained())
    with pytest.raises(InputError, match=message):  # and so does convert
        convert(newest, tmp_path / "converted")
    found, skipped = newest_good(out)  # the previous good one is what a restart takes
    assert found == out / "ckpt" / "step1" and skipped[0][0] == newest
    result = convert(out, tmp_path / "from-run")  # a run folder means its newest good checkpoint
    assert result["source"].endswith("step1")
    fresh = GPTStage(CFG)
    load(tmp_path / "from-run", fresh, torch.optim.AdamW(fresh.parameters()))
    for a, b in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(a, b)


def test_restart_takes_only_a_checkpoint_of_the_same_job_and_model(tmp_path):
    from resihp.ckpt.integrity import newest_good

    out, _ = saved_run(tmp_path, steps=(29,), job="old-job")
    saved_run(tmp_path, steps=(9,), job="new-job")  # the same folder, a later job
    assert newest_good(out, job_id="new-job", model_hash="m1")[0] == out / "ckpt" / "step9"
    found, skipped = newest_good(out, job_id="new-job", model_hash="other")
    assert found is None and "another model" in skipped[-1][1]
    found, skipped = newest_good(out, job_id="third-job")
    assert found is None and "another job (old-job)" in skipped[0][1]


def test_crafted_metadata_cannot_run_code(tmp_path):
    import pickle

    from resihp.ckpt.integrity import write_manifest

    out, _ = saved_run(tmp_path, steps=(1,))
    ckpt = out / "ckpt" / "step1"
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload()))
    write_manifest(ckpt)  # a manifest is no signature: the files verify, the pickle must still be refused
    for use in (lambda: inspect(ckpt), lambda: load(ckpt, *trained()),
                lambda: convert(ckpt, tmp_path / "c")):
        with pytest.raises(InputError, match="refused global"):
            use()
    assert not marker.exists()


def test_ckpt_inspect_cli_names_what_is_wrong(tmp_path):
    from tests.faults import corrupt_bytes

    out, _ = saved_run(tmp_path)
    corrupt_bytes(shard_of(out / "ckpt" / "step3"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "resihp.cli", "ckpt", "inspect", str(out / "ckpt" / "step3")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "damaged checkpoint" in proc.stderr and "sha256" in proc.stderr and "step1" in proc.stderr
