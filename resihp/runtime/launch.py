"""Launching a training run as torchrun worker processes on this machine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from resihp.runtime.config import RunConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(config_path: str | Path, nproc: int, max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.2",
            "-m", "resihp.runtime.worker", "--config", str(config_path)]


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["MASTER_ADDR"] = "127.0.0.1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def launch(cfg: RunConfig, timeout_s: float | None = None, capture: bool = True,
           max_restarts: int = 0) -> subprocess.CompletedProcess:
    """Run ``cfg`` to completion under torchrun; the config is written to ``OUT/config.json``."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.json"
    config_path.write_text(cfg.to_json())
    cmd = torchrun_command(config_path, cfg.dims().world_size, max_restarts)
    return subprocess.run(cmd, env=worker_env(), timeout=timeout_s, text=True,
                          capture_output=capture)
