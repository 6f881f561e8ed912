"""Transfer times of each link, with the waiting taken out: the detector's view of a slow link.

They come from the ops trace's send/receive and collective records.

A receive's record spans its wait for the sender and the transfer. With ``start_ts`` the wait is
taken out: a message's transfer is from when it could start to the receive's end. It could start at
the latest of the receive's start, the matching send's start and the end of the sending stage's
own compute of that micro-batch: a receive that waited because its upstream stage computed longer
on that micro-batch (longer sequences) waited for the sender, not the link, whether or not the
trace records the send, or records it posted before its data was ready. A trace that times the
transfer on the sending side (its send's duration, less any part before the data was computed)
counts that too (the larger of the two). Per pipeline link (indexed by the rank at its lower stage)
and step: the fastest of its messages' transfer seconds per token (tokens from the message's
record, else its micro-batch's sequence lengths).

A gradient collective waits for its last member: a member's transfer is from the latest start
over its group (the ranks of its stage and tensor-parallel rank across replicas) to its own end.
Per rank and step: the sum over its gradient collectives.

A slow compute rank makes its neighbours wait, never transfer longer: neither figure moves.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

SYNC_OPTYPES = ("grads-all-reduce", "grads-reduce-scatter")
# per link and step, this quantile of its messages' transfers (0: the fastest): a host's scheduling
# delays only lengthen some messages, a slow link every one
LINK_QUANTILE = 0.0
_SEND_RECV = ("forward-send", "forward-recv", "backward-send", "backward-recv")


def optype_factors(
    optype: pd.Series | pd.Categorical | np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """``pd.factorize(optype)``: each row's code (-1: missing) and the names coded.

    A categorical column's own codes and categories as they are (no hashing of the rows)."""
    if isinstance(optype, pd.Series) and isinstance(optype.dtype, pd.CategoricalDtype):
        optype = optype.array
    if isinstance(optype, pd.Categorical):
        return np.asarray(optype.codes), np.asarray(optype.categories, dtype=object)
    codes, names = pd.factorize(optype)
    return codes, np.asarray(names, dtype=object)


def _rows_of(cols: Mapping[str, np.ndarray], wanted: tuple[str, ...]) -> np.ndarray | None:
    """Indices of the rows whose optype is one of ``wanted``; None when there are none (checked
    on the distinct optypes first: a long trace of compute ops alone costs nothing here)."""
    codes, names = optype_factors(cols["optype"])
    hit = np.flatnonzero(np.isin(names, wanted))
    if not hit.size:
        return None
    rows = np.flatnonzero(np.isin(codes, hit))
    return rows if rows.size else None


def _frame(
    cols: Mapping[str, np.ndarray], keep: np.ndarray, names: tuple[str, ...]
) -> pd.DataFrame:
    return pd.DataFrame({n: np.asarray(cols[n])[keep] for n in names if n in cols})


def pipeline_transfers(
    cols: Mapping[str, np.ndarray], steps: np.ndarray, world: int
) -> np.ndarray | None:
    """(step x rank) low-quantile transfer seconds per token of each rank's link to the next stage.

    NaN where none; None when the trace cannot separate transfers from waits (no
    ``start_ts`` or ``mb_id``).

    Args:
        cols: the trace's columns (``trace_columns``).
        steps: the steps observed, in order.
        world: the job's ranks.
    """
    if "start_ts" not in cols or "mb_id" not in cols:
        return None
    sel = _rows_of(cols, _SEND_RECV)
    if sel is None:
        return None
    names = (
        "step",
        "rank",
        "dp_rank",
        "stage",
        "tp_rank",
        "optype",
        "start_ts",
        "duration",
        "mb_id",
        "tokens",
        "seq_lens",
    )
    df = _frame(cols, sel, names)
    df = df[df["mb_id"].notna()]
    if "tp_rank" not in df:
        df["tp_rank"] = 0
    df["tp_rank"] = df["tp_rank"].fillna(0).astype(np.int64)
    df["mb_id"] = df["mb_id"].astype(np.int64)
    df["optype"] = df["optype"].astype(str)
    # the lower stage of the link each record crossed
    fwd = df["optype"].str.startswith("forward")
    sender_side = df["optype"].str.endswith("send")
    lower_is_self = fwd == sender_side  # forward-send and backward-recv sit on the lower stage
    df["link_stage"] = np.where(lower_is_self, df["stage"], df["stage"] - 1)
    df["direction"] = np.where(fwd, 0, 1)
    key = ["step", "dp_rank", "tp_rank", "mb_id", "link_stage", "direction"]
    send = df[sender_side].drop_duplicates(key)
    recv = df[~sender_side].drop_duplicates(key)
    pairs = recv.merge(send, on=key, how="outer", suffixes=("_r", "_s"))
    if not len(pairs):
        return None
    recv_end = (pairs["start_ts_r"] + pairs["duration_r"]).to_numpy(np.float64)
    send_start = pairs["start_ts_s"].to_numpy(np.float64)
    computed = _sender_ready(pairs, recv_end, cols)
    ready = np.fmax(send_start, computed)
    from_ready = recv_end - np.fmax(pairs["start_ts_r"].to_numpy(np.float64), ready)
    # a send posted before its data was computed: the part of it before then is not the link's
    early = np.nan_to_num(np.fmax(computed - send_start, 0.0), nan=0.0)
    sent = pairs["duration_s"].to_numpy(np.float64) - early
    transfer = np.fmax(from_ready, sent)
    # the lower end's rank: the sender of a forward message, the receiver of a backward one
    lower = np.where(pairs["direction"] == 0, pairs["rank_s"], pairs["rank_r"]).astype(np.float64)
    tokens = _message_tokens(pairs, cols)
    per_token = transfer / tokens
    ok = np.isfinite(per_token) & np.isfinite(lower) & (per_token >= 0)
    if not ok.any():
        return None
    frame = pd.DataFrame(
        {
            "step": pairs["step"].to_numpy()[ok],
            "rank": lower[ok].astype(np.int64),
            "v": per_token[ok],
        }
    )
    low = frame.groupby(["step", "rank"], sort=False)["v"].quantile(LINK_QUANTILE)
    return _matrix(low, steps, world)


def _sender_ready(
    pairs: pd.DataFrame, recv_end: np.ndarray, cols: Mapping[str, np.ndarray]
) -> np.ndarray:
    """When each message's data was ready: the end of its sending stage's own compute of that
    micro-batch (forward for a forward message, backward for a backward one; the latest that ended
    by the receive's end, for a stage holding several model chunks); NaN where the trace has none.
    A receive posted before then waited for the sender's compute, not for the link."""
    out = np.full(len(pairs), np.nan)
    comp = _rows_of(cols, ("forward-compute", "backward-compute"))
    if comp is None:
        return out
    cdf = _frame(
        cols,
        comp,
        ("step", "dp_rank", "stage", "tp_rank", "optype", "start_ts", "duration", "mb_id"),
    )
    cdf = cdf[cdf["mb_id"].notna() & cdf["start_ts"].notna() & cdf["duration"].notna()]
    if not len(cdf):
        return out
    cdf["tp_rank"] = cdf["tp_rank"].fillna(0).astype(np.int64) if "tp_rank" in cdf else 0
    cdf["mb_id"] = cdf["mb_id"].astype(np.int64)
    cdf["direction"] = (cdf["optype"].astype(str) == "backward-compute").astype(np.int64)
    # a forward message leaves the link's lower stage, a backward one its upper stage
    cdf["link_stage"] = cdf["stage"] - cdf["direction"]
    cdf["end"] = cdf["start_ts"] + cdf["duration"]
    key = ["step", "dp_rank", "tp_rank", "mb_id", "link_stage", "direction"]
    look = pairs[key].assign(_i=np.arange(len(pairs)), _by=recv_end)
    look = look.merge(cdf[key + ["end"]], on=key, how="inner")
    look = look[~(look["end"] > look["_by"])]  # a receive's own end unknown: any of them
    if not len(look):
        return out
    latest = look.groupby("_i")["end"].max()
    out[latest.index.to_numpy(np.int64)] = latest.to_numpy(np.float64)
    return out


def _message_tokens(pairs: pd.DataFrame, cols: Mapping[str, np.ndarray]) -> np.ndarray:
    """Tokens of each message's micro-batch: its own record's, else the micro-batch's compute
    records'; 1 where unknown (then the figure is seconds per message)."""
    out = np.full(len(pairs), np.nan)
    for side in ("_r", "_s"):
        if "tokens" + side in pairs:
            out = np.where(
                np.isnan(out),
                pd.to_numeric(pairs["tokens" + side], errors="coerce").to_numpy(np.float64),
                out,
            )
    comp = _rows_of(cols, ("forward-compute", "backward-compute")) if "seq_lens" in cols else None
    if np.isnan(out).any() and comp is not None:
        cdf = _frame(cols, comp, ("step", "dp_rank", "mb_id", "seq_lens"))
        cdf = cdf[cdf["mb_id"].notna() & cdf["seq_lens"].notna()]
        if len(cdf):
            cdf = cdf.drop_duplicates(["step", "dp_rank", "mb_id"])
            cdf["n"] = [float(sum(s)) for s in cdf["seq_lens"]]
            cdf["mb_id"] = cdf["mb_id"].astype(np.int64)
            look = pairs[["step", "dp_rank", "mb_id"]].merge(
                cdf[["step", "dp_rank", "mb_id", "n"]], on=["step", "dp_rank", "mb_id"], how="left"
            )
            out = np.where(np.isnan(out), look["n"].to_numpy(np.float64), out)
    return np.where(np.isfinite(out) & (out > 0), out, 1.0)


def sync_transfers(
    cols: Mapping[str, np.ndarray], steps: np.ndarray, world: int
) -> np.ndarray | None:
    """(step x rank) seconds in gradient collectives after their last member arrived.

    NaN where none; None without ``start_ts`` or such records.

    Args:
        cols: the trace's columns (``trace_columns``).
        steps: the steps observed, in order.
        world: the job's ranks.
    """
    if "start_ts" not in cols:
        return None
    sel = _rows_of(cols, SYNC_OPTYPES)
    if sel is None:
        return None
    df = _frame(cols, sel, ("step", "rank", "stage", "tp_rank", "optype", "start_ts", "duration"))
    if "tp_rank" not in df:
        df["tp_rank"] = 0
    df["tp_rank"] = df["tp_rank"].fillna(0).astype(np.int64)
    group = ["step", "stage", "tp_rank", "optype"]
    members = df.groupby(group)["rank"].transform("nunique")
    last_in = df.groupby(group)["start_ts"].transform("max")
    df["v"] = (df["start_ts"] + df["duration"] - last_in).clip(lower=0.0)
    df = df[members > 1]
    if not len(df):
        return None
    return _matrix(df.groupby(["step", "rank"], sort=False)["v"].sum(), steps, world)


def _matrix(values: pd.Series, steps: np.ndarray, world: int) -> np.ndarray:
    """A (step, rank)-indexed series as a (len(steps) x world) matrix, NaN elsewhere."""
    out = np.full((len(steps), world), np.nan)
    s = values.index.get_level_values(0).to_numpy(np.int64)
    r = values.index.get_level_values(1).to_numpy(np.int64)
    at = np.searchsorted(steps, s)
    ok = (at < len(steps)) & (r >= 0) & (r < world)
    ok[ok] = steps[at[ok]] == s[ok]
    out[at[ok], r[ok]] = values.to_numpy(np.float64)[ok]
    return out
