"""A slow link in a real 4-process job (DP 2 x PP 2, gloo, CPU): the live detector names it as a
link-slow (both ends, the traffic), never a fail-slow of either end; the planner prices the link
and the job applies the new plan live (around a slow pipeline link fewer micro-batches for its
replica, or none; around a slow data-parallel link a new placement that takes the link out of use),
and the time the link's ends spend in its transfers falls back."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from resihp.detect.config import DetectorConfig
from resihp.launch.live import LiveLoop
from resihp.launch.supervisor import supervise
from resihp.opstrace import read_ops_trace
from resihp.train.config import RunConfig
from resihp.train.worker import step_table, write_job_files

JOB = dict(
    layers=4,
    hidden=64,
    heads=2,
    ffn_hidden=256,
    vocab=512,
    dp=2,
    pp=2,
    global_tokens=8192,
    budget=512,
    max_len=512,
    source="text",
)
ONSET, FACTOR = 10, 100
# the ops that move each traffic's bytes over the link (the injected delay is in these)
TRANSFERS = {
    "pipeline": ("forward-send", "forward-recv", "backward-send", "backward-recv"),
    "gradient-sync": ("grads-all-reduce",),
}


def _run(tmp_path, inject: str, steps: int) -> tuple[LiveLoop, dict, pd.DataFrame]:
    cfg = RunConfig.from_flags(**JOB, steps=steps, inject=[inject], out=str(tmp_path))
    loop = LiveLoop(cfg, detector_config=DetectorConfig(calibration_steps=8))
    outcome = supervise(cfg, on_steps=loop.on_steps)
    assert outcome.error is None, outcome.error
    loop.save()
    write_job_files(cfg, tmp_path)
    applied = {c["id"]: c["step"] for c in json.loads((tmp_path / "plan_changes.json").read_text())}
    return loop, applied, read_ops_trace(tmp_path / "ops.parquet")


def _link_s(
    trace: pd.DataFrame, ends: tuple[int, int], traffic: str, first: int, last: int
) -> float:
    """Median over steps ``first..last - 1`` of the seconds the link's two ends spent in its
    traffic's transfers (0 in a step where neither end has any: the link out of use)."""
    ops = trace[trace["rank"].isin(ends) & trace["optype"].isin(TRANSFERS[traffic])]
    per_step = ops.groupby("step")["duration"].sum().reindex(range(first, last), fill_value=0.0)
    return float(np.median(per_step))


@pytest.mark.slow
@pytest.mark.parametrize(
    "ends, traffic, steps", [((0, 2), "pipeline", 24), ((0, 1), "gradient-sync", 24)]
)
def test_slow_link_is_named_and_replanned(tmp_path, monkeypatch, ends, traffic, steps):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    loop, applied, trace = _run(
        tmp_path, f"link:ranks={ends[0]}+{ends[1]},factor={FACTOR},step={ONSET}", steps
    )
    assert loop.error is None, loop.error
    links = [e for e in loop.events if e["kind"] == "link-slow"]
    assert len(links) == 1, loop.events
    ev = links[0]
    assert sorted(ev["ranks"]) == list(ends) and ev["rank"] in ends and ev["traffic"] == traffic
    # within the detector's own promise (``detect_within``). Not 5: in the gradient-sync case the
    # unslowed end's own collective time spans 1-13 ms over its 8 calibration steps on 2 shared
    # cores, so its CUSUM, which must alarm too, needed 6 or 7 steps in 4 of 16 runs (at a861868
    # too)
    assert ONSET <= ev["detected_step"] <= ONSET + DetectorConfig().detect_within
    # the planner re-planned for the link (priced at the transfers measured), and the job applied
    # it live: around a slow data-parallel link, an end trades places with the other stage of its
    # pipeline (a new layout, its state moved without a restart)
    change = loop.changes[0]
    assert change["reason"]["ranks"] == ev["ranks"]
    assert change["applied"] is True, change
    step = applied[change["id"]]
    # never a fail-slow of either end; none at all until the new plan has run a few steps (later,
    # on 2 shared cores, a millisecond op can be held up by the scheduler: not this test's subject)
    slow = [e for e in loop.events if e["kind"] == "fail-slow"]
    assert not [e for e in slow if e["rank"] in ends or e["detected_step"] <= step + 3], slow
    if traffic == "pipeline":
        # the replica behind the slow link gets fewer micro-batches, or leaves the job (its ranks
        # hot spares) where the planner prices that cheaper: a transfer also costs the runtime's
        # measured overhead per send/recv (``ClusterSpec.p2p_overhead_s``)
        pipes = (change.get("layout") or {}).get("pipelines") or [[[0], [2]], [[1], [3]]]
        behind = sum(
            w for p, w in zip(pipes, change["dp_weights"]) if {p[0][0], p[-1][0]} == set(ends)
        )
        assert behind < 0.5 * sum(change["dp_weights"]), change
    else:  # the link's ends share no gradient reduction and no pipeline boundary any more
        pipes = change["layout"]["pipelines"]
        groups = [{p[s][0] for p in pipes} for s in range(2)]
        assert set(ends) not in groups and set(ends) not in [{p[0][0], p[1][0]} for p in pipes], (
            pipes
        )
    # and the link costs less: its ends spend less time in its transfers once the plan is in force.
    # Not the job's throughput: in the gradient-sync case the slowed collective is a small part of
    # a step whose compute swings +-50% on 2 shared cores, and a run here under load measured the
    # few slowed steps faster than the ones after (20,305 against 19,215 tokens/s)
    during = _link_s(trace, ends, traffic, ONSET, step)
    after = _link_s(trace, ends, traffic, step + 1, steps)
    assert after < 0.5 * during, (during, after)
    assert step_table(trace).index.max() == steps - 1  # every step trained
