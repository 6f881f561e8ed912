"""The per-rank library for the user's own training: snapshots of its state and their restore."""

from resihp.train.snapshots import KEEPER_OWNER, RestoredState, Snapshots
from resihp.train.state import RNG, flatten, unflatten

__all__ = ["KEEPER_OWNER", "RNG", "RestoredState", "Snapshots", "flatten", "unflatten"]
