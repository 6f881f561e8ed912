"""Fail-stop detection with real processes: senders and per-node aggregators over a real
TCPStore."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from resihp.detect.heartbeat import (
    KEEPER_WAIT,
    HeartbeatMonitor,
    HeartbeatSender,
    NodeAggregator,
    Progress,
    node_key,
    rank_key,
    start_local_store,
)

INTERVAL = 0.2
TIMEOUT = 1.5


def _spawn(port: int, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resihp.detect.heartbeat",
            *args,
            "--port",
            str(port),
            "--interval",
            str(INTERVAL),
            "--timeout",
            str(TIMEOUT),
        ],
        env=env,
    )


def _poll_until(monitor: HeartbeatMonitor, want: set[int], deadline_s: float, step: int) -> list:
    found = []
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        found += monitor.poll(step)
        if want <= {e.rank for e in found}:
            break
        time.sleep(INTERVAL)
    return found


@pytest.mark.slow
def test_killed_rank_and_lost_node_become_fail_stop_events():
    store, port = start_local_store()
    nodes = {0: [0, 1], 1: [2, 3]}
    procs = {}
    try:
        for node, ranks in nodes.items():
            procs[f"agg{node}"] = _spawn(
                port, "aggregator", "--node", str(node), "--ranks", ",".join(map(str, ranks))
            )
            for r in ranks:
                procs[r] = _spawn(port, "sender", "--node", str(node), "--rank", str(r))
        monitor = HeartbeatMonitor(store, nodes, timeout_s=TIMEOUT)
        # start-up (importing torch in 6 processes) is not a failure: wait for every first beat
        keys = [rank_key("resihp/hb", n, r) for n, rs in nodes.items() for r in rs]
        keys += [node_key("resihp/hb", n) for n in nodes]
        end = time.monotonic() + 90
        while not store.check(keys) and time.monotonic() < end:
            assert monitor.poll(0) == []
            time.sleep(INTERVAL)
        assert store.check(keys), "heartbeat processes did not start"
        # everyone alive: several timeouts pass with no event
        quiet = _poll_until(monitor, {-1}, 3 * TIMEOUT, step=1)
        assert quiet == []

        procs[3].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        found = _poll_until(monitor, {3}, 4 * TIMEOUT, step=2)
        assert [(e.kind, e.rank) for e in found] == [("fail-stop", 3)]
        assert found[0].node == 1 and found[0].cause == "exited"
        assert time.monotonic() - t0 < TIMEOUT + 4 * INTERVAL + 1.0

        # the whole of node 0 disappears (aggregator and ranks): both its ranks are reported
        for key in ("agg0", 0, 1):
            procs[key].send_signal(signal.SIGKILL)
        found = _poll_until(monitor, {0, 1}, 4 * TIMEOUT, step=3)
        assert sorted(e.rank for e in found) == [0, 1]
        assert {e.cause for e in found} <= {"node", "exited"}
        assert 2 not in monitor.dead
    finally:
        for p in procs.values():
            p.kill()
            p.wait(timeout=10)


def _first_events(monitor: HeartbeatMonitor, step: int, within_s: float = 10.0) -> list:
    """The first events the monitor reports (polling every 50 ms), or [] after ``within_s``."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        found = monitor.poll(step)
        if found:
            return found
        time.sleep(0.05)
    return []


def test_a_rank_beating_without_progress_is_hung_and_its_waiting_peers_are_not():
    """In one process: three ranks' heartbeat threads. Rank 0 makes progress; rank 1 is stuck
    waiting in a receive (for rank 2); rank 2 is stuck outside any communication op: rank 2 is
    the hang. A rank whose beats stop while its process lives is a hang too; finished ranks are
    never judged."""

    store, _ = start_local_store()
    ops = {"n": 0}

    def moving() -> Progress:
        ops["n"] += 1
        return Progress(3, "train", ops["n"], "")

    senders = [
        HeartbeatSender(store, 0, 0, 0.05, progress=moving),
        HeartbeatSender(
            store, 1, 0, 0.05, progress=lambda: Progress(3, "train", 40, "backward-recv")
        ),
        HeartbeatSender(store, 2, 0, 0.05, progress=lambda: Progress(3, "train", 17, "")),
    ]
    for snd in senders:
        snd.start()
    agg = NodeAggregator(store, 0, [0, 1, 2], interval_s=0.05, timeout_s=1.0).start()
    monitor = HeartbeatMonitor(store, {0: [0, 1, 2]}, timeout_s=1.0, hang_timeout_s=0.6)
    try:
        found = _first_events(monitor, 3)
        assert [(e.rank, e.cause) for e in found] == [(2, "hang")]
        assert found[0].step == 3 and found[0].silent_s >= 0.6
        senders[1].finish("done")  # a rank that finished is never judged
        senders[0].stop()  # silent while its process lives: hung
        found = _first_events(monitor, 4)
        assert [(e.rank, e.cause) for e in found] == [(0, "hang")]
        time.sleep(0.3)
        assert monitor.poll(5) == []
    finally:
        for snd in senders:
            snd.stop()
        agg.stop()


def _slow(state: dict) -> Progress:
    """A fail-slow rank: its ops still finish, until it is stuck."""
    state["n"] += 0 if state["stuck"] else 1
    return Progress(3, "train", state["n"], "")


def _held_by_keeper(state: dict) -> Progress:
    """A rank waiting for its node's keeper to release a memory slot (a checkpoint the keeper
    writes), until it is stuck outside that wait."""
    return Progress(3, "train", 17, "" if state["stuck"] else KEEPER_WAIT)


@pytest.mark.parametrize("rank0", [_slow, _held_by_keeper], ids=["slow", "keeper-wait"])
def test_ranks_waiting_on_a_rank_that_is_busy_are_not_hung(rank0):
    """Rank 0 is slow (its ops still finish) or waits for its keeper (a wait with its own
    deadline); rank 1 waits in a collective for it for longer than the hang timeout: nobody is
    hung. Once rank 0 is stuck, it is the hang."""
    store, _ = start_local_store()
    state = {"n": 0, "stuck": False}
    senders = [
        HeartbeatSender(store, 0, 0, 0.05, progress=lambda: rank0(state)),
        HeartbeatSender(
            store, 1, 0, 0.05, progress=lambda: Progress(3, "train", 40, "grads-all-reduce")
        ),
    ]
    for snd in senders:
        snd.start()
    agg = NodeAggregator(store, 0, [0, 1], interval_s=0.05, timeout_s=5.0).start()
    monitor = HeartbeatMonitor(store, {0: [0, 1]}, timeout_s=5.0, hang_timeout_s=0.4)
    try:
        assert _first_events(monitor, 3, within_s=1.5) == []  # rank 1 waited ~4x the hang timeout
        state["stuck"] = True
        found = _first_events(monitor, 3)
        assert [(e.rank, e.cause) for e in found] == [(0, "hang")]
    finally:
        for snd in senders:
            snd.stop()
        agg.stop()


_WAITING_RANK = """
import sys, time
from resihp.detect.heartbeat import HeartbeatSender, Progress, connect_store
store = connect_store("127.0.0.1", int(sys.argv[1]))
HeartbeatSender(store, int(sys.argv[2]), 0, 0.05,
                progress=lambda: Progress(3, "train", 40, "grads-all-reduce")).start()
time.sleep(120)
"""


def test_a_stopped_rank_inside_the_op_its_peer_waits_in_is_the_hang():
    """Two real rank processes beat the same progress (step 3, 40 ops, both waiting in the
    gradient all-reduce); rank 1's process is stopped (SIGSTOP) inside it. Step, ops and the op
    waited in are a tie: the stopped process is the hang, not the first rank of the tie."""

    store, port = start_local_store()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", _WAITING_RANK, str(port), str(r)], env=env)
        for r in (0, 1)
    ]
    agg = None
    try:
        keys = [rank_key("resihp/hb", 0, r) for r in (0, 1)]
        end = time.monotonic() + 90
        while not store.check(keys) and time.monotonic() < end:
            time.sleep(0.05)
        assert store.check(keys), "the rank processes did not start"
        agg = NodeAggregator(store, 0, [0, 1], interval_s=0.05, timeout_s=30.0).start()
        procs[1].send_signal(signal.SIGSTOP)
        monitor = HeartbeatMonitor(store, {0: [0, 1]}, timeout_s=30.0, hang_timeout_s=1.0)
        found = _first_events(monitor, 3)
        assert [(e.rank, e.cause) for e in found] == [(1, "hang")]
    finally:
        if agg is not None:
            agg.stop()
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def test_a_rank_in_its_warm_up_is_not_hung_until_the_start_up_bound_and_a_hang_is_confirmed():
    """Default (adaptive) limits: rank 0's first step stalls far past the hang floor while rank 1
    waits for it in the all-reduce: a warm-up, nobody is hung. Once rank 0 has finished steps, the
    same stall is a hang, acted on only after a second look ``confirm_s`` later; a stall that moves
    on before that second look is forgotten."""
    store, _ = start_local_store()
    state = {"step": 0, "ops": 5}
    senders = [
        HeartbeatSender(
            store, 0, 0, 0.05, progress=lambda: Progress(state["step"], "train", state["ops"], "")
        ),
        HeartbeatSender(
            store,
            1,
            0,
            0.05,
            progress=lambda: Progress(state["step"], "train", 3, "grads-all-reduce"),
        ),
    ]
    for snd in senders:
        snd.start()
    agg = NodeAggregator(store, 0, [0, 1], interval_s=0.05, timeout_s=5.0).start()
    monitor = HeartbeatMonitor(
        store, {0: [0, 1]}, timeout_s=5.0, startup_s=30.0, hang_floor_s=0.3, confirm_s=1.0
    )
    try:
        assert _first_events(monitor, 0, within_s=1.5) == []  # 5x the floor, in the warm-up
        for _ in range(4):  # steps finish: a step time is measured
            state["step"] += 1
            time.sleep(0.1)
        time.sleep(0.6)  # stalled past the limit: a suspect, not yet a verdict
        assert monitor.poll(5) == []
        state["ops"] += 1  # it moved on before the second look
        time.sleep(0.6)
        assert monitor.poll(5) == []  # a suspect afresh
        t0 = time.monotonic()
        found = _first_events(monitor, 5)
        assert [(e.rank, e.cause) for e in found] == [(0, "hang")]
        assert time.monotonic() - t0 >= 0.9  # the second look came confirm_s after the first
    finally:
        for snd in senders:
            snd.stop()
        agg.stop()
