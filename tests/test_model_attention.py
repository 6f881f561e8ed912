"""Packed-row attention in one call (``sdpa_masked``, ``flex``) computes what one SDPA call per
document computes: outputs, gradients and the losses of a few AdamW steps, whole and tensor
parallel.

Tolerances: float32 everywhere. The one-call paths reduce each softmax row over all T keys (masked
ones contribute exact zeros) and tile the products differently from the per-document calls, so
results agree to rounding, not bit for bit: outputs and gradients to torch's float32 defaults
(rtol 1.3e-6, atol 1e-5; measured gaps are about 1e-7), the summed losses to 1e-5 relative after
the updates have carried the rounding through the optimizer.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resihp.errors import InputError
from resihp.model.attention import PackedDocs, check_attention, packed_attention
from resihp.model.config import GPTConfig
from resihp.model.gpt import GPTStage, init_by_name, lm_loss
from resihp.model.tensor_parallel import TPContext
from tests.gloo_ranks import spawn_ranks

CFG = GPTConfig(layers=2, hidden=64, heads=4, ffn_hidden=128, vocab=97, max_seq_len=128)
LENS = [
    5,
    1,
    17,
    40,
    1,
    64,
    1,
    2,
]  # length-1 documents among longer ones, T = 131 (not a block size)


def _batch(lens: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lens)
    return (
        torch.randint(0, CFG.vocab, (tokens,), generator=gen),
        torch.randint(0, CFG.vocab, (tokens,), generator=gen),
    )


def _model(kind: str, tp: TPContext | None = None) -> GPTStage:
    cfg = dataclasses.replace(CFG, attention=kind)
    model = GPTStage(cfg, tp=tp)
    init_by_name(model, 3, tp, cfg.heads)
    return model


def _train(kind: str, steps: int = 4) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per-step summed losses of ``steps`` AdamW steps on one batch, and the first gradients."""
    model = _model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, targets = _batch(LENS)
    losses, first = [], {}
    for step in range(steps):
        opt.zero_grad()
        loss = lm_loss(model(ids, LENS), targets)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, first


@pytest.mark.parametrize("kind", ["sdpa_masked", "flex"])
def test_forward_matches_per_document(kind):
    ids, _ = _batch(LENS)
    with torch.no_grad():  # flex has no backward on CPU: its forward is what can be compared here
        reference = _model("per_document")(ids, LENS)
        out = _model(kind)(ids, LENS)
    torch.testing.assert_close(out, reference)


def test_training_losses_and_gradients_match_per_document():
    reference, ref_grads = _train("per_document")
    losses, grads = _train("sdpa_masked")
    assert losses == pytest.approx(reference, rel=1e-5)
    assert losses[-1] < losses[0]  # it learnt the batch
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], msg=name)


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=8), seed=st.integers(0, 2**16))
def test_random_packings_match_per_document(lens, seed):
    gen = torch.Generator().manual_seed(seed)
    heads, dim = 2, 8
    qkv = [torch.randn(sum(lens), heads, dim, generator=gen, requires_grad=True) for _ in range(3)]
    docs = PackedDocs.of(lens, "cpu")
    weight = torch.randn(sum(lens), heads, dim, generator=gen)  # a loss that weights every output
    reference = packed_attention(*qkv, docs, "per_document")
    ref_grads = torch.autograd.grad((reference * weight).sum(), qkv)
    out = packed_attention(*qkv, docs, "sdpa_masked")
    grads = torch.autograd.grad((out * weight).sum(), qkv)
    torch.testing.assert_close(out, reference)
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref)
    with torch.no_grad():
        flex = packed_attention(*(t.detach() for t in qkv), docs, "flex")
    torch.testing.assert_close(flex, reference.detach())


def test_mask_is_document_causal():
    mask = PackedDocs.of([2, 1, 3], "cpu").causal_mask
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def _tp_body(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist

    tp = TPContext(world, rank, dist.group.WORLD)
    ids, targets = _batch(LENS)
    out = {}
    for kind in ("per_document", "sdpa_masked"):
        model = _model(kind, tp)
        loss = lm_loss(model(ids, LENS), targets)
        loss.backward()
        out[kind] = {"loss": loss.item(), "qkv_grad": model.layers["1"].qkv.weight.grad.clone()}
    return out


def test_tensor_parallel_heads_match(tmp_path):
    whole_ids, targets = _batch(LENS)
    whole = lm_loss(_model("per_document")(whole_ids, LENS), targets).item()
    ranks = spawn_ranks(_tp_body, 2, tmp_path)
    for res in ranks:
        assert res["sdpa_masked"]["loss"] == pytest.approx(whole, rel=1e-5)
        assert res["per_document"]["loss"] == pytest.approx(whole, rel=1e-5)
        torch.testing.assert_close(res["sdpa_masked"]["qkv_grad"], res["per_document"]["qkv_grad"])
    assert not torch.equal(ranks[0]["sdpa_masked"]["qkv_grad"], ranks[1]["sdpa_masked"]["qkv_grad"])


def test_the_choice_leaves_the_model_hash_alone():
    assert dataclasses.replace(CFG, attention="sdpa_masked").to_dict() == CFG.to_dict()


def test_bad_attention_value_is_one_line_input_error():
    with pytest.raises(InputError) as info:
        GPTConfig(attention="fused")
    assert str(info.value) == (
        "model.attention (--attention): expected one of per_document, "
        "sdpa_masked, flex, got 'fused'"
    )


def test_flex_training_on_cpu_is_refused_up_front():
    check_attention("per_document", "cpu")
    check_attention("sdpa_masked", "cpu")
    with pytest.raises(
        InputError,
        match=r"model.attention \(--attention\) flex: .*expected "
        "per_document or sdpa_masked",
    ) as info:
        check_attention("flex", "cpu")
    assert "\n" not in str(info.value)


def test_run_with_flex_on_cpu_exits_2_with_one_line(monkeypatch, capsys, tmp_path):
    from resihp.cli import main

    monkeypatch.setattr(
        sys,
        "argv",
        ["resihp", "run", "--attention", "flex", "--device", "cpu", "--out", str(tmp_path / "run")],
    )
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2, err
    assert err.count("\n") == 0 and "model.attention (--attention) flex" in err
    assert not (tmp_path / "run").exists()  # refused before the run folder or any rank
