"""The detector suite (``resihp detect-eval``) at several effect-size floors, beside a saved run.

Usage: ``python benchmarks/detector_floor.py --seeds 0 1 --floors 1.0 1.25
[--before S=FILE ...]``: per seed and floor, resihp's F1, false alarms, delays and each case's
figures (by slowdown factor and by kind); ``--before`` adds a ``resihp detect-eval --seed S
--json`` document of another checkout, and the change of every figure against it. One JSON
document on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from resihp.detect.config import DetectorConfig  # noqa: E402
from resihp.detect.suite import evaluate_suite  # noqa: E402

FIELDS = (
    "tp",
    "fp",
    "fn",
    "f1",
    "false_alarms_per_10k_healthy_steps",
    "delay_steps_median",
    "delay_steps_max",
)


def cases(result: dict, method: str = "resihp") -> dict:
    """A suite result's figures for ``method``: the totals, each kind and each slowdown factor."""
    pick = lambda s: {k: s[k] for k in FIELDS if k in s}  # noqa: E731
    return {
        "total": pick(result["methods"][method]),
        **{f"kind {k}": pick(s) for k, s in result["by_kind"][method].items()},
        **{f"fail-slow x{f}": pick(s) for f, s in result["by_factor"][method].items()},
        "stage_imbalance_trace": result["stage_imbalance_trace"].get(method),
    }


def changed(before: dict, after: dict) -> list[str]:
    """The cases whose figures differ."""
    return [name for name in before if before[name] != after.get(name)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--floors", type=float, nargs="+", default=[1.25])
    ap.add_argument("--before", nargs="*", default=[], help="SEED=FILE of a detect-eval JSON")
    args = ap.parse_args()
    pairs = (b.split("=", 1) for b in args.before)
    before = {int(s): cases(json.loads(Path(f).read_text())) for s, f in pairs}
    out: dict = {"seeds": args.seeds, "floors": args.floors, "runs": {}}
    for seed in args.seeds:
        for floor in args.floors:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                res = evaluate_suite(
                    seed=seed, config=DetectorConfig(alarm_floor=floor), methods=["resihp"]
                )
            now = cases(res)
            run = {"traces": res["traces"], "cases": now}
            if seed in before:
                run["changed_against_before"] = changed(before[seed], now)
            out["runs"][f"seed {seed} floor {floor:g}"] = run
    out["before"] = {f"seed {s}": c for s, c in before.items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
