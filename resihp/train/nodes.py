"""One node's part of a job (torchrun's terms) and the job's endpoint.

No torch import, so ``resihp run`` checks them before its own imports (and before it starts a spare
agent)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from resihp.detect.records import JOB_SECRET_ENV
from resihp.errors import InputError

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


# a worker's global rank is this plus its local rank (set by the launcher: nodes may hold different
# numbers of ranks after a relaunch re-formed around a lost device)
FIRST_RANK_ENV = "RESIHP_FIRST_RANK"


@dataclass(frozen=True)
class Nodes:
    """One node's part of a job, in torchrun's terms.

    Those are ``--nnodes``, ``--node-rank``, ``--nproc-per-node`` and ``--rdzv-endpoint``. Node 0
    hosts the job's store at the endpoint (bound to its host: loopback unless the user names another
    address); the other nodes join it."""

    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int = 1
    endpoint: str | None = None  # HOST:PORT; None: one node, a free loopback port
    # ranks per node where they differ (a relaunch re-formed around a lost device keeps each
    # survivor on its node); None: ``nproc_per_node`` on every node
    sizes: tuple[int, ...] | None = None

    def check(self, world: int) -> None:
        if self.sizes is not None:
            if len(self.sizes) != self.nnodes or min(self.sizes) < 1 or sum(self.sizes) != world:
                raise InputError(
                    f"ranks per node {list(self.sizes)}: expected {self.nnodes} positive counts "
                    f"adding up to the world size {world}"
                )
            return
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise InputError(
                f"--nnodes {self.nnodes} --nproc-per-node {self.nproc_per_node}: expected "
                "positive integers"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise InputError(
                f"--node-rank {self.node_rank}: out of range for --nnodes {self.nnodes} "
                f"(expected 0..{self.nnodes - 1})"
            )
        if self.nnodes * self.nproc_per_node != world:
            raise InputError(
                f"--nnodes {self.nnodes} x --nproc-per-node {self.nproc_per_node} = "
                f"{self.nnodes * self.nproc_per_node} ranks, but the layout needs {world} "
                "(dp x pp x tp)"
            )
        if self.nnodes > 1 and self.endpoint is None:
            raise InputError(
                "--rdzv-endpoint HOST:PORT is required with --nnodes > 1 (node 0's "
                "address, reachable from every node)"
            )
        if self.endpoint is not None:
            host_port(self.endpoint)

    @property
    def counts(self) -> tuple[int, ...]:
        """The ranks of each node."""
        return self.sizes if self.sizes is not None else (self.nproc_per_node,) * self.nnodes

    def layout(self) -> dict[int, list[int]]:
        """Every node's ranks: the nodes' ranks in order, node ``i``'s after those of the nodes
        before."""
        starts = [sum(self.counts[:n]) for n in range(self.nnodes)]
        return {n: list(range(starts[n], starts[n] + self.counts[n])) for n in range(self.nnodes)}

    @property
    def ranks(self) -> list[int]:
        """This node's ranks."""
        return self.layout()[self.node_rank]


MIN_SECRET = 32  # characters of the job's secret (``secrets.token_hex(32)`` makes 64)


def check_secret(nodes: Nodes, env: Mapping[str, str] = os.environ) -> None:
    """A job on several nodes: each node must be launched with the job's secret.

    The secret is in ``RESIHP_JOB_SECRET``, the same on every node (what steers the job is signed
    with it: a node, or any other process, without it cannot stop, relaunch, evict or re-plan the
    others). One node makes its own."""
    if nodes.nnodes == 1:
        return
    secret = env.get(JOB_SECRET_ENV, "")
    if len(secret) < MIN_SECRET:
        got = f"{len(secret)} characters" if secret else "none"
        raise InputError(
            f"--nnodes {nodes.nnodes}: expected the job's secret in {JOB_SECRET_ENV}, the same on "
            f"every node, at least {MIN_SECRET} characters (e.g. python -c 'import secrets; "
            f"print(secrets.token_hex(32))'), got {got}"
        )


def host_port(endpoint: str, option: str = "--rdzv-endpoint") -> tuple[str, int]:
    """``endpoint``'s host and port; ``option``: the option it came from, for the error."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"{option} {endpoint!r}: expected HOST:PORT, e.g. 10.0.0.1:29500")
    return host, int(port)
