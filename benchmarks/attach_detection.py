"""Issue 19's done-when, measured: a user's own 2-rank DDP job with resihp attached
(``examples/ddp_straggler.py`` under torchrun, gloo, a tiny transformer over variable lengths), rank
1 made x2 slower per token from step 30, beside the identical loop without the slowdown.

Each way of detecting runs on its own job (two detectors at once would load the 2-core machine and
slow the job they watch): in the job (``--detect``: a rank-0 thread), and ``resihp follow --store``
beside it. Every run folder is then read offline (``resihp detect`` logic) with the default cost
model (``fitted``: each phase's cost fitted on the calibration window) and with analytic FLOPs (the
cost model before), so the two are compared on the same measurements.

Usage: ``python benchmarks/attach_detection.py [--seeds 3] [--steps 80]``; prints one JSON document:
per run the events and noise, and per way the largest delay after step 30 and the false alarms
(an alarm on the healthy job, or one raised before step 30 on the slowed job, whichever rank it
names).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from resihp.detect.config import DetectorConfig
from resihp.detect.online import detect_trace
from resihp.opstrace import read_meta, read_run_folder

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ddp_straggler.py"
ONSET, FACTOR = 30, 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(out: Path, port: int, seed: int, steps: int, slow: bool, detect: bool) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        str(EXAMPLE),
        "--out",
        str(out),
        "--seed",
        str(seed),
        "--steps",
        str(steps),
    ]
    if slow:
        cmd += ["--slow-rank", "1", "--factor", str(FACTOR), "--slow-from", str(ONSET)]
    if detect:
        cmd.append("--detect")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )


def _faults(events: list[dict]) -> list[dict]:
    return [
        {
            k: e.get(k)
            for k in (
                "rank",
                "phase",
                "onset_step",
                "detected_step",
                "slowdown",
                "alarm_factor",
                "rank_slowdown",
            )
        }
        for e in events
        if e["kind"] == "fail-slow"
    ]


def run_one(root: Path, way: str, seed: int, steps: int, slow: bool, nice: int = 10) -> dict:
    out, port = root / f"{way}-{'slow' if slow else 'healthy'}{seed}", _free_port()
    job = _job(out, port, seed, steps, slow, detect=way == "in-process")
    if way == "in-process":
        stdout, _ = job.communicate(timeout=900)
        report = json.loads([ln for ln in stdout.splitlines() if ln.startswith('{"report"')][-1])[
            "report"
        ]
    else:
        time.sleep(1.0)  # the follower waits for the store; a head start only saves retries
        follower = subprocess.run(
            [
                shutil.which("resihp") or "resihp",
                "follow",
                "--store",
                f"127.0.0.1:{port}",
                "--json",
                "--start-timeout",
                "120",
                "--nice",
                str(nice),
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
        job.communicate(timeout=900)
        report = json.loads(follower.stdout)
    return {
        "way": way,
        "seed": seed,
        "slow": slow,
        "live": {"faults": _faults(report["events"]), "noise": report["noise"]["0"]["noise"]},
        "offline": _offline(out),
    }


def _offline(out: Path) -> dict:
    """The run folder ``out`` read by ``resihp detect``'s logic, with each cost model."""
    df, meta_path = read_run_folder(out)
    meta, meta_dict = read_meta(meta_path)
    offline = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for name, cfg in (("fitted", DetectorConfig()), ("flops", DetectorConfig(fit_cost=False))):
            doc = detect_trace(df, meta, config=cfg, meta_dict=meta_dict)
            offline[name] = {
                "cost_model": doc["cost_model"],
                "noise": doc["noise"][0]["noise"],
                "faults": _faults(doc["events"]),
            }
    return offline


def rescore(root: Path) -> dict:
    """The run folders kept under ``root`` scored offline by the detector as it is now."""
    runs = []
    for out in sorted(p for p in root.iterdir() if p.is_dir()):
        way, _, rest = out.name.rpartition("-")
        slow = rest.startswith("slow")
        seed = int(rest.removeprefix("slow" if slow else "healthy"))
        runs.append({"way": way, "seed": seed, "slow": slow, "offline": _offline(out)})
    ways = sorted({r["way"] for r in runs})
    return {
        "rescored": str(root),
        "summary": {
            f"{way} offline {name}": _summary(
                [r for r in runs if r["way"] == way], lambda r, n=name: r["offline"][n]
            )
            for way in ways
            for name in ("fitted", "flops")
        },
        "runs": runs,
    }


def _summary(runs: list[dict], pick) -> dict:
    delays, missed, false_alarms, errors = [], 0, 0, []
    for r in runs:
        faults = pick(r)["faults"]
        if not r["slow"]:
            false_alarms += len(faults)
            continue
        # an alarm raised before the slowdown began is a false alarm, whichever rank it names
        hits = [f for f in faults if f["rank"] == 1 and f["detected_step"] >= ONSET]
        false_alarms += len(faults) - len(hits)
        if not hits:
            missed += 1
            continue
        delays.append(hits[0]["detected_step"] - ONSET)
        errors.append(abs(hits[0]["slowdown"] - FACTOR) / FACTOR)
    noise = [pick(r)["noise"] for r in runs]
    return {
        "delay_steps_max": max(delays) if delays else None,
        "delay_steps_median": float(np.median(delays)) if delays else None,
        "missed": missed,
        "false_alarms": false_alarms,
        "slowdown_error_median": round(float(np.median(errors)), 3) if errors else None,
        "noise_median": round(float(np.median(noise)), 3),
        "noise_range": [min(noise), max(noise)],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument(
        "--ways", default="in-process,follow", help="comma-separated: in-process, follow"
    )
    ap.add_argument("--nice", type=int, default=10, help="resihp follow --nice")
    ap.add_argument("--keep", type=Path, help="keep the run folders here (for --rescore)")
    ap.add_argument(
        "--rescore", type=Path, help="no jobs: score the run folders kept by --keep offline"
    )
    args = ap.parse_args()
    ways = args.ways.split(",")
    runs = []
    if args.rescore:
        print(json.dumps(rescore(args.rescore)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for seed in range(args.seeds):
            for slow in (True, False):  # interleaved: the machine's drift falls on both alike
                for way in ways:
                    runs.append(run_one(root, way, seed, args.steps, slow, args.nice))
    out = {
        "onset_step": ONSET,
        "factor": FACTOR,
        "seeds": args.seeds,
        "steps": args.steps,
        "follow_nice": args.nice,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "summary": {},
    }
    for way in ways:
        mine = [r for r in runs if r["way"] == way]
        out["summary"][f"{way} live"] = _summary(mine, lambda r: r["live"])
        for name in ("fitted", "flops"):
            out["summary"][f"{way} offline {name}"] = _summary(
                mine, lambda r, n=name: r["offline"][n]
            )
    out["runs"] = runs
    print(json.dumps(out))


if __name__ == "__main__":
    main()
