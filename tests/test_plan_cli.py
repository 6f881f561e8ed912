import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resihp.paths import TRACES

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout (notebooks, examples)

CLUSTER = str(TRACES / "clusters" / "h100-64.yaml")
MODEL = str(TRACES / "models" / "gpt-13b.yaml")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "resihp.cli", "plan", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_plan_json_then_replan_from_it(tmp_path):
    out = tmp_path / "plan.json"
    first = cli("--cluster", CLUSTER, "--model", MODEL, "--json", "-o", str(out))
    assert first.returncode == 0, first.stderr
    plan = json.loads(first.stdout)
    assert plan["layout"]["tp"] * plan["layout"]["pp"] * plan["layout"]["dp"] <= 64
    assert json.loads(out.read_text())["ranks"] == plan["ranks"]
    second = cli(
        "--cluster",
        CLUSTER,
        "--model",
        MODEL,
        "--current",
        str(out),
        "--speed",
        "3=0",
        "--speed",
        "n5/1=0.5",
        "--token-budgets",
        "--json",
    )
    assert second.returncode == 0, second.stderr
    replan = json.loads(second.stdout)
    assert {"rank": 3, "excluded": True} in replan["ranks"]
    shares = [p.get("tokens", p["microbatches"] * 8192) for p in replan["pipelines"]]
    assert sum(shares) == 4194304  # gpt-13b's global batch, whatever the per-replica budgets
    assert replan["bound_ratio"] > 0.9
    assert replan["solver"]["status"] in ("optimal", "time-limit")


def test_readable_table_by_default():
    result = cli(
        "--cluster",
        str(TRACES / "clusters" / "h100-8-degraded.yaml"),
        "--model",
        str(TRACES / "models" / "gpt-7b.yaml"),
        "--policy",
        "resihp-heuristic",
    )
    assert result.returncode == 0, result.stderr
    assert "resihp-heuristic plan" in result.stdout and "of the capacity bound" in result.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--cluster", "missing.yaml", "--model", MODEL], "missing.yaml: cannot read cluster"),
        (
            ["--cluster", CLUSTER, "--model", MODEL, "--speed", "3"],
            "--speed '3': expected DEVICE=SPEED",
        ),
        (["--cluster", CLUSTER, "--model", MODEL, "--speed", "64=0"], "unknown device rank 64"),
        (["--cluster", CLUSTER, "--model", MODEL, "--speed", "3=2"], "must be a number in [0, 1]"),
        (["--cluster", CLUSTER, "--model", MODEL, "--policy", "magic"], "unknown policy 'magic'"),
        (
            ["--cluster", CLUSTER, "--model", MODEL, "--time-limit", "0"],
            "--time-limit: must be positive",
        ),
        (
            [
                "--cluster",
                str(TRACES / "clusters" / "h100-8.yaml"),
                "--model",
                str(TRACES / "models" / "gpt-70b.yaml"),
            ],
            "no TP x PP layout fits model gpt-70b",
        ),
        (
            ["--cluster", CLUSTER, "--model", MODEL, "-o", "/nonexistent-dir/plan.json"],
            "/nonexistent-dir/plan.json: cannot write the plan (No such file or directory)",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(args, message, monkeypatch, capsys):
    from resihp.cli import main

    monkeypatch.setattr(sys, "argv", ["resihp", "plan", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_bad_input_from_the_installed_command_has_no_traceback():
    result = cli("--cluster", CLUSTER, "--model", MODEL, "--speed", "64=0")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "resihp: error: --speed: unknown device rank 64 (cluster has ranks 0..63)"
    )


def test_current_plan_for_another_cluster_is_rejected(tmp_path):
    out = tmp_path / "plan.json"
    assert cli("--cluster", CLUSTER, "--model", MODEL, "--json", "-o", str(out)).returncode == 0
    result = cli(
        "--cluster",
        str(TRACES / "clusters" / "h100-8.yaml"),
        "--model",
        str(TRACES / "models" / "gpt-7b.yaml"),
        "--current",
        str(out),
    )
    assert result.returncode == 2
    assert "world_size 64 does not match the cluster's 8 devices" in result.stderr
    broken = tmp_path / "broken.json"
    broken.write_text('{"world_size": 64}')
    result = cli("--cluster", CLUSTER, "--model", MODEL, "--current", str(broken))
    assert result.returncode == 2 and "field 'layout' is missing" in result.stderr


def test_out_is_the_spelling_and_output_a_hidden_alias(tmp_path):
    assert (
        cli(
            "--cluster",
            CLUSTER,
            "--model",
            MODEL,
            "--time-limit",
            "1",
            "--out",
            str(tmp_path / "a.json"),
        ).returncode
        == 0
    )
    assert (
        cli(
            "--cluster",
            CLUSTER,
            "--model",
            MODEL,
            "--time-limit",
            "1",
            "--output",
            str(tmp_path / "b.json"),
        ).returncode
        == 0
    )
    assert (tmp_path / "a.json").exists() and (tmp_path / "b.json").exists()
    assert "--output" not in cli("--help").stdout


def test_a_cluster_wider_than_the_batch_says_so(tmp_path, monkeypatch, capsys):
    """Every layout of 800 devices has more replicas than cpu-small's 32 micro-batches: the error
    says that (it said the model did not fit in 1,600 GB of free memory)."""
    from resihp.cli import main

    wide = tmp_path / "wide.yaml"
    wide.write_text(
        "name: wide\ndevice: {memory_gb: 4, tflops: 1}\nnodes: {count: 100, devices: 8}\n"
    )
    monkeypatch.setattr(
        sys, "argv", ["resihp", "plan", "--cluster", str(wide), "--model", "cpu-small"]
    )
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert (
        len(lines) == 1
        and "more replicas than model cpu-small's 32 micro-batches a step" in lines[0]
    ), lines


def test_a_fixed_tp_wider_than_every_node_says_so(tmp_path, monkeypatch, capsys):
    """tp 8 on nodes of 4 devices: the error names tp and the node size (it said the model did
    not fit in memory: "needs about 0 GB, the cluster has 14 GB free")."""
    from resihp.cli import main

    model = tmp_path / "m.yaml"
    model.write_text(
        "name: m\nlayers: 4\nhidden: 256\nheads: 4\nffn_hidden: 1024\nvocab: 4096\n"
        "max_seq_len: 2048\nglobal_batch_tokens: 65536\nmicrobatch_tokens: 2048\ntp: 8\n"
    )
    monkeypatch.setattr(
        sys, "argv", ["resihp", "plan", "--cluster", "cpu-4", "--model", str(model)]
    )
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "tp 8 needs tensor-parallel groups of 8 devices" in lines[0], lines
    assert "largest node has 4" in lines[0]
