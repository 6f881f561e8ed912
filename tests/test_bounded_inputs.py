"""Bounded waits and reads on bad input (issue 70): a port that is not a job store, a huge lengths
file, a memory tier left behind by a dead job; each ends in one line, never a hang or a traceback."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from resihp.runtime import launch
from resihp.runtime.launch import JobStore

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


class Listener(threading.Thread):
    """A plain TCP listener on loopback that is not a store: it accepts and says nothing
    (``reply=b""``) or sends ``reply`` to every connection, which it keeps open."""

    def __init__(self, reply: bytes = b"") -> None:
        super().__init__(daemon=True)
        self.reply = reply
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.reply:
                with contextlib.suppress(OSError):
                    conn.sendall(self.reply)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture(params=[b"", b"HTTP/1.0 200 OK\r\n\r\ngarbage\n" * 50], ids=["silent", "garbage"])
def not_a_store(request) -> Iterator[Listener]:
    listener = Listener(request.param)
    listener.start()
    yield listener
    listener.close()


@pytest.mark.slow
def test_follow_store_on_a_port_that_is_not_a_store(not_a_store: Listener) -> None:
    """``resihp follow --store`` at a listener that is not a store ends within its start timeout
    with one line naming the endpoint and what it expected (exit 2), silent or garbage."""
    endpoint = f"127.0.0.1:{not_a_store.port}"
    proc = subprocess.run([sys.executable, "-m", "resihp.cli", "follow", "--store", endpoint,
                           "--start-timeout", "3", "--nice", "0"], capture_output=True, text=True,
                          timeout=40, env=ENV)
    err = proc.stderr.strip()
    assert proc.returncode == 2, err[-2000:]
    assert len(err.splitlines()) == 1, err[-2000:]  # no traceback, no C++ stack from TCPStore
    assert endpoint in err and "expected a resihp job store" in err
    assert "Traceback" not in err and "frame #" not in err


def test_probe_accepts_a_real_store() -> None:
    """The handshake the probe speaks is TCPStore's own: a real store passes, and a client joins."""
    host = JobStore(timeout_s=10)
    try:
        launch.probe_store("127.0.0.1", host.port, 5.0)
        client = JobStore(host.endpoint, host=False, timeout_s=10)
        host.store.set("k", "v")
        assert client.store.get("k") == b"v"
    finally:
        host.close()


def _write_lengths(path: Path, n: int) -> Path:
    chunk = "512\n" * 1_000_000
    with path.open("w") as f:
        for _ in range(n // 1_000_000):
            f.write(chunk)
    return path
