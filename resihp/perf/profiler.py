"""Real torch measurements of a decoder-layer stack, forward and backward, per micro-batch.

They are taken so that a drifting device does not decide the result.

A device's speed is not constant: a CPU core switches between speed regimes for seconds to minutes
(the same micro-batch measured 104-186 ms on this project's machines), a GPU moves with clocks,
temperature and neighbours. Two measures make the profile hold anyway:

1. **Interleaved repeats**: every (micro-batch, repeat) pair is one measurement, and all of them run
   in one shuffled order, so a micro-batch's repeats are spread over the whole profile instead of
   landing back to back in one regime.
2. **A reference next to every measurement**: a fixed micro-batch on a fixed layer stack
   (:class:`ReferenceSpec`) is timed between consecutive measurements; each measurement is divided
   by the mean of the reference times just before and just after it. That ratio, summarised over
   the repeats by :func:`faster_half_mean` (``cost``, in reference units), is the micro-batch's
   intrinsic cost on this device; the predictor learns it and
   converts to seconds with the device's reference time, measured during profiling and
   re-measurable on a live device in about a second (:func:`measure_reference`).

The log keeps the raw times of each repeat, the reference times around them and the normalised
cost. On a CPU device it also keeps the calling thread's CPU time (with one intra-op thread all the
work runs on it): wall time on a shared CPU includes time given to other processes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd
import torch

from resihp.errors import InputError
from resihp.model.config import GPTConfig
from resihp.model.gpt import DecoderBlock
from resihp.perf.device import device_name, measurement_env

PROFILE_COLUMNS = [
    "device",
    "model",
    "layers",
    "hidden",
    "heads",
    "ffn_hidden",
    "tp",
    "phase",
    "seq_lens",
    "time_s",
]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class ReferenceSpec:
    """The fixed micro-batch whose time tells the device's speed at a moment.

    It depends on the device kind only, never on the profiled model, so profiles of different
    shapes taken at different times share one unit, and a live job can re-measure it without
    knowing anything about the model it trains.
    """

    layers: int = 1
    hidden: int = 256
    heads: int = 4
    ffn_hidden: int = 1024
    seq_lens: tuple[int, ...] = (512,)
    dtype: str = "float32"

    @classmethod
    def for_device(cls, device: torch.device) -> ReferenceSpec:
        if device.type == "cuda":  # large enough to keep the GPU's kernels busy, not launch-bound
            return cls(
                layers=1, hidden=2048, heads=16, ffn_hidden=8192, seq_lens=(4096,), dtype="bfloat16"
            )
        return cls()

    def to_dict(self) -> dict:
        return {**asdict(self), "seq_lens": list(self.seq_lens)}

    @classmethod
    def from_dict(cls, data: dict, source: str = "reference") -> ReferenceSpec:
        try:
            return cls(**{**data, "seq_lens": tuple(int(n) for n in data["seq_lens"])})
        except (TypeError, KeyError, ValueError) as exc:
            raise InputError(
                f"{source}: expected fields layers, hidden, heads, ffn_hidden, "
                f"seq_lens, dtype ({exc})"
            ) from None


class _Timed:
    """A layer stack and one packed micro-batch, timed fwd then bwd. Inputs are made before each
    pass, outside the timed part: holding every micro-batch's inputs for the whole profile would
    take gigabytes of device memory at GPU widths."""

    def __init__(
        self,
        layers: torch.nn.ModuleList,
        seq_lens: Sequence[int],
        hidden: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.layers, self.seq_lens, self.device = layers, [int(n) for n in seq_lens], device
        self.shape, self.dtype = (int(sum(seq_lens)), hidden), dtype

    def run(self) -> tuple[float, float, float, float]:
        """(wall fwd, wall bwd, thread-CPU fwd, thread-CPU bwd) seconds of one pass."""
        x = torch.randn(self.shape, device=self.device, dtype=self.dtype, requires_grad=True)
        grad = torch.randn(self.shape, device=self.device, dtype=self.dtype)
        _sync(self.device)
        t0, c0 = time.perf_counter(), time.thread_time()
        y = x
        for layer in self.layers:
            y = layer(y, self.seq_lens)
        _sync(self.device)
        t1, c1 = time.perf_counter(), time.thread_time()
        y.backward(grad)
        _sync(self.device)
        t2, c2 = time.perf_counter(), time.thread_time()
        self.layers.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1, c1 - c0, c2 - c1


def _stack(
    cfg: GPTConfig, device: torch.device, dtype: torch.dtype, seed: int
) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    return torch.nn.ModuleList([DecoderBlock(cfg) for _ in range(cfg.layers)]).to(device, dtype)


class Reference:
    """The reference micro-batch, built once, timed as often as asked."""

    def __init__(self, spec: ReferenceSpec, device: torch.device) -> None:
        if spec.dtype not in DTYPES:
            raise InputError(
                f"reference dtype: expected one of {', '.join(DTYPES)}, got {spec.dtype!r}"
            )
        cfg = GPTConfig(
            layers=spec.layers,
            hidden=spec.hidden,
            heads=spec.heads,
            ffn_hidden=spec.ffn_hidden,
            max_seq_len=max(spec.seq_lens),
        )
        layers = _stack(cfg, device, DTYPES[spec.dtype], seed=12345)
        self.spec = spec
        self._timed = _Timed(layers, spec.seq_lens, spec.hidden, device, DTYPES[spec.dtype])

    def time(self) -> tuple[float, float]:
        """(wall, thread-CPU) seconds of one forward + backward pass."""
        wf, wb, cf, cb = self._timed.run()
        return wf + wb, cf + cb


def measure_reference(
    spec: ReferenceSpec, device: str | torch.device = "cpu", repeats: int = 7, warmup: int = 2
) -> dict[str, float]:
    """The device's reference time now: the median of ``repeats`` passes, wall and CPU seconds.

    What a predictor trained on normalised cost multiplies by to predict seconds on this device at
    this moment.

    Args:
        spec: the reference micro-batch and layer stack.
        device: the device measured.
        repeats: timed passes.
        warmup: untimed passes first.
    """
    ref = Reference(spec, torch.device(device))
    for _ in range(warmup):
        ref.time()
    times = np.array([ref.time() for _ in range(repeats)])
    return {"wall_s": float(np.median(times[:, 0])), "cpu_s": float(np.median(times[:, 1]))}


@dataclass
class Profile:
    """A profile's results: its log and the device's speed trace.

    ``log``: one row per micro-batch and phase, the profiling-log contract; ``speed``: the
    reference time over the profile."""

    log: pd.DataFrame
    speed: pd.DataFrame
    reference: ReferenceSpec = field(default_factory=ReferenceSpec)


def measurement_order(n_microbatches: int, repeats: int, rng: np.random.Generator) -> np.ndarray:
    """Micro-batch index of each measurement, in ``repeats`` shuffled rounds.

    Each round is a fresh random permutation of all micro-batches, so every micro-batch is measured
    once in each part of the profile and never twice in a row (with two or more micro-batches).

    Args:
        n_microbatches: micro-batches measured.
        repeats: rounds.
        rng: the random generator.
    """
    rounds = []
    for _ in range(repeats):
        perm = rng.permutation(n_microbatches)
        if rounds and n_microbatches > 1 and perm[0] == rounds[-1][-1]:
            perm[[0, 1]] = perm[[1, 0]]
        rounds.append(perm)
    return np.concatenate(rounds)


def profile(
    cfg: GPTConfig,
    microbatches: Sequence[Sequence[int]],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    repeats: int = 3,
    warmup: int = 0,
    model_name: str = "gpt",
    seed: int = 0,
    reference: ReferenceSpec | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> Profile:
    """Measure ``cfg.layers`` decoder layers on each micro-batch, in one shuffled order.

    Each micro-batch is measured ``repeats`` times, with the reference timed between consecutive
    measurements.

    Args:
        cfg: the decoder layers' config.
        microbatches: the packed sequence lengths of each micro-batch.
        device: the device measured.
        dtype: the parameters' and activations' dtype.
        repeats: timed passes of each micro-batch.
        warmup: untimed passes of a micro-batch right before each of its timed passes.
        model_name: the ``model`` field of the log's rows.
        seed: the layers' initialisation seed.
        reference: the reference micro-batch and stack (default: the device's,
            ``ReferenceSpec.for_device``).
        on_progress: called with the number of measurements done (of ``len(microbatches) *
            repeats``).
    """
    if repeats < 1:
        raise InputError(f"repeats: expected a positive integer, got {repeats}")
    if not microbatches:
        raise InputError("profile: no micro-batches to measure")
    device = torch.device(device)
    reference = reference or ReferenceSpec.for_device(device)
    layers = _stack(cfg, device, dtype, seed)
    timed = [_Timed(layers, mb, cfg.hidden, device, dtype) for mb in microbatches]
    ref = Reference(reference, device)
    # untimed passes first: allocator, kernels and caches reach their steady state
    largest = max(range(len(timed)), key=lambda i: sum(timed[i].seq_lens))
    for _ in range(2):
        timed[largest].run()
        ref.time()
    order = measurement_order(len(timed), repeats, np.random.default_rng(seed))
    raw = np.empty((len(order), 4))
    refs = np.empty((len(order) + 1, 2))
    stamps = np.empty(len(order) + 1)
    start = time.perf_counter()
    wall_start = time.time()
    stamps[0], refs[0] = 0.0, ref.time()
    for k, i in enumerate(order):
        for _ in range(warmup):
            timed[i].run()
        raw[k] = timed[i].run()
        stamps[k + 1], refs[k + 1] = time.perf_counter() - start, ref.time()
        if on_progress:
            on_progress(k + 1)
    around = (refs[:-1] + refs[1:]) / 2  # reference time (wall, cpu) around each measurement
    name = device_name(device)
    on_cpu = device.type == "cpu"
    reference_json = json.dumps(reference.to_dict())
    env_json = json.dumps(measurement_env(device))
    rows = []
    for mb_id, mb in enumerate(timed):
        ks = np.flatnonzero(order == mb_id)
        for p, phase in enumerate(("fwd", "bwd")):
            wall, cpu = raw[ks, p], raw[ks, 2 + p]
            cost, cpu_cost = wall / around[ks, 0], cpu / around[ks, 1]
            median = float(np.median(wall))
            rows.append(
                {
                    "device": name,
                    "model": model_name,
                    "layers": cfg.layers,
                    "hidden": cfg.hidden,
                    "heads": cfg.heads,
                    "ffn_hidden": cfg.ffn_hidden,
                    "tp": 1,
                    "phase": phase,
                    "seq_lens": mb.seq_lens,
                    "time_s": median,
                    "mb_id": mb_id,
                    "tokens": sum(mb.seq_lens),
                    "repeats": repeats,
                    "time_min_s": float(wall.min()),
                    "time_spread": float((wall.max() - wall.min()) / median),
                    "cpu_time_s": float(np.median(cpu)) if on_cpu else float("nan"),
                    "cpu_time_min_s": float(cpu.min()) if on_cpu else float("nan"),
                    "ref_time_s": float(np.median(around[ks, 0])),
                    "ref_cpu_time_s": float(np.median(around[ks, 1])) if on_cpu else float("nan"),
                    "cost": faster_half_mean(cost),
                    "cpu_cost": faster_half_mean(cpu_cost) if on_cpu else float("nan"),
                    "cost_spread": float((cost.max() - cost.min()) / np.median(cost)),
                    "times_s": wall.tolist(),
                    "cpu_times_s": cpu.tolist() if on_cpu else [],
                    "ref_times_s": around[ks, 0].tolist(),
                    "costs": cost.tolist(),
                    "cpu_costs": cpu_cost.tolist() if on_cpu else [],
                    "dtype": str(dtype).removeprefix("torch."),
                    "reference": reference_json,
                    "measured_at": wall_start + float(stamps[ks[0] + 1]),
                    "env": env_json,
                }
            )
    speed = pd.DataFrame(
        {"t_s": stamps, "ref_wall_s": refs[:, 0], "ref_cpu_s": refs[:, 1] if on_cpu else np.nan}
    )
    speed["speed"] = float(np.median(refs[:, 0])) / speed["ref_wall_s"]
    return Profile(log=pd.DataFrame(rows), speed=speed, reference=reference)


def faster_half_mean(values: np.ndarray) -> float:
    """Mean of the faster half of a micro-batch's normalised repeats (the faster two of three).

    What a shared device adds to a measurement, another process's time slice, an interrupt, a
    neighbour thrashing the cache, only ever makes it slower; so the faster repeats are the better
    estimate of the micro-batch's own cost, and averaging the faster half keeps most of the
    repeats' averaging while the one slowed repeat is left out."""
    values = np.sort(np.asarray(values, dtype=np.float64))
    return float(values[: max(1, (len(values) + 1) // 2)].mean())


def noise_floor(log: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Per phase, the mean absolute deviation (%) of one repeat from its micro-batch's median.

    Identical work measured at different moments, before (``raw_pct``, wall time) and after
    (``normalised_pct``) dividing by the reference; the CPU-time pair beside them on CPU devices.
    No predictor can beat the floor of the column it learns."""
    out: dict[str, dict[str, float]] = {}
    columns = {
        "raw_pct": "times_s",
        "normalised_pct": "costs",
        "cpu_raw_pct": "cpu_times_s",
        "cpu_normalised_pct": "cpu_costs",
    }
    for phase, rows in log.groupby("phase"):
        out[phase] = {"n": int(len(rows))}
        for key, col in columns.items():
            if col not in rows.columns:
                continue
            devs = [np.abs(np.asarray(v) / np.median(v) - 1) for v in rows[col] if len(v) >= 2]
            if devs:
                out[phase][key] = float(np.mean(np.concatenate(devs)) * 100)
    return out


def speed_summary(speed: pd.DataFrame) -> dict[str, float]:
    """The device's speed over the profile relative to its median (1.0): spread and range."""
    s = speed["speed"].to_numpy()
    return {
        "min": float(s.min()),
        "p05": float(np.percentile(s, 5)),
        "p95": float(np.percentile(s, 95)),
        "max": float(s.max()),
        "median_ref_s": float(speed["ref_wall_s"].median()),
        "duration_s": float(speed["t_s"].iloc[-1]),
    }
