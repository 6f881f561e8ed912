"""Live step estimates against measured steps: each applied plan change's ``predicted_step_s``
(the planner's expected step, ``planning.predicted_step_s``, on analytic costs paced on the job's
first healthy steps, ``planning.paced_to``, and a fail-slow decision without pipeline stages on the
healthy ranks' present level, ``present_pace``) beside the median step measured while it was in
force (``measured_step_s``), for real ``resihp run`` jobs
(torchrun workers on gloo, CPU) with a slow or a dead rank. Prints JSON.

    OMP_NUM_THREADS=1 python benchmarks/step_estimates.py
        [--out benchmarks/results/step-estimates.json]
        [--jobs N]  # N cases at once: only where the cores outnumber all their ranks
        [--repeats R]  # R interleaved rounds of every case; per-case medians over them

Cases: a slow rank (x3 from step 24, the detector calibrating on the 20 steps before it) in DP 2
(micro-batch shares), PP 2 (layers moved, the slow rank a spare) and DP 2 x PP 2, with
``--recovery none`` (every plan applied in full) and in replica mode (shares on the layers in
force); a dead rank in DP 2 x PP 2 (the survivors re-formed by the planner, paced on the steps
before the loss). Controls (``healthy-dp2``, ``healthy-pp2``): the same jobs with nothing injected,
the "estimate" the median step of the 20 calibration steps before step 24 and the "measured" the
median of the steps a change would be measured on (29-49): the error a perfect cost model would show
on this machine, i.e. the noise floor of ``step_error`` (``summary.control_abs_step_error``).
``unpaced_error`` is what the estimate would have been without the pacing (the analytic
costs alone). A job with more ranks than cores (``oversubscribed``) measures the harness more than
the plan: a rank slowed by sleeps frees a core for the others, which no cost model of a device
predicts; such cases are reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd

from resihp.train.worker import step_table

CASES = [
    (
        "slow-dp2",
        [
            "--dp",
            "2",
            "--pp",
            "1",
            "--recovery",
            "none",
            "--inject",
            "slow:rank=1,factor=3,step=24",
        ],
    ),
    (
        "slow-pp2",
        [
            "--dp",
            "1",
            "--pp",
            "2",
            "--recovery",
            "none",
            "--inject",
            "slow:rank=1,factor=3,step=24",
        ],
    ),
    (
        "slow-dp2-replica",
        [
            "--dp",
            "2",
            "--pp",
            "1",
            "--recovery",
            "replica",
            "--inject",
            "slow:rank=1,factor=3,step=24",
        ],
    ),
    (
        "slow-dp2xpp2",
        [
            "--dp",
            "2",
            "--pp",
            "2",
            "--recovery",
            "none",
            "--inject",
            "slow:rank=1,factor=3,step=24",
        ],
    ),
    (
        "dead-dp2xpp2",
        [
            "--dp",
            "2",
            "--pp",
            "2",
            "--recovery",
            "none",
            "--ckpt-every",
            "4",
            "--inject",
            "stop:rank=3,step=22",
        ],
    ),
]
CONTROLS = [
    ("healthy-dp2", ["--dp", "2", "--pp", "1", "--recovery", "none"]),
    ("healthy-pp2", ["--dp", "1", "--pp", "2", "--recovery", "none"]),
]
STEPS = 50
CALIBRATION = range(4, 24)  # the steps a change at step 24 is paced on
AFTER = range(29, 50)  # the steps such a change's step is measured on (21, as in the cases)


def run_job(name: str, args: list[str], tmp: Path) -> tuple[dict | None, str | None]:
    """``resihp run --json`` of one case: (its summary, None), or (None, the error's last line)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "resihp.cli",
        "run",
        "--device",
        "cpu",
        "--steps",
        str(STEPS),
        *args,
        "-o",
        str(tmp / name),
        "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        return None, (proc.stderr.strip().splitlines() or ["?"])[-1]
    return json.loads(proc.stdout), None


def run_control(name: str, args: list[str], tmp: Path) -> dict:
    """A job with nothing injected: its later steps against its calibration steps."""
    summary, error = run_job(name, args, tmp)
    if summary is None:
        return {"case": name, "control": True, "error": error}
    wall = step_table(pd.read_parquet(summary["trace"])).wall_s
    before = float(wall[wall.index.isin(CALIBRATION)].median())
    after = float(wall[wall.index.isin(AFTER)].median())
    return {
        "case": name,
        "control": True,
        "oversubscribed": bool(summary.get("oversubscribed")),
        "calibration_step_s": round(before, 6),
        "measured_step_s": round(after, 6),
        "step_error": round(before / after - 1, 4),
    }


def run_case(name: str, args: list[str], tmp: Path) -> dict:
    summary, error = run_job(name, args, tmp)
    if summary is None:
        return {"case": name, "error": error}
    changes = []
    for c in summary.get("plan_changes") or []:
        cal = c.get("planner_calibration") or summary.get("planner_calibration")
        if c.get("measured_step_s") is None:
            continue
        # the one-factor pacing's factor divides out to the analytic estimate; a two-part pacing's
        # (devices on compute, an overhead per transfer) does not
        factor = cal["factor"] if cal and "p2p_overhead_s" not in cal else None
        changes.append(
            {
                "reason": (c.get("reason") or {"kind": c.get("kind")}).get("kind"),
                "slowdown": (c.get("reason") or {}).get("slowdown"),
                "present_pace": c.get("present_pace"),
                "applied": c.get("applied"),
                "predicted_step_s": round(c["predicted_step_s"], 4),
                "measured_step_s": c["measured_step_s"],
                "measured_steps": c["measured_steps"],
                "step_error": c["step_error"],
                "unpaced_error": round(c["predicted_step_s"] / factor / c["measured_step_s"] - 1, 4)
                if factor
                else None,
            }
        )
    return {
        "case": name,
        "oversubscribed": bool(summary.get("oversubscribed")),
        "calibration": summary.get("planner_calibration")
        or next((c.get("planner_calibration") for c in summary.get("plan_changes") or []), None),
        "changes": changes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cases", default=",".join(n for n, _ in CASES + CONTROLS))
    ap.add_argument("--jobs", type=int, default=1, help="cases run at once (each runs its own job)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of every case, interleaved (this CPU drifts: one run per case is noise)",
    )
    args = ap.parse_args()
    wanted = args.cases.split(",")
    runs = []
    for round_ in range(max(1, args.repeats)):
        with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max(1, args.jobs)) as pool:
            todo = [(run_case, c) for c in CASES if c[0] in wanted]
            todo += [(run_control, c) for c in CONTROLS if c[0] in wanted]
            done = list(pool.map(lambda job: job[0](*job[1], Path(tmp)), todo))
        runs += [{**r, "round": round_} for r in done]
    controls = [r for r in runs if r.get("control") and "step_error" in r]
    runs = [r for r in runs if not r.get("control")]

    def errors(over: bool, key: str) -> list[float]:
        return [
            abs(c[key])
            for r in runs
            if r.get("oversubscribed") == over
            for c in r.get("changes", [])
            if c.get(key) is not None
        ]

    fit, over = errors(False, "step_error"), errors(True, "step_error")
    unpaced = errors(False, "unpaced_error")
    result = {
        "benchmark": "step-estimates",
        "steps": STEPS,
        "cores": os.cpu_count(),
        "jobs": args.jobs,
        "runs": runs,
        "summary": {
            "median_abs_step_error": round(statistics.median(fit), 4) if fit else None,
            "max_abs_step_error": round(max(fit), 4) if fit else None,
            "median_abs_unpaced_error": round(statistics.median(unpaced), 4) if unpaced else None,
            "oversubscribed_median_abs_step_error": round(statistics.median(over), 4)
            if over
            else None,
            "changes_measured": len(fit) + len(over),
            # per case, the median over its rounds of each run's median |step_error|
            "per_case_median_abs_step_error": {
                name: round(statistics.median(per), 4)
                for name in wanted
                if (
                    per := [
                        statistics.median(abs(c["step_error"]) for c in r["changes"])
                        for r in runs
                        if r["case"] == name and r.get("changes")
                    ]
                )
            },
            # nothing injected: the calibration steps' median against the later steps'
            "control_abs_step_error": {
                name: sorted(abs(r["step_error"]) for r in controls if r["case"] == name)
                for name in wanted
                if any(r["case"] == name for r in controls)
            },
        },
        "controls": controls,
        "target": {"abs_step_error": "<= 0.05"},
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
