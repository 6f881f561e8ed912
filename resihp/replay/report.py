"""Replay results: the JSON summary of docs/DESIGN.md, a rich table, and throughput timelines."""

from __future__ import annotations

import numpy as np

from resihp.replay.engine import ReplayOutcome
from resihp.replay.scenario import FailureEvent, Scenario

BASE = "resihp"


def _timeline(outcome: ReplayOutcome, points: int = 96) -> list[list[float]]:
    """Mean tokens/s over ``points`` equal slices of the run, as [slice start s, tokens/s]."""
    edges = np.linspace(0.0, outcome.duration_s, points + 1)
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        tokens = sum(max(0.0, min(b, e) - max(a, s)) * r for s, e, r in outcome.timeline)
        out.append([round(float(a), 1), round(tokens / (b - a), 1)])
    return out


def summary(
    scenario: Scenario,
    outcomes: list[ReplayOutcome],
    events: list[FailureEvent],
    wall_s: dict[str, float] | None = None,
    timeline_points: int = 96,
) -> dict:
    """The ``resihp replay --json`` document.

    Args:
        scenario: the replayed scenario.
        outcomes: one outcome per policy.
        events: the failure events replayed.
        wall_s: replay wall seconds per policy name (absent: not reported).
        timeline_points: equal slices of the run each policy's tokens/s timeline has.
    """
    wall_s = wall_s or {}
    by_name = {o.policy: o for o in outcomes}
    policies = []
    for o in outcomes:
        delays = [d["delay_s"] for d in o.detections if d["true"] and d["delay_s"] is not None]
        mean_step = o.duration_s / o.replayed_steps if o.replayed_steps else float("nan")
        entry = {
            "name": o.policy,
            "tokens_per_s": round(o.tokens_per_s, 1),
            "effective_time": round(o.effective_time, 4),
            "false_alarms": o.false_alarms,
            "bound_fraction": round(o.bound_fraction, 4),
            "total_tokens": round(o.tokens),
            "downtime_s": round(o.downtime_s, 1),
            "lost_work_s": round(o.lost_s, 1),
            "detections": sum(1 for d in o.detections if d["true"]),
            "detection_delay_s": round(float(np.mean(delays)), 1) if delays else None,
            "detection_delay_steps": round(float(np.mean(delays)) / mean_step, 1)
            if delays
            else None,
            "actions": len(o.actions) - 1,
            "simulated_steps": o.simulated_steps,
            "replayed_steps": round(o.replayed_steps),
            "timeline": _timeline(o, timeline_points),
        }
        if o.policy in wall_s:
            entry["replay_wall_s"] = round(wall_s[o.policy], 2)
        policies.append(entry)
    cap = outcomes[0].capacity_tokens / outcomes[0].duration_s if outcomes else float("nan")
    out = {
        "scenario": scenario.name,
        "family": scenario.family,
        "devices": len(scenario.cluster),
        "model": scenario.model.name,
        "duration_s": scenario.duration_s,
        "events": {
            k: sum(1 for e in events if e.kind == k) for k in ("stop", "slow", "link", "recover")
        },
        "policies": policies,
        "capacity_tokens_per_s": round(cap, 1),
    }
    if BASE in by_name:
        out["speedups"] = {
            o.policy: round(by_name[BASE].tokens / o.tokens, 4) if o.tokens > 0 else None
            for o in outcomes
            if o.policy != BASE
        }
    return out


def table(doc: dict):
    """A rich table of the summary."""
    from rich.table import Table

    t = Table(
        title=f"{doc['scenario']} ({doc['devices']} devices, {doc['model']}, "
        f"{doc['duration_s'] / 3600:g} h; capacity {doc['capacity_tokens_per_s']:,.0f} tok/s)"
    )
    for col in (
        "policy",
        "tokens/s",
        "of bound",
        "effective",
        "downtime s",
        "lost s",
        "detections",
        "false alarms",
        "delay (steps)",
        "resihp speedup",
    ):
        t.add_column(col, justify="left" if col == "policy" else "right", no_wrap=col == "policy")
    speed = doc.get("speedups", {})
    for p in doc["policies"]:
        sp = speed.get(p["name"])
        t.add_row(
            p["name"],
            f"{p['tokens_per_s']:,.0f}",
            f"{p['bound_fraction']:.3f}",
            f"{p['effective_time']:.3f}",
            f"{p['downtime_s']:,.0f}",
            f"{p['lost_work_s']:,.0f}",
            str(p["detections"]),
            str(p["false_alarms"]),
            "-" if p["detection_delay_steps"] is None else f"{p['detection_delay_steps']:.1f}",
            "-" if sp is None else f"{sp:.3f}x",
        )
    return t


def plot(doc: dict, outcomes: list[ReplayOutcome], events: list[FailureEvent], path: str) -> None:
    """Small multiples of throughput over time: one panel per policy, with shared axes.

    Each panel draws the capacity bound and the failure events, so that no policy's line hides
    another's.

    Args:
        doc: the ``summary`` document (each policy's figures for its panel title).
        outcomes: one outcome per policy.
        events: the failure events replayed.
        path: the PNG file to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(outcomes)
    cols = 1 if n <= 3 else 2
    rows = -(-n // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(11, 1.9 * rows + 0.8), sharex=True, sharey=True, squeeze=False
    )
    hours = 3600.0
    cap = outcomes[0].capacity_timeline
    cap_x = [x for a, b, _ in cap for x in (a / hours, b / hours)]
    cap_y = [c for _, _, c in cap for _ in (0, 1)]
    colors = {"stop": "red", "slow": "orange", "link": "purple", "recover": "green"}
    by_name = {p["name"]: p for p in doc.get("policies", [])}
    for i, o in enumerate(outcomes):
        ax = axes[i // cols][i % cols]
        ax.plot(cap_x, cap_y, color="black", lw=1, ls="--", label="capacity bound")
        xs = [x for a, b, _ in o.timeline for x in (a / hours, b / hours)]
        ax.plot(xs, [r for _, _, r in o.timeline for _ in (0, 1)], lw=1.2, color=f"C{i}")
        for kind, color in colors.items():
            times = sorted({e.at_s for e in events if e.kind == kind})
            for j, t in enumerate(times):
                ax.axvline(
                    t / hours,
                    color=color,
                    alpha=0.25,
                    lw=0.8,
                    label=kind if (j == 0 and i == 0) else None,
                )
        frac = by_name.get(o.policy, {}).get("bound_fraction")
        ax.set_title(
            o.policy + (f"  ({frac:.1%} of bound)" if frac is not None else ""),
            fontsize=9,
            loc="left",
        )
        if i % cols == 0:
            ax.set_ylabel("tokens / s", fontsize=8)
    for j in range(n, rows * cols):
        axes[j // cols][j % cols].axis("off")
    for j in range(max(0, n - cols), n):  # the lowest panel of each column
        axes[j // cols][j % cols].set_xlabel("hours")
        axes[j // cols][j % cols].xaxis.set_tick_params(labelbottom=True)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, ncol=len(labels), loc="upper right")
    fig.suptitle(f"{doc['scenario']}: throughput by policy", x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
