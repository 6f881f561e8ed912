"""``resihp run --resume``: a run folder (its newest checkpoint) starts another layout; ``--steps``
stays the total; the summary's losses from ``first_step`` equal the uninterrupted run's."""

import json
import os
import subprocess
import sys

import pytest

TINY = [
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "4",
    "--ffn-hidden",
    "64",
    "--vocab",
    "61",
    "--global-tokens",
    "1024",
    "--budget",
    "256",
    "--max-len",
    "256",
    "--timeout",
    "60",
    "--no-live",
    "--mlp",
    "swiglu",
    "--vocab-parallel",
    "--json",
]


def resihp(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "resihp.cli", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.slow
def test_resume_a_run_folder_in_another_layout(tmp_path):
    first = resihp(
        *TINY,
        "--dp",
        "1",
        "--pp",
        "1",
        "--tp",
        "1",
        "--steps",
        "5",
        "--ckpt-every",
        "3",
        "-o",
        str(tmp_path / "a"),
    )
    assert first.returncode == 0, first.stderr
    whole = json.loads(first.stdout)
    again = resihp(
        *TINY,
        "--dp",
        "1",
        "--pp",
        "1",
        "--tp",
        "2",
        "--steps",
        "5",
        "--resume",
        str(tmp_path / "a"),
        "-o",
        str(tmp_path / "b"),
    )
    assert again.returncode == 0, again.stderr
    resumed = json.loads(again.stdout)
    assert resumed["first_step"] == 3 and len(resumed["losses"]) == 2  # steps 3 and 4 of 5
    assert resumed["resume"]["checkpoint"].endswith("step2")
    for a, b in zip(whole["losses"][3:], resumed["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a)


@pytest.mark.parametrize(
    "args, meta, message",
    [
        (["--resume", "nowhere"], None, "nowhere: not a resihp checkpoint (no meta.json)"),
        (["--resume", "CKPT", "--steps", "2"], None, "--steps 2: the checkpoint"),
        (
            ["--resume", "CKPT"],
            "{}",
            "meta.json: field step: expected the last step the checkpoint trained",
        ),
        (["--resume", "CKPT"], '{"step": "2"}', "meta.json: field step: expected"),
        (["--resume", "CKPT"], "[2]", "meta.json: expected a JSON object, got list"),
    ],
)
def test_bad_resume_is_one_line_and_exit_2(tmp_path, args, meta, message):
    """Before any worker starts (a meta.json without its step once crashed rank 0 with a
    KeyError)."""
    import torch

    from resihp.ckpt.universal import save

    model = torch.nn.Linear(2, 2)
    save(tmp_path / "ckpt", model, torch.optim.AdamW(model.parameters()), 1, {"tp": 1})
    if meta is not None:
        (tmp_path / "ckpt" / "meta.json").write_text(meta)
    args = [str(tmp_path / "ckpt") if a == "CKPT" else a for a in args]
    proc = resihp(*args, "-o", str(tmp_path / "out"), timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
