"""One node's part of a job (torchrun's terms) and the job's endpoint: no torch import, so
``resihp run`` checks them before its own imports (and before it starts a spare agent)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from resihp.errors import InputError

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Nodes:
    """One node's part of a job, in torchrun's terms (``--nnodes``, ``--node-rank``,
    ``--nproc-per-node``, ``--rdzv-endpoint``). Node 0 hosts the job's store at the endpoint (bound
    to its host: loopback unless the user names another address); the other nodes join it."""

    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int = 1
    endpoint: str | None = None  # HOST:PORT; None: one node, a free loopback port

    def check(self, world: int) -> None:
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise InputError(f"--nnodes {self.nnodes} --nproc-per-node {self.nproc_per_node}: expected "
                             "positive integers")
        if not 0 <= self.node_rank < self.nnodes:
            raise InputError(f"--node-rank {self.node_rank}: out of range for --nnodes {self.nnodes} "
                             f"(expected 0..{self.nnodes - 1})")
        if self.nnodes * self.nproc_per_node != world:
            raise InputError(f"--nnodes {self.nnodes} x --nproc-per-node {self.nproc_per_node} = "
                             f"{self.nnodes * self.nproc_per_node} ranks, but the layout needs {world} "
                             "(dp x pp x tp)")
        if self.nnodes > 1 and self.endpoint is None:
            raise InputError("--rdzv-endpoint HOST:PORT is required with --nnodes > 1 (node 0's "
                             "address, reachable from every node)")
        if self.endpoint is not None:
            host_port(self.endpoint)

    @property
    def ranks(self) -> list[int]:
        first = self.node_rank * self.nproc_per_node
        return list(range(first, first + self.nproc_per_node))


def host_port(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT, e.g. 10.0.0.1:29500")
    return host, int(port)
