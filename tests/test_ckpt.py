"""Universal checkpoints: save tensor-parallel shards, join them, load into another layout."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resihp.ckpt.universal import convert, inspect, load, state_of
from resihp.errors import InputError
from resihp.runtime.model import GPTConfig, GPTStage, init_by_name, lm_loss
from resihp.runtime.tensor_parallel import TPContext

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
