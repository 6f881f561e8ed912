"""CLI verbs of the performance model.

``resihp profile`` and ``resihp predictor train|eval|calibrate``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from resihp.cli_options import Seed, renamed
from resihp.errors import InputError
from resihp.progress import progress_bar
from resihp.workload.lengths import MAX_LENGTHS, load_lengths

# Imports inside the verbs are deferred for start-up time: ``resihp`` imports every commands module
# to build its help, and the verbs' work pulls in torch, lightgbm, OR-Tools or matplotlib.

predictor_app = typer.Typer(
    help="Train and evaluate micro-batch time predictors.", no_args_is_help=True
)


def _out(out: Path | None, output: Path | None) -> Path:
    """``-o/--out`` (``--output``, the old spelling, still works); required."""
    if (out or output) is None:
        raise InputError("missing option -o/--out: where to write")
    return out or output


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {name}: CUDA is not available on this machine")
    if name.split(":")[0] not in ("cpu", "cuda"):
        raise InputError(f"--device: expected cpu, cuda, cuda:N or auto, got {name!r}")
    return torch.device(name)


profile_app = typer.Typer(help="Measure micro-batch times, or import them from other tools' logs.")


def profile_cmd(
    ctx: typer.Context,
    out: Annotated[
        Path,
        typer.Option(
            "-o",
            "--out",
            help="Profiling log to write (.parquet); its "
            "speed trace goes beside it as NAME.speed.csv",
        ),
    ] = None,
    output: Annotated[Path, typer.Option("--output", hidden=True)] = None,  # old spelling of --out
    source: Annotated[
        list[str],
        typer.Option(
            help="Length source: code, text, changelog, or a "
            "lengths file; documents are drawn at random and "
            "chunked"
        ),
    ] = None,
    lengths: Annotated[
        Path,
        typer.Option(help="Explicit sequence lengths, one integer per line, packed in file order"),
    ] = None,
    max_lengths: Annotated[
        int,
        typer.Option(
            min=1, help="Most lengths read from --lengths; a longer file is refused (one line)"
        ),
    ] = MAX_LENGTHS,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    ffn_hidden: int = 1024,
    budget: Annotated[int, typer.Option(min=1, help="Micro-batch token budget")] = 1024,
    max_len: Annotated[
        int, typer.Option(min=1, help="Longest sequence; longer documents are chunked")
    ] = 1024,
    microbatches: Annotated[int, typer.Option(help="Micro-batches per source")] = 100,
    repeats: Annotated[
        int,
        typer.Option(
            help="Timed passes of each micro-batch, spread over the whole profile in shuffled order"
        ),
    ] = 3,
    warmup: Annotated[int, typer.Option(help="Untimed passes right before each timed one")] = 0,
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16")] = "float32",
    threads: Annotated[
        int, typer.Option(min=0, help="CPU threads for torch (0: torch's default)")
    ] = 1,
    model_name: Annotated[str, typer.Option("--model-name")] = "gpt",
    seed: Seed = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON summary")] = False,
) -> None:
    """Measure real forward/backward time of the decoder stack on packed micro-batches.

    A reference micro-batch is timed between measurements to normalise the device's drift; or, as
    `resihp profile import`, read a torch.profiler trace, a Megatron log or a run folder.
    \f
    Args:
        ctx: typer's context (a subcommand, ``import``, runs instead when invoked).
        out: profiling log to write (.parquet); its speed trace goes beside it as NAME.speed.csv.
        output: the old spelling of ``out``.
        source: length source: code, text, changelog, or a lengths file; documents are drawn at
            random and chunked.
        lengths: explicit sequence lengths, one integer per line, packed in file order.
        max_lengths: most lengths read from --lengths; a longer file is refused (one line).
        layers: decoder layers of the measured stack.
        hidden: the model's hidden size.
        heads: attention heads.
        ffn_hidden: the model's hidden size.
        budget: micro-batch token budget.
        max_len: longest sequence; longer documents are chunked.
        microbatches: micro-batches per source.
        repeats: timed passes of each micro-batch, spread over the whole profile in shuffled order.
        warmup: untimed passes right before each timed one.
        device: cpu, cuda, cuda:N or auto.
        dtype: float32 or bfloat16.
        threads: CPU threads for torch (0: torch's default).
        model_name: the ``model`` field of the log's rows.
        seed: random seed (0 to 2**32 - 1).
        json_out: print a JSON summary.
    """
    if ctx.invoked_subcommand is not None:
        return
    import torch

    from resihp.model.config import GPTConfig
    from resihp.perf.calibrate import draw_microbatches, profile_summary, run_profile, write_profile
    from resihp.workload.packing import pack_greedy

    output = _out(out, output)
    if output.suffix.lower() not in (".parquet", ".pq"):
        raise InputError(f"--out {output}: the profiling log is Parquet; use a .parquet name")
    for name, value in (("repeats", repeats), ("microbatches", microbatches)):
        if value < 1:
            raise InputError(f"--{name}: expected a positive integer, got {value}")
    if warmup < 0:
        raise InputError(f"--warmup: expected zero or more, got {warmup}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise InputError(f"--dtype: expected float32 or bfloat16, got {dtype!r}")
    cfg = GPTConfig(
        layers=layers,
        hidden=hidden,
        heads=heads,
        ffn_hidden=ffn_hidden,
        max_seq_len=max(max_len, budget),
    )
    dev = _device(device)
    if threads > 0:
        torch.set_num_threads(threads)
    batches: list[tuple[str, np.ndarray]] = []
    if lengths is not None:
        seqs = load_lengths(lengths, limit=max_lengths)
        if seqs.max() > budget:
            raise InputError(
                f"{lengths}: sequence length {int(seqs.max())} exceeds --budget {budget}"
            )
        batches += [(str(lengths), b) for b in pack_greedy(seqs, budget)]
    sources = source or ([] if lengths is not None else ["code", "text"])
    batches += draw_microbatches(
        sources, microbatches, budget, max_len, np.random.default_rng(seed)
    )
    with progress_bar("profiling", len(batches) * repeats, enabled=not json_out) as advance:
        result = run_profile(
            cfg,
            batches,
            budget=budget,
            device=dev,
            dtype=torch_dtype,
            repeats=repeats,
            warmup=warmup,
            model_name=model_name,
            seed=seed,
            on_progress=advance,
        )
    write_profile(result, output)
    summary = profile_summary(result, output)
    if json_out:
        print(json.dumps(summary))
        return
    floor = summary["noise_floor"]
    typer.echo(
        f"wrote {len(result.log)} rows ({len(batches)} micro-batches on {summary['device']}) "
        f"to {output}"
    )
    for phase in ("fwd", "bwd"):
        f = floor.get(phase, {})
        if "normalised_pct" in f:
            extra = (
                f"; CPU time {f['cpu_raw_pct']:.1f}% -> {f['cpu_normalised_pct']:.1f}%"
                if "cpu_raw_pct" in f
                else ""
            )
            typer.echo(
                f"  {phase} noise floor (one repeat vs its micro-batch's median): wall "
                f"{f['raw_pct']:.1f}% raw -> {f['normalised_pct']:.1f}% normalised{extra}"
            )
    sp = summary["speed"]
    typer.echo(
        f"  device speed over {sp['duration_s']:.0f} s: {sp['p05']:.2f}-{sp['p95']:.2f}x of "
        f"its median (5th-95th percentile); trace in {summary['speed_trace']}"
    )


@predictor_app.command("calibrate")
def calibrate_cmd(
    out: Annotated[
        Path,
        typer.Option(
            "-o",
            "--out",
            help="Model directory to write (default: the "
            "user's model directory, named after the device)",
        ),
    ] = None,
    output: Annotated[Path, typer.Option("--output", hidden=True)] = None,  # old spelling of --out
    microbatches: Annotated[int, typer.Option(help="Micro-batches per source and shape")] = 60,
    repeats: Annotated[int, typer.Option(help="Timed passes of each micro-batch")] = 3,
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto")] = "cpu",
    threads: Annotated[int, typer.Option(help="CPU threads for torch (resihp's jobs use 1)")] = 1,
    seed: Seed = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON summary")] = False,
) -> None:
    """Make a predictor for this device from the shipped length sources.

    Profile the shipped length sources (code, text, changelog) on two decoder shapes, train on the
    normalised cost, write a model directory named after the device; detect and plan find it with
    `--predictor auto`.
    \f
    Args:
        out: model directory to write (default: the user's model directory, named after the device).
        output: the old spelling of ``out``.
        microbatches: micro-batches per source and shape.
        repeats: timed passes of each micro-batch.
        device: cpu, cuda, cuda:N or auto.
        threads: CPU threads for torch (resihp's jobs use 1).
        seed: random seed (0 to 2**32 - 1).
        json_out: print a JSON summary.
    """
    import torch

    from resihp.perf.calibrate import CalibrationPlan, calibrate

    dev = _device(device)
    if threads > 0:
        torch.set_num_threads(threads)
    plan = CalibrationPlan(microbatches=microbatches, repeats=repeats, seed=seed)
    with progress_bar("calibrating", plan.measurements, enabled=not json_out) as advance:
        out, card = calibrate(plan, out or output, device=str(dev), on_progress=advance)
    elapsed = card["calibration"]["seconds"]
    if json_out:
        print(
            json.dumps(
                {
                    "model": str(out),
                    "device": card["device"],
                    "seconds": elapsed,
                    "held_out": card["held_out"],
                    "held_out_cross_source": card["held_out_cross_source"],
                }
            )
        )
        return
    _print_metrics(f"{out} ({card['device']}, {elapsed:.0f} s), random split", card["held_out"])
    if card["held_out_cross_source"]:
        _print_metrics(
            "leave one length source out (mean over sources)", card["held_out_cross_source"]
        )


def register(app: typer.Typer) -> None:
    profile_app.callback(invoke_without_command=True)(profile_cmd)
    app.add_typer(profile_app, name="profile")
    app.add_typer(predictor_app, name="predictor")


@profile_app.command("import")
def import_cmd(
    inputs: Annotated[
        list[Path],
        typer.Argument(
            help="torch.profiler traces (.json, .json.gz), Megatron-LM logs or resihp run folders"
        ),
    ],
    out: Annotated[
        Path, typer.Option("-o", "--out", help="Profiling log to write (.parquet)")
    ] = None,
    lengths: Annotated[
        Path,
        typer.Option(
            help="torch.profiler traces: JSON mapping micro-batch "
            "ids to their sequence lengths, for spans whose names "
            "do not carry seq_lens="
        ),
    ] = None,
    layers: Annotated[
        int, typer.Option(min=1, help="Layers each span ran (default: from the log)")
    ] = None,
    hidden: Annotated[int, typer.Option(min=1)] = None,
    heads: Annotated[int, typer.Option(min=1)] = None,
    ffn_hidden: Annotated[int, typer.Option(min=1)] = None,
    tp: Annotated[int, typer.Option(min=1, help="Tensor-parallel size")] = None,
    seq_length: Annotated[int, typer.Option(min=1, help="Megatron logs: sequence length")] = None,
    micro_batch_size: Annotated[
        int, typer.Option(min=1, help="Megatron logs: sequences per micro-batch")
    ] = None,
    microbatches: Annotated[
        int, typer.Option(min=1, help="Megatron logs: micro-batches per iteration on a stage")
    ] = None,
    device: Annotated[
        str,
        typer.Option(
            help="The device the log was measured on, as a "
            "predictor card names it (default: from the log, else "
            "this machine)"
        ),
    ] = None,
    model_name: Annotated[str, typer.Option("--model-name")] = None,
    fmt: Annotated[str, typer.Option("--format", help="auto, kineto, megatron or run")] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON summary")] = False,
) -> None:
    """Turn a torch.profiler trace, a Megatron-LM log or a resihp run folder into a profiling log.

    The log `resihp predictor train` reads: one row per forward or backward span.
    \f
    Args:
        inputs: torch.profiler traces (.json, .json.gz), Megatron-LM logs or resihp run folders.
        out: profiling log to write (.parquet).
        lengths: torch.profiler traces: JSON mapping micro-batch ids to their sequence lengths, for
            spans whose names do not carry seq_lens=.
        layers: layers each span ran (default: from the log).
        hidden: the model's hidden size.
        heads: attention heads.
        ffn_hidden: the model's hidden size.
        tp: tensor-parallel size.
        seq_length: megatron logs: sequence length.
        micro_batch_size: megatron logs: sequences per micro-batch.
        microbatches: megatron logs: micro-batches per iteration on a stage.
        device: the device the log was measured on, as a predictor card names it (default: from the
            log, else this machine).
        model_name: the ``model`` field of the log's rows.
        fmt: auto, kineto, megatron or run.
        json_out: print a JSON summary.
    """
    from resihp.perf.megatron_log import MegatronBatch
    from resihp.perf.profile_import import ImportOptions, import_profiles, write_log
    from resihp.perf.spans import Shape

    output = _out(out, None)
    options = ImportOptions(
        shape=Shape(layers=layers, hidden=hidden, heads=heads, ffn_hidden=ffn_hidden, tp=tp),
        device=device,
        model=model_name,
        lengths=lengths,
        format=fmt,
        batch=MegatronBatch(seq_length, micro_batch_size, microbatches),
    )
    result = import_profiles(inputs, options)
    write_log(result.log, output)
    log = result.log
    counts = log.groupby("phase").size().to_dict()
    if json_out:
        print(
            json.dumps(
                {
                    "output": str(output),
                    "rows": len(log),
                    "by_phase": counts,
                    "devices": sorted(log["device"].unique().tolist()),
                    "formats": sorted(log["format"].unique().tolist()),
                    "notes": list(result.notes),
                }
            )
        )
        return
    for note in result.notes:
        typer.echo(note, err=True)
    typer.echo(
        f"wrote {len(log)} rows ({counts.get('fwd', 0)} fwd, {counts.get('bwd', 0)} bwd; "
        f"{', '.join(sorted(log['format'].unique()))}) to {output}"
    )


@predictor_app.command("train")
def train_cmd(
    logs: Annotated[
        list[Path],
        typer.Argument(
            help="Profiling logs (.parquet; `resihp profile "
            "import` makes one from other tools' logs)"
        ),
    ],
    out: Annotated[Path, typer.Option("-o", "--out", help="Model directory to write")] = None,
    output: Annotated[Path, typer.Option("--output", hidden=True)] = None,  # old spelling of --out
    holdout: Annotated[
        float,
        typer.Option(
            help="Fraction of micro-batches held out for the card's "
            "metrics (the model never sees them)"
        ),
    ] = 0.25,
    seed: Seed = 0,
    target: Annotated[
        str,
        typer.Option(
            help="Measured column to learn: auto (the normalised cost "
            "when the log has it: cpu_cost on a CPU, else cost; else "
            "time_s), cost, cpu_cost, time_s (median wall), "
            "time_min_s, cpu_time_s or cpu_time_min_s"
        ),
    ] = "auto",
    json_out: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Train the learned micro-batch predictor (and the linear baseline beside it).
    \f
    Args:
        logs: profiling logs (.parquet; `resihp profile import` makes one from other tools' logs).
        out: model directory to write.
        output: the old spelling of ``out``.
        holdout: fraction of micro-batches held out for the card's metrics (the model never sees
            them).
        seed: random seed (0 to 2**32 - 1).
        target: measured column to learn: auto (the normalised cost when the log has it: cpu_cost on
            a CPU, else cost; else time_s), cost, cpu_cost, time_s (median wall), time_min_s,
            cpu_time_s or cpu_time_min_s.
        json_out: print a JSON summary.
    """
    from resihp.perf.training import train_predictor

    output = _out(out, output)
    card = train_predictor(logs, output, holdout=holdout, seed=seed, target=target)
    if json_out:
        print(
            json.dumps(
                {
                    "model": str(output),
                    "target": card["training_data"]["target"],
                    "held_out": card["held_out"],
                    "held_out_cross_source": card["held_out_cross_source"],
                }
            )
        )
    else:
        _print_metrics(
            f"trained {output} on {card['training_data']['rows']} rows "
            f"({card['training_data']['target']}), random split",
            card["held_out"],
        )
        if card["held_out_cross_source"]:
            _print_metrics(
                "leave one length source out (mean over sources)", card["held_out_cross_source"]
            )


@predictor_app.command("eval")
def eval_cmd(
    logs: Annotated[list[Path], typer.Argument(help="Profiling logs (.parquet)")],
    predictor: Annotated[
        Path, typer.Option("-p", "--predictor", help="Predictor directory")
    ] = None,
    model: Annotated[
        Path, typer.Option("-m", "--model", hidden=True, help="Old name of --predictor")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Evaluate a predictor and its linear baseline on profiling logs: MAPE and p95 per phase.
    \f
    Args:
        logs: profiling logs (.parquet).
        predictor: predictor directory.
        model: old name of --predictor.
        json_out: print a JSON summary.
    """
    from resihp.perf.training import evaluate_model

    which = renamed(predictor, model, "--model", "--predictor")
    if which is None:
        raise InputError("resihp predictor eval: --predictor DIR is required (a trained predictor)")
    result = evaluate_model(which, logs)
    if json_out:
        print(json.dumps(result))
    else:
        _print_metrics(f"{which} on {', '.join(map(str, logs))}", result)


@predictor_app.command("speed")
def speed_cmd(
    predictor: Annotated[
        str,
        typer.Option(
            "-p",
            "--predictor",
            help="A predictor trained on "
            "normalised cost: a folder, an installed model's name, or "
            "auto",
        ),
    ] = None,
    model: Annotated[
        str, typer.Option("-m", "--model", hidden=True, help="Old name of --predictor")
    ] = None,
    repeats: Annotated[int, typer.Option(help="Timed passes of the reference")] = 7,
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto")] = "cpu",
    json_out: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Re-measure the device's reference micro-batch; compare it with the predictor's calibration.

    It takes about a second; the result is the factor the predictor's predictions in seconds
    scale by on this device now.
    \f
    Args:
        predictor: a predictor trained on normalised cost: a folder, an installed model's name, or
            auto.
        model: old name of --predictor.
        repeats: timed passes of the reference.
        device: cpu, cuda, cuda:N or auto.
        json_out: print a JSON summary.
    """
    import torch

    from resihp.perf.device import this_device
    from resihp.perf.predictor import MicroBatchPredictor
    from resihp.perf.profiler import ReferenceSpec, measure_reference
    from resihp.perf.registry import check_device, resolve_model

    which = renamed(predictor, model, "--model", "--predictor") or "auto"
    if repeats < 1:
        raise InputError(f"--repeats: expected a positive integer, got {repeats}")
    torch.set_num_threads(1)
    dev = _device(device)
    name = this_device(dev.type)
    path = resolve_model(which, name)
    loaded = MicroBatchPredictor.load(path)
    check_device(path, loaded.device_, name)
    reference = loaded.reference_
    if not reference or not reference.get("spec"):
        raise InputError(
            f"{path}: this predictor learned raw seconds, so it has no reference to "
            "re-measure; make one with `resihp predictor calibrate`"
        )
    spec = ReferenceSpec.from_dict(reference["spec"], f"{path / 'card.json'}: field reference.spec")
    now = measure_reference(spec, dev, repeats=repeats)[
        "wall_s" if reference["clock"] == "wall" else "cpu_s"
    ]
    doc = {
        "model": str(path),
        "device": name,
        "clock": reference["clock"],
        "calibrated_reference_s": reference["seconds"],
        "reference_s": now,
        "slowdown": now / reference["seconds"],
    }
    if json_out:
        print(json.dumps(doc))
    else:
        typer.echo(
            f"{path}: reference now {now * 1e3:.1f} ms ({reference['clock']} clock) against "
            f"{reference['seconds'] * 1e3:.1f} ms at calibration: this device runs "
            f"x{doc['slowdown']:.2f} of its calibrated time"
        )


def _print_metrics(title: str, result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("phase", "n", "learned MAPE %", "learned p95 %", "linear MAPE %", "linear p95 %"):
        table.add_column(col, justify="right")
    for phase in ("fwd", "bwd"):
        if phase in result:
            r, lin = result[phase], result[phase]["linear_baseline"]
            table.add_row(
                phase,
                str(r["n"]),
                f"{r['mape']:.2f}",
                f"{r['p95']:.2f}",
                f"{lin['mape']:.2f}",
                f"{lin['p95']:.2f}",
            )
    Console().print(table)
