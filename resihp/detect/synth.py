"""Labelled ops traces for evaluating detectors: a 1F1B pipeline-parallel job from real parts.

- Micro-batches are real packed sequence-length mixes with their real measured forward and backward
  times, taken from a profiling log (``resihp profile``; its thread CPU time where recorded, since
  on a shared machine wall time also holds other processes' slices); a stage of ``L`` layers costs
  ``L / layers`` of the profiled stack.
- Op-to-op noise is log-normal with the spread measured between repeats in that same log;
  rank-to-rank host noise per step is resampled from the healthy per-worker residuals of a real
  Alibaba PAI job.
- Injected faults multiply one rank's own compute (``fail-slow``) or one pipeline link's transfer
  time (``link-slow``) from a known onset to a known end.
- Times follow the 1F1B dependencies, and a rank's host-side compute duration includes the time it
  sat blocked on its neighbour, as host timers of asynchronous kernels do; waiting for the slowest
  replica at the gradient reduction appears in ``grads-reduce-scatter``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from resihp.errors import InputError
from resihp.opstrace import JobMeta
from resihp.parallel import ParallelDims
from resihp.perf.schedule import FWD, rank_order

# expected range of 5 normal draws in units of sigma (for turning a measured spread into a sigma)
# expected minus-minimum of n standard normal draws
_EXPECTED_NEG_MIN = {
    2: 0.564,
    3: 0.846,
    4: 1.029,
    5: 1.163,
    6: 1.267,
    7: 1.352,
    8: 1.424,
    9: 1.485,
    10: 1.539,
}
_RANGE_OF_N = {
    2: 1.128,
    3: 1.693,
    4: 2.059,
    5: 2.326,
    6: 2.534,
    7: 2.704,
    8: 2.847,
    9: 2.970,
    10: 3.078,
}


@dataclass(frozen=True)
class Injection:
    kind: (
        str  # "fail-slow" (rank's compute) or "link-slow" (the link from rank's stage to the next)
    )
    rank: int  # in the one rank order (``resihp.parallel``)
    onset_step: int
    end_step: int  # last affected step, inclusive
    factor: float
    # link-slow only: "pipeline" (to the next stage) or "gradient-sync" (to the rank of the same
    # stage in the next replica: both ends' gradient reductions take factor x as long)
    traffic: str = "pipeline"

    def link_ends(self, dims) -> tuple[int, ...]:
        """The ranks a finding may name: the slow rank, or both ends of the slow link."""
        if self.kind != "link-slow":
            return (self.rank,)
        place = dims.coords(self.rank)
        if self.traffic == "gradient-sync":
            peer = dims.rank_of((place.dp_rank + 1) % dims.dp, place.stage, place.tp_rank)
        else:
            peer = dims.rank_of(place.dp_rank, place.stage + 1, place.tp_rank)
        return (self.rank, peer)


@dataclass
class CostPool:
    """Measured micro-batches: packed lengths, forward/backward seconds, and the measured op
    noise."""

    seq_lens: list[list[int]]
    fwd: np.ndarray
    bwd: np.ndarray
    source: np.ndarray
    op_sigma: float
    layers: int
    hidden: int
    device: str | None = None  # the profiled device, as a predictor's card names it

    @classmethod
    def from_profile(cls, path: str | Path) -> CostPool:
        path = Path(path)
        try:
            log = pd.read_parquet(path)
        except Exception as exc:
            raise InputError(f"{path}: cannot read profiling log ({type(exc).__name__})") from None
        need = {"phase", "seq_lens", "time_s", "mb_id", "layers", "hidden"}
        if not need <= set(log.columns):
            raise InputError(
                f"{path}: profiling log lacks {', '.join(sorted(need - set(log.columns)))}"
            )
        key = ["source", "mb_id"] if "source" in log.columns else ["mb_id"]
        # on a shared machine the thread's CPU time is the micro-batch's own cost; wall time also
        # holds other processes' time slices
        cpu = "cpu_time_s" in log.columns and log["cpu_time_s"].notna().all()
        value = "cpu_time_s" if cpu else "time_s"
        wide = log.pivot_table(index=key, columns="phase", values=value, aggfunc="first")
        first = log[log["phase"] == "fwd"].set_index(key)
        wide = wide.join(first[["seq_lens"]]).dropna()
        n = int(log["repeats"].iloc[0]) if "repeats" in log.columns else 5
        if cpu and "cpu_time_min_s" in log.columns:
            # median minus minimum of n normal draws is about E[-min] sigma
            gap = (log["cpu_time_s"] - log["cpu_time_min_s"]) / log["cpu_time_s"]
            sigma = float(gap.median()) / _EXPECTED_NEG_MIN.get(n, 1.163)
        elif "time_spread" in log.columns:
            sigma = float(log["time_spread"].median()) / _RANGE_OF_N.get(n, 2.326)
        else:
            raise InputError(
                f"{path}: profiling log has no repeat spread to take the op noise from"
            )
        src = (
            wide.index.get_level_values(0).to_numpy()
            if "source" in key
            else np.full(len(wide), "any")
        )
        return cls(
            [list(map(int, s)) for s in wide["seq_lens"]],
            wide["fwd"].to_numpy(float),
            wide["bwd"].to_numpy(float),
            np.asarray(src, dtype=object),
            sigma,
            int(log["layers"].iloc[0]),
            int(log["hidden"].iloc[0]),
            str(log["device"].iloc[0]) if "device" in log.columns else None,
        )

    def subset(self, source: str | None) -> np.ndarray:
        if source is None:
            return np.arange(len(self.fwd))
        idx = np.flatnonzero(self.source == source)
        if idx.size == 0:
            raise InputError(f"profiling log has no micro-batches from source {source!r}")
        return idx


def alibaba_residuals(path: str | Path) -> np.ndarray:
    """Healthy host noise: log(worker time / all workers' median that step) minus the worker's
    median."""
    df = pd.read_csv(path)
    wide = df.pivot_table(index="time", columns="worker", values="batch_time_norm").dropna()
    logs = np.log(wide.to_numpy(float))
    rel = logs - np.median(logs, axis=1, keepdims=True)
    res = rel - np.median(rel, axis=0, keepdims=True)
    return res.ravel()


@dataclass
class SimJob:
    dp: int = 4
    pp: int = 4
    microbatches: int = 8
    steps: int = 300
    source: str | None = None
    stage_layers: tuple[int, ...] | None = (
        None  # layers per stage; default: the profiled stack each
    )
    link_gbps: float = (
        10.0  # point-to-point bandwidth for activations (bytes = tokens * hidden * 4)
    )
    injections: list[Injection] = field(default_factory=list)
    seed: int = 0

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(self.dp, self.pp)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    def rank(self, dp_rank: int, stage: int) -> int:
        return self.dims.rank_of(dp_rank, stage)

    def meta(self) -> JobMeta:
        return JobMeta(dp_size=self.dp, pp_size=self.pp, tp_size=1, world_size=self.world_size)


def _schedule(pp: int, m: int) -> list[tuple[int, str, int]]:
    """A dependency-respecting global order of the 1F1B ops (stage, 'F'|'B', micro-batch): each
    stage's order is ``resihp.perf.schedule.rank_order``, taken round-robin as far as it can go."""
    orders = [
        [("F" if op.phase == FWD else "B", op.mb) for op in rank_order("1f1b", pp, m, 1, s)]
        for s in range(pp)
    ]
    done: set[tuple[int, str, int]] = set()
    ptr = [0] * pp
    out = []
    while len(out) < 2 * pp * m:
        progressed = False
        for s in range(pp):
            while ptr[s] < len(orders[s]):
                kind, i = orders[s][ptr[s]]
                dep = (
                    (s - 1, "F", i)
                    if kind == "F"
                    else ((s + 1, "B", i) if s < pp - 1 else (s, "F", i))
                )
                if kind == "F" and s == 0:
                    dep = None
                if dep is not None and dep not in done:
                    break
                done.add((s, kind, i))
                out.append((s, kind, i))
                ptr[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B schedule deadlocked")  # cannot happen for a valid schedule
    return out


def simulate(job: SimJob, pool: CostPool, host_noise: np.ndarray) -> pd.DataFrame:
    """The ops trace of ``job``: compute, point-to-point and gradient-reduction rows of every rank.

    Args:
        job: the simulated job (layout, steps, injected faults, seed).
        pool: the measured micro-batches and op noise drawn from.
        host_noise: healthy per-worker host noise residuals, resampled per rank and step.
    """
    rng = np.random.default_rng(job.seed)
    t_, d_, p_, m_ = job.steps, job.dp, job.pp, job.microbatches
    layers = job.stage_layers or (pool.layers,) * p_
    if len(layers) != p_:
        raise InputError(f"stage_layers has {len(layers)} entries for pp = {p_}")
    scale = np.asarray(layers, dtype=float) / pool.layers
    idx = rng.choice(pool.subset(job.source), size=(t_, d_, m_))
    tokens = np.array([sum(s) for s in pool.seq_lens], dtype=float)
    p2p_s = tokens[idx] * pool.hidden * 4 / (job.link_gbps * 1e9)  # [T, D, M]
    p2p_s = p2p_s * np.exp(rng.normal(0.0, pool.op_sigma, size=p2p_s.shape))
    host = np.exp(rng.choice(host_noise, size=(t_, d_, p_)))
    slow = np.ones((t_, d_, p_))
    link = np.ones((t_, d_, p_))
    sync_link = np.ones((t_, d_, p_))
    for inj in job.injections:
        if not 0 <= inj.rank < job.world_size:
            raise InputError(
                f"injection rank {inj.rank} is outside the job (world {job.world_size})"
            )
        if inj.kind == "link-slow" and inj.traffic == "gradient-sync":
            for r in inj.link_ends(job.dims):
                place = job.dims.coords(r)
                sync_link[inj.onset_step : inj.end_step + 1, place.dp_rank, place.stage] = (
                    inj.factor
                )
            continue
        place = job.dims.coords(inj.rank)
        d, s = place.dp_rank, place.stage
        target = slow if inj.kind == "fail-slow" else link
        target[inj.onset_step : inj.end_step + 1, d, s] *= inj.factor

    def own(kind: str, s: int, i: int) -> np.ndarray:
        base = (pool.fwd if kind == "F" else pool.bwd)[idx[:, :, i]] * scale[s]
        noise = np.exp(rng.normal(0.0, pool.op_sigma, size=(t_, d_)))
        return base * noise * host[:, :, s] * slow[:, :, s]

    free = np.zeros((p_, t_, d_))
    end: dict[tuple[int, str, int], np.ndarray] = {}
    rows: dict[str, list[np.ndarray]] = {
        k: [] for k in ("stage", "optype", "mb", "dur", "start", "seq")
    }

    def emit(s: int, optype: str, i: int, dur: np.ndarray, start: np.ndarray) -> None:
        rows["stage"].append(np.full((t_, d_), s))
        rows["optype"].append(np.full((t_, d_), optype, dtype=object))
        rows["mb"].append(np.full((t_, d_), i))
        rows["dur"].append(dur)
        rows["start"].append(start)
        rows["seq"].append(idx[:, :, i])

    for s, kind, i in _schedule(p_, m_):
        if kind == "F":
            ready = end[(s - 1, "F", i)] + p2p_s[:, :, i] * link[:, :, s - 1] if s > 0 else 0.0
        else:
            ready = end[(s + 1, "B", i)] + p2p_s[:, :, i] * link[:, :, s] if s < p_ - 1 else 0.0
        issued = free[s].copy()
        start = np.maximum(issued, ready)
        finish = start + own(kind, s, i)
        end[(s, kind, i)] = finish
        free[s] = finish
        emit(
            s, "forward-compute" if kind == "F" else "backward-compute", i, finish - issued, issued
        )
        if kind == "F" and s < p_ - 1:
            emit(s, "forward-send", i, p2p_s[:, :, i] * link[:, :, s], finish)
        if kind == "F" and s > 0:
            emit(s, "forward-recv", i, p2p_s[:, :, i] * link[:, :, s - 1], issued)
        if kind == "B" and s > 0:
            emit(s, "backward-send", i, p2p_s[:, :, i] * link[:, :, s - 1], finish)
        if kind == "B" and s < p_ - 1:
            emit(s, "backward-recv", i, p2p_s[:, :, i] * link[:, :, s], issued)
    # each stage's replicas reduce together once the last of them arrives; the step ends with the
    # last stage's reduction
    reduce_base = float(np.median(p2p_s)) * 4
    ends = np.zeros((t_,))
    for s in range(p_):
        arrived = free[s].max(axis=1)  # [T]
        jitter = np.exp(rng.normal(0.0, pool.op_sigma, size=(t_, d_)))
        end_s = arrived[:, None] + reduce_base * jitter * sync_link[:, :, s]
        emit(s, "grads-reduce-scatter", -1, end_s - free[s], free[s])
        ends = np.maximum(ends, end_s.max(axis=1))
    step_len = ends
    step_start = np.concatenate(([0.0], np.cumsum(step_len)[:-1]))

    stage = np.stack(rows["stage"])  # [ops, T, D]
    dp = np.broadcast_to(np.arange(d_)[None, None, :], stage.shape)
    step = np.broadcast_to(np.arange(t_)[None, :, None], stage.shape)
    optype = np.stack(rows["optype"])
    mb = np.stack(rows["mb"])
    seq_idx = np.stack(rows["seq"])
    compute = np.isin(optype, ["forward-compute", "backward-compute"])
    lens = np.empty(seq_idx.size, dtype=object)
    flat_c = compute.ravel()
    lens[flat_c] = [pool.seq_lens[j] for j in seq_idx.ravel()[flat_c]]
    df = pd.DataFrame(
        {
            "step": step.ravel(),
            "rank": job.dims.rank_of(dp, stage).ravel(),
            "dp_rank": dp.ravel(),
            "stage": stage.ravel(),
            "tp_rank": 0,
            "optype": optype.ravel(),
            "duration": np.stack(rows["dur"]).ravel(),
            "start_ts": (np.stack(rows["start"]) + step_start[None, :, None]).ravel(),
            "mb_id": pd.array(np.where(mb >= 0, mb, 0).ravel(), dtype="Int64"),
            "seq_lens": lens,
        }
    )
    df.loc[mb.ravel() < 0, "mb_id"] = pd.NA
    return df.sort_values(["step", "rank", "start_ts"], kind="stable").reset_index(drop=True)
