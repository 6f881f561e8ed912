"""A client of the job store, and the probe that tells a store from anything else on a port."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import struct
import time

import torch.distributed as dist

from resihp.errors import InputError
from resihp.train.nodes import LOOPBACK, host_port


def _wait_listening(addr: str, port: int, timeout_s: float) -> float:
    """Wait until something listens at addr:port (node 0 may start later than this node); returns
    the seconds left of ``timeout_s``. TCPStore's own connect retries with a back-off that ran
    past its timeout (8 s for 3 here), so the wait is done here and the store given what is left."""
    end = time.monotonic() + timeout_s
    while True:
        left = end - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(0.05, min(1.0, left))):
                return max(left, 1.0)
        except OSError:
            if left <= 0:
                raise
            time.sleep(min(0.1, max(0.0, left)))


# TCPStore's handshake as its client opens it (torch's c10d wire protocol, read off a real
# client): VALIDATE (query 0) with the magic number, then PING (query 13) with a nonce the server
# echoes. A listener that is not a TCPStore leaves the client waiting past its timeout (silence)
# or retrying with C++ stack traces (garbage), so the join is probed here first.
_VALIDATE = b"\x00" + struct.pack("<I", 0x3C85F7CE)
_PING = 13
PROBE_REPLY_S = 10.0  # a store answers its ping at once; a longer silence is not a store


def probe_store(addr: str, port: int, timeout_s: float, option: str = "--rdzv-endpoint") -> None:
    """InputError (one line) unless a TCPStore answers at ``addr:port`` within ``timeout_s``.

    The error names the endpoint, what it sent (or that it said nothing) and what was expected.

    Args:
        addr: the store's host.
        port: its port.
        timeout_s: how long to try, in seconds (its handshake's reply at most
            :data:`PROBE_REPLY_S`).
        option: the command-line option the endpoint came from, named in the error."""
    nonce = os.getpid() & 0xFFFFFFFF
    wait = max(0.05, min(timeout_s, PROBE_REPLY_S))
    where = f"{option} {addr}:{port}"
    expected = "expected a resihp job store (torch's TCPStore, node 0's --rdzv-endpoint)"
    try:
        sock = socket.create_connection((addr, port), timeout=wait)
    except OSError as exc:
        raise InputError(f"{where}: cannot connect ({exc.strerror or exc}); {expected}") from None
    got = b""
    with sock, contextlib.suppress(OSError):  # a timeout, a reset: judged by what came
        sock.sendall(_VALIDATE + bytes([_PING]) + struct.pack("<I", nonce))
        end = time.monotonic() + wait
        while len(got) < 4 and time.monotonic() < end:
            sock.settimeout(max(0.01, end - time.monotonic()))
            chunk = sock.recv(4 - len(got))
            if not chunk:
                break
            got += chunk
    if got == struct.pack("<I", nonce):
        return
    if not got:
        raise InputError(
            f"{where}: something listens there but did not answer the store's "
            f"handshake within {wait:g} s; {expected}"
        )
    raise InputError(
        f"{where}: answered the store's handshake with {got!r}, not a TCPStore's reply; {expected}"
    )


class JobStore:
    """The job's store (a TCPStore): torchrun's rendezvous, the process group and control plane.

    It is the rendezvous of torchrun's agents, the workers' process group and the control plane.
    ``host=True``: listen on ``endpoint``'s address only (the socket is
    bound here and handed to the store, which would otherwise listen on every interface); else join
    the store node 0 hosts there. ``option``: the command-line option ``endpoint`` came from, which
    an error names."""

    def __init__(
        self,
        endpoint: str | None = None,
        host: bool = True,
        timeout_s: float = 300.0,
        option: str = "--rdzv-endpoint",
    ) -> None:
        addr, port = host_port(endpoint, option) if endpoint else (LOOPBACK, 0)
        timeout = datetime.timedelta(seconds=timeout_s)
        if host:
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                self._sock.bind((addr, port))
            except OSError as exc:
                self._sock.close()
                raise InputError(
                    f"{option} {addr}:{port}: cannot listen there ({exc.strerror}; "
                    "another job on this endpoint?)"
                ) from None
            self._sock.listen(512)
            self.addr, self.port = addr, self._sock.getsockname()[1]
            self.store = dist.TCPStore(
                addr,
                self.port,
                is_master=True,
                master_listen_fd=self._sock.fileno(),
                wait_for_workers=False,
                multi_tenant=True,
                timeout=timeout,
            )
            self._sock.detach()  # the store owns the listening socket now and closes it
        else:
            self.addr, self.port = addr, port
            try:
                left = _wait_listening(addr, port, timeout_s)
                t0 = time.monotonic()
                probe_store(addr, port, left, option)
                left = max(1.0, left - (time.monotonic() - t0))
                self.store = dist.TCPStore(
                    addr, port, is_master=False, timeout=datetime.timedelta(seconds=left)
                )
            except (OSError, RuntimeError, dist.DistError) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise InputError(
                    f"{option} {addr}:{port}: cannot reach the job's store within "
                    f"{timeout_s:g} s ({first[:120]})"
                ) from None

    @property
    def endpoint(self) -> str:
        return f"{self.addr}:{self.port}"

    def close(self) -> None:
        self.store = None  # the server stops with its last reference

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
