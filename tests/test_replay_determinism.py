"""The same replay scenario and seed gives the same JSON, run after run (wall times aside)."""

import json
import subprocess
import sys

from tests.replay_fixtures import write


def _strip_wall_times(x):
    if isinstance(x, dict):
        return {k: _strip_wall_times(v) for k, v in x.items() if not k.endswith("wall_s")}
    if isinstance(x, list):
        return [_strip_wall_times(v) for v in x]
    return x


def test_replay_twice_gives_identical_json(tmp_path):
    events = [
        {"at": "1h", "device": 13, "kind": "slow", "factor": 3.0},
        {"at": "2h", "device": 40, "kind": "slow", "factor": 1.5},
    ]
    path = write(tmp_path, events=events)
    docs = []
    for _ in range(2):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "resihp.cli",
                "replay",
                str(path),
                "--policies",
                "resihp,recycle",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        docs.append(_strip_wall_times(json.loads(proc.stdout)))
    assert docs[0] == docs[1]
    assert docs[0]["policies"][0]["name"] == "resihp"
