import subprocess
import sys

import pytest

from tests.notebook_runner import run_notebook


def _resihp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "resihp.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args,says",
    [
        (
            ["replay", "failslow-13b-256", "--seed", "abc"],
            "resihp replay: Invalid value for '--seed'",
        ),
        (["detect-eval", "--bogus"], "resihp detect-eval: No such option: --bogus"),
        (["nosuchverb"], "No such command 'nosuchverb'"),
        (
            ["replay", "failslow-13b-256", "--seed", "-1"],
            "resihp replay: Invalid value for '--seed'",
        ),
        (
            ["profile", "-o", "x.parquet", "--max-len", "0"],
            "resihp profile: Invalid value for '--max-len'",
        ),
        (
            ["replay", "failslow-13b-256", "--policies", ","],
            "--policies ',': expected one or more of resihp,",
        ),
    ],
)
def test_a_usage_error_is_one_line_too(args, says):
    """Options typer itself rejects (a bad value, an unknown option or verb) exit 2 with one line,
    as resihp's own checks do (click printed a usage box of 4-6 lines)."""
    proc = _resihp(*args)
    assert proc.returncode == 2 and proc.stdout == "", proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("resihp: error: ") and says in lines[0], lines


def test_bad_input_exits_2_with_one_line(tmp_path):
    proc = _resihp(
        "predictor", "train", str(tmp_path / "missing.parquet"), "-o", str(tmp_path / "m")
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "missing.parquet: no such profiling log" in proc.stderr


def test_profile_with_explicit_lengths(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("100\n50\n200\n30\n")
    out = tmp_path / "p.parquet"
    proc = _resihp(
        "profile",
        "-o",
        str(out),
        "--lengths",
        str(lengths),
        "--budget",
        "256",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--heads",
        "2",
        "--ffn-hidden",
        "64",
        "--repeats",
        "2",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    import pandas as pd

    log = pd.read_parquet(out)
    assert [list(s) for s in log[log["phase"] == "fwd"]["seq_lens"]] == [[100, 50], [200, 30]]
    over = _resihp("profile", "-o", str(out), "--lengths", str(lengths), "--budget", "150")
    assert over.returncode == 2 and "exceeds --budget 150" in over.stderr


@pytest.mark.slow
def test_predictor_notebook_runs():
    run_notebook("notebooks/predictor.ipynb", timeout_s=600)
