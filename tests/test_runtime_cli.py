"""``resihp run``: bad input exits 2 with one line; injected faults really happen; nothing hangs."""

import json
import os
import subprocess
import sys

import pytest

from resihp.errors import InputError
from resihp.opstrace import read_ops_trace
from resihp.train.inject import FaultInjector, carried_faults, parse_fault
from tests.replica_replay import replay_membership

SMALL = [
    "--layers",
    "4",
    "--hidden",
    "64",
    "--heads",
    "2",
    "--ffn-hidden",
    "128",
    "--vocab",
    "256",
    "--global-tokens",
    "2048",
    "--budget",
    "512",
    "--max-len",
    "512",
    "--timeout",
    "30",
]
SMALL_FLAGS = dict(
    layers=4,
    hidden=64,
    heads=2,
    ffn_hidden=128,
    vocab=256,
    global_tokens=2048,
    budget=512,
    max_len=512,
    dp=2,
    pp=2,
)  # SMALL's model and data, in the default layout (DP 2 x PP 2)


def resihp(*args, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "resihp.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dp", "0"], "parallel.dp (--dp): expected an integer >= 1, got 0"),
        (["--pp", "5"], "cannot split 4 layers into 5 non-empty stages"),
        (["--inject", "slow:rank=4,factor=2,step=1"], "no such rank 4 (the world has ranks 0..3)"),
        (["--inject", "slow:rank=1,factor=0.5,step=1"], "factor must be >= 1"),
        (["--inject", "melt:rank=1"], "expected slow:rank=R"),
        (
            ["--inject", "slow:rank=1,factor=inf,step=1"],
            "factor must be >= 1 (a finite number), got inf",
        ),
        (["--inject", "slow:rank=1,rank=2,factor=2,step=1"], "field rank= given twice"),
        (
            ["--steps", "4", "--inject", "stop:rank=1,step=4"],
            "the run's steps are 0..3 (--steps 4): it would never be injected",
        ),
        (["--layer-split", "3,3"], "expected 2 positive layer counts summing to 4"),
        (["--dp-weights", "1,x"], "--dp-weights '1,x'"),
        (
            ["--hidden", "8192", "--ffn-hidden", "32768", "--heads", "64", "--layers", "64"],
            "model too large",
        ),
        (["--source", "nowhere.txt"], "--source 'nowhere.txt': not a file and not one of"),
        (["--seed", "-1"], "train.seed (--seed): expected an integer >= 0, got -1"),
        (
            ["--schedule", "zigzag"],
            "parallel.schedule (--schedule): expected one of 1f1b, gpipe, got 'zigzag'",
        ),
        (["--lr", "inf"], "train.lr (--lr): expected a finite number, got inf"),
        (["--lr", "nan"], "train.lr (--lr): expected a finite number, got nan"),
        (["--steps", "1000000000"], "train.steps (--steps): at most 100,000,000, got 1000000000"),
        (["--timeout", "1e12"], "faults.timeout_s (--timeout): at most 604,800"),
        (["--if-busy", "share"], "--if-busy: expected fail or subfolder, got 'share'"),
        (["--lr", "0"], "train.lr (--lr): expected a number > 0, got 0.0"),
        (
            ["--recovery", "sometimes"],
            "faults.recovery (--recovery): expected one of auto, none, restart, replica, "
            "replica-drop, got 'sometimes'",
        ),
        (
            ["--heartbeat-timeout", "inf"],
            "faults.heartbeat_timeout_s (--heartbeat-timeout): expected a finite number, got inf",
        ),
        (
            ["--calibration-steps", "2"],
            "live.calibration_steps (--calibration-steps): expected an integer >= 3, got 2",
        ),
        (
            ["--min-slowdown", "0.5"],
            "live.min_slowdown (--min-slowdown): expected a number >= 1, got 0.5",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, monkeypatch, capsys):
    from resihp.cli import main

    monkeypatch.setattr(sys, "argv", ["resihp", "run", *args])
    with pytest.raises(SystemExit) as exit_info:
        # in-process: the same entry point as the installed command, without a torch import each
        main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("bad", [["--source", "nowhere.txt"], ["--seed", "-1"]])
def test_bad_input_leaves_the_run_folder_it_names_as_it_was(bad, tmp_path, monkeypatch, capsys):
    """A finished run's folder named again with a bad option: nothing in it changes (the run folder
    was taken, its run.json marked failed and its trace stream removed, before the options were
    checked)."""
    from resihp.cli import main

    out = tmp_path / "done"
    (out / "logs").mkdir(parents=True)
    files = {
        "run.json": '{"state": "done"}',
        "summary.json": '{"losses": [1.0]}',
        "ops.jsonl": "{}\n",
        "config.json": "{}",
        "logs/workers.log": "step 0\n",
    }
    for name, text in files.items():
        (out / name).write_text(text)
    monkeypatch.setattr(sys, "argv", ["resihp", "run", "-o", str(out), *bad])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2, capsys.readouterr().err
    assert {name: (out / name).read_text() for name in files} == files
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == sorted([*files, "logs"])


def test_slow_fault_stretches_compute_from_its_step_until_recovery():
    import time

    inj = FaultInjector(
        [
            parse_fault("slow:rank=1,factor=3,step=2,until=4"),
            parse_fault("slow:rank=0,factor=9,step=0"),
        ],
        rank=1,
    )
    factors = []
    for step in range(5):
        inj.begin_step(step)
        factors.append(inj.slow_factor())
    assert factors == [1, 1, 3, 3, 1]
    inj.begin_step(2)
    t0 = time.perf_counter()
    inj.stretch(0.05)
    assert 0.1 <= time.perf_counter() - t0 < 0.2  # (factor - 1) x the op's own time


def test_fault_spec_parsing():
    f = parse_fault("slow:rank=2,factor=2.5,step=7,until=9")
    assert (f.kind, f.rank, f.factor, f.step, f.until) == ("slow", 2, 2.5, 7, 9)
    assert parse_fault("stop:rank=1,time=3.5").time_s == 3.5
    during = parse_fault("stop:rank=0,during=restore")
    assert during.during == "restore" and during.step is None
    assert FaultInjector([during], rank=0)._started(during, 99) is False  # never a step's fault
    publish = parse_fault(
        "stop:rank=3,step=10,during=publish"
    )  # after step 10's update, unpublished
    assert (publish.step, publish.during) == (10, "publish")
    assert (
        FaultInjector([publish], rank=3)._started(publish, 10) is False
    )  # not at the step's start
    for bad, said in (
        ("stop:rank=0,during=step", "during= is for stop only"),
        ("hang:rank=0,during=restore", "during= is for stop only"),
        ("stop:rank=0,step=2,during=restore", "exactly one of step= or time= or during="),
        ("stop:rank=0,during=publish", "during=publish needs step=S"),
        ("stop:rank=0,time=2,during=publish", "during=publish needs step=S"),
    ):
        with pytest.raises(InputError, match=said):
            parse_fault(bad)


@pytest.mark.parametrize(
    "text",
    [
        "slow:rank=2,factor=2.5,step=7,until=9",
        "link:ranks=0+3,factor=4.0,step=2",
        "stop:rank=1,time=3.5",
        "stop:rank=0,during=restore",
        "stop:rank=3,step=10,during=publish",
        "hang:rank=3,step=4,how=stop",
        "error:rank=2,step=0",
    ],
)
def test_a_fault_spec_parses_back_to_the_same_fault(text):
    fault = parse_fault(text)
    assert parse_fault(fault.spec()) == fault


def test_faults_ahead_of_a_relaunch_are_carried_to_the_survivors_new_numbers():
    faults = [
        parse_fault(t)
        for t in (
            "stop:rank=3,step=3",
            "stop:rank=0,step=6",
            "hang:rank=2,step=7,how=stop",
            "error:rank=1,step=1",
            "stop:rank=2,time=9",
            "slow:rank=1,factor=3,step=1",
            "slow:rank=2,factor=2,step=0,until=2",
            "link:ranks=2+3,factor=5,step=4",
            "link:ranks=0+2,factor=5,step=4",
        )
    ]
    # survivors 0, 1, 2 from step 2: the later stop and hang, and the slowdown of rank 1 still in
    # force (from step 2); not the earlier error, the lost rank's stop or link, a fault by wall
    # time, nor a slowdown over by step 2
    assert [f.spec() for f in carried_faults(faults, [0, 1, 2], 2)] == [
        "stop:rank=0,step=6",
        "hang:rank=2,step=7,how=stop",
        "slow:rank=1,factor=3.0,step=2",
        "link:ranks=0+2,factor=5.0,step=4",
    ]
    assert [f.spec() for f in carried_faults(faults, [1, 2], 6)] == [
        "hang:rank=1,step=7,how=stop",
        "slow:rank=0,factor=3.0,step=6",
    ]


def older_job_checkpoint(directory):
    """A complete, verifying checkpoint of the same model written by another job."""
    import torch

    from resihp.ckpt.universal import save
    from resihp.train.config import RunConfig

    cfg = RunConfig.from_flags(layers=4, hidden=64, heads=2, ffn_hidden=128, vocab=256, max_len=512)
    model = torch.nn.Linear(2, 2)
    save(
        directory,
        model,
        torch.optim.AdamW(model.parameters()),
        29,
        {"dp": 2, "pp": 2, "tp": 1, "job_id": "older-job", "model_hash": cfg.model_hash()},
    )


@pytest.fixture(scope="module")
def clean_losses(tmp_path_factory):
    """The failure-free run the re-formed DP 2 x PP 2 runs below are checked against."""
    out = tmp_path_factory.mktemp("clean") / "run"
    clean = resihp("run", *SMALL, "--steps", "8", "--recovery", "none", "--out", str(out), "--json")
    assert clean.returncode == 0, clean.stderr
    # nothing to alarm the user: each warm agent ran ``resihp.cli`` again as ``__mp_main__``, and
    # runpy warned on the terminal that it was loaded already (``launch/warm_server.py``)
    assert "Warning" not in clean.stderr and "Traceback" not in clean.stderr, clean.stderr
    return json.loads(clean.stdout)["losses"]


@pytest.mark.slow
def test_stopped_rank_is_excluded_and_its_replica_re_formed_by_the_planner_with_the_same_math(
    tmp_path, clean_losses
):
    """DP 2 x PP 2 loses rank 3: the planner re-forms the survivors around it (its replica's other
    rank kept at work), the relaunch reshards the checkpoint into that layout before its first
    step, and every step's loss equals a failure-free run's."""
    out = tmp_path / "stop"
    older_job_checkpoint(out / "ckpt" / "step29")  # an earlier job's, newer-numbered: never taken
    proc = resihp(
        "run",
        *SMALL,
        "--steps",
        "8",
        "--inject",
        "stop:rank=3,step=5",
        "--ckpt-every",
        "2",
        "--out",
        str(out),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["plan_changes"][0]["skipped"] == ["step29: written by another job (older-job)"]
    assert summary["failure"]["kind"] == "fail-stop" and summary["failure"]["rank"] == 3
    assert summary["failure"]["step"] == 5
    change = summary["plan_changes"][0]
    assert change["kind"] == "exclude" and change["applied"] is True
    assert change["ranks"] == [0, 1, 2]  # the relaunch's ranks 0, 1, 2 are these old ones
    pipelines = change["layout"]["pipelines"]
    assert sorted(r for p in pipelines for s in p for r in s) == [0, 1, 2]  # no survivor left idle
    assert len(pipelines) == 2  # the lost rank's replica goes on
    assert [sum(split) for split in change["layer_splits"]] == [4, 4] and sum(
        change["dp_weights"]
    ) == 4
    assert {"rank": 3, "excluded": True} in change["plan"]["ranks"] and change[
        "predicted_step_s"
    ] > 0
    assert change["resumed_step"] == 4 and summary["steps"] == 8
    # the planner's costs paced on the launch's healthy steps 1-4, its estimate checked on steps 5-7
    assert (
        change["planner_calibration"]["steps"] == 4 and change["planner_calibration"]["factor"] > 0
    )
    assert change["measured_steps"] == 3
    assert change["step_error"] == pytest.approx(
        change["predicted_step_s"] / change["measured_step_s"] - 1, abs=1e-3
    )
    before = read_ops_trace(out / "ops.parquet")  # what the ranks recorded before the stop is kept
    after = read_ops_trace(out / "restart" / "ops.parquet")
    assert before[before["rank"] == 3].step.max() == 4 and set(before["rank"]) == {0, 1, 2, 3}
    assert set(after["rank"]) == {0, 1, 2} and sorted(set(after.step)) == [4, 5, 6, 7]
    assert after[after.optype == "replan-layout"].step.unique().tolist() == [
        4
    ]  # before its first step
    # the layout applied is the planner's: each rank's stage and replica in the restart's trace
    work = after[(after.optype == "forward-compute") & (after.step == 5)]
    placed = {(int(r.dp_rank), int(r.stage)): int(r.rank) for r in work.itertuples()}
    assert placed == {
        (d, st): stage[0] for d, p in enumerate(pipelines) for st, stage in enumerate(p)
    }
    reference = clean_losses
    step_loss = lambda t: t[t.optype == "step"].groupby("step").loss.max()  # noqa: E731
    assert summary["losses"] == list(step_loss(before).loc[:3]) + list(step_loss(after))
    assert len(summary["losses"]) == 8 and all(
        abs(a - b) <= 1e-5 * abs(b) for a, b in zip(summary["losses"], reference)
    )
    leftover = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""  # no worker outlives the command


@pytest.mark.slow
def test_a_second_death_in_the_relaunch_is_re_formed_around_in_turn(tmp_path, clean_losses):
    """Rank 3 dies at step 3 and, in the relaunch the survivors re-formed into, old rank 0 dies at
    step 6 (its stop carried into the relaunch, renumbered): the relaunch is re-formed around it in
    turn from its own newest checkpoint, two ranks finish the run, and every step's loss equals the
    failure-free run's. The checkpoints go to a folder of their own (``--ckpt-dir``), each
    relaunch's below it."""
    out, ckpts = tmp_path / "twice", tmp_path / "checkpoints"
    proc = resihp(
        "run",
        *SMALL,
        "--steps",
        "8",
        "--ckpt-every",
        "2",
        "--ckpt-dir",
        str(ckpts),
        "--inject",
        "stop:rank=3,step=3",
        "--inject",
        "stop:rank=0,step=6",
        "--out",
        str(out),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    first, second = summary["plan_changes"]
    assert first["kind"] == second["kind"] == "exclude" and first["applied"] and second["applied"]
    assert first["rank"] == 3 and first["resumed_step"] == 2 and first["ranks"] == [0, 1, 2]
    # the relaunch's rank 0 is old rank 0; its newest checkpoint is its own, of step 5
    assert second["rank"] == 0 and second["ranks"] == [1, 2] and second["resumed_step"] == 6
    assert first["restart_from"] == str(ckpts / "step1") and second["restart_from"] == str(
        ckpts / "restart" / "step5"
    )
    assert not (out / "ckpt").exists() and not (out / "restart" / "ckpt").exists()
    assert json.loads((out / "restart" / "config.json").read_text())["faults"]["inject"] == [
        "stop:rank=0,step=6"
    ]
    last = read_ops_trace(out / "restart" / "restart" / "ops.parquet")
    assert set(last["rank"]) == {0, 1} and sorted(set(last.step)) == [6, 7]
    assert summary["steps"] == 8 and len(summary["losses"]) == 8
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(summary["losses"], clean_losses)), (
        summary["losses"],
        clean_losses,
    )


@pytest.mark.slow
def test_a_re_formed_relaunch_has_a_live_loop_that_re_plans_around_a_slowdown(tmp_path):
    """Rank 3 dies at step 3; the slowdown of rank 1 from step 26 is carried into the relaunch,
    whose live loop calibrates on the re-formed layout, finds it and re-plans around it; the
    launch's exclusion and the relaunch's change are both in the summary, and every step's loss
    equals the failure-free run's."""
    # the default 20-step baseline: on 8 steps right after the relaunch (its warm-up in them) a CI
    # run found rank 0 1.15x slow first; with it, the baseline's end found rank 0 1.08x and 1.35x
    # slow in 2 of 11 runs on this machine (3 ranks on 2 cores, checkpoints every 2 steps), and the
    # re-plan around that left no baseline to find rank 1's 4x by: it plans from 1.5x
    args = [*SMALL, "--steps", "40", "--ckpt-every", "2", "--min-slowdown", "1.5"]
    proc = resihp(
        "run",
        *args,
        "--inject",
        "stop:rank=3,step=3",
        "--inject",
        "slow:rank=1,factor=4,step=26",
        "--out",
        str(tmp_path / "run"),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    exclude, *live = summary["plan_changes"]
    assert exclude["kind"] == "exclude" and exclude["ranks"] == [0, 1, 2]
    found = [c for c in live if c["reason"]["kind"] == "fail-slow"]
    assert found and found[0]["reason"]["rank"] == 1 and found[0]["applied"] is True, (
        live
    )  # old rank 1
    assert 26 <= found[0]["decided_step"] < 40 and found[0]["predicted_step_s"] > 0
    assert summary["after_restart"]["planner_calibration"]["steps"] >= 3
    # the failure-free run's losses: one process training the same batches (a 4-rank run of them
    # took twice as long on 2 cores)
    reference = replay_membership(SMALL_FLAGS | {"steps": 40}, [[0, 1]] * 40, tmp_path / "clean")
    assert len(summary["losses"]) == 40
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(summary["losses"], reference)), (
        summary["losses"],
        reference,
    )


@pytest.mark.slow
def test_a_re_formed_relaunch_snapshots_to_a_memory_tier_of_its_own(tmp_path, clean_losses):
    """With the memory tier on, the relaunch keeps one too (its own, under the job id ``<job>-r``):
    when old rank 0 dies at step 6 of it, its keeper writes the newest step complete in memory to
    disk, newer than any checkpoint due (every 4 steps: step 3), and the second relaunch goes on
    from there with the failure-free run's losses. A rank killed as a step begins may take its copy
    of the step before with it, so the newest complete step is that one or the one before (5 or 4;
    in the launch, 2 or 1)."""
    out = tmp_path / "memory"
    proc = resihp(
        "run",
        *SMALL,
        "--steps",
        "8",
        "--ckpt-every",
        "4",
        "--snapshot-every",
        "1",
        "--inject",
        "stop:rank=3,step=3",
        "--inject",
        "stop:rank=0,step=6",
        "--out",
        str(out),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    first, second = summary["plan_changes"]

    def written(ckpt):
        return [
            (e["step"], e["reason"])
            for e in map(json.loads, (ckpt / "persist.jsonl").read_text().splitlines())
        ]

    ((newest, why),) = written(
        out / "ckpt"
    )  # the first launch's keeper: its newest step, none due before
    assert (
        why == "breakpoint"
        and newest in (1, 2)
        and first["restart_from"] == str(out / "ckpt" / f"step{newest}")
    )
    (due, due_why), (newest, why) = written(out / "restart" / "ckpt")
    assert (due, due_why) == (3, "due") and why == "breakpoint" and newest in (4, 5)
    assert second["restart_from"] == str(out / "restart" / "ckpt" / f"step{newest}")
    assert second["resumed_step"] == newest + 1
    job = json.loads((out / "config.json").read_text())["job_id"]
    assert json.loads((out / "restart" / "config.json").read_text())["job_id"] == f"{job}-r"
    assert len(summary["losses"]) == 8
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(summary["losses"], clean_losses)), (
        summary["losses"],
        clean_losses,
    )


@pytest.mark.slow
def test_a_dead_rank_of_a_tensor_parallel_group_leaves_its_peer_training_from_the_newest_snapshot(
    tmp_path, clean_losses
):
    """DP 2 x TP 2 loses rank 1 with the memory tier on: the keeper writes the newest snapshot, the
    planner puts every survivor to work (rank 0, its group's survivor, too), and the losses equal a
    failure-free run's."""
    layout = [
        "--dp",
        "2",
        "--pp",
        "1",
        "--tp",
        "2",
        "--steps",
        "8",
        "--ckpt-every",
        "3",
        "--snapshot-every",
        "1",
    ]
    proc = resihp(
        "run",
        *SMALL,
        *layout,
        "--inject",
        "stop:rank=1,step=5",
        "--out",
        str(tmp_path / "dead"),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    change = summary["plan_changes"][0]
    assert change["applied"] is True and change["ranks"] == [0, 2, 3]
    # every survivor at work (here: rank 0 alone beside the group of ranks 2 and 3)
    assert sorted(r for p in change["layout"]["pipelines"] for s in p for r in s) == [0, 1, 2]
    assert change["resumed_step"] >= 4  # the keeper's breakpoint: newer than step 2's checkpoint
    # the failure-free run's losses: the DP 2 x PP 2 one's (the same global batches in another
    # layout: the same losses up to reduction order)
    reference = clean_losses
    assert len(summary["losses"]) == 8
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(summary["losses"], reference)), (
        summary["losses"],
        reference,
    )


@pytest.mark.slow
def test_stop_without_checkpoints_ends_the_job_with_one_line(tmp_path):
    out = tmp_path / "stop"
    proc = resihp(
        "run",
        *SMALL,
        "--steps",
        "8",
        "--inject",
        "stop:rank=2,step=3",
        "--out",
        str(out),
        "--recovery",
        "none",
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("resihp: rank 2 stopped at step 3")
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_worker_that_never_joins_is_a_clear_error(tmp_path):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29000 + os.getpid() % 1000),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resihp.train.worker",
            "--dp",
            "1",
            "--pp",
            "2",
            "--timeout",
            "3",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 3
    assert "not every worker joined" in proc.stderr and "Traceback" not in proc.stderr
