"""CLI verbs of the detector: ``resihp detect`` and ``resihp detect-eval``."""

from __future__ import annotations

import json
import math
import warnings
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from resihp.cli_options import renamed
from resihp.detect.config import DEFAULT_STEP_TIME_S, DetectorConfig
from resihp.errors import InputError
from resihp.progress import progress_bar


def _choices(name: str, values: list[str]) -> type[Enum]:
    """A str Enum, so that ``--help`` shows the choices and typer checks them."""
    return Enum(name, {v: v for v in values}, type=str)


# the baselines' names as resihp.detect.baselines registers them (kept here: no import for --help)
Method = _choices("Method", ["resihp", "raw-threshold", "relative-score", "iteration-changepoint"])
InputFormat = _choices("InputFormat", ["ops", "alibaba"])
DropColumn = _choices("DropColumn", ["seq_lens", "start_ts"])

# Imports inside the verbs are deferred for start-up time: ``resihp`` imports every commands module
# to build its help, and the verbs' work pulls in torch, lightgbm, OR-Tools or matplotlib.


def detect_cmd(
    trace: Annotated[
        Path,
        typer.Argument(
            help="Ops trace (.parquet or .csv), a run folder (its "
            "ops.parquet, else its per-rank ops.rank<R>.parquet or "
            "ranks/*.jsonl merged; its job.yaml as --meta), or an "
            "Alibaba PAI mini-batch file with --input-format alibaba"
        ),
    ],
    meta: Annotated[
        Path,
        typer.Option(
            help="Job meta YAML (dp_size, pp_size, tp_size, world_size, "
            "optional model fields); default: the job.yaml beside the trace, else "
            "sizes implied by the trace"
        ),
    ] = None,
    predictor: Annotated[
        str,
        typer.Option(
            help="Trained micro-batch predictor for the expected "
            "compute: a folder, an installed model's name, or auto "
            "(the one measured on the job's device: the meta's device "
            "field, else this machine); needs the meta's model "
            "fields. Without it: with one pipeline stage, the job's "
            "own cost fitted on its first steps; in a pipeline, its "
            "peers and FLOPs"
        ),
    ] = None,
    model: Annotated[str, typer.Option(hidden=True, help="Old name of --predictor")] = None,
    method: Annotated[Method, typer.Option(help="resihp, or a baseline")] = "resihp",
    input_format: Annotated[
        InputFormat,
        typer.Option("--input-format", help="Ops trace or Alibaba PAI mini-batch times"),
    ] = "ops",
    sensitivity: Annotated[
        float,
        typer.Option(
            help="Divides every CUSUM allowance and threshold: "
            "above 1 finds smaller slowdowns sooner at more risk "
            "of false alarms (DetectorConfig.sensitivity)"
        ),
    ] = 1.0,
    calibration_steps: Annotated[
        int,
        typer.Option(
            min=3, help="Steps of each rank its healthy baseline (centre and noise) is learned on"
        ),
    ] = DetectorConfig.calibration_steps,
    alarm_floor: Annotated[
        float,
        typer.Option(
            help="Effect-size floor: no fail-slow or link-slow "
            "is raised below this factor (x slower than "
            "expected; DetectorConfig.alarm_floor)"
        ),
    ] = DetectorConfig.alarm_floor,
    json_out: Annotated[bool, typer.Option("--json", help="Print the event JSON")] = False,
) -> None:
    """Find fail-slow ranks, slow links and imbalance in an ops trace (or a mini-batch time file).

    Thresholds follow each rank's noise, measured over its first calibration steps; the output
    gives each rank's noise and the smallest slowdown found within 10 steps at that noise.
    \f
    Args:
        trace: an ops trace, a run folder, or an Alibaba PAI mini-batch file.
        meta: the job meta YAML (None: the job.yaml beside the trace, else inferred).
        predictor: a trained predictor's folder or name, or ``auto`` (None: no predictor).
        model: the old name of ``predictor``.
        method: ``resihp`` or a baseline's name.
        input_format: ``ops`` or ``alibaba``.
        sensitivity: divides every CUSUM allowance and threshold (above 1: more sensitive).
        calibration_steps: steps of each rank its healthy baseline is learned on.
        alarm_floor: the least slowdown an alarm needs (x).
        json_out: print the event JSON instead of the summary.
    """
    from resihp.detect.alibaba import read_alibaba_job
    from resihp.detect.evaluate import METHODS, run_methods
    from resihp.detect.events import events_json
    from resihp.detect.expected import load_expected, stage_shape
    from resihp.detect.observe import infer_meta, layout_parts
    from resihp.detect.online import budget_line, noise_warnings
    from resihp.opstrace import read_meta, read_ops_trace, read_run_folder

    predictor = renamed(predictor, model, "--model", "--predictor")
    method, input_format = (
        getattr(method, "value", method),
        getattr(input_format, "value", input_format),
    )
    if method not in METHODS:
        raise InputError(f"--method: expected one of {', '.join(METHODS)}, got {method!r}")
    if input_format == "alibaba":
        df, job = read_alibaba_job(trace)
        meta_dict: dict | None = None
    elif input_format == "ops":
        if trace.is_dir():
            df, folder_meta = read_run_folder(trace)
            meta = meta if meta is not None else folder_meta
        else:
            df = read_ops_trace(trace)
            beside = trace.parent / "job.yaml"  # a trace in its run folder: that run's meta
            meta = meta if meta is not None or not beside.is_file() else beside
        job, meta_dict = read_meta(meta) if meta is not None else (infer_meta(df), None)
    else:
        raise InputError(f"--input-format: expected ops or alibaba, got {input_format!r}")
    if input_format == "alibaba" and meta is not None:
        job, meta_dict = read_meta(meta)
    device = (meta_dict or {}).get("device")
    expected = (
        load_expected(predictor, stage_shape(job, meta_dict), str(device) if device else None)
        if predictor is not None
        else None
    )
    cfg = DetectorConfig(
        sensitivity=sensitivity, calibration_steps=calibration_steps, alarm_floor=alarm_floor
    )
    detectors: dict = {}
    with warnings.catch_warnings():  # ranks absent from a step are NaN by design
        warnings.simplefilter("ignore", RuntimeWarning)
        found, obs = run_methods(
            df, job, [method], expected, meta_dict, cfg, detectors=detectors, source=str(trace)
        )
    ranks = int(df["rank"].nunique())
    doc = events_json(
        found[method],
        steps=len(obs.steps),
        ranks=ranks,
        method=method,
        cost_model=obs.cost_model if method == "resihp" else "raw",
    )
    # step numbers as the trace has them (a sampled trace has gaps): events use these numbers
    doc["first_step"] = int(obs.steps[0]) if len(obs.steps) else None
    doc["last_step"] = int(obs.steps[-1]) if len(obs.steps) else None
    if method == "resihp":
        doc["noise"] = {str(r): v for r, v in detectors[method].noise().items()}
        doc["warnings"] = noise_warnings(doc["noise"], cfg)
        doc["budget"] = detectors[method].budget()
    needed = (
        cfg.calibration_steps + cfg.min_persist
    )  # learn each rank's noise, then see a fault persist
    doc["judged"] = doc["steps"] >= needed
    parts = [part for part, _ in layout_parts(df, job)] if input_format == "ops" else [df]
    if len(parts) > 1:
        short = [
            f"{int(p.step.min())}-{int(p.step.max())}"
            for p in parts
            if p["step"].nunique() < needed
        ]
        doc.setdefault("warnings", []).append(
            "ranks took new places at step(s) "
            f"{', '.join(str(int(p.step.min())) for p in parts[1:])} (a live re-plan): each "
            "layout is judged against baselines learned in it"
            + (
                f"; steps {', '.join(short)} are too few for that ({needed} needed)"
                if short
                else ""
            )
        )
    if not doc["judged"]:
        doc["note"] = (
            f"too few steps to judge: the trace has {doc['steps']} distinct step(s), the "
            f"detector needs at least {needed} ({cfg.calibration_steps} to learn each "
            f"rank's noise, {cfg.min_persist} for a fault to persist); no event is not "
            f"a clean bill of health"
        )
    if json_out:
        print(json.dumps(doc))
        return
    span = doc["last_step"] - doc["first_step"] + 1 if doc["steps"] else 0
    steps_text = (
        f"{doc['steps']} steps ({doc['first_step']}-{doc['last_step']})"
        if span == doc["steps"]
        else f"{doc['steps']} sampled steps (step numbers {doc['first_step']}-"
        f"{doc['last_step']}; events below use these numbers)"
    )
    typer.echo(
        f"{trace}: {steps_text}, {ranks} ranks, method {method} "
        f"(cost model: {doc['cost_model']}); {len(doc['events'])} event(s)"
    )
    if not doc["judged"]:
        typer.echo(f"  {doc['note']}")
    if doc.get("budget"):
        typer.echo(f"  {budget_line(doc['budget'])}")
    for w in doc.get("warnings", []):
        typer.echo(f"  warning: {w}")
    for e in doc["events"]:
        where = (
            f"rank {e['rank']} (dp {e['dp_rank']}, stage {e['stage']})"
            if e["rank"] is not None
            else f"stage {e['stage']}"
            if e["stage"] is not None
            else f"replica dp {e['dp_rank']}"
        )
        end = f"-{e['end_step']}" if e["end_step"] is not None else "- (not ended)"
        phase = f"  ({e['phase']} only)" if e.get("phase") else ""
        typer.echo(
            f"  {e['kind']:<18} {where:<28} steps {e['onset_step']}{end} detected at "
            f"{e['detected_step']}  x{e['slowdown']:.2f}  confidence {e['confidence']:.2f}"
            f"{phase}"
        )


def detect_eval_cmd(
    quick: Annotated[
        bool, typer.Option(help="A small suite (a few traces) for a fast check")
    ] = False,
    seed: int = 0,
    profile: Annotated[
        Path, typer.Option(help="Profiling log giving the measured micro-batch costs")
    ] = None,
    predictor: Annotated[
        str,
        typer.Option(
            help="Trained predictor for resihp's expected compute: a "
            "folder, an installed model's name, or auto (the one "
            "measured on the profile's device); default: analytic "
            "FLOPs of the sequence lengths"
        ),
    ] = None,
    model: Annotated[str, typer.Option(hidden=True, help="Old name of --predictor")] = None,
    drop: Annotated[
        list[DropColumn],
        typer.Option(help="Optional trace column to drop before detection; repeatable"),
    ] = None,
    step_time: Annotated[
        float,
        typer.Option(
            help="Seconds a training step takes, at which false alarms per day are stated"
        ),
    ] = DEFAULT_STEP_TIME_S,
    json_out: Annotated[bool, typer.Option("--json", help="Print the results as JSON")] = False,
) -> None:
    """Score resihp and the baselines on labelled traces with injected slow ranks and links.
    \f
    Args:
        quick: a small suite (a few traces) for a fast check.
        seed: the suite's seed.
        profile: the profiling log of measured micro-batch costs (None: ``DEFAULT_PROFILE``).
        predictor: a trained predictor for resihp's expected compute (None: none).
        model: the old name of ``predictor``.
        drop: optional trace columns (``seq_lens``, ``start_ts``) dropped before detection.
        step_time: seconds a training step takes, at which false alarms per day are stated.
        json_out: print the results as JSON.
    """
    from resihp.detect.expected import load_expected
    from resihp.detect.suite import DEFAULT_PROFILE, evaluate_suite, make_suite
    from resihp.detect.synth import CostPool
    from resihp.workload.flops import TransformerShape

    predictor = renamed(predictor, model, "--model", "--predictor")
    profile = profile or DEFAULT_PROFILE
    drop = [getattr(d, "value", d) for d in drop or []]
    for col in drop:
        if col not in ("seq_lens", "start_ts"):
            raise InputError(f"--drop: expected seq_lens or start_ts, got {col!r}")
    if not Path(profile).exists():
        raise InputError(
            f"--profile {profile}: no such profiling log (write one with resihp profile)"
        )
    if not 0 < step_time < math.inf:
        raise InputError(f"--step-time: expected a positive number of seconds, got {step_time!r}")
    expected = None
    if predictor is not None:
        pool = CostPool.from_profile(profile)
        expected = load_expected(
            predictor, TransformerShape(pool.layers, pool.hidden, 4, 4 * pool.hidden), pool.device
        )
    n = len(make_suite(quick, seed))
    with progress_bar("evaluating", n, enabled=not json_out) as advance, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = evaluate_suite(
            quick,
            seed,
            expected,
            profile,
            drop=tuple(drop),
            on_progress=advance,
            step_time_s=step_time,
        )
    if json_out:
        print(json.dumps(result))
        return
    typer.echo(
        f"{result['traces']} traces, {result['steps']} steps x {result['ranks_per_trace']} ranks; "
        f"resihp cost model: {result['cost_model']}"
    )
    typer.echo(
        f"false alarms per day of one job at {result['step_time_s']:g} s a step; delay "
        "against Lorden's bound at each trace's calibrated noise"
    )
    typer.echo(
        f"{'method':<24}{'precision':>10}{'recall':>8}{'F1':>7}{'FA/10k':>8}{'delay':>7}"
        f"{'slow err':>9}{'FA/10k rank-steps':>19}{'FA/day':>9}{'delay/Lorden':>13}"
    )
    for name, s in result["methods"].items():
        delay = "-" if s["delay_steps_median"] is None else f"{s['delay_steps_median']:.0f}"
        err = "-" if s["slowdown_error_median"] is None else f"{s['slowdown_error_median']:.1%}"
        ratio = s["delay_over_lorden_median"]
        typer.echo(
            f"{name:<24}{s['precision']:>10.3f}{s['recall']:>8.3f}{s['f1']:>7.3f}"
            f"{s['false_alarms_per_10k_healthy_steps']:>8.1f}{delay:>7}{err:>9}"
            f"{s['false_alarms_per_10k_rank_steps']:>19.3f}{s['false_alarms_per_day']:>9.1f}"
            f"{'-' if ratio is None else f'{ratio:.2f}':>13}"
        )


def register(app: typer.Typer) -> None:
    app.command("detect")(detect_cmd)
    app.command("detect-eval")(detect_eval_cmd)
