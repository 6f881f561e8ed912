"""Fail-stop detection by heartbeats through torch.distributed's TCPStore, with per-node aggregators.

Layout (all keys under ``prefix``):
- each rank's ``HeartbeatSender`` bumps ``{prefix}/n{node}/r{rank}`` every ``interval_s``;
- one ``NodeAggregator`` per node reads only its node's rank keys (one ``multi_get``), notes by its own
  monotonic clock when each counter last moved, and publishes one key ``{prefix}/agg/n{node}`` with its
  own counter and the ranks it considers dead;
- the coordinator's ``HeartbeatMonitor`` reads one key per node (one ``multi_get``), so its load grows
  with nodes, not ranks. A rank is dead when its aggregator says so; every rank of a node is dead when
  the aggregator's own counter stops (the whole node is gone).

Counters, not wall-clock times, travel through the store, so clocks of different hosts never meet.
"""

from __future__ import annotations

import datetime
import json
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from torch.distributed import TCPStore

from resihp.detect.events import Event


def rank_key(prefix: str, node: int, rank: int) -> str:
    return f"{prefix}/n{node}/r{rank}"


def node_key(prefix: str, node: int) -> str:
    return f"{prefix}/agg/n{node}"


def start_local_store(timeout_s: float = 30.0) -> tuple[TCPStore, int]:
    """A master TCPStore listening on 127.0.0.1 only (a free port); returns (store, port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    # the store takes the listening descriptor over; the Python socket object must not close it
    store = TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=timeout_s),
                     wait_for_workers=False, master_listen_fd=sock.detach())
    return store, port


def connect_store(host: str, port: int, timeout_s: float = 30.0) -> TCPStore:
    return TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))


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

    def tick(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s + 1)


class HeartbeatSender(_Loop):
    """Run in every rank: ``HeartbeatSender(store, rank, node).start()``; ``stop()`` at exit."""

    def __init__(self, store: TCPStore, rank: int, node: int, interval_s: float = 0.5,
                 prefix: str = "resihp/hb") -> None:
        super().__init__(interval_s)
        self.store, self.key = store, rank_key(prefix, node, rank)
        self.count = 0

    def tick(self) -> None:
        self.count += 1
        self.store.set(self.key, str(self.count))


class NodeAggregator(_Loop):
    """Run once per node (e.g. in local rank 0, or in the node's agent process)."""

    def __init__(self, store: TCPStore, node: int, ranks: Sequence[int], interval_s: float = 0.5,
                 timeout_s: float = 3.0, prefix: str = "resihp/hb", startup_s: float = 60.0) -> None:
        super().__init__(interval_s)
        self.store, self.node, self.ranks = store, node, list(ranks)
        self.timeout_s = timeout_s
        self.startup_s = startup_s
        self._seen: set[int] = set()
        self.keys = [rank_key(prefix, node, r) for r in self.ranks]
        self.out_key = node_key(prefix, node)
        self.count = 0
        self._last: dict[int, bytes | None] = dict.fromkeys(self.ranks)
        now = time.monotonic()
        self._moved = dict.fromkeys(self.ranks, now)
        self._all_present = False

    def read(self) -> dict[int, bytes | None]:
        if not self._all_present:
            present = [self.store.check([k]) for k in self.keys]
            self._all_present = all(present)
            if not self._all_present:
                got = [self.store.get(k) if p else None for k, p in zip(self.keys, present)]
                return dict(zip(self.ranks, got))
        return dict(zip(self.ranks, self.store.multi_get(self.keys)))

    def tick(self) -> None:
        now = time.monotonic()
        for rank, value in self.read().items():
            if value is not None and value != self._last[rank]:
                self._last[rank] = value
                self._moved[rank] = now
                self._seen.add(rank)
        # a rank that never beat yet is still starting (imports, CUDA init) until startup_s
        dead = [r for r in self.ranks
                if now - self._moved[r] > (self.timeout_s if r in self._seen else self.startup_s)]
        self.count += 1
        self.store.set(self.out_key, json.dumps({"beat": self.count, "dead": dead}))


class HeartbeatMonitor:
    """The coordinator's view: ``poll(step)`` returns new ``fail-stop`` events (one per dead rank)."""

    def __init__(self, store: TCPStore, nodes: Mapping[int, Sequence[int]], timeout_s: float = 3.0,
                 prefix: str = "resihp/hb", places: Mapping[int, tuple[int, int, int]] | None = None,
                 startup_s: float = 60.0) -> None:
        self.store = store
        self.startup_s = startup_s
        self.nodes = {int(n): list(r) for n, r in nodes.items()}
        self.timeout_s = timeout_s
        self.keys = {n: node_key(prefix, n) for n in self.nodes}
        self.places = dict(places or {})
        start = time.monotonic()
        self._beat: dict[int, int | None] = dict.fromkeys(self.nodes)
        self._moved = dict.fromkeys(self.nodes, start)
        self._last_step: dict[int, int] = {}
        self.dead: dict[int, Event] = {}

    def poll(self, step: int = -1) -> list[Event]:
        now = time.monotonic()
        present = {n: k for n, k in self.keys.items() if self.store.check([k])}
        values = dict(zip(present, self.store.multi_get(list(present.values())))) if present else {}
        new: list[Event] = []
        for node, ranks in self.nodes.items():
            dead_here: list[int] = []
            raw = values.get(node)
            if raw is not None:
                msg = json.loads(raw)
                if msg["beat"] != self._beat[node]:
                    self._beat[node] = msg["beat"]
                    self._moved[node] = now
                dead_here = [int(r) for r in msg["dead"]]
            limit = self.timeout_s if self._beat[node] is not None else self.startup_s
            if now - self._moved[node] > limit:
                dead_here = ranks  # the aggregator itself stopped: the node is gone
                reason = "node"
            else:
                reason = "rank"
            for r in dead_here:
                if r not in self.dead:
                    dp, st, tp = self.places.get(r, (None, None, None))
                    ev = Event("fail-stop", r, dp, st, tp, self._last_step.get(r, step), step, 0.0, 1.0,
                               extra={"node": node, "cause": reason})
                    self.dead[r] = ev
                    new.append(ev)
        for ranks in self.nodes.values():
            for r in ranks:
                if r not in self.dead:
                    self._last_step[r] = step
        return new


def _serve(argv: Sequence[str] | None = None) -> None:
    """``python -m resihp.detect.heartbeat sender|aggregator ...``: one heartbeat role as a process."""
    import argparse

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
        loop = NodeAggregator(store, args.node, ranks, args.interval, args.timeout,
                              startup_s=args.startup)
    loop.start()
    try:
        while loop._thread is not None and loop._thread.is_alive():
            time.sleep(args.interval)
    except KeyboardInterrupt:
        loop.stop()
    if loop.error is not None:
        print(f"heartbeat {args.role}: stopped: {loop.error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    _serve()
