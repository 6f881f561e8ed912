"""Universal checkpoints: save tensor-parallel shards, join them, load into another layout."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resihp.ckpt.integrity import write_manifest
from resihp.ckpt.universal import convert, inspect, load
from resihp.errors import InputError
from resihp.model.config import GPTConfig
from resihp.model.gpt import GPTStage, init_by_name, lm_loss
from resihp.model.shards import split_of
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


def v1_state(model, opt, tp_rank: int = 0, tp: int = 1) -> dict:
    """What an older resihp (checkpoint format 1) saved: a shard as ``<key>@tp<r>of<n>`` in the
    unsharded model's shape."""
    out = {}
    for name, p in model.named_parameters():
        key = f"{name}@tp{tp_rank}of{tp}" if tp > 1 and split_of(name) else name
        out[f"model.{key}"] = p.detach()
        for k in ("step", "exp_avg", "exp_avg_sq"):
            out[f"optim.{key}.{k}"] = opt.state[p][k]
    return out


def test_format1_tp_shards_load_into_their_tp_or_join_into_a_checkpoint_any_layout_loads(tmp_path):
    # two tensor-parallel ranks' shards in one checkpoint (what a tp=2 job of an older resihp wrote)
    shards = [trained(r, 2) for r in range(2)]
    state = {**v1_state(*shards[0], 0, 2), **v1_state(*shards[1], 1, 2)}
    dcp.save(state, checkpoint_id=str(tmp_path / "tp2"))
    (tmp_path / "tp2" / "meta.json").write_text('{"step": 0, "tp": 2, "model": {"heads": 4}}')
    write_manifest(tmp_path / "tp2")
    with pytest.raises(InputError, match="format 1.*resihp ckpt convert"):
        load(tmp_path / "tp2", *trained(), tp=1)
    same = GPTStage(CFG, tp=TPContext(2, 1))  # into its own tensor-parallel size it still loads
    load(tmp_path / "tp2", same, torch.optim.AdamW(same.parameters(), lr=0.01), tp=TPContext(2, 1))
    for (name, a), b in zip(shards[1][0].named_parameters(), same.parameters()):
        assert torch.equal(a, b), name

    with warnings.catch_warnings():  # DCP's single-process warning is not passed on to the user
        warnings.simplefilter("error")
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
    load(tmp_path / "universal", part, part_opt, tp=TPContext(2, 1))
    for (name, a), b in zip(shards[1][0].named_parameters(), part.parameters()):
        torch.testing.assert_close(a, b, msg=name)
    ids = torch.arange(10)
    torch.testing.assert_close(lm_loss(fresh(ids, [10]), ids), lm_loss(reference(ids, [10]), ids))


def test_checkpoint_round_trips_and_exports_one_consolidated_file(tmp_path):
    from resihp.ckpt.universal import read_full, save

    cfg = GPTConfig(
        layers=2, hidden=32, heads=4, ffn_hidden=64, vocab=50, max_seq_len=64, mlp="swiglu"
    )
    model = GPTStage(cfg)
    init_by_name(model, 5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = p.detach().clone()
    opt.step()
    save(tmp_path / "c", model, opt, 7, {"tp": 1, "model": cfg.to_dict()})
    assert read_full(tmp_path / "c")["model.layers.0.qkv.weight"].shape == (3, 32, 32)  # per head
    assert read_full(tmp_path / "c")["model.layers.0.gate_up.weight"].shape == (
        2,
        64,
        32,
    )  # per half
    fresh = GPTStage(cfg)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    assert load(tmp_path / "c", fresh, fresh_opt)["format"] == 2
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b) and torch.equal(
            opt.state[a]["exp_avg"], fresh_opt.state[b]["exp_avg"]
        ), name
    convert(tmp_path / "c", tmp_path / "model.pt")
    pt = torch.load(tmp_path / "model.pt", weights_only=True)["model"]
    for name, p in model.named_parameters():  # the model's own shapes, usable outside resihp
        assert torch.equal(pt[name], p.detach()), name
    try:
        from safetensors.torch import load_file
    except ImportError:  # not a dependency of resihp (the hf extra brings it): the export says so
        with pytest.raises(InputError, match="needs the safetensors package"):
            convert(tmp_path / "c", tmp_path / "model.safetensors")
    else:
        convert(tmp_path / "c", tmp_path / "model.safetensors")
        exported = load_file(tmp_path / "model.safetensors")
        for name, p in model.named_parameters():
            assert torch.equal(exported[name], p.detach()), name
    other = GPTStage(
        GPTConfig(layers=2, hidden=32, heads=4, ffn_hidden=64, vocab=50, max_seq_len=64)
    )
    with pytest.raises(InputError, match="has no model.layers.0.fc1.weight"):
        load(tmp_path / "c", other, torch.optim.AdamW(other.parameters()))


def test_fused_and_padded_parameters_are_placed_per_head_half_and_real_row():
    # a shard's block of the global tensor, for each parameter that splits unlike a plain row cut
    cfg = GPTConfig(
        layers=1,
        hidden=32,
        heads=4,
        ffn_hidden=64,
        vocab=61,
        max_seq_len=64,
        mlp="swiglu",
        vocab_parallel=True,
        tie_embeddings=True,
    )
    full = GPTStage(cfg)
    init_by_name(full, 11)
    whole = dict(full.named_parameters())
    assert (
        full.head.weight is full.embed.weight and "head.weight" not in whole
    )  # one tied parameter
    for tp in (2, 4):
        for r in range(tp):
            part = GPTStage(cfg, tp=TPContext(tp, r))
            init_by_name(part, 11, TPContext(tp, r))
            mine = dict(part.named_parameters())
            gate_up = mine["layers.0.gate_up.weight"].view(
                2, 64 // tp, 32
            )  # [gate shard; up shard]
            assert torch.equal(
                gate_up[0], whole["layers.0.gate_up.weight"][r * 64 // tp : (r + 1) * 64 // tp]
            )
            assert torch.equal(
                gate_up[1],
                whole["layers.0.gate_up.weight"][64 + r * 64 // tp : 64 + (r + 1) * 64 // tp],
            )
            qkv = mine["layers.0.qkv.weight"].view(3, 32 // tp, 32)  # whole heads of Q, K and V
            for g in range(3):
                assert torch.equal(
                    qkv[g],
                    whole["layers.0.qkv.weight"][
                        g * 32 + r * 32 // tp : g * 32 + (r + 1) * 32 // tp
                    ],
                )
            rows = -(-61 // tp)  # the vocabulary padded to a multiple of tp; padding rows stay zero
            real = max(0, min(rows, 61 - r * rows))
            assert mine["embed.weight"].shape == (rows, 32)
            assert torch.equal(
                mine["embed.weight"][:real], whole["embed.weight"][r * rows : r * rows + real]
            )
            assert not mine["embed.weight"][real:].any()
            where = cfg.shard_placement("embed.weight", (rows, 32), tp)
            assert (
                where.global_shape == (61, 32)
                and where.local_view(mine["embed.weight"], tp, r).shape[0] == real
            )


def test_ckpt_cli_bad_input(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "ckpt", "inspect", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2 and "not a resihp checkpoint (no meta.json)" in proc.stderr
    assert "Traceback" not in proc.stderr
    (tmp_path / "afile").write_text("x")  # a file, not a folder: was NotADirectoryError
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "ckpt", "inspect", str(tmp_path / "afile")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert (
        proc.returncode == 2
        and proc.stderr.strip()
        == f"resihp: error: {tmp_path / 'afile'}: not a resihp checkpoint (no meta.json)"
    )


# --- integrity (issue 20) -------------------------------------------------------------------------
def saved_run(tmp_path, steps=(1, 3), job="jobA", model_hash="m1"):
    """A run folder with real checkpoints written by ``save`` (manifest last, renamed into
    place)."""
    from resihp.ckpt.universal import save

    out = tmp_path / "run"
    model, opt = trained()
    for step in steps:
        save(
            out / "ckpt" / f"step{step}",
            model,
            opt,
            step,
            {
                "dp": 1,
                "pp": 1,
                "tp": 1,
                "model": {"heads": 4},
                "job_id": job,
                "model_hash": model_hash,
            },
        )
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


@pytest.mark.parametrize(
    "damage, message",
    [
        ("flip", "does not match its sha256"),
        ("delete", "is missing"),
        ("truncate", "bytes, the manifest says"),
        ("no-manifest", "no manifest.json"),
        # a shard written elsewhere (another node's own folder), the manifest of what is here intact
        ("torn", "the DCP metadata names it"),
    ],
)
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
    elif damage == "torn":
        manifest = json.loads((newest / "manifest.json").read_text())
        shard_of(newest).unlink()
        write_manifest(newest, {k: manifest[k] for k in ("job_id", "model_hash")})
    else:
        (newest / "manifest.json").unlink()
    with pytest.raises(InputError, match=message) as info:  # inspect says what is wrong
        inspect(newest)
    assert "previous good checkpoint" in str(info.value) and "step1" in str(info.value)
    with pytest.raises(InputError, match=message):  # restore refuses it
        load(newest, *trained())
    with pytest.raises(InputError, match=message):  # and so does convert
        convert(newest, tmp_path / "converted")
    found, skipped = newest_good(out / "ckpt")  # the previous good one is what a restart takes
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
    assert newest_good(out / "ckpt", job_id="new-job", model_hash="m1")[0] == out / "ckpt" / "step9"
    found, skipped = newest_good(out / "ckpt", job_id="new-job", model_hash="other")
    assert found is None and "another model" in skipped[-1][1]
    found, skipped = newest_good(out / "ckpt", job_id="third-job")
    assert found is None and "another job (old-job)" in skipped[0][1]
    # --resume takes a run folder or a folder of checkpoints (--ckpt-dir): its newest that verifies
    from resihp.ckpt.universal import resolve

    assert resolve(out) == resolve(out / "ckpt") == out / "ckpt" / "step29"


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
    write_manifest(
        ckpt
    )  # a manifest is no signature: the files verify, the pickle must still be refused
    for use in (
        lambda: inspect(ckpt),
        lambda: load(ckpt, *trained()),
        lambda: convert(ckpt, tmp_path / "c"),
    ):
        with pytest.raises(InputError, match="refused global"):
            use()
    assert not marker.exists()


def test_ckpt_inspect_cli_names_what_is_wrong(tmp_path):
    from tests.faults import corrupt_bytes

    out, _ = saved_run(tmp_path)
    corrupt_bytes(shard_of(out / "ckpt" / "step3"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "ckpt", "inspect", str(out / "ckpt" / "step3")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert (
        "damaged checkpoint" in proc.stderr and "sha256" in proc.stderr and "step1" in proc.stderr
    )
