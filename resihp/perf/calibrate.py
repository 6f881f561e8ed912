"""Profiling runs as the CLI does them, and ``calibrate``: a predictor for this device in minutes.

``calibrate`` profiles the shipped length sources on a few decoder shapes (interleaved repeats, a
reference next to every measurement), trains the predictor on the normalised cost and writes a
model directory named after the device, with the profiling logs beside it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from resihp.errors import InputError
from resihp.model.config import GPTConfig
from resihp.perf.device import device_name
from resihp.perf.profiler import Profile, noise_floor, profile, speed_summary
from resihp.perf.registry import device_slug, user_models_dir
from resihp.perf.training import train_predictor
from resihp.workload.lengths import resolve_source
from resihp.workload.packing import packed_microbatches

CALIBRATION_SOURCES = ("code", "text", "changelog")


def shape_name(cfg: GPTConfig) -> str:
    return f"h{cfg.hidden}-l{cfg.layers}"


# the profile verb's default shape and the runtime's default width (resihp run)
CALIBRATION_SHAPES = (
    GPTConfig(layers=2, hidden=256, heads=4, ffn_hidden=1024),
    GPTConfig(layers=2, hidden=128, heads=4, ffn_hidden=512),
)


def draw_microbatches(
    sources: Sequence[str], n: int, budget: int, max_len: int, rng: np.random.Generator
) -> list[tuple[str, np.ndarray]]:
    """``n`` packed micro-batches from each length source, labelled with the source's name.

    Args:
        sources: length sources, by name or lengths file.
        n: micro-batches per source.
        budget: tokens per micro-batch.
        max_len: the longest sequence.
        rng: the random generator.
    """
    out: list[tuple[str, np.ndarray]] = []
    for name in sources:
        out += [
            (name, b) for b in packed_microbatches(resolve_source(name), n, budget, max_len, rng)
        ]
    return out


def run_profile(
    shape: GPTConfig,
    batches: Sequence[tuple[str, np.ndarray]],
    *,
    budget: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    repeats: int = 3,
    warmup: int = 0,
    model_name: str = "gpt",
    seed: int = 0,
    on_progress: Callable[[int], None] | None = None,
) -> Profile:
    """``profile`` over labelled micro-batches; the log gains its ``source`` and ``budget``.

    Args:
        shape: the decoder layers' config.
        batches: (source name, packed sequence lengths) per micro-batch.
        budget: the micro-batches' token budget, recorded in the log.
        device: the device measured.
        dtype: the parameters' and activations' dtype.
        repeats: timed passes of each micro-batch.
        warmup: untimed passes of a micro-batch right before each of its timed passes.
        model_name: the ``model`` field of the log's rows.
        seed: the layers' initialisation seed.
        on_progress: called with the number of measurements done.
    """
    result = profile(
        shape,
        [b for _, b in batches],
        device=device,
        dtype=dtype,
        repeats=repeats,
        warmup=warmup,
        model_name=model_name,
        seed=seed,
        on_progress=on_progress,
    )
    result.log["source"] = [batches[i][0] for i in result.log["mb_id"]]
    result.log["budget"] = budget
    return result


def speed_path(output: Path) -> Path:
    return output.with_name(output.stem + ".speed.csv")


def write_profile(result: Profile, output: Path) -> None:
    """The profiling log at ``output`` and its speed trace beside it (``NAME.speed.csv``)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        result.log.to_parquet(output, index=False)
        result.speed.to_csv(speed_path(output), index=False)
    except OSError as exc:
        raise InputError(f"{output}: cannot write the profiling log ({exc.strerror})") from None


def profile_summary(result: Profile, output: Path) -> dict:
    log = result.log
    return {
        "output": str(output),
        "speed_trace": str(speed_path(output)),
        "rows": len(log),
        "microbatches": int(log["mb_id"].nunique()),
        "device": log["device"].iloc[0],
        "median_spread": float(log["time_spread"].median()),
        "noise_floor": noise_floor(log),
        "speed": speed_summary(result.speed),
        "time_s": {ph: float(g["time_s"].median()) for ph, g in log.groupby("phase")},
    }


@dataclass
class CalibrationPlan:
    """What ``calibrate`` measures: shapes x sources x micro-batches x repeats."""

    shapes: tuple[GPTConfig, ...] = CALIBRATION_SHAPES
    sources: tuple[str, ...] = CALIBRATION_SOURCES
    microbatches: int = 60
    repeats: int = 3
    budget: int = 1024
    max_len: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("microbatches", "repeats", "budget", "max_len"):
            if getattr(self, name) < 1:
                raise InputError(
                    f"--{name.replace('_', '-')}: expected a positive integer, "
                    f"got {getattr(self, name)}"
                )
        if not self.shapes:
            raise InputError("calibrate: no shapes to profile")

    @property
    def measurements(self) -> int:
        return len(self.shapes) * len(self.sources) * self.microbatches * self.repeats


def calibrate(
    plan: CalibrationPlan,
    output: Path | None = None,
    device: str = "cpu",
    on_progress: Callable[[int], None] | None = None,
) -> tuple[Path, dict]:
    """Profile ``plan`` on ``device``, train on the normalised cost, write the model directory.

    Returns (directory, card).

    Args:
        plan: what to measure (shapes, length sources, micro-batches, repeats).
        output: the model directory (default: the user's model directory, named after the
            device).
        device: the torch device to measure (``cpu``, ``cuda``).
        on_progress: called with the number of measurements done.
    """
    start = time.perf_counter()
    dev = torch.device(device)
    name = device_name(dev)
    out = Path(output) if output is not None else user_models_dir() / device_slug(name)
    rng = np.random.default_rng(plan.seed)
    logs, done, summaries = [], 0, {}
    for shape in plan.shapes:
        batches = draw_microbatches(plan.sources, plan.microbatches, plan.budget, plan.max_len, rng)
        offset = done
        result = run_profile(
            replace(shape, max_seq_len=max(plan.max_len, plan.budget)),
            batches,
            budget=plan.budget,
            device=dev,
            repeats=plan.repeats,
            model_name=f"gpt-{shape_name(shape)}",
            seed=plan.seed,
            on_progress=(lambda n, o=offset: on_progress(o + n)) if on_progress else None,
        )
        done += len(batches) * plan.repeats
        path = out / "profiles" / f"{shape_name(shape)}.parquet"
        write_profile(result, path)
        logs.append(path)
        summaries[shape_name(shape)] = profile_summary(result, path)
    card = train_predictor(logs, out, holdout=0.25, seed=plan.seed, target="auto")
    card["calibration"] = {
        "shapes": [s.to_dict() for s in plan.shapes],
        "sources": list(plan.sources),
        "microbatches_per_source": plan.microbatches,
        "repeats": plan.repeats,
        "budget": plan.budget,
        "profiles": summaries,
        "seconds": time.perf_counter() - start,
    }
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    return out, card
