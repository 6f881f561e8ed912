"""Fail-stop and hang detection by heartbeats through torch.distributed's store.

One aggregator per node: the job's one heartbeat.

Layout (all keys under ``prefix``):
- each rank's ``HeartbeatSender`` (a thread of the rank) rewrites ``{prefix}/n{node}/r{rank}`` every
  ``interval_s`` with a counter and the rank's progress: step, phase, operations finished, the
  communication op it is waiting in (if any) and its PID;
- one ``NodeAggregator`` per node (the node's launcher, or local rank 0) reads only its node's
  rank keys (one ``multi_get``), notes by its own monotonic clock when each counter and each
  rank's progress last moved, checks the PIDs (same host), and publishes one key
  ``{prefix}/agg/n{node}``;
- the coordinator's ``HeartbeatMonitor`` reads one key per node (one ``multi_get``), so its load
  grows with nodes, not ranks, and turns what it reads into ``fail-stop`` events with a cause:
  ``exited`` (the process is gone), ``hang`` (alive but silent, or beating without progress for
  longer than the hang timeout) or ``node`` (the node's aggregator itself went silent).

Where the process has the job's secret (``RESIHP_JOB_SECRET``: a launcher and its workers), beats
and node aggregates are signed with it and a reader takes only signed ones (``records``): another
process that reaches the store cannot fake a rank's death or stall.

Counters and durations measured by one clock, not wall-clock times, travel through the store, so
clocks of different hosts never meet.

Why a hang needs progress, not only beats: a rank stuck in a collective keeps its heartbeat thread
alive. When one rank hangs its peers soon block too (they wait for it), so the monitor blames the
stalled rank that is not waiting in a communication op (the peers are), as NCCL's flight recorder
compares what each rank has entered. Ranks that only wait, while another training rank still
finishes ops, wait for a slow rank (a fail-slow, the detector's to find), not a hung one: no
verdict.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch.distributed import Store, TCPStore

from resihp.detect.events import Event
from resihp.detect.records import JOB_SECRET_ENV, RECORDS, RecordError, fields, sign, verified
from resihp.procinfo import process_state

PREFIX = "resihp/hb"
FINISHED = ("done", "stopped")  # phases of a rank that ended on purpose: never judged again
# a rank waiting on its node's keeper (for a memory slot the keeper still writes to disk) is not
# stalled: that wait ends by its own deadline (an error the rank reports), and a slow keeper on a
# loaded machine is no hang of the rank's
KEEPER_WAIT = "keeper-wait"


def rank_key(prefix: str, node: int, rank: int) -> str:
    """The store key of a rank's heartbeat.

    Args:
        prefix: the heartbeat keys' prefix.
        node: the rank's node.
        rank: the rank.
    """
    return f"{prefix}/n{node}/r{rank}"


def node_key(prefix: str, node: int) -> str:
    return f"{prefix}/agg/n{node}"


_NUM = (int, float)
_BEAT = {"c": int, "pid": int, "step": int, "phase": str, "ops": int, "wait": str}
_ENTRY = {"seen": bool, "silent_s": _NUM}
_ENTRY_OPTIONAL = {
    "step": int,
    "phase": str,
    "ops": int,
    "wait": str,
    "pid": int,
    "stalled_s": _NUM,
    "step_s": _NUM,
    "exited": bool,
    "stopped": bool,
    "alive": bool,
}


def parse_beat(doc: object) -> dict:
    """A rank's heartbeat record, checked (``HeartbeatSender.tick``'s fields and types)."""
    beat = fields(doc, "heartbeat", _BEAT)
    if beat["pid"] <= 0:
        raise RecordError(f"heartbeat: field 'pid' expected a positive integer, got {beat['pid']}")
    return beat


def parse_aggregate(doc: object) -> dict:
    """A node aggregator's record, checked: ``{"beat", "ranks": {rank: entry}}``."""
    agg = fields(doc, "node aggregate", {"beat": int, "ranks": dict})
    for r, entry in agg["ranks"].items():
        if not r.isdigit():
            raise RecordError(f"node aggregate: rank {r!r} is not a rank number")
        fields(entry, f"node aggregate rank {r}", _ENTRY, _ENTRY_OPTIONAL)
    return agg


def _secret(secret: str | None) -> str | None:
    """The secret beats are signed with: ``secret``, else this process's ``RESIHP_JOB_SECRET``
    (a launcher and the workers it starts share it); None: unsigned (a job started without one)."""
    return secret or os.environ.get(JOB_SECRET_ENV) or None


def _signed(doc: dict, secret: str | None) -> str:
    return json.dumps(sign(doc, secret) if secret else doc)


def _checked(
    parse: Callable[[object], dict], secret: str | None, what: str
) -> Callable[[object], dict]:
    """``parse`` after the record's signature is checked under ``secret`` (None: not checked)."""
    if secret is None:
        return parse
    return lambda doc: parse(verified(doc, secret, what))


def start_local_store(timeout_s: float = 30.0) -> tuple[TCPStore, int]:
    """A master TCPStore listening on 127.0.0.1 only (a free port); returns (store, port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    # the store takes the listening descriptor over; the Python socket object must not close it
    store = TCPStore(
        "127.0.0.1",
        port,
        None,
        True,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )
    return store, port


def connect_store(host: str, port: int, timeout_s: float = 30.0) -> TCPStore:
    """A client of the TCPStore at ``host``:``port``.

    Args:
        host: the store's host.
        port: the store's port.
        timeout_s: the client's timeout in seconds.
    """
    return TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))


@dataclass
class Progress:
    """What a rank is doing, as its heartbeat carries it."""

    step: int = -1
    phase: str = "init"  # "init", "train", then "done" (finished) or "stopped" (ended early)
    ops: int = 0  # operations finished so far
    wait: str = ""  # the communication op the rank is blocked in, "" when computing

    def key(self) -> tuple:
        return (self.step, self.phase, self.ops, self.wait)


class _Loop:
    """A daemon thread calling ``tick`` every ``interval_s`` until ``stop``."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: Exception | None = None

    def start(self) -> _Loop:
        self._thread = threading.Thread(target=self._run, daemon=True, name=type(self).__name__)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as exc:  # the store went away: stop beating, as a dead rank would
                self.error = exc
                return
            self._stop.wait(self.interval_s)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def tick(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.interval_s + 1)


class HeartbeatSender(_Loop):
    """A rank's heartbeat thread: ``HeartbeatSender(store, rank, node, progress=...).start()``.

    Run in every rank; ``stop()`` at exit. ``progress`` is read at each beat (the engine's op
    recorder supplies it)."""

    def __init__(
        self,
        store: Store,
        rank: int,
        node: int,
        interval_s: float = 0.5,
        prefix: str = PREFIX,
        progress: Callable[[], Progress] | None = None,
        secret: str | None = None,
    ) -> None:
        super().__init__(interval_s)
        self.store, self.key = store, rank_key(prefix, node, rank)
        self.secret = _secret(secret)
        self.count = 0
        self.state = Progress()
        self._progress = progress or (lambda: self.state)

    def follow(self, progress: Callable[[], Progress]) -> None:
        """From now on, beat with what ``progress`` says (e.g. once the engine exists)."""
        self._progress = progress

    def tick(self) -> None:
        self.count += 1
        p = self._progress()
        self.store.set(
            self.key,
            _signed(
                {
                    "c": self.count,
                    "pid": os.getpid(),
                    "step": p.step,
                    "phase": p.phase,
                    "ops": p.ops,
                    "wait": p.wait,
                },
                self.secret,
            ),
        )

    def finish(self, phase: str = "done") -> None:
        """The last beat: the rank is done (a monitor never judges it again)."""
        self.stop()
        last = self._progress()
        self._progress = lambda: Progress(last.step, phase, last.ops, "")
        self.tick()


class NodeAggregator(_Loop):
    """A node's heartbeat aggregator, run once per node (in its launcher, or in local rank 0).

    With ``check_pids`` (it runs on the ranks' host) a rank whose process is gone or stopped is
    known at once."""

    def __init__(
        self,
        store: Store,
        node: int,
        ranks: Sequence[int],
        interval_s: float = 0.5,
        timeout_s: float = 3.0,
        prefix: str = PREFIX,
        startup_s: float = 60.0,
        check_pids: bool = True,
        secret: str | None = None,
    ) -> None:
        super().__init__(interval_s)
        self.store, self.node, self.ranks = store, node, list(ranks)
        self.secret = _secret(secret)
        self.parse_beat = _checked(parse_beat, self.secret, "heartbeat")
        self.timeout_s, self.startup_s, self.check_pids = timeout_s, startup_s, check_pids
        self.keys = [rank_key(prefix, node, r) for r in self.ranks]
        self.out_key = node_key(prefix, node)
        self.count = 0
        self._last: dict[int, dict | None] = dict.fromkeys(self.ranks)
        now = time.monotonic()
        self._beat_at = dict.fromkeys(self.ranks, now)
        self._moved_at = dict.fromkeys(self.ranks, now)
        self._step_at: dict[int, float] = {}
        self._step_s: dict[int, deque] = {r: deque(maxlen=16) for r in self.ranks}
        self._all_present = False
        # whether a PID is one of the processes this node started (None: not checked); a beat
        # naming another is dropped, so that its PID is never looked at or signalled
        self.owns: Callable[[int], bool] | None = None

    def read(self) -> dict[int, bytes | None]:
        if not self._all_present:
            present = [self.store.check([k]) for k in self.keys]
            self._all_present = all(present)
            if not self._all_present:
                got = [self.store.get(k) if p else None for k, p in zip(self.keys, present)]
                return dict(zip(self.ranks, got))
        return dict(zip(self.ranks, self.store.multi_get(self.keys)))

    def snapshot(self) -> dict:
        """This node's view of its ranks, as published."""
        now = time.monotonic()
        ranks = {}
        for rank, raw in self.read().items():
            key = self.keys[self.ranks.index(rank)]
            msg = RECORDS.decode(key, raw, self.parse_beat)
            # a process already gone is let through: nothing is ever signalled to it, and its
            # rank is judged exited (a rank killed right after its first beat is gone before the
            # launcher could see it was its own)
            if (
                msg is not None
                and self.owns is not None
                and (self._last[rank] is None or msg["pid"] != self._last[rank]["pid"])
                and (process_state(msg["pid"]) not in (None, "Z"))
                and not self.owns(msg["pid"])
            ):
                RECORDS.reject(key, f"it names process {msg['pid']}, which this node did not start")
                msg = None
            last = self._last[rank]
            if msg is not None and (last is None or msg["c"] != last["c"]):
                self._beat_at[rank] = now
                if last is None or (msg["step"], msg["phase"], msg["ops"], msg["wait"]) != (
                    last["step"],
                    last["phase"],
                    last["ops"],
                    last["wait"],
                ):
                    self._moved_at[rank] = now
                if last is not None and msg["step"] != last["step"] and rank in self._step_at:
                    self._step_s[rank].append(
                        (now - self._step_at[rank]) / max(1, msg["step"] - last["step"])
                    )
                if last is None or msg["step"] != last["step"]:
                    self._step_at[rank] = now
                self._last[rank] = msg
            msg = self._last[rank]
            entry = {
                "seen": msg is not None,
                "silent_s": round(now - self._beat_at[rank], 3),
                "stalled_s": round(now - self._moved_at[rank], 3),
            }
            if msg is not None:
                entry.update(
                    step=msg["step"],
                    phase=msg["phase"],
                    ops=msg["ops"],
                    wait=msg["wait"],
                    pid=msg["pid"],
                )
                if self._step_s[rank]:
                    entry["step_s"] = round(statistics.median(self._step_s[rank]), 4)
                if self.check_pids and msg["phase"] not in FINISHED:
                    state = process_state(msg["pid"])
                    entry["exited"] = state is None or state == "Z"
                    entry["stopped"] = state in ("T", "t")
                    entry["alive"] = not entry["exited"]
            ranks[str(rank)] = entry
        return ranks

    def exited_now(self) -> list[tuple[int, int, float]]:
        """The ranks whose process is gone: (rank, its last step, seconds since its last beat).

        Checked now rather than at the next beat (a few ``/proc`` reads)."""
        now, gone = time.monotonic(), []
        for rank, msg in self._last.items():
            if (
                msg is not None
                and msg["phase"] not in FINISHED
                and process_state(msg["pid"]) in (None, "Z")
            ):
                gone.append((rank, msg["step"], round(now - self._beat_at[rank], 3)))
        if gone:  # a rank that finished says so in its last beat, which may be newer than ours
            fresh = self.read()
            gone = [
                g
                for g in gone
                if (
                    beat := RECORDS.decode(
                        self.keys[self.ranks.index(g[0])], fresh.get(g[0]), self.parse_beat
                    )
                )
                is None
                or beat["phase"] not in FINISHED
            ]
        return gone

    def excuse(self) -> None:
        """Start this node's ranks' stall clocks again: a peer that held them up is gone.

        As when a replica is evicted."""
        now = time.monotonic()
        self._moved_at = dict.fromkeys(self.ranks, now)

    def tick(self) -> None:
        ranks = self.snapshot()
        self.count += 1
        self.store.set(self.out_key, _signed({"beat": self.count, "ranks": ranks}, self.secret))


@dataclass
class RankView:
    """One rank as the monitor last read it."""

    rank: int
    node: int
    seen: bool = False
    step: int = -1
    phase: str = "init"
    ops: int = 0
    wait: str = ""
    pid: int | None = None
    silent_s: float = 0.0
    stalled_s: float = 0.0
    step_s: float | None = None
    exited: bool = False
    stopped: bool = False
    alive: bool | None = None  # its process exists (known where the aggregator can look)


class HeartbeatMonitor:
    """The coordinator's view: ``poll(step)`` returns new ``fail-stop`` events.

    One per dead or hung rank, ``extra``: node, cause ``exited`` | ``hang`` | ``node``, step,
    silent_s.

    ``hang_timeout_s``: how long a training rank may make no progress before it counts as hung;
    None: ``hang_factor`` x the median step time, at least ``hang_floor_s`` (default:
    ``timeout_s``), and a rank that has not finished a step since it was (re)started (its warm-up:
    compilation, first allocations, a loaded machine) may stall for ``startup_s``. A hang found by a
    stall is acted on only when the next look, ``confirm_s`` later, finds it still stalled.
    """

    def __init__(
        self,
        store: Store,
        nodes: Mapping[int, Sequence[int]],
        timeout_s: float = 3.0,
        prefix: str = PREFIX,
        places: Mapping[int, tuple[int, int, int]] | None = None,
        startup_s: float = 60.0,
        hang_timeout_s: float | None = None,
        hang_factor: float = 5.0,
        hang_floor_s: float | None = None,
        stopped_s: float | None = None,
        confirm_s: float = 0.5,
        secret: str | None = None,
    ) -> None:
        self.store = store
        self.parse = _checked(parse_aggregate, _secret(secret), "node heartbeat")
        self.confirm_s = confirm_s
        self._suspects: dict[int, tuple[float, int, int]] = {}  # rank -> (first seen, step, ops)
        self.startup_s = startup_s
        self.nodes = {int(n): list(r) for n, r in nodes.items()}
        self.timeout_s = timeout_s
        self.hang_timeout_s, self.hang_factor = hang_timeout_s, hang_factor
        self.hang_floor_s = timeout_s if hang_floor_s is None else hang_floor_s
        self.stopped_s = (
            stopped_s  # a process stopped (SIGSTOP) this long is hung; None: once silent
        )
        self.keys = {n: node_key(prefix, n) for n in self.nodes}
        self.places = dict(places or {})
        start = time.monotonic()
        self._beat: dict[int, int | None] = dict.fromkeys(self.nodes)
        self._moved = dict.fromkeys(self.nodes, start)
        self.views = {r: RankView(r, n) for n, rs in self.nodes.items() for r in rs}
        self.dead: dict[int, Event] = {}
        self._excused_until: dict[int, float] = {}

    def excuse(self, ranks: Sequence[int], seconds: float) -> None:
        """These ranks were held up by a peer now gone: no stall counts against them for a while.

        For ``seconds``: their nodes' views of the stall lag by up to an aggregator beat."""
        until = time.monotonic() + seconds
        for r in ranks:
            self._excused_until[r] = until

    def hang_limit(self) -> float:
        if self.hang_timeout_s is not None:
            return self.hang_timeout_s
        steps = [v.step_s for v in self.views.values() if v.step_s]
        return (
            max(self.hang_floor_s, self.hang_factor * statistics.median(steps))
            if steps
            else self.hang_floor_s
        )

    def _read(self, now: float) -> list[int]:
        """Update the rank views; returns the nodes whose aggregator went silent."""
        present = {n: k for n, k in self.keys.items() if self.store.check([k])}
        values = dict(zip(present, self.store.multi_get(list(present.values())))) if present else {}
        lost = []
        for node in self.nodes:
            msg = RECORDS.decode(self.keys[node], values.get(node), self.parse)
            if msg is not None:
                if msg["beat"] != self._beat[node]:
                    self._beat[node] = msg["beat"]
                    self._moved[node] = now
                for r, entry in msg["ranks"].items():
                    view = self.views.get(int(r))
                    if view is not None and entry["seen"]:
                        for name in (
                            "step",
                            "phase",
                            "ops",
                            "wait",
                            "pid",
                            "silent_s",
                            "stalled_s",
                            "step_s",
                            "exited",
                            "stopped",
                            "alive",
                        ):
                            if name in entry:
                                setattr(view, name, entry[name])
                        view.seen = True
                    elif view is not None:
                        view.silent_s = entry["silent_s"]
            limit = self.timeout_s if self._beat[node] is not None else self.startup_s
            if now - self._moved[node] > limit:
                lost.append(node)
        return lost

    def poll(self, step: int = -1) -> list[Event]:
        now = time.monotonic()
        lost = self._read(now)
        found: dict[int, tuple[str, float]] = {}
        for node in lost:
            for r in self.nodes[node]:
                found[r] = ("node", round(now - self._moved[node], 3))
        live = [v for v in self.views.values() if v.rank not in found and v.phase not in FINISHED]
        for v in live:
            if v.exited:
                found[v.rank] = ("exited", v.silent_s)
            elif v.stopped and self.stopped_s is not None and v.stalled_s > self.stopped_s:
                found[v.rank] = ("hang", v.stalled_s)
            elif v.seen and v.silent_s > self.timeout_s:
                # silent: hung if its process is still there (stopped, or stuck holding the GIL)
                found[v.rank] = ("hang" if v.stopped or v.alive else "exited", v.silent_s)
            elif not v.seen and v.silent_s > self.startup_s:
                found[v.rank] = ("exited", v.silent_s)
        if not found:
            steady = self.hang_limit()

            def limit(v: RankView) -> float:
                # in its warm-up a rank is judged by the start-up bound, as a rank not yet seen is
                warm = self.hang_timeout_s is None and not v.step_s
                return max(steady, self.startup_s) if warm else steady

            live = [v for v in live if self._excused_until.get(v.rank, 0.0) < now]
            # a rank waiting on its keeper is busy, not stalled (unless its process is stopped)
            keeper = {v.rank for v in live if v.wait == KEEPER_WAIT and not v.stopped}
            if any(
                v.phase == "train" and v.stalled_s > limit(v) and v.rank not in keeper for v in live
            ):
                # the candidates: every rank stalled for a while, not only those past the limit
                # (each node's view is up to an aggregator beat old, so the culprit may read a
                # little less)
                stalled = [
                    v
                    for v in live
                    if v.phase == "train" and v.stalled_s > limit(v) / 2 and v.rank not in keeper
                ]
                # the ranks waiting in a communication op wait for the one that is not
                idle = [v for v in stalled if not v.wait]
                # a training rank still finishing ops (or waiting on its keeper): what the waiting
                # ranks wait for is slow, not hung
                moving = any(
                    v.phase == "train" and (v.stalled_s <= limit(v) / 2 or v.rank in keeper)
                    for v in live
                )
                # a stalled rank whose process is stopped (SIGSTOP, a debugger) is the culprit
                # whatever its last beat said: it may have stopped inside the very op its peers wait
                # in, a tie that its step and ops cannot break
                frozen = [v for v in stalled if v.stopped]
                if frozen:
                    v = max(frozen, key=lambda v: v.stalled_s)
                    found[v.rank] = ("hang", v.stalled_s)
                elif idle or not moving:
                    # the one stuck longest among those not waiting; if all wait, the one furthest
                    # behind
                    v = (
                        max(idle, key=lambda v: v.stalled_s)
                        if idle
                        else min(stalled, key=lambda v: (v.step, v.ops))
                    )
                    found[v.rank] = ("hang", v.stalled_s)
        found = self._confirmed(found, now)
        new: list[Event] = []
        for r, (cause, silent_s) in sorted(found.items()):
            if r in self.dead:
                continue
            view = self.views[r]
            dp, st, tp = self.places.get(r, (None, None, None))
            at = view.step if view.step >= 0 else step
            ev = Event(
                "fail-stop",
                r,
                dp,
                st,
                tp,
                at,
                step if step >= 0 else at,
                0.0,
                1.0,
                node=view.node,
                cause=cause,
                step=view.step if view.step >= 0 else None,
                silent_s=silent_s,
            )
            self.dead[r] = ev
            new.append(ev)
        return new

    def _confirmed(
        self, found: dict[int, tuple[str, float]], now: float
    ) -> dict[int, tuple[str, float]]:
        """The verdicts to act on: an exit or a lost node at once; a hang once a second look,
        ``confirm_s`` after the first, finds the rank at the same step and op count (a false hang
        evicts a replica)."""
        out = {r: f for r, f in found.items() if f[0] != "hang"}
        for r, verdict in found.items():
            if verdict[0] != "hang" or r in self.dead:
                continue
            view = self.views[r]
            first = self._suspects.get(r)
            if first is None or (first[1], first[2]) != (view.step, view.ops):
                self._suspects[r] = (now, view.step, view.ops)
            elif now - first[0] >= self.confirm_s:
                out[r] = verdict
        for r in [r for r in self._suspects if r not in found]:
            del self._suspects[r]  # moved on, or no longer a suspect: a later hang starts afresh
        return out

    def min_step(self) -> int:
        return min((v.step for v in self.views.values()), default=-1)

    def reset(self, node: int) -> None:
        """A node's ranks were relaunched (a replica restarted alone): judge them afresh."""
        self._beat[node], self._moved[node] = None, time.monotonic()
        for r in self.nodes[node]:
            self.views[r] = RankView(r, node)
            self.dead.pop(r, None)
            self._suspects.pop(r, None)


def _serve(argv: Sequence[str] | None = None) -> None:
    """``python -m resihp.detect.heartbeat sender|aggregator ...``: one heartbeat role as a
    process."""
    import argparse  # deferred: only this command line needs it

    p = argparse.ArgumentParser(prog="python -m resihp.detect.heartbeat")
    p.add_argument("role", choices=["sender", "aggregator"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--rank", type=int, help="sender: this rank")
    p.add_argument("--ranks", type=str, help="aggregator: the node's ranks, comma-separated")
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--startup", type=float, default=60.0)
    args = p.parse_args(argv)
    store = connect_store(args.host, args.port)
    if args.role == "sender":
        loop: _Loop = HeartbeatSender(store, args.rank, args.node, args.interval)
    else:
        ranks = [int(r) for r in args.ranks.split(",")]
        loop = NodeAggregator(
            store, args.node, ranks, args.interval, args.timeout, startup_s=args.startup
        )
    loop.start()
    try:
        while loop.alive():
            time.sleep(args.interval)
    except KeyboardInterrupt:
        loop.stop()
    if loop.error is not None:
        print(f"heartbeat {args.role}: stopped: {loop.error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    _serve()
