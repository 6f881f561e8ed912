"""CLI verbs of the performance model: ``resihp profile`` and ``resihp predictor train|eval``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from resihp.errors import InputError
from resihp.progress import progress_bar

# Imports inside the verbs are deferred for start-up time: ``resihp`` imports every commands module
# to build its help, and the verbs' work pulls in torch, lightgbm, OR-Tools or matplotlib.

predictor_app = typer.Typer(help="Train and evaluate micro-batch time predictors.",
                            no_args_is_help=True)


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {name}: CUDA is not available on this machine")
    if name.split(":")[0] not in ("cpu", "cuda"):
        raise InputError(f"--device: expected cpu, cuda, cuda:N or auto, got {name!r}")
    return torch.device(name)


def profile_cmd(
    output: Annotated[Path, typer.Option("-o", "--output", help="Profiling log to write (.parquet)")],
    source: Annotated[list[str], typer.Option(help="Length source: code, text, or a lengths file; "
                                              "documents are drawn at random and chunked")] = None,
    lengths: Annotated[Path, typer.Option(help="Explicit sequence lengths, one integer per line, "
                                          "packed in file order")] = None,
    layers: int = 2, hidden: int = 256, heads: int = 4, ffn_hidden: int = 1024,
    budget: Annotated[int, typer.Option(help="Micro-batch token budget")] = 1024,
    max_len: Annotated[int, typer.Option(help="Longest sequence; longer documents are chunked")] = 1024,
    microbatches: Annotated[int, typer.Option(help="Micro-batches per source")] = 100,
    repeats: int = 5, warmup: int = 1,
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16")] = "float32",
    threads: Annotated[int, typer.Option(help="CPU threads for torch (0: torch's default)")] = 1,
    model_name: Annotated[str, typer.Option("--model-name")] = "gpt",
    seed: int = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON summary")] = False,
) -> None:
    """Measure real forward/backward time of the decoder stack on packed micro-batches."""
    import torch

    from resihp.model.gpt import GPTConfig
    from resihp.perf.profiler import profile
    from resihp.workload.lengths import load_lengths, resolve_source, sample_sequences
    from resihp.workload.packing import pack_greedy

    if output.suffix.lower() not in (".parquet", ".pq"):
        raise InputError(f"--output {output}: the profiling log is Parquet; use a .parquet name")
    for name, value in (("repeats", repeats), ("microbatches", microbatches)):
        if value < 1:
            raise InputError(f"--{name}: expected a positive integer, got {value}")
    if warmup < 0:
        raise InputError(f"--warmup: expected zero or more, got {warmup}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise InputError(f"--dtype: expected float32 or bfloat16, got {dtype!r}")
    cfg = GPTConfig(layers=layers, hidden=hidden, heads=heads, ffn_hidden=ffn_hidden,
                    max_seq_len=max(max_len, budget))
    dev = _device(device)
    if threads > 0:
        torch.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    batches: list[tuple[str, np.ndarray]] = []
    if lengths is not None:
        seqs = load_lengths(lengths)
        if seqs.max() > budget:
            raise InputError(f"{lengths}: sequence length {int(seqs.max())} exceeds --budget {budget}")
        batches += [(str(lengths), b) for b in pack_greedy(seqs, budget)]
    for name in source or ([] if lengths is not None else ["code", "text"]):
        docs = resolve_source(name)
        seqs = sample_sequences(docs, microbatches * budget, min(max_len, budget), rng)
        batches += [(name, b) for b in pack_greedy(seqs, budget)[:microbatches]]
    with progress_bar("profiling", len(batches), enabled=not json_out) as advance:
        log = profile(cfg, [b for _, b in batches], device=dev, dtype=torch_dtype, repeats=repeats,
                      warmup=warmup, model_name=model_name, seed=seed, on_progress=advance)
    log["source"] = [batches[i][0] for i in log["mb_id"]]
    log["budget"] = budget
    output.parent.mkdir(parents=True, exist_ok=True)
    log.to_parquet(output, index=False)
    summary = {"output": str(output), "rows": len(log), "microbatches": len(batches),
               "device": log["device"].iloc[0],
               "median_spread": float(log["time_spread"].median()),
               "time_s": {ph: float(g["time_s"].median()) for ph, g in log.groupby("phase")}}
    if json_out:
        print(json.dumps(summary))
    else:
        typer.echo(f"wrote {len(log)} rows ({len(batches)} micro-batches on {summary['device']}) to "
                   f"{output}; median repeat spread {summary['median_spread']:.1%}")


def register(app: typer.Typer) -> None:
    app.command("profile")(profile_cmd)
    app.add_typer(predictor_app, name="predictor")


@predictor_app.command("train")
def train_cmd(
    logs: Annotated[list[Path], typer.Argument(help="Profiling logs (.parquet)")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Model directory to write")],
    holdout: Annotated[float, typer.Option(help="Fraction of micro-batches held out for the card's "
                                           "metrics (the model never sees them)")] = 0.25,
    seed: int = 0,
    target: Annotated[str, typer.Option(help="Measured column to learn: time_s (median wall), "
                                        "time_min_s, cpu_time_s or cpu_time_min_s")] = "time_s",
    json_out: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Train the learned micro-batch predictor (and the linear baseline beside it)."""
    from resihp.perf.training import train_predictor

    card = train_predictor(logs, output, holdout=holdout, seed=seed, target=target)
    if json_out:
        print(json.dumps({"model": str(output), "held_out": card["held_out"]}))
    else:
        _print_metrics(f"trained {output} on {card['training_data']['rows']} rows", card["held_out"])


@predictor_app.command("eval")
def eval_cmd(
    logs: Annotated[list[Path], typer.Argument(help="Profiling logs (.parquet)")],
    model: Annotated[Path, typer.Option("-m", "--model", help="Model directory")],
    json_out: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Evaluate a predictor and its linear baseline on profiling logs: MAPE and p95 per phase."""
    from resihp.perf.training import evaluate_model

    result = evaluate_model(model, logs)
    if json_out:
        print(json.dumps(result))
    else:
        _print_metrics(f"{model} on {', '.join(map(str, logs))}", result)


def _print_metrics(title: str, result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("phase", "n", "learned MAPE %", "learned p95 %", "linear MAPE %", "linear p95 %"):
        table.add_column(col, justify="right")
    for phase in ("fwd", "bwd"):
        if phase in result:
            r, lin = result[phase], result[phase]["linear_baseline"]
            table.add_row(phase, str(r["n"]), f"{r['mape']:.2f}", f"{r['p95']:.2f}",
                          f"{lin['mape']:.2f}", f"{lin['p95']:.2f}")
    Console().print(table)
