"""The summary of a run with an injected fault, and its plot.

Throughput before, during and after re-planning, detection delay and adaptation times (the DESIGN
``resihp demo --json`` fields)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from resihp.train.worker import step_table

WARMUP_STEPS = 2


def _window_tps(table: pd.DataFrame, first: int, last: int) -> float | None:
    """Median per-step tokens/s over steps ``[first, last)`` (medians: the machine is shared)."""
    rows = table[(table.index >= first) & (table.index < last)]
    return float(np.median(rows.tokens / rows.wall_s)) if len(rows) else None


def cores_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def oversubscription(processes: int, device: str = "cpu") -> dict:
    """Whether a CPU run had more processes than cores, and what that does to its figures."""
    cores = cores_available()
    out = {
        "processes": processes,
        "cpu_cores": cores,
        "oversubscribed": device == "cpu" and processes > cores,
    }
    if out["oversubscribed"]:
        out["oversubscribed_note"] = (
            f"{processes} processes on {cores} cores: ranks take turns on the cores, so tokens/s "
            "is below what the model runs at on dedicated cores, and a slowed rank that sleeps "
            "lends its core to the others (measured slowdowns come out smaller than injected)"
        )
    return out


def fault_summary(
    trace: pd.DataFrame, injected: dict, events: list[dict], changes: list[dict], world_size: int
) -> dict:
    """The DESIGN summary fields of a run with one injected slow rank.

    Args:
        trace: the run's ops trace.
        injected: the fault (``rank``, ``step``, ``factor``).
        events: the detector's events (DESIGN event JSON).
        changes: the plan changes of the live loop (``applied_step`` once applied).
        world_size: the job's ranks.
    """
    table = step_table(trace)
    onset = int(injected["step"])
    slow = [e for e in events if e["kind"] == "fail-slow" and e.get("rank") == injected["rank"]]
    detected = min((int(e["detected_step"]) for e in slow), default=None)
    applied = [c for c in changes if c.get("applied_step") is not None]
    plan_step = min((c["applied_step"] for c in applied), default=None)
    factor = float(injected.get("factor", 1.0))
    capacity = (world_size - 1 + 1 / factor) / world_size
    before = _window_tps(table, WARMUP_STEPS, onset)
    during = _window_tps(table, onset, plan_step if plan_step is not None else len(table) + onset)
    after = _window_tps(table, plan_step + 1, 10**9) if plan_step is not None else None
    adapt = trace[trace.optype.str.startswith("replan")].groupby(["step", "optype"]).duration.max()
    return {
        "steps": int(len(table)),
        "injected": injected,
        "detected_step": detected,
        "detection_delay_steps": None if detected is None else detected - onset,
        "plan_changes": changes,
        "plan_applied_step": plan_step,
        "adaptation_s": {f"{op}@{step}": round(float(v), 4) for (step, op), v in adapt.items()},
        "tokens_per_s_before": before,
        "tokens_per_s_during": during,
        "tokens_per_s_after": after,
        "remaining_capacity_fraction": capacity,
        "recovered_fraction": (after / (before * capacity)) if after and before else None,
        "events": events,
    }


def plot_run(trace: pd.DataFrame, summary: dict, path: str | Path) -> None:
    """Plot tokens/s per step with the fault, its detection and the plan change marked.

    Args:
        trace: the run's ops trace.
        summary: its ``fault_summary``.
        path: the PNG file to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = step_table(trace)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(table.index, table.tokens / table.wall_s, marker="o", ms=3, label="tokens/s per step")
    marks = [
        ("fault injected", summary["injected"]["step"], "tab:red"),
        ("detected", summary.get("detected_step"), "tab:orange"),
        ("new plan applied", summary.get("plan_applied_step"), "tab:green"),
    ]
    for label, step, color in marks:
        if step is not None:
            ax.axvline(step, color=color, ls="--", label=f"{label} (step {step})")
    for key, style in (("tokens_per_s_before", ":"), ("tokens_per_s_after", "-.")):
        if summary.get(key):
            ax.axhline(summary[key], color="gray", ls=style, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / s")
    rf = summary.get("recovered_fraction")
    ax.set_title(
        f"{summary['injected']['kind']} x{summary['injected'].get('factor', '')} on rank "
        f"{summary['injected']['rank']}"
        + (f"; recovered {rf:.2f} of remaining capacity" if rf else "")
    )
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_replicas(trace: pd.DataFrame, recovery: dict, path: str | Path) -> None:
    """Replica-level fault tolerance on one timeline: tokens/s per step, and who trained each step.

    Below the tokens/s, which replicas trained each step (a lost replica's absence shaded, its
    failure and return marked).

    Args:
        trace: the run's ops trace.
        recovery: the summary's ``recovery`` fields.
        path: the PNG file to write.
    """
    import matplotlib  # deferred: start-up time

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = step_table(trace, complete_only=False)
    steps = trace[trace.optype == "step"]
    present = steps.groupby("dp_rank").step.apply(set)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 4.5), sharex=True, height_ratios=[3, 1.2])
    top.plot(table.index, table.tokens / table.wall_s, marker="o", ms=2, label="tokens/s per step")
    for f in recovery.get("failures", [recovery]):
        if f.get("failed_step") is not None:
            top.axvline(
                f["failed_step"],
                color="tab:red",
                ls="--",
                label=f"replica {f['lost_replica']} lost ({f['cause']}, step {f['failed_step']})",
            )
        if f.get("rejoined_step") is not None:
            top.axvline(
                f["rejoined_step"],
                color="tab:green",
                ls="--",
                label=f"replica {f['lost_replica']} rejoined (step {f['rejoined_step']})",
            )
    top.set_ylabel("tokens / s")
    top.legend(fontsize=7, loc="lower left")
    for d, trained in present.items():
        absent = [s for s in table.index if s not in trained]
        bottom.scatter(sorted(trained), [d] * len(trained), s=4, color="tab:blue")
        bottom.scatter(absent, [d] * len(absent), s=4, color="tab:red", marker="x")
    bottom.set_yticks(list(present.index))
    bottom.set_ylabel("replica")
    bottom.set_xlabel("step (x: replica away, its micro-batches trained by the others)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
