"""A receive that waited for its sender's compute on longer sequences is not a slow link; a link
that really slowed is one, named by both ends (an ops trace of receives posted ahead, as a schedule
that overlaps communication posts them, with no send records)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from resihp.detect.online import detect_trace
from resihp.opstrace import JobMeta
from resihp.workload.flops import TransformerShape, attention_flops, linear_flops_per_token

META = {"layers": 2, "hidden": 64, "heads": 2, "ffn_hidden": 256}
SHAPE = TransformerShape(layers=2, hidden=64, heads=2, ffn_hidden=256)
DP, PP, MB, STEPS, ONSET = 2, 2, 4, 70, 40
SHORT, LONG = [128] * 8, [1024]  # one packed micro-batch: 1,024 tokens either way
SECONDS_PER_FLOP = 2e-10  # a forward of short sequences ~0.02 s, of one long one ~0.05 s
TRANSFER_S = 0.002  # a message's healthy transfer (1,024 tokens)


def _cost(lens: list[int], rng: np.random.Generator) -> float:
    tokens = float(sum(lens))
    flops = SHAPE.layers * (
        linear_flops_per_token(SHAPE) * tokens
        + attention_flops(SHAPE, float(sum(n * n for n in lens)), tokens)
    )
    return float(flops) * SECONDS_PER_FLOP * float(np.exp(rng.normal(0.0, 0.01)))


def _trace(
    long_from_onset: float, slow_link: tuple[int, float] | None, seed: int = 3
) -> pd.DataFrame:
    """Per replica and step: stage 0 runs every forward, then each backward as its gradient comes;
    stage 1 runs forward and backward of each micro-batch as it comes. Every receive is posted as
    soon as the one before it arrived (the first at the step's start); its data moves once it is
    posted and the sender has computed it (a rendezvous), then it ends. From ``ONSET`` on, a
    micro-batch holds one long sequence with probability ``long_from_onset`` (0.2 before);
    ``slow_link``: (replica, factor) of a link slowed from
    then."""
    rng = np.random.default_rng(seed)
    rows: list[dict] = []
    t = 0.0
    for step in range(STEPS):
        p_long = long_from_onset if step >= ONSET else 0.2
        step_end = t
        for d in range(DP):
            ranks = (d, DP + d)  # (dp_rank, stage) -> rank: stage * DP + dp_rank
            x = TRANSFER_S
            if slow_link and slow_link[0] == d and step >= ONSET:
                x *= slow_link[1]
            x_each = [x * float(np.exp(rng.normal(0.0, 0.02))) for _ in range(2 * MB)]
            lens = [LONG if rng.random() < p_long else SHORT for _ in range(MB)]

            def op(
                rank: int,
                stage: int,
                optype: str,
                mb: int,
                start: float,
                end: float,
                step: int = step,
                d: int = d,
                lens: list = lens,
            ) -> None:
                rows.append(
                    {
                        "step": step,
                        "rank": rank,
                        "dp_rank": d,
                        "stage": stage,
                        "optype": optype,
                        "start_ts": start,
                        "duration": end - start,
                        "mb_id": mb,
                        "seq_lens": lens[mb],
                    }
                )

            free0 = t
            ready1 = []
            for i in range(MB):  # stage 0 forwards
                c = _cost(lens[i], rng)
                op(ranks[0], 0, "forward-compute", i, free0, free0 + c)
                free0 += c
                ready1.append(free0)
            free1, ready0, posted = t, [], t  # ready: when the sender has it
            for i in range(MB):  # stage 1: receive, forward, backward
                end = max(posted, ready1[i]) + x_each[i]
                op(ranks[1], 1, "forward-recv", i, posted, end)
                posted = end
                start = max(free1, end)
                f, b = _cost(lens[i], rng), 2 * _cost(lens[i], rng)
                op(ranks[1], 1, "forward-compute", i, start, start + f)
                op(ranks[1], 1, "backward-compute", i, start + f, start + f + b)
                free1 = start + f + b
                ready0.append(free1)
            posted = t
            for i in range(MB):  # stage 0 backwards
                end = max(posted, ready0[i]) + x_each[MB + i]
                op(ranks[0], 0, "backward-recv", i, posted, end)
                posted = end
                start = max(free0, end)
                b = 2 * _cost(lens[i], rng)
                op(ranks[0], 0, "backward-compute", i, start, start + b)
                free0 = start + b
            step_end = max(step_end, free0, free1)
        t = step_end
    return pd.DataFrame(rows)


def _doc(df: pd.DataFrame) -> dict:
    meta = JobMeta(dp_size=DP, pp_size=PP, tp_size=1, world_size=DP * PP)
    return detect_trace(df, meta, meta_dict=META)


def _link_events(doc: dict) -> list[dict]:
    return [e for e in doc["events"] if e["kind"] in ("link-slow", "shared-link-slow")]


def test_wait_for_the_senders_longer_compute_is_no_link_alarm():
    df = _trace(long_from_onset=0.9, slow_link=None)
    # the receives themselves did wait longer: the wait is in the trace, not only in its model
    recv = df[df["optype"] == "forward-recv"]
    before = recv[recv["step"] < ONSET]["duration"].median()
    after = recv[recv["step"] >= ONSET]["duration"].median()
    assert after > 1.5 * before
    doc = _doc(df)
    assert _link_events(doc) == [], doc["events"]
    assert not [e for e in doc["events"] if e["kind"] in ("fail-slow", "fail-stop")], doc["events"]


def test_a_slow_link_among_longer_sequences_is_named_by_both_ends():
    df = _trace(long_from_onset=0.9, slow_link=(0, 3.0))
    events = _link_events(_doc(df))
    assert [e["kind"] for e in events] == ["link-slow"], events
    ev = events[0]
    assert sorted(ev["ranks"]) == [0, DP] and ev["traffic"] == "pipeline"
    assert ONSET <= ev["detected_step"] <= ONSET + 5
    assert ev["alarm_factor"] >= ev["alarm_floor"]
