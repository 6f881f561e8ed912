"""A run's summary (``summary.json``): written, read back, and the live and replica fields."""

from __future__ import annotations

import json
import math
from pathlib import Path

from resihp.ckpt.integrity import write_json_atomic
from resihp.errors import InputError
from resihp.parallel import Placement
from resihp.train.config import RunConfig

# Imports inside the functions are deferred for start-up time: the CLI imports this module to build
# its help, and the live loop pulls in OR-Tools, networkx and pandas.


def live_loop(cfg: RunConfig):
    """The run's live loop, or None without live re-planning.

    A run with ``--no-live`` does not import the planner and the detector (OR-Tools, networkx,
    pandas) on its way to its launch.
    """
    if not cfg.live.live:
        return None
    # deferred: the planner and the detector, for live runs only
    from resihp.launch.live import LiveLoop

    return LiveLoop(cfg)


def write_summary(out: Path, summary: dict) -> None:
    """Write ``summary`` to ``out/summary.json``, whole or not at all, NaN as null."""
    write_json_atomic(out / "summary.json", json_safe(summary))


def json_safe(value):
    """NaN and infinities are not JSON: null instead (the summary must parse anywhere)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def live_fields(cfg: RunConfig, loop, summary: dict) -> dict:
    """The DESIGN summary fields: detection delay, plan changes, throughput around a slow fault.

    Args:
        cfg: the run's configuration (its folder, faults and world).
        loop: the run's live loop (``LiveLoop``): its events, plan changes and calibration.
        summary: the run's summary so far (its tokens/s).
    """
    # deferred: pandas and the report's plotting, after the run
    from resihp.launch.report import fault_summary
    from resihp.opstrace import read_ops_trace

    loop.save()
    out = Path(cfg.out)
    applied_path = out / "plan_changes.json"
    records = json.loads(applied_path.read_text()) if applied_path.exists() else []
    # each change with its plan (the Plan JSON), the step it was applied at and, for a new layout,
    # what moved (bytes, the least the two layouts need, seconds) and the spares it left
    moved = (
        "moved_bytes",
        "minimum_bytes",
        "written_bytes",
        "read_bytes",
        "relayout_s",
        "generation",
        "spares",
    )
    changes = loop.as_applied(records, moved)
    trace = read_ops_trace(out / "ops.parquet") if (out / "ops.parquet").exists() else None
    if trace is not None:
        # layers moved in place, or (replica mode) replicas' groups re-formed: the slowest rank's
        # seconds and, where the job recorded no totals, the bytes the ranks sent, from the step's
        # ``replan-*`` ops; in replica mode the layers other replicas moved beside re-formed ones
        # (a layer moved is exactly what its new stage needs: its bytes are the minimum too)
        moves = trace[trace.optype.isin(["replan-layers", "replan-layout"])]
        for change in changes:
            at = moves[moves.step == change["applied_step"]]
            if not len(at):
                continue
            change["move_s"] = round(float(at.duration.max()), 4)
            layers = int(at[at.optype == "replan-layers"]["bytes"].fillna(0).sum())
            if "moved_bytes" not in change:
                change["moved_bytes"] = int(at["bytes"].fillna(0).sum())
            elif layers and "minimum_bytes" in change:
                change.update(
                    moved_bytes=change["moved_bytes"] + layers,
                    minimum_bytes=change["minimum_bytes"] + layers,
                )
            if "layout" in change and "spares" not in change:  # the ranks its groups leave out
                world = cfg.dims().world_size
                change["spares"] = Placement.parse(change["layout"], world).spares(world)
    # each change's estimate beside the step measured while it was in force
    for change, check in zip(changes, loop.measured_steps([c["applied_step"] for c in changes])):
        change.update(check)
    fields = {
        "detection_delay_steps": None,
        "plan_changes": changes,
        "events": loop.events,
        "planner_calibration": loop.calibration,
        "tokens_per_s_before": summary.get("tokens_per_s"),
        "tokens_per_s_after": summary.get("tokens_per_s"),
        "recovered_fraction": None,
        "live_error": loop.error,
    }
    slow = [f for f in cfg.fault_list() if f.kind == "slow" and f.step is not None]
    if slow and trace is not None:
        report = fault_summary(
            trace, slow[0].to_dict(), loop.events, changes, cfg.dims().world_size
        )
        fields.update({k: v for k, v in report.items() if k not in ("steps", "injected")})
    return fields


def replica_fields(out: Path, outcome, summary: dict) -> None:
    """Replica mode's summary fields, from the launcher's records and the ops trace.

    Args:
        out: the run folder (its ``ops.parquet``; the plot and summary are written there).
        outcome: the launch's ``Outcome`` (its replica records).
        summary: the summary, given ``recovery``, ``members`` (per step from first_step, the
            replicas that trained it) and ``timeline`` (the plot's path).
    """
    # deferred: the replica launcher and pandas, for replica runs only
    from resihp.launch.replicas import recovery_summary
    from resihp.opstrace import read_ops_trace

    if (out / "ops.parquet").exists():
        trace = read_ops_trace(out / "ops.parquet")
        summary["recovery"] = recovery_summary(outcome, trace)
        summary["members"] = outcome.replica_members
        if summary["recovery"] is not None:
            from resihp.launch.report import plot_replicas  # deferred: matplotlib

            plot_replicas(trace, summary["recovery"], out / "timeline.png")
            summary["timeline"] = str(out / "timeline.png")
    write_summary(out, summary)


def run_summary(cfg: RunConfig, outcome) -> dict:
    """The launch's summary: the one rank 0 wrote, else one made from the ops the ranks recorded."""
    # deferred: torch, after the launch
    from resihp.train.worker import write_job_files

    out = Path(cfg.out)
    summary_path = out / "summary.json"
    if outcome.returncode != 0 or summary_job(summary_path) != cfg.job_id:
        try:
            summary = write_job_files(cfg, out)
        except InputError:  # no rank recorded a single op
            summary = {}
        summary.update(
            {
                "failure": outcome.failure.to_dict() if outcome.failure else None,
                "error": outcome.error,
            }
        )
        summary = json_safe(summary)
        write_summary(out, summary)
        return summary
    return json.loads(summary_path.read_text())


def summary_job(path: Path) -> str | None:
    """The job id a summary file names (None: none there, or not a summary)."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return summary.get("job_id") if isinstance(summary, dict) else None
