"""Multi-process runs of the engine under torchrun (gloo, CPU)."""

import json

import numpy as np
import pytest

from resihp.launch.launch import launch
from resihp.opstrace import COMPUTE_OPTYPES, read_meta, read_ops_trace
from resihp.train.config import RunConfig
from resihp.train.follow import follow

SMALL = dict(
    layers=4,
    hidden=64,
    heads=2,
    ffn_hidden=128,
    vocab=256,
    global_tokens=2048,
    budget=512,
    max_len=512,
    source="text",
    steps=3,
    timeout=30,
)


def run(tmp_path, name, **kw) -> tuple[dict, "object"]:
    cfg = RunConfig.from_flags(**{**SMALL, **kw, "out": str(tmp_path / name)})
    proc = launch(cfg, timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    return summary, read_ops_trace(tmp_path / name / "ops.parquet")


def step_losses(trace) -> np.ndarray:
    steps = trace[trace.optype == "step"]
    return steps.groupby("step")["loss"].max().to_numpy()


@pytest.mark.slow
def test_layouts_train_the_same_model(tmp_path):
    """The loss curve does not depend on the parallel layout (DP, PP, Megatron TP), schedule, layer
    split or micro-batch allocation: the loss is summed over tokens and divided by the global token
    count."""
    _, single = run(tmp_path, "single", dp=1, pp=1)
    # with live re-plans mid-run: micro-batches re-allocated, layers (with AdamW state) moved
    summary, hybrid = run(
        tmp_path,
        "hybrid",
        dp=2,
        pp=2,
        schedule="1f1b",
        replan=[
            {"step": 1, "dp_weights": [3, 1], "layer_split": [3, 1]},
            {"step": 2, "layer_splits": [[1, 3], [2, 2]]},
        ],
    )  # pipelines may split differently
    _, tensor = run(tmp_path, "tensor", dp=1, pp=2, tp=2, schedule="gpipe", layer_split=[3, 1])
    reference = step_losses(single)
    assert reference[-1] < reference[0]  # it learns
    np.testing.assert_allclose(step_losses(hybrid), reference, rtol=1e-4)
    np.testing.assert_allclose(step_losses(tensor), reference, rtol=1e-4)
    assert set(tensor["tp_rank"]) == {0, 1}
    moves = hybrid[hybrid.optype == "replan-layers"]
    assert set(moves.step) == {1, 2} and moves["bytes"].sum() > 0

    # the trace follows the contract, with per-micro-batch sequence lengths on compute ops
    meta, extra = read_meta(tmp_path / "hybrid" / "job.yaml")
    assert (meta.dp_size, meta.pp_size, meta.tp_size, meta.world_size) == (2, 2, 1, 4)
    assert extra["layers"] == 4 and extra["hidden"] == 64  # model fields the detector reads
    # the side-process detector follows the finished run's streams: every step, no device fault
    found = follow(tmp_path / "hybrid", timeout_s=5)
    assert found["steps"] == 3
    assert not [e for e in found["events"] if e["kind"] in ("fail-slow", "fail-stop")]
    assert set(hybrid["rank"]) == {0, 1, 2, 3}
    compute = hybrid[hybrid.optype.isin(COMPUTE_OPTYPES)]
    assert (compute.tokens == compute.seq_lens.map(sum)).all()
    assert (compute.duration > 0).all() and compute.start_ts.notna().all()
    for optype in (
        "forward-send",
        "forward-recv",
        "backward-send",
        "backward-recv",
        "grads-all-reduce",
        "optimizer",
        "step",
    ):
        assert (hybrid.optype == optype).any(), optype
    # every micro-batch of a step ran forward and backward once on each stage of its replica
    counts = compute.groupby(["step", "stage", "mb_id", "optype"]).size()
    assert (counts == 1).all()
    assert summary["steps"] == 3 and summary["tokens_per_s"] > 0
