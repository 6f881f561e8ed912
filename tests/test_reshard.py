"""Universal resharding: a checkpoint written at (dp, pp, tp) = (2, 1, 2) loads into other layouts
(another pipeline depth, uneven splits, another tensor-parallel size, more replicas) with its model
and AdamW state bitwise what was saved, and training goes on with the uninterrupted run's losses.
The model has every option that breaks resharding elsewhere: a fused QKV and a fused SwiGLU
gate/up, a vocabulary (61) padded to a multiple of tp, and the embedding tied to the LM head across
the first and last stage. Four ranks spawned on gloo over a FileStore, one Engine per layout."""

from pathlib import Path

import pytest
import torch

from resihp.errors import InputError
from tests.gloo_ranks import spawn_ranks

BASE = {
    "layers": 4,
    "hidden": 32,
    "heads": 4,
    "ffn_hidden": 64,
    "vocab": 61,
    "global_tokens": 1024,
    "budget": 256,
    "max_len": 256,
    "steps": 6,
    "lr": 1e-2,
    "mlp": "swiglu",
    "tie_embeddings": True,
    "vocab_parallel": True,
}
SAVED_AT = {"dp": 2, "pp": 1, "tp": 2}
SAVE_STEP = 2  # the checkpoint holds the state after step 2; steps 3, 4, 5 are compared
LAYOUTS = {
    "1x2x2": {"dp": 1, "pp": 2, "tp": 2},
    "4x1x1": {"dp": 4, "pp": 1, "tp": 1},
    "1x1x4": {"dp": 1, "pp": 1, "tp": 4},
    "1x4x1": {"dp": 1, "pp": 4, "tp": 1},
    "2x2x1-split3,1": {"dp": 2, "pp": 2, "tp": 1, "layer_split": [3, 1]},
}


def _losses(engine, steps) -> list[float | None]:
    return [engine.train_step(s).loss for s in steps]


def _rank(rank: int, world: int, tmp: str) -> dict:
    from resihp.ckpt.universal import save
    from resihp.train.config import RunConfig
    from resihp.train.elastic import checkpoint_meta, rank_tensors, resume
    from resihp.train.engine import Engine

    result: dict = {}
    cfg = RunConfig.from_flags(**BASE, **SAVED_AT, out=tmp)
    engine = Engine(cfg, torch.device("cpu"))
    _losses(engine, range(SAVE_STEP + 1))
    save(
        Path(tmp) / "saved",
        engine.model,
        engine.optimizer,
        SAVE_STEP,
        checkpoint_meta(engine, cfg),
        engine.tp,
        engine.model_cfg,
        rank_tensors(engine),
    )
    result["reference"] = _losses(engine, range(SAVE_STEP + 1, cfg.train.steps))
    for name, layout in LAYOUTS.items():
        new = RunConfig.from_flags(**BASE, **layout, out=tmp, resume=str(Path(tmp) / "saved"))
        engine = Engine(new, torch.device("cpu"))
        resumed = resume(engine, new, Path(tmp) / "saved", SAVE_STEP + 1)
        # what this layout holds now, written back: must be what was saved
        save(
            Path(tmp) / name,
            engine.model,
            engine.optimizer,
            SAVE_STEP,
            checkpoint_meta(engine, new),
            engine.tp,
            engine.model_cfg,
        )
        result[name] = _losses(engine, range(SAVE_STEP + 1, new.train.steps))
        result[name + ":decisions"] = resumed.decisions
    return result


@pytest.fixture(scope="module")
def resharded(tmp_path_factory) -> tuple[Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("reshard")
    out = spawn_ranks(_rank, 4, tmp)
    return Path(tmp), out


def _global_loss(ranks: list[dict], key: str) -> list[float]:
    per_rank = [r[key] for r in ranks if all(v is not None for v in r[key])]
    assert per_rank, f"no rank reported the losses of {key}"
    return per_rank[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_state_loaded_into_another_layout_is_bitwise_what_was_saved(resharded, layout):
    from resihp.ckpt.universal import read_full

    tmp, _ = resharded
    saved, loaded = read_full(tmp / "saved"), read_full(tmp / layout)
    tensors = [k for k in saved if k.startswith(("model.", "optim."))]
    assert any(".gate_up." in k for k in tensors) and "model.embed.weight" in tensors
    assert "model.head.weight" not in tensors  # tied: saved once, as the embedding
    assert saved["model.embed.weight"].shape == (BASE["vocab"], BASE["hidden"])  # no padding rows
    assert sorted(k for k in loaded if k.startswith(("model.", "optim."))) == sorted(tensors)
    for key in tensors:
        assert torch.equal(saved[key], loaded[key]), key


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_goes_on_with_the_uninterrupted_losses(resharded, layout):
    _, ranks = resharded
    reference, resumed = _global_loss(ranks, "reference"), _global_loss(ranks, layout)
    assert len(resumed) == 3
    for a, b in zip(reference, resumed):
        assert abs(a - b) <= 1e-5 * abs(a), (layout, reference, resumed)


@pytest.mark.slow
def test_non_tensor_state_follows_its_rule(resharded):
    _, ranks = resharded
    rules = {d["key"]: d["rule"] for d in ranks[0]["1x1x4:decisions"]}
    assert rules["data.cursor"] == "kept" and rules["data.seed"] == "kept"
    assert rules["data.dp_weights"] == "re-derived" and rules["layer_splits"] == "re-derived"
    assert (
        rules["rng.torch"] == "re-derived"
    )  # another layout: no rank's stream maps onto a new rank


def test_a_changed_data_stream_is_refused_with_the_flag_to_resume_with():
    from resihp.ckpt.reshard_rules import decide, state_of_run

    saved = state_of_run(
        0, "text", 1024, 256, 256, [1.0, 1.0], [[4], [4]], 1e-2, {"dp": 2, "pp": 1, "tp": 2}
    )
    same = state_of_run(0, "text", 1024, 256, 128, [1.0], [[4]], 1e-3, {"dp": 1, "pp": 1, "tp": 4})
    rules = {d["key"]: d["rule"] for d in decide(saved, same)}
    assert rules["data.budget"] == "re-derived" and rules["optim.lr"] == "re-derived"
    assert rules["rng.torch"] == "re-derived"
    assert {d["key"]: d["rule"] for d in decide(saved, saved)}["rng.torch"] == "kept"
    other = state_of_run(0, "text", 2048, 256, 256, [1.0], [[4]], 1e-2, {"dp": 1, "pp": 1, "tp": 4})
    with pytest.raises(
        InputError,
        match=(
            "written with --global-tokens 1024, this run has 2048.*resume with --global-tokens 1024"
        ),
    ):
        decide(saved, other, "ckpt/step9")
    older = {k: v for k, v in saved.items() if not k.startswith("data.")}
    assert {d["key"]: d["rule"] for d in decide(older, other)}["data.global_tokens"].startswith(
        "unchecked"
    )
