"""Replica-level fault tolerance benchmark: what a replica failure costs the survivors under
``resihp run --recovery replica`` against restarting the whole job, on one harness. Prints JSON.

    OMP_NUM_THREADS=1 python benchmarks/replica_ft.py [--rounds 2]
        [--out benchmarks/results/replica-ft.json]
    OMP_NUM_THREADS=1 python benchmarks/replica_ft.py --nodes-only
        --out benchmarks/results/replica-ft-2nodes.json

Every arm is a real ``resihp run`` (DP 2 x PP 2, torchrun workers on gloo, CPU) with the same
model, data and fault: ``stop:rank=1,step=S`` (SIGKILL of a rank of replica 1). Arms run in
rounds, in a rotated order, so the machine's drifts hit all alike; medians over rounds.

- ``replica``: ``--recovery replica``. Survivor stall = the time the survivors lost to the failure
  (their aborted step attempt and forming the next group: ``recovery.survivor_stall_s``), also in
  median failure-free steps; catch-up = from the state being available on the returning ranks to
  their first step (``catchup_s``), against the survivors' median step; the survivors' slowest
  step around the rejoin against their median step.
- ``memory``: ``--recovery restart`` (the whole job relaunched, every rank restored from the
  memory tier). Stall = the survivors' time from their last step before the failure to the first
  step after it, plus the steps done twice.
- ``disk``: ``--ckpt-every 5`` without a memory tier (the whole job restarted from the newest
  disk checkpoint, without the lost rank). Stall = the survivors' time from their last step before
  the failure to the first step after the restart, plus the steps done twice.
- ``replica-2nodes`` (with ``--nodes``): the ``replica`` arm on two launchers (``--nnodes 2``, one
  replica each, as on two machines): node 0 judges and evicts replica 1, node 1's launcher
  relaunches it. ``--nodes-only`` runs just the two replica arms.
- ``failure_free``: ``--recovery replica`` against ``--recovery none`` without a fault, the
  overhead of the quorum and the cross-replica groups while training: the steady step period (the
  median over ranks of each rank's median interval between the starts of its steps, from step 3 on:
  everything a rank does per step, the vote and what runs between steps included), the median
  over rounds of each round's ratio (``failure_free_overhead``). Forming the cross-replica groups
  once at the start is reported apart (``failure_free_startup_s``: the first step's extra wall
  time), and the summary's tokens per second over every step, start included, as before
  (``failure_free_overhead_tokens_per_s``: over 40 steps the start weighs about 2%). A second
  ``--recovery none`` run per round gives the noise floor of each comparison on this machine
  (``..._noise``: the median of |none / none again - 1|). ``--ff-only`` runs only these arms
  (``--ff-rounds`` of them).
torchft is not run here: it is an optional extra, absent unless installed (``torchft`` import).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from resihp.detect.records import JOB_SECRET_ENV

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
    "--pp",
    "2",
    "--no-live",
    "--json",
    "--heartbeat-timeout",
    "3",
    "--timeout",
    "60",
]


def run(out: Path, *args: str, nodes: int = 1) -> dict:
    """One ``resihp run``; with ``nodes`` 2, two launchers on this machine (node 0's summary)."""
    # every node of a job is launched with the same secret (what steers the job is signed with it)
    env = {**os.environ, "OMP_NUM_THREADS": "1", JOB_SECRET_ENV: secrets.token_hex(32)}
    cmd = [sys.executable, "-m", "resihp.cli", "run", *MODEL, *args]
    others = []
    if nodes > 1:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd += [
            "--nnodes",
            str(nodes),
            "--nproc-per-node",
            "2",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
        ]
        others = [
            subprocess.Popen(
                [*cmd, "--node-rank", str(n), "-o", str(out) + f"-node{n}"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for n in range(1, nodes)
        ]
        cmd += ["--node-rank", "0"]
    t0 = time.time()
    proc = subprocess.run(
        [*cmd, "-o", str(out)], capture_output=True, text=True, env=env, timeout=900
    )
    for other in others:
        other.wait(timeout=120)
    summary = (
        json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    )
    summary["_rc"], summary["_wall_s"], summary["_stderr"] = (
        proc.returncode,
        time.time() - t0,
        proc.stderr[-400:],
    )
    return summary


def step_walls(out: Path) -> pd.Series:
    trace = pd.read_parquet(out / "ops.parquet")
    return trace[trace.optype == "step"].groupby("step").duration.max()


def failure_free_arm(out: Path, steps: int, recovery: str) -> dict:
    s = run(out, "--steps", str(steps), "--recovery", recovery)
    row = {
        "rc": s["_rc"],
        "tokens_per_s": s.get("tokens_per_s"),
        "step_period_s": None,
        "first_step_s": None,
    }
    if (out / "ops.parquet").exists():
        trace = pd.read_parquet(out / "ops.parquet")
        starts = trace[trace.optype == "step"].sort_values("step")
        periods = [
            float(g[g.step >= 3].start_ts.diff().median()) for _, g in starts.groupby("rank")
        ]
        walls = starts.groupby("step").duration.max()
        row["step_period_s"] = round(statistics.median(periods), 5)
        row["first_step_s"] = round(float(walls.iloc[0] - walls.iloc[3:].median()), 4)
    return row


def replica_arm(out: Path, steps: int, fail: int, nodes: int = 1) -> dict:
    s = run(
        out,
        "--steps",
        str(steps),
        "--recovery",
        "replica",
        "--inject",
        f"stop:rank=1,step={fail}",
        nodes=nodes,
    )
    rec = s.get("recovery") or {}
    walls = step_walls(out)
    median = float(walls[walls.index < fail].median())
    rejoin = rec.get("rejoined_step")
    around = (
        walls[(walls.index >= rejoin - 1) & (walls.index <= rejoin + 1)]
        if rejoin
        else walls.iloc[:0]
    )
    return {
        "rc": s["_rc"],
        "stall_s": rec.get("survivor_stall_s"),
        "stall_steps": rec.get("survivor_stall_steps"),
        "median_step_s": round(median, 4),
        "detected_s": rec.get("detected_s"),
        "rejoined_step": rejoin,
        "restart_s": rec.get("restart_s"),
        "catchup_s": rec.get("catchup_s"),
        "catchup_over_step": round(rec["catchup_s"] / median, 3) if rec.get("catchup_s") else None,
        "rejoin_slowest_over_median": round(float(around.max()) / median, 3)
        if len(around)
        else None,
        "transfer_bytes": rec.get("transfer_bytes"),
        "error": s.get("error"),
    }


def restart_arm(out: Path, steps: int, fail: int, how: str) -> dict:
    if how == "memory":
        s = run(
            out,
            "--steps",
            str(steps),
            "--recovery",
            "restart",
            "--inject",
            f"stop:rank=1,step={fail}",
        )
        rec = s.get("recovery") or {}
        walls = step_walls(out)
        median = float(walls[walls.index < fail].median())
        stall = (rec.get("stall_s") or 0.0) + (rec.get("lost_steps") or 0) * median
        extra = {
            "source": rec.get("source"),
            "restart_stall_s": rec.get("stall_s"),
            "lost_steps": rec.get("lost_steps"),
        }
    else:
        s = run(
            out, "--steps", str(steps), "--ckpt-every", "5", "--inject", f"stop:rank=1,step={fail}"
        )
        change = (s.get("plan_changes") or [{}])[0]
        walls = step_walls(out)
        median = float(walls[walls.index < fail].median())
        done = int(walls.index.max()) + 1  # steps complete before the failure
        lost = max(0, done - change.get("resumed_step", done))
        before = pd.read_parquet(out / "ops.parquet")
        after = pd.read_parquet(out / "restart" / "ops.parquet")
        last_end = float((before.start_ts + before.duration)[before.optype == "step"].max())
        first_start = float(after[after.optype == "step"].start_ts.min())
        stall = first_start - last_end + lost * median
        extra = {"restart_stall_s": round(first_start - last_end, 3), "lost_steps": lost}
    return {
        "rc": s["_rc"],
        "stall_s": round(stall, 3),
        "stall_steps": round(stall / median, 3),
        "median_step_s": round(median, 4),
        **extra,
        "error": s.get("error"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--fail-step", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--ff-only", action="store_true", help="only the failure-free arms")
    parser.add_argument(
        "--ff-rounds", type=int, default=None, help="rounds of the failure-free arms"
    )
    parser.add_argument(
        "--nodes", action="store_true", help="also the replica arm on two launchers"
    )
    parser.add_argument(
        "--nodes-only", action="store_true", help="only the replica arms, one and two launchers"
    )
    args = parser.parse_args()
    arms = ([] if args.ff_only else ["replica", "memory", "disk"]) + [
        "ff-replica",
        "ff-none",
        "ff-none-again",
    ]
    if args.nodes or args.nodes_only:
        arms.insert(1, "replica-2nodes")
    if args.nodes_only:
        arms = ["replica", "replica-2nodes"]
    args.rounds = args.ff_rounds or args.rounds if args.ff_only else args.rounds
    every = [
        "replica",
        "replica-2nodes",
        "memory",
        "disk",
        "ff-replica",
        "ff-none",
        "ff-none-again",
    ]
    results: dict[str, list[dict]] = {a: [] for a in every}
    with tempfile.TemporaryDirectory(prefix="replica-ft-") as tmp:
        for r in range(args.rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            for arm in order:
                out = Path(tmp) / f"{arm}-{r}"
                if arm in ("replica", "replica-2nodes"):
                    results[arm].append(
                        replica_arm(
                            out, args.steps, args.fail_step, 2 if arm == "replica-2nodes" else 1
                        )
                    )
                elif arm in ("memory", "disk"):
                    results[arm].append(restart_arm(out, args.steps, args.fail_step, arm))
                else:
                    results[arm].append(
                        failure_free_arm(
                            out, args.steps, "replica" if arm == "ff-replica" else "none"
                        )
                    )
                print(arm, r, json.dumps(results[arm][-1]), file=sys.stderr, flush=True)

    def med(arm: str, key: str) -> float | None:
        values = [x[key] for x in results[arm] if x.get(key) is not None]
        return round(statistics.median(values), 4) if values else None

    try:
        import torchft  # noqa: F401 - an optional extra

        torchft_note = "installed, not yet wired into this harness"
    except ImportError:
        torchft_note = "not installed (optional extra): not run"
    replica_stall, memory_stall, disk_stall = (
        med("replica", "stall_s"),
        med("memory", "stall_s"),
        med("disk", "stall_s"),
    )
    ff_replica, ff_none = med("ff-replica", "tokens_per_s"), med("ff-none", "tokens_per_s")
    pairs = list(
        zip(results["ff-replica"], results["ff-none"], results["ff-none-again"], strict=True)
    )
    replica_keys = (
        "stall_s",
        "stall_steps",
        "median_step_s",
        "detected_s",
        "restart_s",
        "catchup_s",
        "catchup_over_step",
        "rejoin_slowest_over_median",
        "rejoined_step",
    )

    def paired(key: str, slower: bool) -> tuple[list[float], list[float]]:
        """Per round, replica's cost over none's (``slower``: a larger ``key`` is worse), and the
        noise floor |none / none again - 1|."""
        over = [
            (r[key] / n[key] if slower else n[key] / r[key]) - 1
            for r, n, _ in pairs
            if r.get(key) and n.get(key)
        ]
        noise = [abs(n[key] / a[key] - 1) for _, n, a in pairs if n.get(key) and a.get(key)]
        return over, noise

    def median(values: list[float]) -> float | None:
        return round(statistics.median(values), 4) if values else None

    over, noise = paired("step_period_s", slower=True)
    over_tps, noise_tps = paired("tokens_per_s", slower=False)
    startup = [
        r["first_step_s"] - n["first_step_s"]
        for r, n, _ in pairs
        if r.get("first_step_s") is not None and n.get("first_step_s") is not None
    ]
    summary = {
        "harness": {
            "model": MODEL,
            "steps": args.steps,
            "fault": f"stop:rank=1,step={args.fail_step}",
            "rounds": args.rounds,
            "machine": os.cpu_count(),
        },
        "replica": {k: med("replica", k) for k in replica_keys},
        "replica_2nodes": {k: med("replica-2nodes", k) for k in replica_keys}
        if results["replica-2nodes"]
        else None,
        "memory_restart": {
            k: med("memory", k) for k in ("stall_s", "stall_steps", "restart_stall_s", "lost_steps")
        },
        "disk_restart": {
            k: med("disk", k) for k in ("stall_s", "stall_steps", "restart_stall_s", "lost_steps")
        },
        "stall_vs_disk_restart": round(replica_stall / disk_stall, 4)
        if replica_stall and disk_stall
        else None,
        "stall_vs_memory_restart": round(replica_stall / memory_stall, 4)
        if replica_stall and memory_stall
        else None,
        "failure_free_overhead": median(over),
        "failure_free_overhead_each": [round(x, 4) for x in over],
        "failure_free_noise": median(noise),
        "failure_free_step_period_s": {
            "replica": med("ff-replica", "step_period_s"),
            "none": med("ff-none", "step_period_s"),
        },
        "failure_free_startup_s": median(startup),
        "failure_free_overhead_tokens_per_s": median(over_tps),
        "failure_free_overhead_tokens_per_s_each": [round(x, 4) for x in over_tps],
        "failure_free_noise_tokens_per_s": median(noise_tps),
        "failure_free_overhead_tokens_per_s_of_medians": round(ff_none / ff_replica - 1, 4)
        if ff_replica and ff_none
        else None,
        "failure_free_tokens_per_s": {"replica": ff_replica, "none": ff_none},
        "torchft": torchft_note,
        "targets": {
            "stall_vs_disk_restart": "<= 0.05",
            "stall_steps": "<= 3",
            "catchup_over_step": "<= 1",
            "rejoin_slowest_over_median": "<= 2",
            "failure_free_overhead": "<= 0.03",
        },
        "runs": results,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
