"""A slow link is reported as link-slow naming both ends and its traffic, never as a fail-slow;
a slow device never as a slow link (labelled traces of the detector's simulator)."""

from __future__ import annotations

import pytest

from resihp.detect.alibaba import alibaba_path
from resihp.detect.online import detect_trace
from resihp.detect.suite import DEFAULT_PROFILE
from resihp.detect.synth import CostPool, Injection, SimJob, alibaba_residuals, simulate

META = {"layers": 2, "hidden": 256, "heads": 4, "ffn_hidden": 1024}


@pytest.fixture(scope="module")
def pool() -> CostPool:
    return CostPool.from_profile(DEFAULT_PROFILE)


@pytest.fixture(scope="module")
def noise():
    return alibaba_residuals(alibaba_path(2))


def _faults(doc: dict) -> list[dict]:
    return [e for e in doc["events"] if e["kind"] in ("fail-slow", "fail-stop", "link-slow")]


@pytest.mark.parametrize(
    "traffic, dp_rank, stage, factor",
    [
        ("pipeline", 1, 2, 2.0),
        ("pipeline", 3, 0, 1.5),
        ("gradient-sync", 0, 1, 2.0),
        ("gradient-sync", 2, 3, 3.0),
    ],
)
def test_slow_link_named_by_both_ends(pool, noise, traffic, dp_rank, stage, factor):
    job = SimJob(steps=100, source="code", seed=7)
    inj = Injection("link-slow", job.rank(dp_rank, stage), 50, 99, factor, traffic)
    job = SimJob(steps=100, source="code", seed=7, injections=[inj])
    doc = detect_trace(simulate(job, pool, noise), job.meta(), meta_dict=META)
    faults = _faults(doc)
    assert [e["kind"] for e in faults] == ["link-slow"], faults
    ev = faults[0]
    assert sorted(ev["ranks"]) == sorted(inj.link_ends(job.dims)) and ev["rank"] in ev["ranks"]
    assert ev["traffic"] == traffic
    assert 50 <= ev["detected_step"] <= 55
    assert ev["slowdown"] == pytest.approx(factor, rel=0.15)


def test_slow_device_is_not_a_slow_link(pool, noise):
    job = SimJob(steps=100, source="text", seed=3)
    slow = job.rank(2, 1)
    job = SimJob(
        steps=100, source="text", seed=3, injections=[Injection("fail-slow", slow, 50, 99, 2.0)]
    )
    faults = _faults(detect_trace(simulate(job, pool, noise), job.meta(), meta_dict=META))
    assert [(e["kind"], e["rank"]) for e in faults] == [("fail-slow", slow)]
