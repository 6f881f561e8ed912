"""How fast a lost replica's processes come back: the start of a run and the relaunch of a replica
after a SIGKILL, for one or more source trees in interleaved rounds. Prints JSON.

    OMP_NUM_THREADS=1 python benchmarks/relaunch.py [--rounds 3] [--tree PATH ...] [--out FILE]

Each arm is a real ``resihp run`` (DP 2 x PP 2, gloo on CPU, the small model of
``tests/test_replica_ft.py``, 80 steps, ``--recovery replica``): rank 3 is killed at step 10 and
the survivors' first stage is slowed 3x from then on, as in the tests. Per run: ``first_worker_s``
(from the command to the first worker's start, ``OUT/logs/processes.jsonl``), ``restart_s`` (from
the failure to the relaunched replica's workers, the summary's), ``survivor_stall_s`` and
``catchup_s`` (the summary's), ``rejoin_steps`` (steps the survivors trained before the replica
rejoined) and the run's wall time. ``--tree`` names a source
tree to run (``PYTHONPATH``), for example a ``git worktree`` of an older commit; arms alternate in
each round, medians over rounds.

``--scenario memory``: instead, the run re-formed around a dead rank from the memory tier (DP 2 x
TP 2, the small model of ``tests/test_runtime_cli.py``, 8 steps, a checkpoint every 3 and a
snapshot every step, rank 1 stopped at step 5, as that file's test): ``restart_s`` (from the
relaunch's start to its first step, the plan change's), ``first_worker_s`` and the wall time.

``--scenario hang``: a restart from the memory tier after a hang (DP 2, a snapshot every step,
rank 1 hung at step 10, hang timeout 5 s): ``stall_s`` (the hung step's start to the relaunched
job's first step, the summary's), ``detected_s`` (of it, the hang timeout's share).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMALL = [
    "--layers",
    "2",
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
    "256",
    "--max-len",
    "256",
    "--json",
    "--timeout",
    "60",
    "--no-live",
    "--dp",
    "2",
    "--pp",
    "2",
    "--steps",
    "80",
    "--recovery",
    "replica",
    "--inject",
    "stop:rank=3,step=10",
    "--inject",
    "slow:rank=0,factor=3,step=10",
]


MEMORY = [
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
    "--json",
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
    "--inject",
    "stop:rank=1,step=5",
]
HANG = [
    "--layers",
    "2",
    "--hidden",
    "64",
    "--heads",
    "4",
    "--json",
    "--dp",
    "2",
    "--pp",
    "1",
    "--steps",
    "16",
    "--snapshot-every",
    "1",
    "--ckpt-every",
    "2",
    "--recovery",
    "restart",
    "--hang-timeout",
    "5",
    "--inject",
    "hang:rank=1,step=10",
]
SCENARIOS = {"replica": SMALL, "memory": MEMORY, "hang": HANG}


def one(tree: Path, out: Path, scenario: str = "replica") -> dict:
    shutil.rmtree(out, ignore_errors=True)
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "run", "-o", str(out), *SCENARIOS[scenario]],
        capture_output=True,
        text=True,
        cwd=tree,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)},
    )
    wall = time.time() - start
    if proc.returncode:
        raise SystemExit(f"{tree}: resihp run failed: {proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    started = [
        json.loads(line)["started"]
        for line in (out / "logs" / "processes.jsonl").read_text().splitlines()
    ]
    common = {"wall_s": round(wall, 2), "first_worker_s": round(min(started) - start, 2)}
    if scenario == "hang":
        rec = summary["recovery"]
        return {
            **common,
            "stall_s": rec["stall_s"],
            "detected_s": rec["detected_s"],
            "resumed_step": rec["resumed_step"],
        }
    if scenario == "memory":
        change = summary["plan_changes"][0]
        return {**common, "restart_s": change["restart_s"], "resumed_step": change["resumed_step"]}
    rec = summary["recovery"]
    return {
        **common,
        "restart_s": rec["restart_s"],
        "survivor_stall_s": rec["survivor_stall_s"],
        "catchup_s": rec["catchup_s"],
        "rejoin_steps": rec["rejoined_step"] - rec["failed_step"],
    }


def _commit(tree: Path) -> str | None:
    proc = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return (proc.stdout.strip() + ("+changes" if dirty else "")) if proc.returncode == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--tree",
        type=Path,
        action="append",
        default=None,
        help="a source tree to run (repeat for interleaved arms); this one by default",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="replica")
    args = parser.parse_args()
    trees = [t.resolve() for t in (args.tree or [Path(__file__).resolve().parents[1]])]
    runs: dict[str, list[dict]] = {str(t): [] for t in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for i, tree in enumerate(trees):
                runs[str(tree)].append(one(tree, Path(tmp) / f"arm{i}", args.scenario))
    result = {
        "harness": {
            "scenario": args.scenario,
            "run": SCENARIOS[args.scenario],
            "rounds": args.rounds,
            "machine_cores": os.cpu_count(),
        },
        "arms": {
            tree: {
                "commit": _commit(Path(tree)),
                "median": {k: statistics.median(r[k] for r in rows) for k in rows[0]},
                "runs": rows,
            }
            for tree, rows in runs.items()
        },
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
