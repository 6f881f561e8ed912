"""From an ops trace to per-step, per-rank matrices the detector works on.

For each rank and step: ``raw`` (seconds of compute), ``own`` (a low quantile over the rank's compute
ops of measured / expected cost, i.e. how slow the rank's own work ran, ignoring the ops that were
inflated by waiting on a neighbour), ``expected`` (seconds the cost model expects; only with a trained
predictor) and ``comm`` (a low quantile of the per-token transfer times over the link to the next
stage: forward sends and backward receives).

The expected cost of an op comes from, in order of preference: a predictor callable given the op's
packed sequence lengths; analytic FLOPs of those lengths; peers that did the same work (the same stage
and micro-batch slot on the other data-parallel replicas, or with one replica the same micro-batch on
the other stages); the op's phase alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from resihp.errors import InputError
from resihp.opstrace import COMPUTE_OPTYPES, JobMeta
from resihp.workload.features import length_features
from resihp.workload.flops import TransformerShape, stage_flops

# expected_compute(seq_lens of each micro-batch, phase 'fwd'|'bwd') -> seconds per micro-batch
ExpectedCompute = Callable[[Sequence[Sequence[int]], str], np.ndarray]

# transfers over the link from a rank's stage to the next one: the rank's view of that link
NEXT_LINK_OPTYPES = ("forward-send", "backward-recv")
_PHASE = {"forward-compute": "fwd", "backward-compute": "bwd"}


@dataclass
class Layout:
    """Where each rank sits; indexed by rank id (``-1``: the rank never appears in the trace)."""

    dp_rank: np.ndarray
    stage: np.ndarray
    tp_rank: np.ndarray

    @property
    def world_size(self) -> int:
        return len(self.dp_rank)


@dataclass
class Observations:
    steps: np.ndarray
    own: np.ndarray
    raw: np.ndarray
    expected: np.ndarray | None
    comm: np.ndarray | None
    cost_model: str


def infer_meta(df: pd.DataFrame) -> JobMeta:
    """Parallel sizes implied by a trace when no job meta is given."""
    dp = int(df["dp_rank"].max()) + 1
    pp = int(df["stage"].max()) + 1
    tp = int(df["tp_rank"].max()) + 1 if "tp_rank" in df.columns and df["tp_rank"].notna().any() else 1
    world = max(dp * pp * tp, int(df["rank"].max()) + 1)
    if world != dp * pp * tp:
        tp = -(-world // (dp * pp))
        world = dp * pp * tp
    return JobMeta(dp_size=dp, pp_size=pp, tp_size=tp, world_size=world)


def rank_layout(df: pd.DataFrame, meta: JobMeta, source: str = "ops trace") -> Layout:
    """Each rank's (dp_rank, stage, tp_rank), checked against the job meta."""
    world = meta.world_size
    for col, limit, name in (("rank", world, "world_size"), ("dp_rank", meta.dp_size, "dp_size"),
                             ("stage", meta.pp_size, "pp_size")):
        top = int(df[col].max())
        if top >= limit:
            row = int(np.flatnonzero(df[col].to_numpy() >= limit)[0])
            raise InputError(f"{source}: column {col} row {row}: {top} is outside the job meta "
                             f"({name} = {limit}); expected 0..{limit - 1}")
    has_tp = "tp_rank" in df.columns and df["tp_rank"].notna().any()
    cols = ["rank", "dp_rank", "stage"] + (["tp_rank"] if has_tp else [])
    pairs = df[cols].drop_duplicates()
    dup = pairs["rank"].duplicated(keep=False)
    if dup.any():
        r = int(pairs.loc[dup, "rank"].iloc[0])
        raise InputError(f"{source}: rank {r} appears with more than one (dp_rank, stage"
                         f"{', tp_rank' if has_tp else ''}); expected one place per rank")
    dp = np.full(world, -1, dtype=np.int64)
    st = np.full(world, -1, dtype=np.int64)
    tp = np.full(world, -1, dtype=np.int64)
    ranks = pairs["rank"].to_numpy(np.int64)
    dp[ranks] = pairs["dp_rank"].to_numpy(np.int64)
    st[ranks] = pairs["stage"].to_numpy(np.int64)
    if has_tp:
        tp[ranks] = pairs["tp_rank"].fillna(-1).to_numpy(np.int64)
    return Layout(dp, st, tp)


def shape_from_meta(meta_dict: dict | None) -> TransformerShape | None:
    """The model shape from a job meta's optional model fields, if they are all there."""
    if not meta_dict:
        return None
    keys = ("layers", "hidden", "heads", "ffn_hidden")
    if not all(k in meta_dict for k in keys):
        return None
    try:
        return TransformerShape(*(int(meta_dict[k]) for k in keys), tp=int(meta_dict.get("tp_size", 1)))
    except (TypeError, ValueError) as exc:
        raise InputError(f"job meta: model fields {', '.join(keys)} must be integers ({exc})") from None


def _op_costs(comp: pd.DataFrame, meta: JobMeta, expected: ExpectedCompute | None,
              shape: TransformerShape | None, unblocked: bool = False
              ) -> tuple[np.ndarray, np.ndarray | None, str]:
    """(relative cost of each compute op, expected seconds or None, name of the cost model).

    With the waits taken out, the same micro-batch on the other stages of the pipeline is the best
    reference (the same data, whatever a cost model gets wrong about it), so the model's cost is
    scaled by the peers' measured/modelled ratio. Without lengths, peers are the only reference.
    """
    cost, exp_s, model = _model_costs(comp, expected, shape)
    has_mb = "mb_id" in comp.columns and comp["mb_id"].notna().all()
    if has_mb and ((unblocked and meta.pp_size > 1) or (model == "phase" and meta.world_size > 1
                                                          and (meta.dp_size > 1 or meta.pp_size > 1))):
        ratio = comp[["step", "dp_rank", "stage", "mb_id", "optype"]
                     + (["tp_rank"] if "tp_rank" in comp.columns else [])].copy()
        ratio["duration"] = comp["duration"].to_numpy() / cost
        cost = cost * _peer_reference(ratio, meta, unblocked)
        model = "peers" if model == "phase" else f"{model}+peers"
    return cost, exp_s, model


def _model_costs(comp: pd.DataFrame, expected: ExpectedCompute | None,
                 shape: TransformerShape | None) -> tuple[np.ndarray, np.ndarray | None, str]:
    """Each op's cost from its sequence lengths (predictor, else analytic FLOPs), else its phase."""
    phase = comp["optype"].map(_PHASE).to_numpy()
    has_lens = "seq_lens" in comp.columns and comp["seq_lens"].notna().all() and len(comp)
    if not has_lens:
        return np.where(phase == "bwd", 2.0, 1.0), None, "phase"
    keys = comp[["step", "dp_rank", "optype"]].copy()
    keys["mb"] = comp["mb_id"].to_numpy() if "mb_id" in comp.columns else np.arange(len(comp))
    if "mb_id" in comp.columns and comp["mb_id"].isna().any():
        keys["mb"] = np.arange(len(comp))
    codes, first = _unique_rows(keys)
    lens = comp["seq_lens"].to_numpy()[first]
    ph = phase[first]
    cost_u = np.empty(len(first))
    if expected is not None:
        for p in ("fwd", "bwd"):
            sel = np.flatnonzero(ph == p)
            if sel.size:
                cost_u[sel] = np.asarray(expected([lens[i] for i in sel], p), dtype=np.float64)
        if not np.all(np.isfinite(cost_u)) or cost_u.min() <= 0:
            raise InputError("predictor: expected compute times must be positive and finite")
        cost = cost_u[codes]
        return cost, cost, "predictor"
    feats = length_features(list(lens))
    use = shape or TransformerShape(1, 4096, 32, 16384)
    for p in ("fwd", "bwd"):
        sel = np.flatnonzero(ph == p)
        if sel.size:
            d, a = stage_flops(use, feats["tokens"].to_numpy()[sel], feats["sum_sq"].to_numpy()[sel], p)
            cost_u[sel] = d + (a if shape is not None else 0.0)
    return cost_u[codes], None, "flops" if shape is not None else "tokens"


def _peer_reference(ops: pd.DataFrame, meta: JobMeta, unblocked: bool) -> np.ndarray:
    """Per op, the lower median of the same op of its peers (with few peers, one slow member must not
    lift everybody's reference, so the lower, not the mean of the middle two).

    Peers are the other stages of the pipeline running the same micro-batch (the same data; needs the
    waits taken out, since upstream and downstream stages wait differently), else the same stage on
    the other data-parallel replicas (the same layers and token budget; their data differ).
    """
    if (unblocked or meta.dp_size == 1) and meta.pp_size > 1:
        keys = ["step", "dp_rank", "mb_id", "optype"]
    else:
        keys = ["step", "stage", "mb_id", "optype"]
    if "tp_rank" in ops.columns and ops["tp_rank"].notna().all():
        keys.append("tp_rank")
    ref = ops.groupby(keys)["duration"].quantile(0.5, interpolation="lower")
    ref = ref.reindex(pd.MultiIndex.from_frame(ops[keys])).to_numpy(np.float64)
    return np.maximum(ref, 1e-12)


def _unique_rows(keys: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    codes = keys.groupby(list(keys.columns), sort=False, dropna=False).ngroup().to_numpy()
    _, first = np.unique(codes, return_index=True)
    return codes, first


def _to_matrix(step_idx: np.ndarray, rank: np.ndarray, values: np.ndarray, t: int, w: int) -> np.ndarray:
    out = np.full((t, w), np.nan)
    out[step_idx, rank] = values
    return out


def _low_quantile(frame: pd.DataFrame, value: str, q: float) -> pd.Series:
    grouped = frame.groupby(["step", "rank"], sort=True)[value]
    return grouped.min() if q <= 0 else grouped.quantile(q)


def observe_ops(df: pd.DataFrame, meta: JobMeta, *, expected: ExpectedCompute | None = None,
                shape: TransformerShape | None = None, own_quantile: float = 0.1) -> Observations:
    """Per-step, per-rank matrices from a validated ops trace (rows of any subset of ranks/steps)."""
    steps = np.unique(df["step"].to_numpy(np.int64))
    t, w = len(steps), meta.world_size
    comp = df[df["optype"].isin(COMPUTE_OPTYPES)]
    if comp.empty:
        raise InputError("ops trace: no forward-compute or backward-compute rows to analyse")
    unblocked = _unblocked_durations(comp) if meta.pp_size > 1 else None
    if unblocked is not None:
        comp = comp.assign(duration=unblocked)
    cost, exp_s, model = _op_costs(comp, meta, expected, shape, unblocked is not None)
    frame = pd.DataFrame({"step": comp["step"].to_numpy(), "rank": comp["rank"].to_numpy(),
                          "ratio": comp["duration"].to_numpy() / cost,
                          "duration": comp["duration"].to_numpy()})
    # with the waits taken out (or none to take: one stage), the median op speaks for the rank;
    # otherwise a low quantile, the ops that did not wait
    waits_left = meta.pp_size > 1 and unblocked is None
    own = _low_quantile(frame, "ratio", own_quantile if waits_left else 0.5)
    idx = own.index
    s_idx = np.searchsorted(steps, idx.get_level_values(0).to_numpy())
    r_idx = idx.get_level_values(1).to_numpy()
    raw = frame.groupby(["step", "rank"], sort=True)["duration"].sum()
    expected_m = None
    if exp_s is not None:
        frame["expected"] = exp_s
        expected_m = _to_matrix(s_idx, r_idx, frame.groupby(["step", "rank"], sort=True)["expected"]
                                .sum().to_numpy(), t, w)
    comm_m = None
    p2p = df[df["optype"].isin(NEXT_LINK_OPTYPES)]
    if not p2p.empty:
        c = _low_quantile(_per_token(p2p, comp, meta), "duration", own_quantile)
        ci = c.index
        comm_m = _to_matrix(np.searchsorted(steps, ci.get_level_values(0).to_numpy()),
                            ci.get_level_values(1).to_numpy(), c.to_numpy(), t, w)
    if unblocked is not None:
        model += "+timestamps" if "start_ts" in comp.columns else "+cumulative-times"
    return Observations(steps, _to_matrix(s_idx, r_idx, own.to_numpy(), t, w),
                        _to_matrix(s_idx, r_idx, raw.to_numpy(), t, w), expected_m, comm_m, model)


def _per_token(p2p: pd.DataFrame, comp: pd.DataFrame, meta: JobMeta) -> pd.DataFrame:
    """Transfer seconds per token of the micro-batch carried, where the trace says which one it was;
    without lengths, relative to the same transfer on the pipeline's other links (or replicas)."""
    out = p2p[["step", "rank", "duration"]].copy()
    keys = ["step", "dp_rank", "mb_id"]
    if "mb_id" not in p2p.columns or p2p["mb_id"].isna().any():
        return out
    if "seq_lens" not in comp.columns or comp["seq_lens"].isna().any():
        if meta.pp_size > 2 or meta.dp_size > 1:
            ref = _peer_reference(p2p, meta, unblocked=meta.pp_size > 2)
            out["duration"] = out["duration"].to_numpy() / ref
        return out
    first = comp.drop_duplicates(keys)
    tokens = pd.Series([sum(s) for s in first["seq_lens"]], dtype=np.float64,
                       index=pd.MultiIndex.from_frame(first[keys].astype(np.int64)))
    look = pd.MultiIndex.from_frame(p2p[keys].fillna(-1).astype(np.int64))
    t = tokens.reindex(look).to_numpy()
    out["duration"] = np.where(np.isfinite(t) & (t > 0), out["duration"].to_numpy() / t, np.nan)
    return out.dropna()


def _unblocked_durations(comp: pd.DataFrame) -> np.ndarray | None:
    """Compute durations without the time spent blocked on the pipeline neighbour, from timestamps.

    A forward op of stage ``s`` cannot run before the same micro-batch's forward on ``s - 1`` ended
    (a backward op: before the backward on ``s + 1``). Its own time is from the later of its issue
    and that end to its own end. Needs ``mb_id`` on every compute row; issue times are ``start_ts``
    (clocks that agree across a pipeline) or, without it, the running sum of the rank's compute
    durations in the step. An op whose neighbour is absent keeps its duration.
    """
    if "mb_id" not in comp.columns or comp["mb_id"].isna().any():
        return None
    keys = ["step", "dp_rank", "mb_id", "optype"]
    if "tp_rank" in comp.columns and comp["tp_rank"].notna().all():
        keys.append("tp_rank")
    if "start_ts" in comp.columns and comp["start_ts"].notna().all():
        start = comp["start_ts"].to_numpy(np.float64)
    else:
        # no clock: a rank's compute ops run back to back from the step's start, in record order
        # (every rank starts a step together, after the previous step's gradient synchronisation)
        dur = comp["duration"].to_numpy(np.float64)
        start = comp.assign(_d=dur).groupby(["step", "rank"], sort=False)["_d"].cumsum().to_numpy() - dur
    dur = comp["duration"].to_numpy(np.float64)
    ends = comp[keys + ["stage"]].copy()
    ends["_end"] = start + dur
    ends = ends.drop_duplicates(keys + ["stage"])
    look = comp[keys].copy()
    look["stage"] = comp["stage"].to_numpy() + np.where(comp["optype"].to_numpy() == "backward-compute",
                                                        1, -1)
    dep_end = look.merge(ends, on=keys + ["stage"], how="left")["_end"].to_numpy()
    own = np.where(np.isfinite(dep_end) & (dep_end > start) & (dep_end < start + dur),
                   start + dur - dep_end, dur)
    return own
