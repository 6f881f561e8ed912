"""The distributed core inside the test process's reach: ranks spawned on gloo over a FileStore
(no torchrun). A plan change broadcast from rank 0 is checked and applied on every rank; layers move
between pipeline stages with their parameters and AdamW state; gradients are summed over whichever
stages hold a layer when replicas split their layers differently."""

import pytest
import torch

from resihp.errors import InputError
from tests.gloo_ranks import spawn_ranks

CFG = {
    "dp": 1,
    "pp": 2,
    "layers": 4,
    "hidden": 32,
    "heads": 2,
    "ffn_hidden": 64,
    "vocab": 64,
    "global_tokens": 1024,
    "budget": 256,
    "max_len": 256,
    "steps": 2,
}


def _layer_state(engine) -> dict[str, torch.Tensor]:
    """Each decoder-layer parameter of this stage and its AdamW exp_avg, by global name."""
    out = {}
    for name, p in engine.model.named_parameters():
        if name.startswith("layers."):
            out[name] = p.detach().clone()
            out[name + ":exp_avg"] = engine.optimizer.state[p]["exp_avg"].clone()
    return out


def _rank(rank: int, world: int, tmp: str) -> dict:
    from resihp.train.config import RunConfig
    from resihp.train.engine import Engine

    result: dict = {}
    engine = Engine(RunConfig.from_flags(**CFG, out=tmp), torch.device("cpu"))
    engine.train_step(0)
    result["before"] = _layer_state(engine)
    result["ranges_before"] = list(engine.ranges)
    change = engine.sync_plan(
        1, {"version": 1, "layer_split": [1, 3], "reason": "test"} if rank == 0 else None
    )
    result["change"] = change
    result["after"] = _layer_state(engine)
    result["ranges_after"] = list(engine.ranges)
    result["loss"] = engine.train_step(1).loss  # training goes on under the new split
    try:
        engine.sync_plan(2, {"version": 2, "layer_split": [4, 0]} if rank == 0 else None)
    except InputError as exc:
        result["bad_change"] = str(exc)
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("dist")
    out = spawn_ranks(_rank, 2, tmp)
    return out


def test_a_broadcast_plan_change_is_applied_on_every_rank(ranks):
    for res in ranks:
        assert res["change"]["layer_split"] == [1, 3] and res["change"]["version"] == 1
    assert ranks[0]["ranges_before"] == [(0, 2), (2, 4)]
    assert ranks[0]["ranges_after"] == ranks[1]["ranges_after"] == [(0, 1), (1, 4)]
    assert ranks[1]["loss"] is not None and torch.isfinite(torch.tensor(ranks[1]["loss"]))


def test_a_moved_layer_keeps_its_parameters_and_adam_state(ranks):
    before0, after1 = ranks[0]["before"], ranks[1]["after"]
    moved = [k for k in before0 if k.startswith("layers.1.")]
    assert moved and all(k not in ranks[0]["after"] for k in moved)
    for key in moved:
        assert torch.equal(before0[key], after1[key]), key
    for key in ranks[1]["before"]:  # the layers it held already are untouched
        assert torch.equal(ranks[1]["before"][key], after1[key]), key


def test_a_bad_plan_change_stops_every_rank_alike(ranks):
    for res in ranks:
        assert "expected 2 positive layer counts" in res["bad_change"]


def _replicas(rank: int, world: int, tmp: str) -> dict:
    from resihp.train.config import RunConfig
    from resihp.train.engine import Engine

    result: dict = {}
    engine = Engine(RunConfig.from_flags(**{**CFG, "dp": 2}, out=tmp), torch.device("cpu"))
    engine.sync_plan(0, {"version": 1, "layer_splits": [[2, 2], [1, 3]]} if rank == 0 else None)
    for step in range(2):
        engine.train_step(step)
    result["params"] = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    return result


def test_replicas_with_different_layer_splits_stay_identical(tmp_path):
    """Replica 0 holds layer 1 on stage 0, replica 1 on stage 1: its gradient is still summed over
    both, so every parameter is the same in both replicas after training steps."""
    out = spawn_ranks(_replicas, 4, tmp_path)
    # Megatron order: rank = stage * dp + dp_rank
    replica = [{**out[0]["params"], **out[2]["params"]}, {**out[1]["params"], **out[3]["params"]}]
    assert set(replica[0]) == set(replica[1]) and any(k.startswith("layers.1.") for k in replica[0])
    for name, value in replica[0].items():
        assert torch.allclose(value, replica[1][name], atol=1e-6), name
