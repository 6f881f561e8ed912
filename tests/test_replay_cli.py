import json
import subprocess
import sys

from tests.replay_fixtures import write


def test_replay_cli_json_and_plot(tmp_path):
    events = [
        {"at": "1h", "device": 13, "kind": "slow", "factor": 2.0},
        {"at": "2h", "node": 3, "kind": "stop"},
    ]
    path = write(tmp_path, events=events)
    png = tmp_path / "out" / "timeline.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resihp.cli",
            "replay",
            str(path),
            "--policies",
            "resihp,checkpoint-restart,recycle",
            "--json",
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["scenario"] == "tiny" and doc["capacity_tokens_per_s"] > 0
    names = [p["name"] for p in doc["policies"]]
    assert names == ["resihp", "checkpoint-restart", "recycle"]
    for p in doc["policies"]:
        for field in ("tokens_per_s", "effective_time", "false_alarms", "bound_fraction"):
            assert isinstance(p[field], (int, float))
        assert len(p["timeline"]) == 96
    assert set(doc["speedups"]) == {"checkpoint-restart", "recycle"}
    assert doc["speedups"]["checkpoint-restart"] > 1.0
    assert png.stat().st_size > 10_000


def test_replay_cli_table(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resihp.cli",
            "replay",
            str(write(tmp_path)),
            "--policies",
            "oobleck",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "oobleck" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "replay", str(write(tmp_path)), "--plot", "x.jpg"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "--plot" in proc.stderr
