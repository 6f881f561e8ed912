"""``resihp detect`` and ``resihp detect-eval`` as a user runs them, bad input included."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from unittest import mock

import numpy as np
import pandas as pd
import pytest

from resihp.detect.alibaba import alibaba_path
from resihp.detect.online import detect_trace
from resihp.detect.suite import DEFAULT_PROFILE
from resihp.detect.synth import CostPool, Injection, SimJob, alibaba_residuals, simulate
from resihp.opstrace import JobMeta, write_meta, write_ops_trace
from resihp.train.follow import LiveDetection
from tests.frame_steps import FrameSteps


def resihp(*args: str) -> subprocess.CompletedProcess:
    """``resihp ARGS`` in this process: the installed command's entry point (``resihp.cli.main``),
    its exit status, stdout and stderr, without a fresh interpreter and its imports per call."""
    from resihp.cli import main

    argv, out, err = ["resihp", *map(str, args)], io.StringIO(), io.StringIO()
    code = 0
    with (
        mock.patch.object(sys, "argv", argv),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def resihp_process(*args: str) -> subprocess.CompletedProcess:
    """``resihp ARGS`` as its own process."""
    return subprocess.run(
        [sys.executable, "-m", "resihp.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("detect")
    job = SimJob(
        steps=80,
        source="code",
        injections=[Injection("fail-slow", SimJob().rank(1, 3), 40, 79, 2.0)],
    )
    df = simulate(job, CostPool.from_profile(DEFAULT_PROFILE), alibaba_residuals(alibaba_path(2)))
    write_ops_trace(df, tmp / "t.parquet")
    write_ops_trace(df, tmp / "t.csv")
    write_meta(job.meta(), tmp / "meta.yaml", layers=8, hidden=256, heads=4, ffn_hidden=1024)
    return tmp, df


@pytest.mark.parametrize("name", ["t.parquet", "t.csv"])
def test_detect_json_names_the_slow_rank(trace, name):
    tmp, _ = trace
    proc = resihp("detect", tmp / name, "--meta", tmp / "meta.yaml", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["steps"] == 80 and doc["ranks"] == 16
    faults = [e for e in doc["events"] if e["kind"] == "fail-slow"]
    assert [(e["rank"], e["dp_rank"], e["stage"]) for e in faults] == [
        (13, 1, 3)
    ]  # Megatron order: rank = stage * dp + dp_rank
    assert set(faults[0]) >= {
        "kind",
        "rank",
        "dp_rank",
        "stage",
        "tp_rank",
        "onset_step",
        "detected_step",
        "slowdown",
        "confidence",
    }


def test_detect_reads_the_meta_beside_a_trace(trace, tmp_path):
    """A trace in its run folder is read with that run's job.yaml (its model fields give the
    analytic cost model) unless --meta names another."""
    tmp, _ = trace
    (tmp_path / "ops.parquet").write_bytes((tmp / "t.parquet").read_bytes())
    bare = json.loads(resihp("detect", tmp_path / "ops.parquet", "--json").stdout)
    (tmp_path / "job.yaml").write_bytes((tmp / "meta.yaml").read_bytes())
    beside = json.loads(resihp("detect", tmp_path / "ops.parquet", "--json").stdout)
    named = json.loads(
        resihp("detect", tmp / "t.parquet", "--meta", tmp / "meta.yaml", "--json").stdout
    )
    assert beside == named and beside["cost_model"] != bare["cost_model"]


def test_detect_text_output_and_baseline_and_alibaba(trace):
    tmp, _ = trace
    proc = resihp_process("detect", tmp / "t.parquet")  # once as its own process: the real command
    assert proc.returncode == 0 and "fail-slow" in proc.stdout and "rank 13" in proc.stdout
    proc = resihp("detect", tmp / "t.parquet", "--method", "relative-score", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["method"] == "relative-score"
    proc = resihp("detect", alibaba_path(1), "--input-format", "alibaba", "--json")
    assert proc.returncode == 0
    assert any(e["rank"] == 6 for e in json.loads(proc.stdout)["events"])


def test_detect_says_when_a_trace_has_too_few_steps_to_judge(trace):
    """Issue 20: 15 steps (or 12 sparsely sampled ones) gave "events": [] and no word."""
    tmp, df = trace
    full = json.loads(
        resihp("detect", tmp / "t.parquet", "--meta", tmp / "meta.yaml", "--json").stdout
    )
    assert full["judged"] is True and "note" not in full
    for name, part in [
        ("short.parquet", df[df.step < 15]),
        ("sampled.parquet", df[(df.step % 7 == 0) & (df.step < 80)]),
    ]:
        write_ops_trace(part, tmp / name)
        proc = resihp("detect", tmp / name, "--meta", tmp / "meta.yaml", "--json")
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["judged"] is False and doc["events"] == []
        assert (
            f"the trace has {doc['steps']} distinct step(s), the detector needs at least 23"
            in doc["note"]
        )
    text = resihp("detect", tmp / "short.parquet", "--meta", tmp / "meta.yaml").stdout
    assert "too few steps to judge: the trace has 15 distinct step(s)" in text


def _bad(tmp, df: pd.DataFrame, name: str = "bad.csv"):
    path = tmp / name
    df.to_csv(path, index=False)
    return path


@pytest.mark.parametrize(
    "case,fragment",
    [
        ("missing", "missing required column"),
        ("nan", "duration"),
        ("negative", "duration"),
        ("rank", "world_size"),
        ("dp", "dp_size"),
        ("moved", "more than one"),
        # each was accepted (a rank of 0.5 judged as rank 0, text in optional columns ignored) or a
        # traceback (text in start_ts; a step of 4e13 asked for a petabyte)
        ("half-rank", "column rank row 5: expected an integer, got 0.5"),
        ("text-tp-rank", "column tp_rank row 5: expected an integer, got 'a'"),
        ("text-start", "column start_ts row 5: expected a number, got 'abc'"),
        ("huge-step", "column step: at most 100,000,000"),
        # named by its file, not as "ops trace:"
        ("no-compute", "no-compute.csv: no forward-compute or backward-compute rows to analyse"),
    ],
)
def test_bad_traces_exit_2_with_one_line(trace, case, fragment):
    tmp, df = trace
    df = df[df["step"] < 20].drop(columns=["seq_lens"]).copy()
    meta = tmp / "meta.yaml"
    if case == "missing":
        df = df.drop(columns=["stage"])
    elif case == "nan":
        df.loc[df.index[5], "duration"] = np.nan
    elif case == "negative":
        df.loc[df.index[5], "duration"] = -1.0
    elif case == "rank":
        df.loc[df.index[5], "rank"] = 99
        fragment = f"99 is outside the job meta ({fragment}"
    elif case == "no-compute":
        df = df[~df["optype"].isin(["forward-compute", "backward-compute"])]
    elif case == "dp":
        write_meta(JobMeta(dp_size=2, pp_size=4, tp_size=2, world_size=16), tmp / "small.yaml")
        meta = tmp / "small.yaml"
    elif case == "moved":
        df.loc[df.index[5], "stage"] = (df.loc[df.index[5], "stage"] + 1) % 4
    elif case == "half-rank":
        df["rank"] = df["rank"].astype(float)
        df.loc[df.index[5], "rank"] = 0.5
    elif case in ("text-tp-rank", "text-start"):
        col = {"text-tp-rank": "tp_rank", "text-start": "start_ts"}[case]
        df[col] = df.get(col, pd.Series(0, index=df.index)).astype(object)
        df.loc[df.index[5], col] = "a" if case == "text-tp-rank" else "abc"
    elif case == "huge-step":
        df.loc[df.index[5], "step"] = 39 * 10**12
    proc = resihp("detect", _bad(tmp, df, f"{case}.csv"), "--meta", meta)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("resihp: error:") and fragment in lines[0], lines
    assert "Traceback" not in proc.stderr
    if case == "rank":  # named by its file, not as "ops trace:"
        assert "rank.csv: column rank row " in lines[0], lines


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["nope.parquet"], "no such ops trace"),
        (["{t}", "--method", "magic"], "--method"),
        (["{t}", "--input-format", "xml"], "--input-format"),
        (["{t}", "--meta", "nope.yaml"], "cannot read job meta"),
        (["{t}", "--predictor", "models/none", "--meta", "{m}"], "not a predictor directory"),
        (["{t}", "--sensitivity", "inf"], "sensitivity must be a positive finite number, got inf"),
    ],
)
def test_bad_options_exit_2(trace, args, fragment):
    tmp, _ = trace
    args = [a.format(t=tmp / "t.parquet", m=tmp / "meta.yaml") for a in args]
    proc = resihp("detect", *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert fragment in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("title\nline one\nsee, the\n", "not a CSV Alibaba mini-batch file"),
        ("", "not a CSV Alibaba mini-batch file"),
        ("worker,time\n1,2\n", "expected columns worker, time, batch_time_norm"),
        (
            "worker,time,batch_time_norm\n1,2,3\nx,3,4\n",
            "column worker row 1: 'x' is not an integer",
        ),
        (
            "worker,time,batch_time_norm\n1,2,fast\n",
            "column batch_time_norm row 0: 'fast' is not a number",
        ),
    ],
)
def test_a_bad_alibaba_file_is_one_line(tmp_path, text, fragment):
    bad = tmp_path / "bad.csv"
    bad.write_text(text)
    proc = resihp("detect", bad, "--input-format", "alibaba")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and fragment in lines[0], lines


def test_the_predictor_option_has_one_name_across_verbs_and_the_old_one_still_works(trace):
    # ``--model`` is a model YAML in ``resihp plan``; a predictor is ``--predictor`` everywhere
    tmp, _ = trace
    for verb in (
        ["detect", tmp / "t.parquet", "--meta", tmp / "meta.yaml"],
        ["detect-eval", "--quick"],
    ):
        assert "--predictor" in resihp(*verb[:1], "--help").stdout
        old = resihp(*verb, "--model", "models/none")
        assert old.returncode == 2 and "--model is now --predictor" in old.stderr, old.stderr
        both = resihp(*verb, "--model", "a", "--predictor", "b")
        assert both.returncode == 2, both.stderr
        assert "--model is the old name of --predictor: give one of them" in both.stderr


def test_detect_eval_quick_json():
    proc = resihp("detect-eval", "--quick", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc["methods"]) == {
        "resihp",
        "raw-threshold",
        "relative-score",
        "iteration-changepoint",
    }
    ours = doc["methods"]["resihp"]
    assert ours["recall"] >= 0.8 and ours["fp"] <= 1
    assert ours["slowdown_error_median"] < 0.1
    proc = resihp("detect-eval", "--quick", "--drop", "bogus")
    assert proc.returncode == 2 and "--drop" in proc.stderr


def _relaid_trace() -> tuple[pd.DataFrame, SimJob, int]:
    """A run's trace across a live re-plan that re-formed its layout at step 60 (``replan-layout``):
    DP 2 x PP 4 with a rank 2x slow from step 35, then DP 4 x PP 2 (every rank in a new place,
    twice the layers per stage)."""
    slow = SimJob(dp=2, pp=4).rank(1, 1)
    first = SimJob(
        dp=2,
        pp=4,
        steps=60,
        source="code",
        seed=5,
        injections=[Injection("fail-slow", slow, 35, 59, 2.0)],
    )
    second = SimJob(dp=4, pp=2, steps=60, source="code", seed=6)
    pool, noise = CostPool.from_profile(DEFAULT_PROFILE), alibaba_residuals(alibaba_path(2))
    before, after = simulate(first, pool, noise), simulate(second, pool, noise)
    after["step"] += 60
    mark = (
        after[(after["rank"] == 0) & (after["step"] == 60)]
        .iloc[[0]]
        .assign(optype="replan-layout", duration=0.01)
    )
    return pd.concat([before, mark, after], ignore_index=True), first, slow


def _device_faults(doc: dict) -> list[tuple]:
    return [
        (e["kind"], e["rank"], e["stage"], e["onset_step"], e["detected_step"])
        for e in doc["events"]
        if e["kind"] in ("fail-slow", "fail-stop", "link-slow")
    ]


def test_a_trace_whose_ranks_took_new_places_live_is_judged_layout_by_layout(tmp_path):
    """A run folder after a live re-plan that re-formed the layout: ranks in new places with other
    work. Each layout is observed with baselines learned in it; the old layout's fault is found, and
    the new layout's doubled work per stage is no fault (the trace was refused: a rank in two
    places; and a re-formed run's deeper pipeline was outside its job meta)."""
    df, first, slow = _relaid_trace()
    write_ops_trace(df, tmp_path / "ops.parquet")
    write_meta(first.meta(), tmp_path / "job.yaml")
    done = resihp("detect", tmp_path, "--json")
    assert done.returncode == 0, done.stderr
    cli = json.loads(done.stdout)
    assert "ranks took new places at step(s) 60" in cli["warnings"][-1]
    for doc in (detect_trace(df, first.meta()), cli):
        [(kind, rank, stage, onset, found)] = _device_faults(doc)
        assert (kind, rank, stage) == ("fail-slow", slow, 1) and 33 <= onset <= 37 and found < 60


def test_following_a_job_across_a_live_re_form_judges_each_layout_on_its_own():
    """``resihp follow`` (``LiveDetection``) over the same records as they arrive: the same finding,
    none after the re-form (it kept one detector, whose old places refused the new ones)."""
    df, first, slow = _relaid_trace()

    follow = LiveDetection(None, source=FrameSteps(df, first.meta()))
    while not follow.steps.finished():
        follow.poll()
    [(kind, rank, stage, onset, found)] = _device_faults({"events": follow.events})
    assert (kind, rank, stage) == ("fail-slow", slow, 1) and 33 <= onset <= 37 and found < 60


@pytest.mark.parametrize("where", ["ops.jsonl", "ranks/rank0.jsonl"])
def test_a_run_folders_streams_are_read_and_a_damaged_line_is_one_line(trace, where, tmp_path):
    """A run folder with only its JSON-lines stream (a job stopped before its ops.parquet; the node
    0 stream or a rank's) is judged from it; a damaged complete line in it is one line naming the
    file and line (it was a JSONDecodeError traceback from detect and follow)."""
    import json

    tmp, df = trace
    folder = tmp_path / "run"
    (folder / "ranks").mkdir(parents=True)
    (folder / "job.yaml").write_text((tmp / "meta.yaml").read_text())
    rows = [
        {k: (v.item() if hasattr(v, "item") else v) for k, v in r.items() if v == v}
        for r in df.to_dict("records")
    ]
    for r in rows:
        if isinstance(r.get("seq_lens"), (list, tuple)) or hasattr(r.get("seq_lens"), "tolist"):
            r["seq_lens"] = list(map(int, r["seq_lens"]))
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (folder / where).write_text(text)
    good = resihp("detect", folder, "--json")
    assert good.returncode == 0, good.stderr
    assert [e["rank"] for e in json.loads(good.stdout)["events"]] == [SimJob().rank(1, 3)]
    lines = text.splitlines(keepends=True)
    (folder / where).write_text(
        "".join(lines[:5]) + '{"step": 3, "rank": 0, trunc\n' + "".join(lines[5:])
    )
    # follow in this process: --nice 0, or it would lower the priority of pytest and every later
    # test
    for verb in (["detect", folder], ["follow", folder, "--start-timeout", "3", "--nice", "0"]):
        bad = resihp(*verb)
        assert bad.returncode == 2, bad
        assert bad.stderr.strip().splitlines() == [
            f"resihp: error: {folder / where}:6: expected one op record (a JSON object) "
            "per line, got "
            '\'{"step": 3, "rank": 0, trunc\''
        ], bad.stderr


def test_following_a_file_is_one_line_at_once(tmp_path):
    """A file where the run folder goes: one line at once (it waited --start-timeout, 600 s by
    default, for a job.yaml that could never appear)."""
    (tmp_path / "afile").write_text("x")
    proc = resihp(
        "follow", tmp_path / "afile", "--nice", "0"
    )  # in this process: keep pytest's priority
    assert proc.returncode == 2 and "a file, not a run folder" in proc.stderr, proc.stderr
