"""Launching a training run as torchrun worker processes, on one node or as one node of many.

The launcher of node 0 hosts the job's store itself, on a socket it binds to the endpoint's address
(127.0.0.1 on one node: nothing of the job listens beyond loopback); torchrun joins it as a client
(``is_host=false``) and the workers share it for their process group and the control plane. On one
node gloo's sockets are bound to the loopback interface too.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from resihp.errors import InputError
from resihp.runtime.config import RunConfig
from resihp.runtime.lifecycle import guarded
from resihp.runtime.nodes import LOOPBACK, free_port, host_port
from resihp.runtime.warm import agent_env


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
    """InputError (one line) unless a TCPStore answers at ``addr:port`` within ``timeout_s``
    (its handshake's reply at most :data:`PROBE_REPLY_S`): names the endpoint, what it sent
    (or that it said nothing) and what was expected."""
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
        raise InputError(f"{where}: something listens there but did not answer the store's "
                         f"handshake within {wait:g} s; {expected}")
    raise InputError(f"{where}: answered the store's handshake with {got!r}, not a TCPStore's "
                     f"reply; {expected}")


class JobStore:
    """The job's store (a TCPStore): the rendezvous of torchrun's agents, the workers' process
    group and the control plane. ``host=True``: listen on ``endpoint``'s address only (the socket is
    bound here and handed to the store, which would otherwise listen on every interface); else join
    the store node 0 hosts there. ``option``: the command-line option ``endpoint`` came from, which
    an error names."""

    def __init__(self, endpoint: str | None = None, host: bool = True, timeout_s: float = 300.0,
                 option: str = "--rdzv-endpoint") -> None:
        addr, port = host_port(endpoint, option) if endpoint else (LOOPBACK, 0)
        timeout = datetime.timedelta(seconds=timeout_s)
        if host:
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                self._sock.bind((addr, port))
            except OSError as exc:
                self._sock.close()
                raise InputError(f"{option} {addr}:{port}: cannot listen there ({exc.strerror}; "
                                 "another job on this endpoint?)") from None
            self._sock.listen(512)
            self.addr, self.port = addr, self._sock.getsockname()[1]
            self.store = dist.TCPStore(addr, self.port, is_master=True, master_listen_fd=self._sock.fileno(),
                                       wait_for_workers=False, multi_tenant=True, timeout=timeout)
            self._sock.detach()  # the store owns the listening socket now and closes it
        else:
            self.addr, self.port = addr, port
            try:
                left = _wait_listening(addr, port, timeout_s)
                t0 = time.monotonic()
                probe_store(addr, port, left, option)
                left = max(1.0, left - (time.monotonic() - t0))
                self.store = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=left))
            except (OSError, RuntimeError, dist.DistError) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise InputError(f"{option} {addr}:{port}: cannot reach the job's store within "
                                 f"{timeout_s:g} s ({first[:120]})") from None

    @property
    def endpoint(self) -> str:
        return f"{self.addr}:{self.port}"

    def close(self) -> None:
        self.store = None  # the server stops with its last reference

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def forks_workers(cfg: RunConfig) -> bool:
    """Whether the run's workers are forked from a warm agent (``resihp.runtime.agent``): a CPU
    run on a machine with no usable GPU. Where a GPU is visible, the workers start as torchrun
    starts them, in a fresh interpreter, whatever the device: the agent's imports can initialise
    CUDA's driver, and a process forked after that fails at its first CUDA call, even a CPU
    run's: on an H200 machine every forked worker of a ``--device cpu`` run stopped with "CUDA
    error: initialization error"."""
    return cfg.device in ("cpu", "auto") and not torch.cuda.is_available()


def torchrun_command(config_path: str | Path, nproc: int, max_restarts: int = 0,
                     endpoint: str | None = None, nnodes: int = 1, run_id: str | None = None,
                     forked: bool = False) -> list[str]:
    """torchrun for ``nproc`` workers on this node, or (``forked``) resihp's agent with the same
    options (torchrun's elastic agent, the workers forked from it); with ``endpoint`` (a
    :class:`JobStore`'s) it joins that store instead of hosting one. Wrapped so that it dies with
    this process."""
    rdzv = ["--rdzv-endpoint", endpoint, "--rdzv-conf", "is_host=false"] if endpoint else [
        "--rdzv-endpoint", f"{LOOPBACK}:{free_port()}"]
    if run_id:
        rdzv += ["--rdzv-id", run_id]
    agent = "resihp.runtime.agent" if forked else "torch.distributed.run"
    return guarded([sys.executable, "-m", agent, "--nnodes", str(nnodes), "--nproc-per-node",
                    str(nproc), "--rdzv-backend", "c10d", *rdzv, "--max-restarts", str(max_restarts),
                    "--monitor-interval", "0.2", "-m", "resihp.runtime.worker", "--config", str(config_path)])


def worker_env(extra: dict[str, str] | None = None, endpoint: str | None = None, node: int = 0,
               managed: bool = False) -> dict[str, str]:
    """The environment of torchrun and its workers. With ``endpoint`` (a :class:`JobStore`'s)
    the workers form their process group and control plane on that store, and torchrun hosts no
    store of its own for them (its shared store would listen on every interface). ``managed``: this
    node's launcher aggregates heartbeats and reads the trace (``resihp run``)."""
    env = agent_env()
    if endpoint is None or host_port(endpoint)[0] == LOOPBACK:
        env["MASTER_ADDR"] = LOOPBACK
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's listening sockets on loopback, not the host's address
    env["RESIHP_NODE"] = str(node)
    if managed:
        env["RESIHP_MANAGED"] = "1"
    if endpoint:
        env["RESIHP_STORE"] = endpoint
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.update(extra or {})
    return env


def launch(cfg: RunConfig, timeout_s: float | None = None, capture: bool = True,
           max_restarts: int = 0) -> subprocess.CompletedProcess:
    """Run ``cfg`` to completion under torchrun; the config is written to ``OUT/config.json``."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.json"
    config_path.write_text(cfg.to_json())
    with JobStore() as store:
        cmd = torchrun_command(config_path, cfg.dims().world_size, max_restarts, store.endpoint,
                               forked=forks_workers(cfg))
        return subprocess.run(cmd, env=worker_env(endpoint=store.endpoint), timeout=timeout_s, text=True, capture_output=capture)
