"""CLI verb ``resihp follow RUN``: detect live beside a running job (waits for it to start)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from resihp.detect.config import DetectorConfig
from resihp.errors import InputError

# Imports inside the verb are deferred for start-up time: ``resihp`` imports every commands module
# to build its help, and following pulls in torch and the detector.


def follow_cmd(
    run: Annotated[
        Path,
        typer.Argument(
            help="Run folder of a job writing resihp streams "
            "(resihp.attach(out=...) or resihp run -o ...)"
        ),
    ] = None,
    store: Annotated[
        str,
        typer.Option(
            help="HOST:PORT of a resihp run job's store (node 0's "
            "--rdzv-endpoint): follow its control plane from any machine "
            "that reaches it, no shared files"
        ),
    ] = None,
    start_timeout: Annotated[
        float,
        typer.Option(
            min=0, max=86400 * 7, help="Seconds to wait for the job to write its job.yaml"
        ),
    ] = 600.0,
    timeout: Annotated[
        float,
        typer.Option(
            min=0,
            max=86400 * 365,
            help="Stop following after this many seconds (default: until every rank is done)",
        ),
    ] = None,
    sensitivity: Annotated[
        float, typer.Option(help="Divides every CUSUM allowance and threshold (see resihp detect)")
    ] = 1.0,
    calibration_steps: Annotated[
        int,
        typer.Option(
            min=3,
            help="Steps of each rank its healthy baseline is learned on (a resihp run's "
            "--calibration-steps)",
        ),
    ] = DetectorConfig.calibration_steps,
    alarm_floor: Annotated[
        float,
        typer.Option(
            help="Effect-size floor: no fail-slow or link-slow "
            "is raised below this factor (see resihp detect)"
        ),
    ] = DetectorConfig.alarm_floor,
    nice: Annotated[
        int,
        typer.Option(
            min=0,
            max=19,
            help="Lower the follower's CPU priority by this "
            "much (Linux nice; 0 keeps it): beside the job on its machine it "
            "must not take a core from the ranks it times",
        ),
    ] = 10,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the final report as JSON")
    ] = False,
) -> None:
    """Detect live on a running job, printing each finding as it comes.

    It waits for the job to start, and prints the stragglers still open when the job ends.
    \f
    Args:
        run: run folder of a job writing resihp streams (resihp.attach(out=...) or resihp run -o
            ...).
        store: HOST:PORT of a resihp run job's store (node 0's --rdzv-endpoint): follow its control
            plane from any machine that reaches it, no shared files.
        start_timeout: seconds to wait for the job to write its job.yaml.
        timeout: stop following after this many seconds (default: until every rank is done).
        sensitivity: divides every CUSUM allowance and threshold (see resihp detect).
        calibration_steps: steps of each rank its healthy baseline is learned on (a resihp run's
            --calibration-steps).
        alarm_floor: effect-size floor: no fail-slow or link-slow is raised below this factor (see
            resihp detect).
        nice: lower the follower's CPU priority by this much (Linux nice; 0 keeps it): beside the
            job on its machine it must not take a core from the ranks it times.
        json_out: print the final report as JSON.
    """
    if (run is None) == (store is None):
        raise InputError("resihp follow: give a run folder or --store HOST:PORT (one of them)")
    if nice:
        os.nice(nice)  # first: the imports below (torch) are most of what the follower ever runs

    from resihp.detect.online import budget_line
    from resihp.train import logs
    from resihp.train.follow import follow

    logs.setup(None, 0)
    config = DetectorConfig(
        sensitivity=sensitivity, calibration_steps=calibration_steps, alarm_floor=alarm_floor
    )
    report = follow(run, config, timeout_s=timeout, start_timeout_s=start_timeout, store=store)
    if json_out:
        print(json.dumps(report, default=str))
        return
    typer.echo(
        f"{run or store}: {report['steps']} step(s) judged, {len(report['events'])} event(s)"
    )
    if report.get("budget", {}).get("series"):
        typer.echo(f"  {budget_line(report['budget'])}")
    for s in report["stragglers"]:
        phase = f" ({s['phase']} only)" if s.get("phase") else ""
        typer.echo(
            f"  straggler: rank {s['rank']} x{s['slowdown']:.2f} from step {s['onset_step']} "
            f"(detected at {s['detected_step']}){phase}"
        )


def register(app: typer.Typer) -> None:
    app.command("follow")(follow_cmd)
