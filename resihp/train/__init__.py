"""The per-rank library for the user's own training: snapshots of its state and their
restore, and a process group that a torchrun restart rejoins."""

from resihp.train.rendezvous import attempt_prefix, init_process_group
from resihp.train.snapshots import KEEPER_OWNER, RestoredState, Snapshots
from resihp.train.state import RNG, flatten, unflatten

__all__ = ["KEEPER_OWNER", "RNG", "RestoredState", "Snapshots", "attempt_prefix", "flatten",
           "init_process_group", "unflatten"]
