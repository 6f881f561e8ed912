"""The job's control plane on its torch.distributed store.

Nothing is shared between nodes but the network. One namespace per job (``resihp/<job id>/cp``)
carries

- heartbeats with progress, hierarchical (``resihp.detect.heartbeat``: a sender per rank, an
  aggregator per node, a monitor on node 0);
- the op records the live detector needs: at the end of each step every rank appends one compact,
  column-wise record of its ops to its node's key for that step (``ops/n<node>/s<step>``), so a
  reader takes one key per node per step; the reader that owns the run folder deletes steps once
  consumed and older than a window, other readers (``resihp follow --store``) read within it;
- plan changes from the live loop to the job's rank 0 (``plan``), which broadcasts them;
- workers' errors (``errors``, one line each) and the job's identity and configuration (``job``),
  which a joining node checks against its own.

What carries authority (the job's launch and end announcements, stop, relaunch, evict and stacks
orders, a replica's launch and end) is signed with the job's secret (``resihp.detect.records``):
a record without the job's signature is refused (one warning per key) and acts as if absent.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torch.distributed import Store

from resihp.detect.heartbeat import PREFIX as HB
from resihp.detect.records import (
    JOB_SECRET_ENV,
    RECORDS,
    RecordError,
    authority,
    checked_int,
    fields,
    job_secret,
    load_json,
    sign,
    signed_json,
    verified,
)
from resihp.errors import InputError
from resihp.ft.quorum import changes_key
from resihp.train.nodes import Nodes
from resihp.train.recorder import columns_frame

if TYPE_CHECKING:
    import pandas as pd

JOB_KEY = "resihp/job"
KEEP_STEPS = 64  # steps of op records kept in the store for other readers
_ROUND = 6  # decimals of seconds kept in records (microseconds)


def prefix_of(job_id: str) -> str:
    return f"resihp/{job_id}/cp"


def heartbeat_prefix(job_id: str) -> str:
    return f"{prefix_of(job_id)}/{HB.rpartition('/')[2]}"


def node_ranks(
    nnodes: int,
    nproc_per_node: int,
    sizes: list[int] | tuple[int, ...] | None = None,
) -> dict[int, list[int]]:
    """The global ranks of each node.

    Node ``i`` holds ``i * P .. i * P + P - 1``; with ``sizes``, node ``i`` the next ``sizes[i]``
    after those of the nodes before it.

    Args:
        nnodes: the number of nodes.
        nproc_per_node: the ranks of each node (``P``).
        sizes: the ranks of each node where they differ (None: ``P`` each)."""
    return Nodes(nnodes, 0, nproc_per_node, None, tuple(sizes) if sizes else None).layout()


def append_steps(path: str | Path, steps: Sequence[StepRecords]) -> None:
    """Append complete steps' rows to the run folder's trace stream."""
    if steps:
        with open(path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for s in steps for r in s.rows))


# --- op records -----------------------------------------------------------------------------------
_IDS = ("step", "rank", "dp_rank", "stage", "tp_rank")
_COLS = ("optype", "seq_id", "mb_id", "tokens", "loss", "bytes", "wait_s")


def encode_rows(rows: Sequence[dict], cost_s: float = 0.0) -> bytes:
    """One rank's rows of one step, column-wise.

    The ids once, times as offsets in microseconds, each micro-batch's sequence lengths once;
    ``cost_s``: the rank's time spent publishing so far."""
    # the ids once: the step's last row's (a live layout change at the step's start records its
    # own op at the old place; the step's training ops, and so the step, are at the new one)
    last = rows[-1]
    t0 = min(r["start_ts"] for r in rows)
    lens: dict[str, list[int]] = {}
    for r in rows:
        if r.get("seq_lens") is not None and r.get("mb_id") is not None:
            lens.setdefault(str(r["mb_id"]), r["seq_lens"])
    doc = {
        "ids": [last[k] for k in _IDS],
        "t0": t0,
        "ts": [round(r["start_ts"] - t0, _ROUND) for r in rows],
        "dur": [round(r["duration"], _ROUND) for r in rows],
        **{c: [r.get(c) for r in rows] for c in _COLS},
        "lens": lens,
        "sent": time.time(),
        "cost_s": round(cost_s, _ROUND),
    }
    return json.dumps(doc, separators=(",", ":")).encode()


@dataclass
class Part:
    """One rank's records of one step, as read (column-wise, as sent)."""

    doc: dict
    nbytes: int

    @property
    def sent(self) -> float:  # when the rank sent them (its clock)
        return float(self.doc["sent"])

    @property
    def cost_s(self) -> float:  # the rank's time spent publishing before this part
        return float(self.doc.get("cost_s", 0.0))

    @property
    def rank(self) -> int:
        return int(self.doc["ids"][1])

    def columns(self) -> dict[str, list]:
        doc, n = self.doc, len(self.doc["ts"])
        cols: dict[str, list] = {k: [v] * n for k, v in zip(_IDS, doc["ids"])}
        t0 = doc["t0"]
        cols["start_ts"] = [t0 + x for x in doc["ts"]]
        cols["duration"] = doc["dur"]
        for c in _COLS:
            cols[c] = doc.get(c, [None] * n)
        lens = doc["lens"]
        cols["seq_lens"] = [lens.get(str(m)) if m is not None else None for m in doc["mb_id"]]
        return cols

    def rows(self) -> list[dict]:
        cols = self.columns()
        names = list(cols)
        return [dict(zip(names, values)) for values in zip(*cols.values())]


_NUM = (int, float)


def parse_part(doc: object) -> dict:
    """One rank's op record of one step, checked (``encode_rows``'s form)."""
    doc = fields(
        doc,
        "op record",
        {
            "ids": list,
            "t0": _NUM,
            "ts": list,
            "dur": list,
            "mb_id": list,
            "lens": dict,
            "sent": _NUM,
        },
        {"cost_s": _NUM},
    )
    n = len(doc["ts"])
    if len(doc["ids"]) != len(_IDS) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in doc["ids"]
    ):
        raise RecordError(
            f"op record: field 'ids' expected {len(_IDS)} integers ({', '.join(_IDS)})"
        )
    for name in ("dur", "mb_id", *(c for c in _COLS if c in doc)):
        if not isinstance(doc[name], list) or len(doc[name]) != n:
            raise RecordError(
                f"op record: field {name!r} expected a list of {n} values (one per op)"
            )
    if not all(isinstance(x, _NUM) for x in doc["ts"] + doc["dur"]):
        raise RecordError("op record: fields 'ts' and 'dur' expected numbers")
    return doc


def decode_rows(blob: bytes, key: str = "ops") -> Part | None:
    """One rank's part of a step as read from ``key``; None (warned once) where malformed."""
    doc = RECORDS.decode(key, blob, parse_part)
    return None if doc is None else Part(doc, len(blob))


class StepPublisher:
    """A rank's sending end: ``publish(rows)`` after each step (one store message).

    Rank 0 first says which step the job starts at (``first``: 0, or the step after a
    checkpoint)."""

    def __init__(self, store: Store, job_id: str, node: int, first: int | None = None) -> None:
        self.store, self.base = store, f"{prefix_of(job_id)}/ops/n{node}"
        self.bytes = 0
        self.messages = 0
        self.seconds = 0.0  # time spent encoding and sending: the control plane's cost on the rank
        if first is not None:
            store.set(f"{prefix_of(job_id)}/ops/first", str(first))

    def publish(self, rows: Sequence[dict]) -> None:
        """Send rows (normally one step's; rows of several steps go to each step's key)."""
        by_step: dict[int, list[dict]] = {}
        for row in rows:
            by_step.setdefault(int(row["step"]), []).append(row)
        for step, part in by_step.items():
            t0 = time.perf_counter()
            blob = encode_rows(part, self.seconds) + b"\n"
            self.store.append(f"{self.base}/s{step}", blob)
            self.seconds += time.perf_counter() - t0
            self.bytes += len(blob)
            self.messages += 1


@dataclass
class StepRecords:
    step: int
    parts: list[Part]
    sent: float  # when the last rank sent its part (its clock)
    seen: float  # when this reader had every part

    @property
    def rows(self) -> list[dict]:
        """The step's ops-trace rows (dicts)."""
        return [row for p in self.parts for row in p.rows()]

    def frame(self) -> pd.DataFrame:
        """The step's rows as an ops-trace frame, built column-wise.

        No row dicts: thousands of ranks' records are read every step."""
        merged: dict[str, list] = {}
        for p in self.parts:
            for name, values in p.columns().items():
                merged.setdefault(name, []).extend(values)
        return columns_frame(merged)


class StepReader:
    """Complete steps (every rank's part) in step order, read from the store.

    ``owner`` (the run folder's writer) deletes what it has read, beyond the last ``KEEP_STEPS``
    steps."""

    def __init__(
        self,
        store: Store,
        job_id: str,
        nodes: Mapping[int, Sequence[int]],
        first_step: int | None = None,
        owner: bool = False,
        members: Callable[[int], Sequence[int] | None] | None = None,
    ) -> None:
        self.store, self.prefix = store, prefix_of(job_id)
        self.nodes = {int(n): list(r) for n, r in nodes.items()}
        # which nodes trained a step (replica-level fault tolerance: those the quorum committed it
        # with; None: not decided yet); by default every node
        self.members = members
        self.next_step, self.owner = first_step, owner  # None: the job's first step, once it says
        self.messages = 0  # store requests this reader made
        self.bytes = 0  # record bytes read (complete steps)
        self.parts = 0  # rank-step parts read
        self.steps = 0
        self.cost_s: dict[int, float] = {}  # per rank: time spent publishing, as last reported
        self.skipped = 0  # steps a slow non-owner reader lost to the window
        # per node: the steps before this one are not waited for where the node's parts are
        # missing (``lost``: a replica's attempt died after a commit, before it published)
        self.lost_before: dict[int, int] = {}
        # a follower says how far it has read, so that the owner can wait for it at the job's end
        self.follower_id = None if owner else store.add(f"{self.prefix}/followers", 1)

    def _keys(self, step: int, nodes: Sequence[int] | None = None) -> list[str]:
        return [f"{self.prefix}/ops/n{n}/s{step}" for n in (self.nodes if nodes is None else nodes)]

    def lost(self, node: int, before_step: int) -> None:
        """``node``'s attempt in flight is gone: wait for no more of its records.

        Of the steps before ``before_step`` (the first its survivors train without it), take what
        its ranks published and wait for no more. With
        replica-level fault tolerance a replica can die after the quorum committed a step and
        before its ranks published that step's records; the survivors' records carry the step's
        global loss and tokens, and without this the reader would wait for that step, and so for
        every later one, forever. The owner says so on the store, for the followers."""
        self.lost_before[node] = max(before_step, self.lost_before.get(node, before_step))
        if self.owner:
            self.store.set(self._lost_key(node), str(self.lost_before[node]))

    def _lost_key(self, node: int) -> str:
        return f"{self.prefix}/ops/lost/n{node}"

    def _learn_lost(self, nodes: Sequence[int]) -> bool:
        """A follower: whether the owner said that any of ``nodes`` was lost before this step
        (asked only once the owner has read past it: before that the step is still coming)."""
        last = self._owner_last()
        if last is None or last < self.next_step:
            return False
        learned = False
        for n in nodes:
            key = self._lost_key(n)
            self.messages += 1
            said = checked_int(self.store.get(key), key) if self.store.check([key]) else None
            if said is not None and said > self.lost_before.get(n, -1):
                self.lost_before[n] = said
                learned = learned or self.next_step < self.lost_before[n]
        return learned

    def complete_steps(self, limit: int = 1000) -> list[StepRecords]:
        done: list[StepRecords] = []
        if self.next_step is None:
            first = f"{self.prefix}/ops/first"
            if not self.store.check([first]):
                return done
            self.next_step = checked_int(self.store.get(first), first)
            if self.next_step is None:
                return done
        while len(done) < limit:
            nodes = None
            if self.members is not None:
                nodes = self.members(self.next_step)
                self.messages += 1
                if nodes is None:
                    break
            members = list(self.nodes) if nodes is None else list(nodes)
            waived = [n for n in members if self.next_step < self.lost_before.get(n, -1)]
            awaited = [n for n in members if n not in waived]
            keys = self._keys(self.next_step, awaited)
            self.messages += 1
            if not self.store.check(keys):
                if not self.owner:
                    if self._learn_lost(awaited):
                        continue
                    self._catch_up()
                break
            keys += [k for k in self._keys(self.next_step, waived) if self.store.check([k])]
            blobs = self.store.multi_get(keys)
            self.messages += 1
            decoded = self._parts(keys, blobs)
            if not {r for n in awaited for r in self.nodes[n]} <= {p.rank for p in decoded}:
                if not self.owner and self._learn_lost(awaited):
                    continue
                break
            done.append(
                StepRecords(self.next_step, decoded, max(p.sent for p in decoded), time.time())
            )
            self.bytes += sum(p.nbytes for p in decoded)
            self.parts += len(decoded)
            self.steps += 1
            for p in decoded:
                self.cost_s[p.rank] = p.cost_s
            if self.follower_id is not None:
                self.store.set(f"{self.prefix}/followed/{self.follower_id}", str(self.next_step))
            if self.owner:
                self.store.set(f"{self.prefix}/ops/last", str(self.next_step))
                if self.next_step >= KEEP_STEPS:
                    for key in self._keys(self.next_step - KEEP_STEPS):
                        self.store.delete_key(key)
            self.next_step += 1
        return done

    def _parts(self, keys: Sequence[str], blobs: Sequence[bytes]) -> list[Part]:
        """The well-formed parts of this step from ranks of the key's node (one each: a rank's
        first); a malformed or foreign line is dropped (warned once per key)."""
        parts: dict[int, Part] = {}
        for key, blob in zip(keys, blobs):
            node = int(key.rsplit("/", 2)[-2][1:])
            for line in blob.splitlines():
                part = decode_rows(line, key) if line.strip() else None
                if part is None:
                    continue
                if part.doc["ids"][0] != self.next_step or part.rank not in self.nodes.get(
                    node, ()
                ):
                    RECORDS.reject(
                        key,
                        f"a part for step {part.doc['ids'][0]} of rank {part.rank}, "
                        f"not one of this step's ranks of node {node}",
                    )
                elif part.rank not in parts:
                    parts[part.rank] = part
        return list(parts.values())

    def wait_for_followers(self, timeout_s: float = 10.0) -> None:
        """The owner, at the job's end: give the followers time to read the last step.

        The followers read the store (``resihp follow --store``); they get up to ``timeout_s``
        before the store goes."""
        last = (self.next_step or 0) - 1
        end = time.monotonic() + timeout_s
        for i in range(1, int(self.store.add(f"{self.prefix}/followers", 0)) + 1):
            key = f"{self.prefix}/followed/{i}"
            while time.monotonic() < end and not (
                self.store.check([key]) and (checked_int(self.store.get(key), key) or -1) >= last
            ):
                time.sleep(0.1)

    def _owner_last(self) -> int | None:
        """The last step the owner has read (None: none yet)."""
        key = f"{self.prefix}/ops/last"
        self.messages += 1
        return checked_int(self.store.get(key), key) if self.store.check([key]) else None

    def _catch_up(self) -> None:
        """A reader that fell out of the window the owner keeps skips to its oldest step."""
        last = self._owner_last()
        if last is not None:
            oldest = last - KEEP_STEPS + 2
            if oldest > self.next_step:
                self.skipped += oldest - self.next_step
                self.next_step = oldest


# --- plan changes, errors, the job ----------------------------------------------------------------
def plan_key(job_id: str) -> str:
    """Where the live planner posts the newest plan change of a job."""
    return f"{prefix_of(job_id)}/plan"


def post_change(store: Store, job_id: str, change: dict) -> None:
    """Hand a plan change to the running job, signed with the job's secret.

    Its rank 0 takes it at the next step boundary; with replica-level fault tolerance, the next
    commit carries it to every rank.

    Args:
        store: the job's store.
        job_id: the job's id.
        change: the change's JSON form (``version``, ``dp_weights``, ``layer_split``, ...)."""
    store.set(plan_key(job_id), json.dumps(sign(change, job_secret())))
    store.add(changes_key(job_id), 1)  # after it: replica mode's next commit looks for it


class PlanInbox:
    """Rank 0's view of the plan channel.

    Scheduled changes from the run config come first, then the newest change posted (each ``id``
    once) that carries the job's signature (``secret``: by default this process's
    ``RESIHP_JOB_SECRET``; without one, no posted change is taken)."""

    def __init__(
        self, store: Store, job_id: str, scheduled: Sequence[dict], secret: str | None = None
    ) -> None:
        self.store, self.key = store, plan_key(job_id)
        self.secret = secret or os.environ.get(JOB_SECRET_ENV) or None
        self.scheduled = {int(c["step"]): c for c in scheduled}
        self._seen_id: object = None

    def poll(self, step: int) -> dict | None:
        if step in self.scheduled:
            return {**self.scheduled[step], "source": "scheduled"}
        if not self.store.check([self.key]):
            return None
        change = RECORDS.decode(
            self.key,
            self.store.get(self.key),
            lambda doc: verified(doc, self.secret, "plan change"),
        )
        if change is None or change.get("id") == self._seen_id:
            return None
        self._seen_id = change.get("id")
        return change


def report_error(store: Store, job_id: str, rank: int | str, kind: str, message: str) -> None:
    """Post a worker's reason to stop, one line.

    Args:
        store: the job's store.
        job_id: the job's id.
        rank: the worker's rank.
        kind: ``input``, ``stop``, ``lost-peer`` or ``crash``.
        message: the reason, one line."""
    line = json.dumps({"rank": rank, "kind": kind, "message": message}) + "\n"
    store.append(f"{prefix_of(job_id)}/errors", line.encode())


def parse_error(doc: object) -> dict:
    """A worker's error line, checked (``report_error``'s form)."""
    err = fields(doc, "worker error", {"rank": (int, str), "kind": str, "message": str})
    if err["kind"] not in ERROR_KINDS:
        raise RecordError(f"worker error: field 'kind' expected one of {', '.join(ERROR_KINDS)}")
    return err


ERROR_KINDS = ("input", "stop", "lost-peer", "crash")


def read_errors(store: Store, job_id: str) -> list[dict]:
    """The workers' error lines (``report_error``), each checked; a malformed line is dropped."""
    key = f"{prefix_of(job_id)}/errors"
    if not store.check([key]):
        return []
    found = (
        RECORDS.decode(key, line, parse_error)
        for line in store.get(key).splitlines()
        if line.strip()
    )
    return [e for e in found if e is not None]


def announce_job(
    store: Store,
    job_id: str,
    config: dict | None,
    nnodes: int,
    nproc_per_node: int,
    meta: dict | None = None,
    attempt: int = 0,
    sizes: list[int] | None = None,
    no_relaunch: str | None = None,
) -> None:
    """Node 0: announce the job's identity, configuration and job meta, signed.

    Args:
        store: the job's store.
        job_id: the job's id.
        config: ``resihp run``'s configuration, which every joining node checks (None: none).
        nnodes: the number of nodes.
        nproc_per_node: the ranks of each node.
        meta: the job meta, what a detector following it needs (None: none).
        attempt: the relaunch this launch is (0: the first launch).
        sizes: the ranks of each node where they differ (None: ``nproc_per_node`` each).
        no_relaunch: why there is no launch ``attempt`` (the nodes waiting for it end; None: there
            is)."""
    store.set(
        JOB_KEY,
        signed_json(
            {
                "job_id": job_id,
                "config": config,
                "nnodes": nnodes,
                "nproc_per_node": nproc_per_node,
                "meta": meta,
                "started": time.time(),
                "attempt": attempt,
                "sizes": sizes,
                "no_relaunch": no_relaunch,
            }
        ),
    )


_JOB_FIELDS = {"job_id": str, "nnodes": int, "nproc_per_node": int}
_JOB_OPTIONAL = {
    "config": dict,
    "meta": dict,
    "started": _NUM,
    "attempt": int,
    "sizes": list,
    "no_relaunch": str,
}


def parse_job(doc: object, verify: bool = True) -> dict:
    """The job's announcement, checked against ``announce_job``'s form.

    Unless ``verify`` is False (a follower, which acts on nothing), it must be signed with the job's
    secret."""
    job = authority("job announcement", _JOB_FIELDS, _JOB_OPTIONAL, verify=verify)(doc)
    if job["nnodes"] < 1 or job["nproc_per_node"] < 1:
        raise RecordError(
            "job announcement: fields 'nnodes' and 'nproc_per_node' expected positive integers"
        )
    return job


def read_job(
    store: Store, timeout_s: float, poll_s: float = 0.2, attempt: int = 0, verify: bool = True
) -> dict | None:
    """The job announced on ``store`` (its launch ``attempt`` or a later one), or None on timeout.

    InputError where what stays there is not the job's announcement (malformed, or not signed with
    this node's ``RESIHP_JOB_SECRET``: the job cannot go on without it).

    Args:
        store: the job's store.
        timeout_s: how long to wait for it, in seconds.
        poll_s: the wait between looks, in seconds.
        attempt: the least launch attempt taken.
        verify: check the announcement's signature (False: a follower's look)."""
    end = time.monotonic() + timeout_s
    why: RecordError | None = None
    while True:
        if store.check([JOB_KEY]):
            try:
                job = parse_job(load_json(store.get(JOB_KEY)), verify)
                why = None
            except RecordError as exc:
                job, why = None, exc
                RECORDS.reject(JOB_KEY, exc)
            if job is not None and int(job.get("attempt") or 0) >= attempt:
                return job
        if time.monotonic() > end:
            if why is not None:
                hint = (
                    f" (is {JOB_SECRET_ENV} the same on every node of the job?)"
                    if "refused" in str(why)
                    else ""
                )
                raise InputError(
                    f"store key {JOB_KEY}: expected the job's announcement (a JSON object "
                    f"with job_id, nnodes, nproc_per_node, signed), got {why}{hint}"
                )
            return None
        time.sleep(poll_s)


def mark_ended(store: Store, job_id: str, reason: str) -> None:
    """Node 0: the job is over (the other nodes' launchers stop their workers).

    Args:
        store: the job's store.
        job_id: the job's id.
        reason: why it ended."""
    store.set(f"{prefix_of(job_id)}/ended", signed_json({"job_id": job_id, "reason": reason}))


def ended(store: Store, job_id: str, verify: bool = True) -> str | None:
    """Why the job ended (``mark_ended``), or None.

    Args:
        store: the job's store.
        job_id: the job's id.
        verify: check the record's signature (False: a follower's look)."""
    return _reason(store, job_id, f"{prefix_of(job_id)}/ended", "end announcement", verify)


def _reason(store: Store, job_id: str, key: str, what: str, verify: bool = True) -> str | None:
    said = _signed(store, key, what, {"reason": str}, {"job_id": job_id}, verify)
    return None if said is None else " ".join(said["reason"][:1000].split())


def _signed(
    store: Store, key: str, what: str, spec: dict, same: dict, verify: bool = True
) -> dict | None:
    """The signed record at ``key`` (``spec``'s fields, ``same``'s values), or None where nothing
    with the job's signature is there."""
    if not store.check([key]):
        return None
    return RECORDS.decode(key, store.get(key), authority(what, spec, same=same, verify=verify))


# --recovery replica on several nodes: node 0 judges every replica; the node a replica runs on
# stops and relaunches it when told, and says when it has (its heartbeat keys then hold the new
# attempt's beats only) and when one finished


def order_replica(store: Store, job_id: str, replica: int, attempt: int, relaunch: bool) -> None:
    """Node 0 evicted ``replica``: its node stops its processes and may launch it again.

    Args:
        store: the job's store.
        job_id: the job's id.
        replica: the replica's index.
        attempt: the attempt to launch.
        relaunch: launch attempt ``attempt`` of it (False: only stop it)."""
    store.set(
        f"{prefix_of(job_id)}/replica/{replica}/order",
        signed_json({"replica": replica, "attempt": attempt, "relaunch": relaunch}),
    )


def replica_order(store: Store, job_id: str, replica: int) -> tuple[int, bool] | None:
    """The newest order for ``replica`` (attempt, relaunch), or None.

    Args:
        store: the job's store.
        job_id: the job's id.
        replica: the replica's index."""
    order = _signed(
        store,
        f"{prefix_of(job_id)}/replica/{replica}/order",
        "replica order",
        {"attempt": int, "relaunch": bool},
        {"replica": replica},
    )
    return None if order is None else (int(order["attempt"]), bool(order["relaunch"]))


def replica_state(store: Store, job_id: str, replica: int, attempt: int, state: str) -> None:
    """The node of ``replica`` says that its ``attempt`` is ``launched`` or ``done`` (exited 0).

    Args:
        store: the job's store.
        job_id: the job's id.
        replica: the replica's index.
        attempt: the replica's attempt.
        state: ``launched`` or ``done``."""
    store.set(
        f"{prefix_of(job_id)}/replica/{replica}/{state}",
        signed_json({"replica": replica, "state": state, "attempt": attempt}),
    )


def replica_attempt(store: Store, job_id: str, replica: int, state: str) -> int | None:
    """The newest attempt of ``replica`` its node said is in ``state`` (``replica_state``).

    Args:
        store: the job's store.
        job_id: the job's id.
        replica: the replica's index.
        state: ``launched`` or ``done``."""
    said = _signed(
        store,
        f"{prefix_of(job_id)}/replica/{replica}/{state}",
        f"replica {state}",
        {"attempt": int},
        {"replica": replica, "state": state},
    )
    return None if said is None else int(said["attempt"])


def node_left(store: Store, job_id: str, node: int) -> None:
    """A node other than 0 saw the job end and stopped its workers: node 0's store may go.

    Args:
        store: the job's store.
        job_id: the job's id.
        node: the node's index."""
    store.set(f"{prefix_of(job_id)}/left/{node}", "1")


def nodes_left(store: Store, job_id: str, nodes: Sequence[int]) -> bool:
    """Whether every one of ``nodes`` said it left (``node_left``).

    Args:
        store: the job's store.
        job_id: the job's id.
        nodes: the nodes' indices (none: True)."""
    return not nodes or store.check([f"{prefix_of(job_id)}/left/{n}" for n in nodes])


def mark_stopping(store: Store, job_id: str, reason: str) -> None:
    """Node 0 found a failure and is stopping its workers: the other nodes stop theirs at once.

    They stop before node 0 has gathered the job's last records and marked it ended (a rank
    blocked on a peer of another node ends only when that peer does).

    Args:
        store: the job's store.
        job_id: the job's id.
        reason: why the job stops."""
    store.set(f"{prefix_of(job_id)}/stopping", signed_json({"job_id": job_id, "reason": reason}))


def ask_for_stacks(store: Store, job_id: str, node: int, rank: int, why: str) -> None:
    """Node 0 judged ``rank``, on ``node``, hung: ask that node's launcher for its stacks.

    That launcher, which can signal the rank's process, writes its stacks to its run folder's log
    (``stacks_asked``, then ``stacks_written``) before the job is stopped.

    Args:
        store: the job's store.
        job_id: the job's id.
        node: the node the rank runs on.
        rank: the rank judged hung.
        why: the judgement, one line."""
    store.set(
        f"{prefix_of(job_id)}/stacks/{node}", signed_json({"node": node, "rank": rank, "why": why})
    )


def stacks_asked(store: Store, job_id: str, node: int) -> tuple[int, str] | None:
    """The rank of ``node`` whose stacks node 0 asked for, and why (None: none).

    Args:
        store: the job's store.
        job_id: the job's id.
        node: this node's index."""
    asked = _signed(
        store,
        f"{prefix_of(job_id)}/stacks/{node}",
        "stacks request",
        {"rank": int, "why": str},
        {"node": node},
    )
    return None if asked is None else (int(asked["rank"]), str(asked["why"]))


def publish_first_failure(store: Store, job_id: str, node: int, rank: int, exitcode: int) -> None:
    """This node's torchrun ended on a failure: publish its first observed one for node 0.

    Node 0 may have found several of this node's ranks gone at once (torchrun stops a dead rank's
    peers) and cannot tell from them which died first.

    Args:
        store: the job's store.
        job_id: the job's id.
        node: this node's index.
        rank: the failed rank, the job's rank number.
        exitcode: its exit code."""
    store.set(
        f"{prefix_of(job_id)}/first-failure/{node}",
        signed_json({"node": node, "rank": rank, "exitcode": exitcode}),
    )


def first_failure(store: Store, job_id: str, node: int) -> tuple[int, int] | None:
    """``node``'s torchrun's first observed failure (rank, exit code), once its launcher said so.

    Args:
        store: the job's store.
        job_id: the job's id.
        node: the node's index."""
    said = _signed(
        store,
        f"{prefix_of(job_id)}/first-failure/{node}",
        "first failure",
        {"rank": int, "exitcode": int},
        {"node": node},
    )
    return None if said is None else (int(said["rank"]), int(said["exitcode"]))


def stacks_written(store: Store, job_id: str, node: int) -> None:
    """This node's launcher wrote the stacks node 0 asked for (``ask_for_stacks``).

    Args:
        store: the job's store.
        job_id: the job's id.
        node: this node's index."""
    store.set(f"{prefix_of(job_id)}/stacks/{node}/written", "1")


def await_stacks(
    store: Store, job_id: str, node: int, timeout_s: float, poll_s: float = 0.05
) -> bool:
    """Whether ``node``'s launcher wrote the stacks asked for within ``timeout_s``.

    The request goes either way: a relaunch on the same store must not answer it again.

    Args:
        store: the job's store.
        job_id: the job's id.
        node: the node asked.
        timeout_s: how long to wait, in seconds.
        poll_s: the wait between looks, in seconds."""
    asked = f"{prefix_of(job_id)}/stacks/{node}"
    key, end = f"{asked}/written", time.monotonic() + timeout_s
    try:
        while not store.check([key]):
            if time.monotonic() > end:
                return False
            time.sleep(poll_s)
        return True
    finally:
        store.delete_key(asked)
        store.delete_key(key)


def stopping(store: Store, job_id: str) -> str | None:
    """Why the job ended or is being stopped (``mark_ended``, ``mark_stopping``), or None."""
    return ended(store, job_id) or _reason(
        store, job_id, f"{prefix_of(job_id)}/stopping", "stop announcement"
    )
