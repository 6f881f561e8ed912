"""Shipped files by name or by repository path, from any directory, and files written whole
(resihp.paths)."""

import threading
from pathlib import Path

import pytest

from resihp.errors import InputError
from resihp.paths import DATA, resolve, shipped_names, write_text_atomic


def test_shipped_files_are_package_data():
    assert (DATA / "traces" / "clusters" / "h100-8-degraded.yaml").is_file()
    assert (DATA / "models" / "cpu-gpt-small" / "card.json").is_file()
    assert "gpt-7b" in shipped_names("model") and "cpu-gpt-small" in shipped_names("predictor")


@pytest.mark.parametrize(
    "value,kind,expect",
    [
        ("h100-8-degraded", "cluster", "traces/clusters/h100-8-degraded.yaml"),
        ("gpt-7b.yaml", "model", "traces/models/gpt-7b.yaml"),
        (
            "traces/scenarios/failslow-13b-256.yaml",
            "scenario",
            "traces/scenarios/failslow-13b-256.yaml",
        ),
        ("cpu-gpt-small", "predictor", "models/cpu-gpt-small"),
        ("models/cpu-gpt-small", "predictor", "models/cpu-gpt-small"),
    ],
)
def test_names_and_repository_paths_resolve_from_any_directory(
    tmp_path, monkeypatch, value, kind, expect
):
    monkeypatch.chdir(tmp_path)
    assert resolve(value, kind) == DATA / expect


def test_an_existing_path_wins_and_an_unknown_name_lists_the_choices(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt-7b.yaml").write_text("layers: 1\n")
    assert resolve("gpt-7b.yaml", "model").resolve() == tmp_path / "gpt-7b.yaml"
    with pytest.raises(
        InputError, match=r"nope: cannot read cluster \(no such file.*shipped: .*h100-8-degraded"
    ):
        resolve("nope", "cluster")
    # a path elsewhere is left to its reader, which names it
    assert resolve("elsewhere/h100-8.yaml", "cluster") == Path("elsewhere/h100-8.yaml")


def test_plan_names_shipped_specs_from_another_directory(tmp_path):
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resihp.cli",
            "plan",
            "--cluster",
            "h100-8-degraded",
            "--model",
            "gpt-7b",
            "--time-limit",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["world_size"] == 8


def test_a_reader_polling_a_file_never_sees_part_of_a_write(tmp_path):
    """``follow`` polls a job's ``job.yaml`` from another process while rank 0 writes it (CI once
    read it half-written and failed): every read sees one whole version."""
    path = tmp_path / "job.yaml"
    versions = [f"v{i}\n" + "x" * 200_000 + "\n" for i in range(40)]
    seen, stop = set(), threading.Event()

    def read() -> None:
        while not stop.is_set():
            if path.exists():
                seen.add(path.read_text())

    reader = threading.Thread(target=read)
    reader.start()
    for text in versions:
        write_text_atomic(path, text, durable=False)
    stop.set()
    reader.join()
    assert seen and seen <= set(versions)
    assert path.read_text() == versions[-1] and [p.name for p in tmp_path.iterdir()] == ["job.yaml"]
