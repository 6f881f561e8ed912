"""The summary of a GPU check's runs (``benchmarks/gpu_restart.sh``, ``benchmarks/gpu_replica.sh``):
each arm's steps, throughput, recovery and error from its ``ARM.json`` (``resihp run --json``), and
beside a failure-free arm ``ff`` the largest relative difference of its per-step losses from it.
Prints JSON.

    python benchmarks/gpu_compare.py DIR NAME ARM... [--before N]

``--before N``: also the largest difference over the first N steps (before the fault: the GPU
kernels' own run-to-run noise). A ``machine.txt`` in DIR is included as ``machine``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(run: Path) -> dict:
    try:
        return json.loads(run.read_text())
    except Exception as exc:  # a run that failed: its error is in its .err
        return {"error": f"{type(exc).__name__}: {exc}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("name")
    ap.add_argument("arms", nargs="+")
    ap.add_argument("--before", type=int, default=None)
    args = ap.parse_args()
    runs = {
        arm: load(args.dir / f"{arm}.json")
        for arm in args.arms
        if (args.dir / f"{arm}.err").exists()
    }
    out: dict = {"benchmark": args.name}
    if (args.dir / "machine.txt").exists():
        out["machine"] = (args.dir / "machine.txt").read_text().splitlines()
    base = runs.get("ff", {}).get("losses")
    for arm, s in runs.items():
        keep = {k: s.get(k) for k in ("steps", "tokens_per_s", "recovery", "error", "first_step")}
        if base and s.get("losses") and arm != "ff":
            rel = [abs(a - b) / abs(a) for a, b in zip(base, s["losses"])]
            keep["loss_max_rel_diff"] = max(rel)
            if args.before:
                keep["loss_max_rel_diff_before_fault"] = max(rel[: args.before])
            keep["losses_compared"] = len(rel)
        out[arm] = keep
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
