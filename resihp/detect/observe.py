"""From an ops trace to per-step, per-rank matrices the detector works on.

For each rank and step: ``raw`` (seconds of compute), ``own`` (a low quantile over the rank's
compute ops of measured / expected cost, i.e. how slow the rank's own work ran, ignoring the ops
that were inflated by waiting on a neighbour), ``expected`` (seconds the cost model expects; only
with a trained predictor), ``comm`` (per-token transfer times over the link to the next stage: with
``start_ts`` the median of its messages with the waits taken out, ``links``; without, a low quantile
of forward sends and backward receives) and ``sync`` (gradient-collective transfer seconds,
``links``).

The expected cost of an op comes from, in order of preference: a predictor callable given the op's
packed sequence lengths (or the job's own cost fitted on its calibration window, ``fitted``);
analytic FLOPs of those lengths; peers that did the same work (the same stage
and micro-batch slot on the other data-parallel replicas, or with one replica the same micro-batch
on the other stages); the op's phase alone.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pandas as pd

from resihp.detect.fitted import FittedCost
from resihp.detect.links import optype_factors, pipeline_transfers, sync_transfers
from resihp.errors import InputError
from resihp.opstrace import JobMeta
from resihp.workload.features import PooledLengths, length_feature_arrays
from resihp.workload.flops import TransformerShape, stage_flops

# expected_compute(seq_lens of each micro-batch, phase 'fwd'|'bwd') -> seconds per micro-batch
ExpectedCompute = Callable[[Sequence[Sequence[int]], str], np.ndarray]

# transfers over the link from a rank's stage to the next one: the rank's view of that link
NEXT_LINK_OPTYPES = ("forward-send", "backward-recv")
_PHASE = {"forward-compute": "fwd", "backward-compute": "bwd"}


@dataclass
class RankPlacement:
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
    # per rank, seconds in gradient collectives after their last member arrived (``links``)
    sync: np.ndarray | None = None
    # per phase (``forward``, ``backward``), its own-work ratio alone, as ``own`` on its ops only
    phase_own: dict[str, np.ndarray] | None = None

    @classmethod
    def joined(cls, parts: Sequence[Observations]) -> Observations:
        """Parts of one trace in step order (``layout_parts``) as one.

        Each per-rank matrix is padded to the widest part's ranks (NaN: no record); one missing in
        some part is NaN there."""
        if len(parts) == 1:
            return parts[0]
        width = max(o.own.shape[1] for o in parts)

        def cat(mats: list[np.ndarray | None]) -> np.ndarray | None:
            if all(m is None for m in mats):
                return None
            out = []
            for o, m in zip(parts, mats):
                full = np.full((len(o.steps), width), np.nan)
                if m is not None:
                    full[:, : m.shape[1]] = m
                out.append(full)
            return np.concatenate(out)

        names = sorted({n for o in parts for n in (o.phase_own or {})})
        models = list(dict.fromkeys(o.cost_model for o in parts))
        return cls(
            np.concatenate([o.steps for o in parts]),
            cat([o.own for o in parts]),
            cat([o.raw for o in parts]),
            cat([o.expected for o in parts]),
            cat([o.comm for o in parts]),
            " then ".join(models),
            cat([o.sync for o in parts]),
            {n: cat([(o.phase_own or {}).get(n) for o in parts]) for n in names} or None,
        )


def covering_meta(meta: JobMeta, dp: int, pp: int, tp: int) -> JobMeta:
    """A job meta whose coordinates take in ``dp`` pipelines, ``pp`` stages and groups of ``tp``.

    For a layout a live re-plan re-formed where ``meta``'s do not (pipelines of other depths, a
    rank moved to another stage): replicas x the deepest pipeline x the widest group, padded with
    stages to hold every rank number of ``meta``; ranks the layout leaves out only have no records.

    Args:
        meta: the job's meta at launch.
        dp: pipelines of the re-formed layout.
        pp: its deepest pipeline's stages.
        tp: its widest tensor-parallel group.
    """
    if dp <= meta.dp_size and pp <= meta.pp_size and tp <= meta.tp_size:
        return meta
    depth = max(pp, math.ceil(meta.world_size / (dp * tp)))
    return JobMeta(dp, depth, tp, dp * depth * tp)


def layout_parts(df: pd.DataFrame, meta: JobMeta) -> list[tuple[pd.DataFrame, JobMeta]]:
    """A trace in parts between the live re-forms of its layout, each with a covering job meta.

    A re-form is a ``replan-layout`` op: ranks took new places from that step."""
    starts = sorted(set(df.loc[df["optype"] == "replan-layout", "step"].astype(int)))
    if not starts:
        return [(df, meta)]
    steps = df["step"].to_numpy()
    edges = [int(steps.min()), *starts, int(steps.max()) + 1]
    out = []
    for lo, hi in zip(edges, edges[1:]):
        part = df[(steps >= lo) & (steps < hi)]
        if part.empty:
            continue
        tp = (
            int(part["tp_rank"].max()) + 1
            if "tp_rank" in part and part["tp_rank"].notna().any()
            else 1
        )
        out.append(
            (
                part,
                covering_meta(
                    meta, int(part["dp_rank"].max()) + 1, int(part["stage"].max()) + 1, tp
                ),
            )
        )
    return out


def infer_meta(df: pd.DataFrame) -> JobMeta:
    """Parallel sizes implied by a trace when no job meta is given."""
    dp = int(df["dp_rank"].max()) + 1
    pp = int(df["stage"].max()) + 1
    tp = (
        int(df["tp_rank"].max()) + 1
        if "tp_rank" in df.columns and df["tp_rank"].notna().any()
        else 1
    )
    world = max(dp * pp * tp, int(df["rank"].max()) + 1)
    if world != dp * pp * tp:
        tp = -(-world // (dp * pp))
        world = dp * pp * tp
    return JobMeta(dp_size=dp, pp_size=pp, tp_size=tp, world_size=world)


def rank_layout(df: pd.DataFrame, meta: JobMeta, source: str = "ops trace") -> RankPlacement:
    """Each rank's (dp_rank, stage, tp_rank), checked against the job meta.

    Args:
        df: the ops trace.
        meta: the job's meta.
        source: what errors name as the trace.
    """
    world = meta.world_size
    for col, limit, name in (
        ("rank", world, "world_size"),
        ("dp_rank", meta.dp_size, "dp_size"),
        ("stage", meta.pp_size, "pp_size"),
    ):
        top = int(df[col].max())
        if top >= limit:
            row = int(np.flatnonzero(df[col].to_numpy() >= limit)[0])
            raise InputError(
                f"{source}: column {col} row {row}: {top} is outside the job meta "
                f"({name} = {limit}); expected 0..{limit - 1}"
            )
    has_tp = "tp_rank" in df.columns and df["tp_rank"].notna().any()
    cols = ["rank", "dp_rank", "stage"] + (["tp_rank"] if has_tp else [])
    pairs = df[cols].drop_duplicates()
    dup = pairs["rank"].duplicated(keep=False)
    if dup.any():
        r = int(pairs.loc[dup, "rank"].iloc[0])
        raise InputError(
            f"{source}: rank {r} appears with more than one (dp_rank, stage"
            f"{', tp_rank' if has_tp else ''}); expected one place per rank"
        )
    dp = np.full(world, -1, dtype=np.int64)
    st = np.full(world, -1, dtype=np.int64)
    tp = np.full(world, -1, dtype=np.int64)
    ranks = pairs["rank"].to_numpy(np.int64)
    dp[ranks] = pairs["dp_rank"].to_numpy(np.int64)
    st[ranks] = pairs["stage"].to_numpy(np.int64)
    if has_tp:
        tp[ranks] = pairs["tp_rank"].fillna(-1).to_numpy(np.int64)
    return RankPlacement(dp, st, tp)


def shape_from_meta(meta_dict: dict | None) -> TransformerShape | None:
    """The model shape from a job meta's optional model fields, if they are all there."""
    if not meta_dict:
        return None
    keys = ("layers", "hidden", "heads", "ffn_hidden")
    if not all(k in meta_dict for k in keys):
        return None
    try:
        return TransformerShape(
            *(int(meta_dict[k]) for k in keys), tp=int(meta_dict.get("tp_size", 1))
        )
    except (TypeError, ValueError) as exc:
        raise InputError(
            f"job meta: model fields {', '.join(keys)} must be integers ({exc})"
        ) from None


class _Ops:
    """The key and value columns of a subset of trace rows as numpy arrays."""

    def __init__(
        self,
        cols: Mapping[str, np.ndarray],
        rows: np.ndarray,
        op: np.ndarray,
        memo: _Memo | None = None,
    ) -> None:
        self.cols = cols
        self._memo = memo  # the structure's derived values (``StructureMemo``), where kept
        self.rows = rows
        self._all = len(rows) == len(op)  # every row: the columns themselves, not copies
        self.op = self.values_of(op)  # small integer code of the optype
        self.step, self.rank, self.dp_rank, self.stage, self.duration = (
            self.values(c) for c in ("step", "rank", "dp_rank", "stage", "duration")
        )
        if (
            "wait_s" in cols
        ):  # time a compute op spent in tensor-parallel collectives, waiting for peers
            self.duration = self.duration - np.nan_to_num(self.values("wait_s"))
        self.tp_rank = self._full_int("tp_rank")
        self.mb_id = self._full_int("mb_id")

    @cached_property
    def micro_batch_code(self) -> np.ndarray:
        """Per row, one code for its micro-batch and phase on its pipeline (step, dp_rank, mb_id,
        op and tp_rank): what a micro-batch's ops on the pipeline's stages share (``mb_id`` on
        every row)."""
        tp = [] if self.tp_rank is None else [self.tp_rank]

        def make() -> np.ndarray:
            return _key_codes([self.step, self.dp_rank, self.mb_id, self.op, *tp])[0]

        return make() if self._memo is None else self._memo.get("micro_batch_code", make)

    def _full_int(self, name: str) -> np.ndarray | None:
        """The column as int64 when present with a value on every row of the subset, else None."""
        if name not in self.cols:
            return None
        col = self.values(name)
        if col.dtype.kind in "iu":  # an integer column has a value on every row
            return col.astype(np.int64, copy=False)
        return None if np.isnan(col).any() else col.astype(np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def has(self, name: str, at: np.ndarray | None = None) -> bool:
        """Whether the column is there with a value on every row of the subset (or on its rows
        ``at``)."""
        if name not in self.cols:
            return False
        col = self.values(name, at)
        if isinstance(col, PooledLengths):
            return True  # a code on every row
        return not (pd.isna(col).any() if col.dtype == object else np.isnan(col).any())

    def values(self, name: str, at: np.ndarray | None = None) -> np.ndarray:
        """The column on the subset's rows (or on its rows ``at``); not to be written to."""
        return self.values_of(self.cols[name], at)

    def values_of(self, column: np.ndarray, at: np.ndarray | None = None) -> np.ndarray:
        if self._all:
            return column if at is None else column[at]
        return column[self.rows if at is None else self.rows[at]]


_STRUCTURE = ("rank", "dp_rank", "stage", "tp_rank", "mb_id", "optype")


@dataclass
class _Structure:
    arrays: tuple  # the structure columns themselves (held, so their ids stay theirs)
    steps: np.ndarray  # the step column less its first value
    derived: dict = field(default_factory=dict)


class StructureMemo:
    """What ``observe_columns`` derives from a trace's row structure, kept for the next call.

    The structure is the rows' places, micro-batches and phases and their steps relative to the
    first (what is derived: the codes, sort orders and table slots of its groupings); it is kept
    for the next call on rows of the same structure: a producer
    whose every few steps of records have the same rows, timings apart, reuses its structure
    columns and passes one memo (the replay does, per layout). Rows are of the same structure when
    their structure columns are the very same arrays and their steps the same relative to the first;
    any other call derives afresh, and the last ``keep`` structures are remembered. Safe to share
    between threads (a structure derived twice at once is derived the same twice)."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._entries: list[_Structure] = []
        self._lock = threading.Lock()

    def bind(self, cols: Mapping[str, np.ndarray]) -> _Memo:
        arrays = tuple(cols.get(c) for c in _STRUCTURE)
        step = np.asarray(cols["step"])
        rel = step - step[0] if len(step) else step
        with self._lock:
            for entry in self._entries:
                if all(a is b for a, b in zip(entry.arrays, arrays)) and np.array_equal(
                    entry.steps, rel
                ):
                    return _Memo(entry.derived)
            entry = _Structure(arrays, rel)
            self._entries = [entry, *self._entries][: self.keep]
        return _Memo(entry.derived)


class _Memo:
    """One structure's derived values by name (``StructureMemo``); without a store, each is
    derived at every call."""

    def __init__(self, store: dict | None = None) -> None:
        self.store = store

    def get(self, name: str, make: Callable[[], object]):
        if self.store is None:
            return make()
        if name not in self.store:
            self.store[name] = make()
        return self.store[name]


_NO_MEMO = _Memo()


# the columns observe reads, with the dtype it works in (NaN marks a missing integer)
_COLUMN_DTYPES = {
    "step": np.int64,
    "rank": np.int64,
    "dp_rank": np.int64,
    "stage": np.int64,
    "duration": np.float64,
    "tp_rank": np.float64,
    "mb_id": np.float64,
    "start_ts": np.float64,
    "wait_s": np.float64,
}


def trace_columns(df: pd.DataFrame) -> dict[str, np.ndarray]:
    """The columns of an ops trace that ``observe_columns`` reads, as numpy arrays."""
    cols = {
        c: df[c].to_numpy(dt, na_value=np.nan) if dt is np.float64 else df[c].to_numpy(dt)
        for c, dt in _COLUMN_DTYPES.items()
        if c in df.columns
    }
    cols["optype"] = df["optype"]
    if "seq_lens" in df.columns:
        cols["seq_lens"] = df["seq_lens"].to_numpy()
    return cols


def _key_codes(*tables: Sequence[np.ndarray]) -> list[np.ndarray]:
    """One int64 code per row of each table of integer key columns, with the same radix for all
    tables (so codes compare across them)."""
    width = len(tables[0])
    codes = [np.zeros(len(t[0]), dtype=np.int64) for t in tables]
    for j in range(width):
        cols = [np.asarray(t[j], dtype=np.int64) for t in tables]
        nonempty = [c for c in cols if len(c)]
        lo = min(int(c.min()) for c in nonempty) if nonempty else 0
        span = (max(int(c.max()) for c in nonempty) - lo + 1) if nonempty else 1
        for code, c in zip(codes, cols):
            code *= span
            code += c
            code -= lo
    return codes


def _first_of_each(code: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(code, return_index=True, return_inverse=True)[1:]``: the first row of each
    distinct code (in code order) and each row's index among them; without a sort when the
    non-negative codes are dense."""
    n = len(code)
    if n and code.min() >= 0 and code.max() < 4 * n:
        first = np.full(int(code.max()) + 1, n)
        np.minimum.at(first, code, np.arange(n))
        present = first < n
        index = np.cumsum(present) - 1
        return first[present], index[code]
    _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
    return first, inverse


@dataclass(frozen=True)
class _Groups:
    """The groups of equal codes of some rows, from the codes alone (``_group_layout``)."""

    by_code: np.ndarray | None  # the rows in code order (stable); None: in code order already
    change: np.ndarray  # in code order, whether a row starts a group
    gcode: np.ndarray
    bounds: np.ndarray  # each group's first position in code order
    size: int  # the rows of every group, where all have as many; else 0
    group_of: np.ndarray | None  # where all have as many: each row's group


def _group_layout(code: np.ndarray) -> _Groups:
    # rows in code order already (a producer that writes them so): no sort and no gathers; else a
    # stable sort by code, nearly free on the mostly ordered codes of real traces
    ordered = len(code) < 2 or bool((code[1:] >= code[:-1]).all())
    by_code = None if ordered else np.argsort(code, kind="stable")
    sc = code if ordered else code[by_code]
    change = np.r_[True, sc[1:] != sc[:-1]]
    bounds = np.flatnonzero(change)
    groups = len(bounds)
    size = len(code) // max(groups, 1)
    if not (groups and np.all(np.diff(bounds, append=len(code)) == size)):
        return _Groups(by_code, change, sc[bounds], bounds, 0, None)
    group_of = np.repeat(np.arange(groups), size)
    if not ordered:
        inverse = np.empty(len(code), dtype=np.int64)
        inverse[by_code] = group_of
        group_of = inverse
    return _Groups(by_code, change, sc[bounds], bounds, size, group_of)


def _sorted_groups(
    code: np.ndarray, values: np.ndarray, layout: _Groups | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(values sorted by code, then value with NaN last; group code; group start; non-NaN count;
    group of each row). ``layout``: ``_group_layout(code)``, where the caller has it."""
    g = _group_layout(code) if layout is None else layout
    groups = len(g.bounds)
    if g.size:
        # groups of one size (a full trace): each group's values sorted as a row of a table
        table = _sort_rows(
            (values if g.by_code is None else values[g.by_code]).reshape(groups, g.size)
        )
        valid = sum((~np.isnan(table[:, j])).astype(np.int64) for j in range(g.size))
        return table.ravel(), g.gcode, g.bounds, valid, g.group_of
    inverse = np.empty(len(code), dtype=np.int64)
    by_value = np.argsort(values)  # NaN last
    order = by_value[np.argsort(code[by_value], kind="stable")]
    group_of_sorted = np.cumsum(g.change) - 1
    v = values[order]
    valid = np.bincount(group_of_sorted, weights=~np.isnan(v), minlength=groups)
    inverse[order] = group_of_sorted
    return v, g.gcode, g.bounds, valid.astype(np.int64), inverse


def _sort_rows(table: np.ndarray) -> np.ndarray:
    """Each row sorted, NaN last. Many short rows (a few ops per rank and step): an odd-even
    transposition network over whole columns, which numpy does far faster than row-by-row sorts."""
    k = table.shape[1]
    if k > 8:
        return np.sort(table, axis=1)
    cols = [table[:, j].copy() for j in range(k)]
    for r in range(k):
        for j in range(r % 2, k - 1, 2):
            # fmin skips a NaN, maximum keeps it: a NaN moves to the later column
            cols[j], cols[j + 1] = np.fmin(cols[j], cols[j + 1]), np.maximum(cols[j], cols[j + 1])
    return np.stack(cols, axis=1) if k else table


def _group_quantile(
    code: np.ndarray,
    values: np.ndarray,
    q: float,
    lower: bool = False,
    layout: _Groups | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group of equal codes: (group codes, quantile, group of each row), as pandas' groupby
    ``quantile(q)`` computes it (linear interpolation, or ``lower``; NaN ignored)."""
    v, gcode, start, n, inverse = _sorted_groups(code, values, layout)
    full = int(n[0]) if len(n) else 0
    if full and len(v) == len(n) * full and n.min() == full:
        # every group whole, of one size, no NaN (a full trace): one position for all, by column
        rows = v.reshape(len(n), full)
        pos = q * (full - 1)
        lo = math.floor(pos)
        out = rows[:, lo]
        if not lower and pos > lo:
            out = out + (rows[:, min(lo + 1, full - 1)] - out) * (pos - lo)
        return gcode, out, inverse
    pos = q * np.maximum(n - 1, 0)
    lo = np.floor(pos).astype(np.int64)
    out = v[np.minimum(start + lo, len(v) - 1)]
    if not lower:
        frac = pos - lo
        hi = v[np.minimum(start + np.minimum(lo + 1, np.maximum(n - 1, 0)), len(v) - 1)]
        out = np.where(frac > 0, out + (hi - out) * frac, out)
    return gcode, np.where(n > 0, out, np.nan), inverse


def _op_costs(
    comp: _Ops,
    meta: JobMeta,
    expected: ExpectedCompute | None,
    shape: TransformerShape | None,
    unblocked: np.ndarray | None = None,
    memo: _Memo = _NO_MEMO,
) -> tuple[np.ndarray, np.ndarray | None, str]:
    """(relative cost of each compute op, expected seconds or None, name of the cost model).

    With the waits taken out, the same micro-batch on the other stages of the pipeline is the best
    reference (the same data, whatever a cost model gets wrong about it), so the model's cost is
    scaled by the peers' measured/modelled ratio. Without lengths, peers are the only reference.
    """
    cost, exp_s, model = _model_costs(comp, expected, shape, memo)
    has_mb = comp.mb_id is not None
    blocked = unblocked is not None
    if has_mb and (
        (blocked and meta.pp_size > 1)
        or (model == "phase" and meta.world_size > 1 and (meta.dp_size > 1 or meta.pp_size > 1))
    ):
        duration = unblocked if blocked else comp.duration
        cost = cost * _peer_reference(comp, duration / cost, meta, blocked, memo)
        model = "peers" if model == "phase" else f"{model}+peers"
    return cost, exp_s, model


def _model_costs(
    comp: _Ops,
    expected: ExpectedCompute | None,
    shape: TransformerShape | None,
    memo: _Memo = _NO_MEMO,
) -> tuple[np.ndarray, np.ndarray | None, str]:
    """Each op's cost from its sequence lengths (predictor, else analytic FLOPs), else its phase."""
    bwd = comp.op == _OP_BWD
    if not (len(comp) and "seq_lens" in comp.cols):
        return np.where(bwd, 2.0, 1.0), None, "phase"
    if comp.mb_id is not None:
        # one cost per micro-batch and phase, from its first record
        first, codes = memo.get(
            "micro_batches",
            lambda: _first_of_each(_key_codes((comp.step, comp.dp_rank, comp.op, comp.mb_id))[0]),
        )
    else:
        first = codes = np.arange(len(comp))
    if not comp.has("seq_lens", first):
        return np.where(bwd, 2.0, 1.0), None, "phase"
    lens = comp.values("seq_lens", first)
    ph_bwd = bwd[first]
    cost_u = np.empty(len(first))
    if expected is not None:
        fitted = isinstance(expected, FittedCost)
        for p, sel in (("fwd", np.flatnonzero(~ph_bwd)), ("bwd", np.flatnonzero(ph_bwd))):
            if sel.size and fitted:  # the fitted window out of fold: its noise seen honestly
                cost_u[sel] = expected.costs([lens[i] for i in sel], p, comp.step[first[sel]])
            elif sel.size:
                cost_u[sel] = np.asarray(expected([lens[i] for i in sel], p), dtype=np.float64)
        if not np.all(np.isfinite(cost_u)) or cost_u.min() <= 0:
            raise InputError("predictor: expected compute times must be positive and finite")
        cost = cost_u[codes]
        if fitted:  # relative costs: the job's own, not a device's seconds
            return cost, None, "fitted"
        return cost, cost, "predictor"
    feats = length_feature_arrays(lens)
    tokens, sum_sq = feats["tokens"], feats["sum_sq"]
    use = shape or TransformerShape(1, 4096, 32, 16384)
    for p, sel in (("fwd", np.flatnonzero(~ph_bwd)), ("bwd", np.flatnonzero(ph_bwd))):
        if sel.size:
            d, a = stage_flops(use, tokens[sel], sum_sq[sel], p)
            cost_u[sel] = d + (a if shape is not None else 0.0)
    return cost_u[codes], None, "flops" if shape is not None else "tokens"


def _peer_reference(
    ops: _Ops, values: np.ndarray, meta: JobMeta, unblocked: bool, memo: _Memo = _NO_MEMO
) -> np.ndarray:
    """Per op, the lower median of the same op of its peers (with few peers, one slow member must
    not lift everybody's reference, so the lower, not the mean of the middle two).

    Peers are the other stages of the pipeline running the same micro-batch (the same data; needs
    the waits taken out, since upstream and downstream stages wait differently), else the same stage
    on the other data-parallel replicas (the same layers and token budget; their data differ).
    """
    tp = [] if ops.tp_rank is None else [ops.tp_rank]
    replicas = [ops.step, ops.stage, ops.mb_id, ops.op, *tp]
    if (unblocked or meta.dp_size == 1) and meta.pp_size > 1:
        ref, alone = _lower_median_by(ops.micro_batch_code, ops.stage, values, memo, "pipeline")
        if alone.any():
            # a pipeline of one stage among deeper ones (replicas of different depths): no other
            # stage ran its micro-batch, so its reference is the step's same phase on every rank
            # (a constant ratio of layers, which the detector's baseline takes in), not itself
            other, lonely = _lower_median_by(
                _key_codes([ops.step, ops.op, *tp])[0], ops.rank, values
            )
            ref = np.where(alone & ~lonely, other, ref)
    else:
        code = memo.get("replicas", lambda: _key_codes(replicas)[0])
        ref, _ = _lower_median_by(code, ops.dp_rank, values, memo, "replicas")
    return np.maximum(ref, 1e-12)


def _lower_median_by(
    code: np.ndarray, member: np.ndarray, values: np.ndarray, memo: _Memo = _NO_MEMO, name: str = ""
) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the lower median of ``values`` over the rows with the same key ``code``
    (``_key_codes``); and whether the row is alone in its group. ``name``: the grouping's in
    ``memo``."""
    table = memo.get(f"{name}:table", lambda: _dense_layout(code, member - member.min()))
    if table is not None:
        ref = _pivot_lower_median(code, values, table)
    else:
        layout = memo.get(f"{name}:groups", lambda: _group_layout(code))
        _, ref_g, inverse = _group_quantile(code, values, 0.5, lower=True, layout=layout)
        ref = ref_g[inverse]
    return ref, memo.get(f"{name}:alone", lambda: np.bincount(code)[code] == 1)


@dataclass(frozen=True)
class _DenseTable:
    """Where each row goes in a (group code x member) table (``_dense_layout``)."""

    slot: np.ndarray
    groups: int
    width: int
    members: np.ndarray  # the rows of each group

    def fill(self, values: np.ndarray) -> np.ndarray:
        """``values`` in the table, NaN where a member has no row."""
        table = np.full(self.groups * self.width, np.nan)
        table[self.slot] = values
        return table.reshape(self.groups, self.width)


def _dense_layout(code: np.ndarray, member: np.ndarray) -> _DenseTable | None:
    """The rows as a (group code x member) table when the codes are dense and each group has at
    most one row per member (a full trace); else None."""
    if not len(code):
        return None
    groups, width = int(code.max()) + 1, int(member.max()) + 1
    if member.min() < 0 or groups * width > 4 * len(code):
        return None
    slot = code * width + member
    if np.bincount(slot, minlength=groups * width).max() > 1:
        return None
    return _DenseTable(slot, groups, width, np.bincount(code, minlength=groups))


def _pivot_lower_median(code: np.ndarray, values: np.ndarray, layout: _DenseTable) -> np.ndarray:
    """``_group_quantile(code, values, 0.5, lower=True)`` per row, without sorting the rows, for
    groups that fit a dense table (``layout``)."""
    table = layout.fill(values)
    table.sort(axis=1)  # NaN last (faster than ``_sort_rows`` on these tables' thousands of rows)
    n = layout.members - np.bincount(code[np.isnan(values)], minlength=layout.groups)
    ref = table.ravel()[np.arange(layout.groups) * layout.width + np.maximum(n - 1, 0) // 2]
    return ref[code]


def _to_matrix(
    step_idx: np.ndarray, rank: np.ndarray, values: np.ndarray, t: int, w: int
) -> np.ndarray:
    out = np.full((t, w), np.nan)
    out[step_idx, rank] = values
    return out


def _distinct_steps(step: np.ndarray) -> np.ndarray:
    """The sorted distinct step numbers (a window of consecutive steps: by counting, not
    sorting)."""
    if not len(step):
        return step[:0]
    lo, hi = int(step.min()), int(step.max())
    if hi - lo < 4 * len(step):
        return np.flatnonzero(np.bincount(step - lo, minlength=hi - lo + 1)) + lo
    return np.unique(step)


def _cells(steps: np.ndarray, step: np.ndarray, rank: np.ndarray, w: int) -> np.ndarray:
    """Each row's cell of the (step, rank) matrix, as a flat index."""
    lo, span = int(steps[0]), int(steps[-1] - steps[0]) + 1
    if span <= 4 * len(steps) + 1024:
        index = np.zeros(span, dtype=np.int64)
        index[steps - lo] = np.arange(len(steps))
        return index[step - lo] * w + rank
    return np.searchsorted(steps, step) * w + rank


def _cell_quantile(
    cell: np.ndarray, values: np.ndarray, q: float, t: int, w: int, layout: _Groups | None = None
) -> np.ndarray:
    out = np.full(t * w, np.nan)
    if q <= 0:
        mins = np.full(t * w, np.inf)
        np.fmin.at(mins, cell, values)
        seen = np.bincount(cell, weights=~np.isnan(values), minlength=t * w) > 0
        out[seen] = mins[seen]
    else:
        gcode, qv, _ = _group_quantile(cell, values, q, layout=layout)
        out[gcode] = qv
    return out.reshape(t, w)


def _cell_sum(
    cell: np.ndarray, values: np.ndarray, t: int, w: int, seen: np.ndarray | None = None
) -> np.ndarray:
    total = np.bincount(cell, weights=values, minlength=t * w)
    seen = np.bincount(cell, minlength=t * w) > 0 if seen is None else seen
    return np.where(seen, total, np.nan).reshape(t, w)


def observe_ops(
    df: pd.DataFrame,
    meta: JobMeta,
    *,
    expected: ExpectedCompute | None = None,
    shape: TransformerShape | None = None,
    own_quantile: float = 0.1,
    phases: bool = False,
    source: str = "ops trace",
) -> Observations:
    """Per-step, per-rank matrices from a validated ops trace.

    Args:
        df: the ops trace (rows of any subset of ranks and steps).
        meta: the job's meta.
        expected: the cost model (None: FLOPs, peers or phases).
        shape: the model's (stage's) shape, for FLOPs (None: lengths only).
        own_quantile: the quantile of a rank's compute ops that is its own-work ratio where waits
            on neighbours are left in.
        phases: also each phase's own work alone (``Observations.phase_own``).
        source: what errors name as the trace.
    """
    return observe_columns(
        trace_columns(df),
        meta,
        expected=expected,
        shape=shape,
        own_quantile=own_quantile,
        phases=phases,
        source=source,
    )


def observe_columns(
    cols: Mapping[str, np.ndarray],
    meta: JobMeta,
    *,
    expected: ExpectedCompute | None = None,
    shape: TransformerShape | None = None,
    own_quantile: float = 0.1,
    phases: bool = False,
    source: str = "ops trace",
    structure: StructureMemo | None = None,
) -> Observations:
    """``observe_ops`` on the trace's columns as arrays (``trace_columns``).

    For a producer that has its op records as arrays already.

    Args:
        cols: the columns; ``optype`` may be strings or a ``pd.Categorical``, ``seq_lens`` an
            object array of sequences or a ``PooledLengths`` (codes into a table).
        meta: the job's meta.
        expected: the cost model (None: FLOPs, peers or phases).
        shape: the model's (stage's) shape, for FLOPs (None: lengths only).
        own_quantile: the quantile of a rank's compute ops that is its own-work ratio where waits
            on neighbours are left in.
        phases: also each phase's own work alone (``Observations.phase_own``).
        source: what errors name as the trace.
        structure: what earlier calls on rows of the same structure derived (``StructureMemo``).
    """
    memo = _NO_MEMO if structure is None else structure.bind(cols)
    steps = _distinct_steps(np.asarray(cols["step"]))
    t, w = len(steps), meta.world_size
    op, rows = memo.get("op", lambda: _compute_rows(cols["optype"]))
    comp = _Ops(cols, rows, op, memo)
    if not len(comp):
        raise InputError(f"{source}: no forward-compute or backward-compute rows to analyse")
    unblocked = _unblocked_durations(comp, memo) if meta.pp_size > 1 else None
    cost, exp_s, model = _op_costs(comp, meta, expected, shape, unblocked, memo)
    duration = comp.duration if unblocked is None else unblocked
    cell = memo.get(f"cell:{w}", lambda: _cells(steps, comp.step, comp.rank, w))
    # with the waits taken out (or none to take: one stage), the median op speaks for the rank;
    # otherwise a low quantile, the ops that did not wait
    waits_left = meta.pp_size > 1 and unblocked is None
    ratio, q = duration / cost, own_quantile if waits_left else 0.5
    own = _cell_quantile(
        cell, ratio, q, t, w, memo.get(f"cell_groups:{w}", lambda: _group_layout(cell))
    )
    phase_own = None
    # one phase's waits come out only with timestamps (without, issue times are rebuilt from both
    # phases' durations in record order)
    if phases and (meta.pp_size == 1 or comp.has("start_ts")):
        phase_own = {}
        for name, code in (("forward", _OP_FWD), ("backward", _OP_BWD)):
            sel = np.flatnonzero(comp.op == code)
            if sel.size:
                phase_own[name] = _cell_quantile(cell[sel], ratio[sel], q, t, w)
    seen = memo.get(f"cell_seen:{w}", lambda: np.bincount(cell, minlength=t * w) > 0)
    raw = _cell_sum(cell, duration, t, w, seen)
    expected_m = None if exp_s is None else _cell_sum(cell, exp_s, t, w, seen)
    # transfers with the waits taken out where the trace has the clock for it (``links``)
    comm_m = pipeline_transfers(cols, steps, w) if meta.pp_size > 1 else None
    link = np.flatnonzero(op == _OP_LINK)
    if link.size and comm_m is None:
        p2p = _Ops(cols, link, op)
        rows, per_token = _per_token(p2p, comp, meta)
        comm_m = _cell_quantile(
            _cells(steps, p2p.step[rows], p2p.rank[rows], w), per_token, own_quantile, t, w
        )
    if unblocked is not None:
        model += "+timestamps" if "start_ts" in cols else "+cumulative-times"
    sync = sync_transfers(cols, steps, w) if meta.dp_size > 1 else None
    return Observations(steps, own, raw, expected_m, comm_m, model, sync, phase_own)


_OP_FWD, _OP_BWD, _OP_LINK, _OP_OTHER = 0, 1, 2, 3


def _compute_rows(optype: pd.Series | pd.Categorical | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each row's ``_optype_codes``, the forward- and backward-compute rows)."""
    op = _optype_codes(optype)
    return op, np.flatnonzero(op <= _OP_BWD)


def _optype_codes(optype: pd.Series | pd.Categorical | np.ndarray) -> np.ndarray:
    """0 forward compute, 1 backward compute, 2 a transfer over the next link, 3 anything else."""
    codes, names = optype_factors(optype)
    table = np.array(
        [
            _OP_FWD
            if n == "forward-compute"
            else _OP_BWD
            if n == "backward-compute"
            else _OP_LINK
            if n in NEXT_LINK_OPTYPES
            else _OP_OTHER
            for n in names
        ]
        + [_OP_OTHER]
    )
    return table[codes]


def _per_token(p2p: _Ops, comp: _Ops, meta: JobMeta) -> tuple[np.ndarray, np.ndarray]:
    """(rows of ``p2p`` kept, their transfer seconds per token of the micro-batch carried) where the
    trace says which one it was; without lengths, relative to the same transfer on the pipeline's
    other links (or replicas)."""
    every = np.arange(len(p2p))
    if p2p.mb_id is None:
        return every, p2p.duration
    if comp.mb_id is None or not comp.has("seq_lens"):
        if meta.pp_size > 2 or meta.dp_size > 1:
            ref = _peer_reference(p2p, p2p.duration, meta, unblocked=meta.pp_size > 2)
            return every, p2p.duration / ref
        return every, p2p.duration
    comp_code, look = _key_codes(
        (comp.step, comp.dp_rank, comp.mb_id), (p2p.step, p2p.dp_rank, p2p.mb_id)
    )
    known, first = np.unique(comp_code, return_index=True)
    lens = comp.values("seq_lens", first)
    tokens = (
        lens.features()["tokens"]
        if isinstance(lens, PooledLengths)
        else np.fromiter((sum(s) for s in lens), dtype=np.float64, count=len(lens))
    )
    t = _lookup(known, tokens, look)
    per = np.where(np.isfinite(t) & (t > 0), p2p.duration / t, np.nan)
    keep = np.flatnonzero(~np.isnan(per))
    return keep, per[keep]


def _lookup(known: np.ndarray, values: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """``values`` of the sorted unique ``known`` codes at ``codes`` (NaN where unknown)."""
    if not len(known):
        return np.full(len(codes), np.nan)
    pos = np.minimum(np.searchsorted(known, codes), len(known) - 1)
    return np.where(known[pos] == codes, values[pos], np.nan)


def _unblocked_durations(comp: _Ops, memo: _Memo = _NO_MEMO) -> np.ndarray | None:
    """Compute durations without the time spent blocked on the pipeline neighbour, from timestamps.

    A forward op of stage ``s`` cannot run before the same micro-batch's forward on ``s - 1`` ended
    (a backward op: before the backward on ``s + 1``). Its own time is from the later of its issue
    and that end to its own end. Needs ``mb_id`` on every compute row; issue times are ``start_ts``
    (clocks that agree across a pipeline) or, without it, the running sum of the rank's compute
    durations in the step. An op whose neighbour is absent keeps its duration.
    """
    if comp.mb_id is None:
        return None
    keys = [comp.step, comp.dp_rank, comp.mb_id, comp.op]
    if comp.tp_rank is not None:
        keys.append(comp.tp_rank)
    dur = comp.duration
    if comp.has("start_ts"):
        start = comp.values("start_ts")
    else:
        # no clock: a rank's compute ops run back to back from the step's start, in record order
        # (every rank starts a step together, after the previous step's gradient synchronisation)
        start = pd.Series(dur).groupby([comp.step, comp.rank], sort=False).cumsum().to_numpy() - dur
    dep_end = _neighbour_ends(
        keys, comp.stage, comp.op == _OP_BWD, start + dur, comp.micro_batch_code, memo
    )
    return np.where(
        np.isfinite(dep_end) & (dep_end > start) & (dep_end < start + dur),
        start + dur - dep_end,
        dur,
    )


def _neighbour_slots(
    group: np.ndarray, stage: np.ndarray, bwd: np.ndarray
) -> tuple[_DenseTable, np.ndarray, np.ndarray] | None:
    """For ``_neighbour_ends`` on a full trace: the (group x stage) table, whether each op has a
    neighbour stage in it, and the neighbour's slot; None where the rows do not fit a table."""
    lo = int(stage.min())
    layout = _dense_layout(group, stage - lo)
    if layout is None:
        return None
    nb = stage - lo + np.where(bwd, 1, -1)
    ok = (nb >= 0) & (nb < layout.width)
    return layout, ok, group * layout.width + np.clip(nb, 0, layout.width - 1)


def _neighbour_ends(
    keys: list[np.ndarray],
    stage: np.ndarray,
    bwd: np.ndarray,
    end: np.ndarray,
    group: np.ndarray,
    memo: _Memo = _NO_MEMO,
) -> np.ndarray:
    """Per op, the end of the first record of the same ``keys`` (whose code is ``group``) on the
    stage before it (forward) or after it (backward); NaN where there is none."""
    lookup = memo.get("neighbours", lambda: _neighbour_slots(group, stage, bwd))
    if lookup is not None:  # a full trace: look the neighbour up in the (group x stage) table
        layout, ok, at = lookup
        return np.where(ok, layout.fill(end).ravel()[at], np.nan)
    # with the stage as the last digit of the key code, a micro-batch's ops on the pipeline sort
    # next to each other in stage order: the neighbour of an op is the run of codes one below
    # (forward: stage - 1) or one above (backward: stage + 1); its first record counts
    (code,) = _key_codes((*keys, stage))
    order = np.argsort(code, kind="stable")
    sc = code[order]
    n = len(sc)
    change = np.r_[True, sc[1:] != sc[:-1]]
    run_start = np.maximum.accumulate(np.where(change, np.arange(n), 0))
    run_next = np.append(np.flatnonzero(change)[1:], n)[np.cumsum(change) - 1]  # next run's start
    end_first = end[order][run_start]  # end of the first record of each row's run
    before = np.maximum(run_start - 1, 0)
    after = np.minimum(run_next, n - 1)
    bwd_s = bwd[order]
    st = stage[order]  # one code apart across a group boundary is not a neighbour
    found = np.where(
        bwd_s,
        (run_next < n) & (sc[after] == sc + 1) & (st[after] == st + 1),
        (run_start > 0) & (sc[before] == sc - 1) & (st[before] == st - 1),
    )
    out = np.empty(n)
    out[order] = np.where(found, end_first[np.where(bwd_s, after, before)], np.nan)
    return out
