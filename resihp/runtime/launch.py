"""Launching a training run as torchrun worker processes on this machine.

On one node nothing of the job listens beyond loopback: the launcher hosts the rendezvous store
itself, on a socket it binds to 127.0.0.1 (torchrun joins it as a client, ``is_host=false``, and the
workers share it for their process group), and gloo's sockets are bound to the loopback interface.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from resihp.runtime.config import RunConfig
from resihp.runtime.lifecycle import guarded

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


class LoopbackStore:
    """The job's rendezvous store (a TCPStore server) listening on 127.0.0.1 only: the socket is
    bound here and handed to the store, which would otherwise listen on every interface."""

    def __init__(self, timeout_s: float = 300.0) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((LOOPBACK, 0))
        self._sock.listen(512)
        self.port = self._sock.getsockname()[1]
        self.store = dist.TCPStore(LOOPBACK, self.port, is_master=True, master_listen_fd=self._sock.fileno(),
                                   wait_for_workers=False, multi_tenant=True,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self._sock.detach()  # the store owns the listening socket now and closes it

    @property
    def endpoint(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def close(self) -> None:
        self.store = None  # the server stops with its last reference

    def __enter__(self) -> LoopbackStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def torchrun_command(config_path: str | Path, nproc: int, max_restarts: int = 0,
                     endpoint: str | None = None) -> list[str]:
    """torchrun for ``nproc`` workers; with ``endpoint`` (a :class:`LoopbackStore`'s) it joins that
    store instead of hosting one. Wrapped so that it dies with this process."""
    rdzv = ["--rdzv-endpoint", endpoint, "--rdzv-conf", "is_host=false"] if endpoint else [
        "--rdzv-endpoint", f"{LOOPBACK}:{free_port()}"]
    return guarded([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
                    str(nproc), "--rdzv-backend", "c10d", *rdzv, "--max-restarts", str(max_restarts),
                    "--monitor-interval", "0.2", "-m", "resihp.runtime.worker", "--config", str(config_path)])


def worker_env(extra: dict[str, str] | None = None, endpoint: str | None = None) -> dict[str, str]:
    """The environment of torchrun and its workers. With ``endpoint`` (a :class:`LoopbackStore`'s)
    the workers form their process group on that store, and torchrun hosts no store of its own
    for them (its shared store would listen on every interface)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["MASTER_ADDR"] = LOOPBACK
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's listening sockets on loopback, not the host's address
    env["PYTHONUNBUFFERED"] = "1"
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
    with LoopbackStore() as store:
        cmd = torchrun_command(config_path, cfg.dims().world_size, max_restarts, store.endpoint)
        return subprocess.run(cmd, env=worker_env(endpoint=store.endpoint), timeout=timeout_s, text=True, capture_output=capture)
