"""Live re-planning under replica-level fault tolerance: what re-planning around a slow rank buys a
``--recovery replica`` job. Prints JSON.

    OMP_NUM_THREADS=1 python benchmarks/replica_replan.py [--rounds 3]
        [--out benchmarks/results/replica-replan.json]
    OMP_NUM_THREADS=1 python benchmarks/replica_replan.py --layout tp [--factor 4]
        [--out .../replica-replan-tp.json]

One job, DP 2 x PP 2 (``--layout pp``; rank 1 is replica 1's stage 0) or DP 2 x TP 2 (``--layout
tp``, the issue's run; rank 1 is replica 0's second tensor-parallel rank), 4 processes, each replica
a torchrun job of its own; rank 1 slowed ``--factor`` x from step ``--slow-step`` (``--inject
slow:...``: its compute is stretched by a sleep). Arms, interleaved in each round, same model, data
and fault:

- ``live``: the default; the live loop finds the slow rank and the planner (``regroup=
  WITHIN_REPLICAS``) re-plans the slow replica on its own ranks (its layers re-split, or its groups
  re-formed without the slow rank or with it in a stage of its own) and moves micro-batches to the
  other; every rank applies the plan at one step boundary (a re-formed replica builds new groups and
  reshards its state from memory).
- ``no-live``: ``--no-live``, the job runs on with the launch plan.

Per run: the healthy step (median step wall time, the slowest rank's, over steps 3 to the fault),
the step after (median over the last ``--tail`` steps, when the plan is long in force), and for
``live`` the plan change (its groups, spares, splits and shares, the step it was applied at, the
planner's predicted step, and the ``replan-layers``/``replan-layout`` ops: bytes moved, seconds and
that stall in healthy steps). ``capacity_ratio``:
throughput after / (throughput before x the capacity left: (world - 1 + 1/factor) / world), the
issue's measure (at least 0.8 wanted). ``live_over_no_live``: the median over rounds of each
round's after-step ratio. The noise floor of a step time on this machine: the spread of the
healthy steps across all runs (``healthy_spread``: max / min of the runs' healthy medians).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

MODEL = [
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
    "--recovery",
    "replica",
    "--json",
    "--timeout",
    "60",
]
LAYOUTS = {"pp": ["--pp", "2", "--tp", "1"], "tp": ["--pp", "1", "--tp", "2"]}
WORLD = 4


def run(
    out: Path, layout: str, steps: int, slow: str, *args: str
) -> tuple[dict, pd.DataFrame | None]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resihp.cli",
            "run",
            "-o",
            str(out),
            *MODEL,
            *LAYOUTS[layout],
            "--steps",
            str(steps),
            "--inject",
            slow,
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    summary = (
        json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    )
    summary["_rc"], summary["_stderr"] = proc.returncode, proc.stderr[-400:]
    trace = pd.read_parquet(out / "ops.parquet") if (out / "ops.parquet").exists() else None
    return summary, trace


def arm(
    out: Path, layout: str, steps: int, slow_step: int, factor: float, tail: int, live: bool
) -> dict:
    summary, trace = run(
        out,
        layout,
        steps,
        f"slow:rank=1,factor={factor},step={slow_step}",
        *([] if live else ["--no-live"]),
    )
    row: dict = {
        "rc": summary["_rc"],
        "error": summary.get("error") or (summary["_stderr"] if summary["_rc"] else None),
    }
    if trace is None:
        return row
    walls = trace[trace.optype == "step"].groupby("step").duration.max()
    healthy = float(walls[(walls.index >= 3) & (walls.index < slow_step)].median())
    after = float(walls[walls.index >= steps - tail].median())
    row.update(
        healthy_step_s=round(healthy, 4),
        after_step_s=round(after, 4),
        capacity_ratio=round((healthy / after) / ((WORLD - 1 + 1 / factor) / WORLD), 4),
    )
    changes = summary.get("plan_changes") or []
    if live and changes:
        first = changes[0]
        at = first.get("applied_step")
        moves = trace[trace.optype.isin(["replan-layers", "replan-layout"]) & (trace.step == at)]
        move_s = float(moves.duration.max()) if len(moves) else None
        row["change"] = {
            "applied": first.get("applied"),
            "applied_step": at,
            "decided_step": first.get("decided_step"),
            "groups": (first.get("layout") or {}).get("pipelines"),
            "spares": first.get("spares", []),
            "layer_splits": first.get("layer_splits"),
            "dp_weights": first.get("dp_weights"),
            "predicted_step_s": round(first["predicted_step_s"], 4),
            "moved_bytes": int(moves["bytes"].sum()) if "bytes" in moves else None,
            "move_s": round(move_s, 4) if move_s is not None else None,
            "stall_steps": round(move_s / healthy, 3) if move_s is not None else None,
            "changes": len(changes),
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="pp")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--slow-step", type=int, default=15)
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument(
        "--tail", type=int, default=30, help="steps at the end the after-step is the median of"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    t0 = time.time()
    results: dict[str, list[dict]] = {"live": [], "no-live": []}
    with tempfile.TemporaryDirectory(prefix="replica-replan-") as tmp:
        for r in range(args.rounds):
            order = ["live", "no-live"] if r % 2 == 0 else ["no-live", "live"]
            for name in order:
                results[name].append(
                    arm(
                        Path(tmp) / f"{name}-{r}",
                        args.layout,
                        args.steps,
                        args.slow_step,
                        args.factor,
                        args.tail,
                        name == "live",
                    )
                )
    ok = all(row["rc"] == 0 and "after_step_s" in row for rows in results.values() for row in rows)
    out: dict = {
        "benchmark": "replica-replan",
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "model": " ".join(MODEL + LAYOUTS[args.layout]),
        "steps": args.steps,
        "slow": f"rank 1 x{args.factor} from step {args.slow_step}",
        "rounds": args.rounds,
        "wall_s": round(time.time() - t0, 1),
        "ok": ok,
        "runs": results,
    }
    if ok:
        med = lambda name, key: statistics.median(row[key] for row in results[name])  # noqa: E731
        healthy = [row["healthy_step_s"] for rows in results.values() for row in rows]
        out["summary"] = {
            "live_capacity_ratio": round(med("live", "capacity_ratio"), 4),
            "no_live_capacity_ratio": round(med("no-live", "capacity_ratio"), 4),
            "live_over_no_live": round(
                statistics.median(
                    a["after_step_s"] / b["after_step_s"]
                    for a, b in zip(results["live"], results["no-live"])
                ),
                4,
            ),
            "healthy_spread": round(max(healthy) / min(healthy), 4),
            "applied": [row.get("change", {}).get("applied") for row in results["live"]],
            "groups": [row.get("change", {}).get("groups") for row in results["live"]],
            "spares": [row.get("change", {}).get("spares") for row in results["live"]],
            "stall_steps": [row.get("change", {}).get("stall_steps") for row in results["live"]],
        }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
