"""A returning replica catches up from a live peer while the survivors keep stepping.

The source (the rank at the same position in the lowest surviving replica) copies its model and
AdamW state after a committed step ``t0``, with its replica's layer split (the returning rank
builds its stage to match), and from then on the summed gradients of every committed step, or its
state again after a plan change moved its layers; a thread sends them over a two-rank gloo group
of its own (its own store client: a TCPStore client is not to be shared with a thread blocked in
a rendezvous). The returning rank loads the state and applies each step's gradients with its own
optimizer: the same AdamW update on the same numbers, so it ends bitwise equal to the source. It
joins at the step boundary the quorum admits it at, without the survivors ever waiting for the
transfer.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed import Store

from resihp.ckpt.snapshot import RNG_KEY, state_tensors
from resihp.ft.group import gloo_group

STATE, GRAD, END = 0, 1, 2


def heal_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a returning rank needs, in one order on both sides.

    A snapshot's tensors (parameters and AdamW state, ``ckpt.snapshot.state_tensors``; zeros where
    it never stepped), without the RNG state (each rank keeps its own)."""
    return [t for name, t in state_tensors(model, optimizer) if name != RNG_KEY]


def flatten(tensors: list[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """One float32 vector of ``tensors`` on ``device`` (default: the first tensor's).

    On a GPU AdamW keeps its ``step`` counts on the CPU, so a state mixes devices."""
    device = tensors[0].device if device is None else device
    return torch.cat(
        [t.detach().reshape(-1).to(device=device, dtype=torch.float32) for t in tensors]
    )


def unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t).to(t.dtype))
        offset += n


def heal_prefix(job_id: str, replica: int, attempt: int, position: str) -> str:
    """The store prefix of the heal channel to one rank of a returning replica.

    Args:
        job_id: the job's id.
        replica: the returning replica.
        attempt: its attempt (each relaunch has a new one).
        position: the rank's place in its replica, ``"<stage>.<tensor-parallel rank>"``.
    """
    return f"resihp/{job_id}/ft/heal/{replica}/{attempt}/{position}"


class HealSource(threading.Thread):
    """The sending end for one returning rank, a thread.

    ``push(kind, step, flat, split)`` from the training loop (a copy, so training goes on;
    ``split``: with a state, the layers per stage it is in), sent in order by this thread;
    ``close(last)`` once the returning replica is admitted and the gradients of step ``last`` are
    queued."""

    def __init__(self, connect: Callable[[], Store], prefix: str, timeout_s: float) -> None:
        super().__init__(name="resihp-heal", daemon=True)
        self.connect, self.prefix, self.timeout_s = connect, prefix, timeout_s
        self.items: queue.Queue = queue.Queue()
        self.error: str | None = None
        self.sent_bytes = 0
        self.last: int | None = None  # the last step whose gradients the returning rank needs

    def push(
        self, kind: int, step: int, flat: torch.Tensor, split: list[int] | None = None
    ) -> None:
        """Queue one item for sending (a host copy, so training goes on).

        Args:
            kind: ``STATE`` or ``GRAD``.
            step: the step the state is after, or whose gradients these are.
            flat: the flat float32 payload (``flatten``).
            split: with a state, the layers per stage of this replica (None: none).
        """
        self.items.put((kind, step, flat.cpu(), list(split or [])))  # gloo sends from host memory

    def close(self, last: int) -> None:
        self.last = last
        self.items.put(None)

    @property
    def done(self) -> bool:
        return not self.is_alive()

    def run(self) -> None:
        try:
            store = self.connect()
            # connect only once the returning rank listens: a thread blocked in a rendezvous could
            # not be stopped when the job ends first
            while not store.check([f"{self.prefix}/listening"]):
                if self.last is not None:
                    return
                time.sleep(0.02)
            pg = gloo_group(store, self.prefix, 0, 2, self.timeout_s)
            while True:
                item = self.items.get()
                if item is None:
                    pg.send([torch.tensor([END, self.last, 0, 0], dtype=torch.int64)], 1, 0).wait()
                    return
                kind, step, flat, split = item
                pg.send(
                    [torch.tensor([kind, step, flat.numel(), len(split)], dtype=torch.int64)], 1, 0
                ).wait()
                if split:
                    pg.send([torch.tensor(split, dtype=torch.int64)], 1, 2).wait()
                pg.send([flat], 1, 1).wait()
                self.sent_bytes += flat.numel() * 4
        except (
            RuntimeError,
            dist.DistError,
        ) as exc:  # the returning rank was lost: stop serving it
            self.error = (
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            )


def close_sources(sources: Iterable[HealSource]) -> None:
    """Close every source (nothing more to send), then wait a little for each to end."""
    sources = list(sources)
    for source in sources:
        source.close(-1)
    for source in sources:
        source.join(timeout=5)


class HealTarget:
    """The receiving end on a returning rank."""

    def __init__(self, store: Store, prefix: str, timeout_s: float) -> None:
        store.set(f"{prefix}/listening", "1")
        self.pg = gloo_group(store, prefix, 1, 2, timeout_s)
        self.received_bytes = 0

    def next(self) -> tuple[int, int, torch.Tensor | None, list[int]]:
        """The next item received: (kind, step, payload, split).

        STATE (with the layers per stage of the source's replica) or GRAD with their numbers, or
        END (no payload)."""
        head = torch.zeros(4, dtype=torch.int64)
        self.pg.recv([head], 0, 0).wait()
        kind, step, n, k = (int(x) for x in head)
        if kind == END:
            return kind, step, None, []
        split = torch.zeros(k, dtype=torch.int64)
        if k:
            self.pg.recv([split], 0, 2).wait()
        flat = torch.empty(n, dtype=torch.float32)
        self.pg.recv([flat], 0, 1).wait()
        self.received_bytes += n * 4
        return kind, step, flat, split.tolist()
