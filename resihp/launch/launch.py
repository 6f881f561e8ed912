"""Launching a training run as torchrun worker processes, on one node or as one node of many.

The launcher of node 0 hosts the job's store itself, on a socket it binds to the endpoint's address
(127.0.0.1 on one node: nothing of the job listens beyond loopback); torchrun joins it as a client
(``is_host=false``) and the workers share it for their process group and the control plane. On one
node gloo's sockets are bound to the loopback interface too.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from resihp.launch.warm import agent_env
from resihp.train.config import RunConfig
from resihp.train.lifecycle import guarded
from resihp.train.nodes import LOOPBACK, free_port, host_port
from resihp.train.store import (
    JobStore,
)


def forks_workers(cfg: RunConfig) -> bool:
    """Whether the run's workers are forked from a warm agent (``resihp.launch.agent``).

    They are for a CPU run on a machine with no usable GPU. Where a GPU is visible, the workers
    start as torchrun starts them, in a fresh interpreter, whatever the device: the agent's imports
    can initialise CUDA's driver, and a process forked after that fails at its first CUDA call, even
    a CPU run's: on an H200 machine every forked worker of a ``--device cpu`` run stopped with "CUDA
    error: initialization error"."""
    return cfg.device in ("cpu", "auto") and not torch.cuda.is_available()


def torchrun_command(
    config_path: str | Path,
    nproc: int,
    max_restarts: int = 0,
    endpoint: str | None = None,
    nnodes: int = 1,
    run_id: str | None = None,
    forked: bool = False,
    program: Sequence[str] | None = None,
) -> list[str]:
    """The torchrun command line for ``nproc`` workers on this node, wrapped to die with this
    process.

    Or (``forked``) resihp's agent with the same options (torchrun's elastic agent, the workers
    forked from it).

    Args:
        config_path: the run's ``config.json`` the workers read.
        nproc: workers on this node.
        max_restarts: torchrun's restarts of a failed worker group.
        endpoint: a :class:`JobStore`'s HOST:PORT to join instead of hosting a store.
        nnodes: nodes in the job.
        run_id: torchrun's run id (the job id).
        forked: run resihp's agent, whose workers fork from it, instead of torchrun.
        program: what each worker runs, as torchrun takes it (a script and its arguments; None:
            ``resihp run``'s worker reading ``config_path``).
    """
    rdzv = (
        ["--rdzv-endpoint", endpoint, "--rdzv-conf", "is_host=false"]
        if endpoint
        else ["--rdzv-endpoint", f"{LOOPBACK}:{free_port()}"]
    )
    if run_id:
        rdzv += ["--rdzv-id", run_id]
    agent = "resihp.launch.agent" if forked else "torch.distributed.run"
    return guarded(
        [
            sys.executable,
            "-m",
            agent,
            "--nnodes",
            str(nnodes),
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            "c10d",
            *rdzv,
            "--max-restarts",
            str(max_restarts),
            "--monitor-interval",
            "0.2",
            *(program or ["-m", "resihp.train.worker", "--config", str(config_path)]),
        ]
    )


def worker_env(
    extra: dict[str, str] | None = None,
    endpoint: str | None = None,
    node: int = 0,
    managed: bool = False,
) -> dict[str, str]:
    """The environment of torchrun and its workers.

    Args:
        extra: further variables.
        endpoint: a :class:`JobStore`'s HOST:PORT: the workers form their process group and
            control plane on that store, and torchrun hosts no store of its own for them (its
            shared store would listen on every interface).
        node: this node's rank.
        managed: this node's launcher aggregates heartbeats and reads the trace (``resihp run``).
    """
    env = agent_env()
    if endpoint is None or host_port(endpoint)[0] == LOOPBACK:
        env["MASTER_ADDR"] = LOOPBACK
        env.setdefault(
            "GLOO_SOCKET_IFNAME", "lo"
        )  # gloo's listening sockets on loopback, not the host's address
    env["RESIHP_NODE"] = str(node)
    if managed:
        env["RESIHP_MANAGED"] = "1"
    if endpoint:
        env["RESIHP_STORE"] = endpoint
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.update(extra or {})
    return env


def launch(
    cfg: RunConfig, timeout_s: float | None = None, capture: bool = True, max_restarts: int = 0
) -> subprocess.CompletedProcess:
    """Run ``cfg`` to completion under torchrun; the config is written to ``OUT/config.json``.

    Args:
        cfg: the run configuration.
        timeout_s: seconds before torchrun is killed (None: no limit).
        capture: capture torchrun's output in the result instead of passing it through.
        max_restarts: torchrun's restarts of a failed worker group.
    """
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.json"
    config_path.write_text(cfg.to_json())
    with JobStore() as store:
        cmd = torchrun_command(
            config_path,
            cfg.dims().world_size,
            max_restarts,
            store.endpoint,
            forked=forks_workers(cfg),
        )
        return subprocess.run(
            cmd,
            env=worker_env(endpoint=store.endpoint),
            timeout=timeout_s,
            text=True,
            capture_output=capture,
        )
