"""Healthy ranks evicted as hung: fault-free ``resihp run --recovery replica --heartbeat-timeout 3``
runs on a loaded machine, counting the runs in which a replica was relaunched (no fault was
injected, so every relaunch is a false verdict). Prints JSON.

    python benchmarks/false_evictions.py --runs 20 --load 2
        --out benchmarks/results/false-evictions.json
    python benchmarks/false_evictions.py --runs 10 --before /tmp/old-checkout   # against other code

``--load N`` keeps N busy processes spinning beside the job (the machine's cores shared, as a
loaded node's are). ``--before DIR`` adds an arm that runs the same job with the ``resihp`` of
another checkout (its folder on ``PYTHONPATH``), runs interleaved with this checkout's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = [
    "--layers",
    "4",
    "--hidden",
    "128",
    "--heads",
    "4",
    "--ffn-hidden",
    "512",
    "--vocab",
    "1024",
    "--global-tokens",
    "4096",
    "--budget",
    "512",
    "--max-len",
    "512",
    "--dp",
    "2",
    "--pp",
    "2",
    "--recovery",
    "replica",
    "--heartbeat-timeout",
    "3",
    "--no-live",
    "--json",
    "--timeout",
    "120",
]
SPIN = "import time\nwhile True:\n    sum(range(10000))\n"


def one_run(out: Path, steps: int, code: str | None) -> dict:
    """One fault-free run; ``code``: a checkout whose resihp runs it (None: this one)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if code is not None:
        env["PYTHONPATH"] = code
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "run", *JOB, "--steps", str(steps), "-o", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    summary = (
        json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    )
    recovery = summary.get("recovery") or {}
    return {
        "rc": proc.returncode,
        "wall_s": round(time.time() - t0, 2),
        "evicted": bool(recovery),
        "cause": recovery.get("cause"),
        "rank": recovery.get("rank"),
        "failed_step": recovery.get("failed_step"),
        "error": None if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1:],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--load", type=int, default=2, help="busy processes beside the job")
    ap.add_argument("--before", default=None, help="another checkout to run as a second arm")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    arms = {"this": None, **({"before": args.before} if args.before else {})}
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.load)]
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    try:
        with tempfile.TemporaryDirectory(prefix="resihp-evict-") as tmp:
            for i in range(args.runs):
                order = list(arms) if i % 2 == 0 else list(reversed(arms))
                for arm in order:
                    runs[arm].append(one_run(Path(tmp) / f"{arm}-{i}", args.steps, arms[arm]))
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    result = {
        "benchmark": "false_evictions",
        "command": "python benchmarks/false_evictions.py "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
        "job": JOB,
        "load_processes": args.load,
        "cores": os.cpu_count(),
        "arms": {
            arm: {
                "runs": len(r),
                "evicted_runs": sum(x["evicted"] for x in r),
                "failed_runs": sum(x["rc"] != 0 for x in r),
                "runs_detail": r,
            }
            for arm, r in runs.items()
        },
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
