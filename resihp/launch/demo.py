"""The README's main job: 4 CPU processes train (DP 2 x PP 2) while one rank is made slow.

The live detector finds it, the planner re-plans, the job applies the plan and keeps training."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from resihp.detect.config import DetectorConfig
from resihp.errors import InputError
from resihp.launch.live import LiveLoop
from resihp.launch.report import fault_summary, plot_run
from resihp.launch.supervisor import supervise
from resihp.opstrace import read_ops_trace
from resihp.train.config import RunConfig
from resihp.train.inject import parse_fault
from resihp.train.worker import write_job_files

DEMO = dict(
    layers=4,
    hidden=64,
    heads=2,
    ffn_hidden=256,
    vocab=512,
    dp=2,
    pp=2,
    global_tokens=8192,
    budget=512,
    max_len=512,
    source="text",
)


class RunFailed(RuntimeError):
    pass


def run_demo(
    out: str | Path,
    steps: int,
    inject: str,
    plot: str | Path | None = None,
    on_step: Callable[[int], None] | None = None,
    detector_config: DetectorConfig | None = None,
    **overrides: object,
) -> dict:
    """Run the demo job into ``out``; returns the summary (also written to ``OUT/demo.json``).

    Args:
        out: the run folder.
        steps: training steps.
        inject: the slow fault, ``slow:rank=R,factor=F,step=S``.
        plot: the throughput plot's path (None: none).
        on_step: called with each finished step.
        detector_config: the live detector's config (default: ``DetectorConfig()``).
        **overrides: run configuration flags over the demo's.
    """
    out = Path(out)
    fault = parse_fault(inject)
    if fault.kind != "slow" or fault.step is None:
        raise InputError(
            f"--inject {inject!r}: the demo takes a slow fault at a step "
            f"(slow:rank=R,factor=F,step=S)"
        )
    calibration = (detector_config or DetectorConfig()).calibration_steps
    if fault.step <= calibration:
        raise InputError(
            f"--inject {inject!r}: inject after step {calibration} (the detector "
            f"calibrates on the first {calibration} steps)"
        )
    if fault.step + 8 > steps:
        raise InputError(
            f"--steps {steps}: leave at least 8 steps after the fault's step {fault.step}"
        )
    cfg = RunConfig.from_flags(**{**DEMO, **overrides}, steps=steps, inject=[inject], out=str(out))
    loop = LiveLoop(cfg, detector_config=detector_config)
    outcome = supervise(cfg, on_step=on_step, on_steps=loop.on_steps)
    if outcome.input_error:
        raise InputError(outcome.error)
    if outcome.error:
        raise RunFailed(outcome.error)
    loop.save()
    write_job_files(cfg, out)
    trace = read_ops_trace(out / "ops.parquet")
    changes = loop.as_applied(json.loads((out / "plan_changes.json").read_text()))
    summary = fault_summary(trace, fault.to_dict(), loop.events, changes, cfg.dims().world_size)
    plot = Path(plot) if plot else out / "demo.png"
    plot_run(trace, summary, plot)
    summary["plot"] = str(plot)
    summary["live_error"] = loop.error
    (out / "demo.json").write_text(json.dumps(summary, indent=1))
    return summary
