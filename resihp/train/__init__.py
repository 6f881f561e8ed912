"""The rank: what runs in each training process, the user's own or ``resihp run``'s.

- The user's own training: ``Snapshots`` (its state in the node's memory tier, and the restore
  after a restart), ``Replicas`` (replica-level fault tolerance over its model and optimizer,
  under ``resihp replicas``), ``init_process_group`` (a group a torchrun restart rejoins),
  ``attach`` (recording and detection, ``resihp.attach``) and the HF and Lightning callbacks.
- ``resihp run``'s rank: ``engine`` (1F1B/GPipe over point-to-point ops, gradient sync, optimizer),
  started by torchrun through ``worker``; ``config.RunConfig`` describes a run; ``data`` the packed
  batches; ``inject`` slow / stop / hang faults; ``replica`` a replica's rank under replica-level
  fault tolerance; ``elastic`` exclusion by restart from a universal checkpoint.
- ``controlplane`` / ``store``: the job's store carries heartbeats, step records, plan changes and
  errors; ``planchange`` / ``replan`` / ``gradsync`` apply plan changes at step boundaries;
  ``planning`` prices plans from measured steps; ``recorder`` writes ops-trace rows; ``follow``
  detects from a job's store.
"""

import importlib

__all__ = [
    "KEEPER_OWNER",
    "RNG",
    "Replicas",
    "RestoredState",
    "Snapshots",
    "attempt_prefix",
    "flatten",
    "init_process_group",
    "unflatten",
]

_HOMES = {
    "KEEPER_OWNER": "snapshots",
    "RestoredState": "snapshots",
    "Snapshots": "snapshots",
    "Replicas": "user_replicas",
    "RNG": "state",
    "flatten": "state",
    "unflatten": "state",
    "attempt_prefix": "rendezvous",
    "init_process_group": "rendezvous",
}


def __getattr__(name: str):
    # lazy, so that the rank's light modules (nodes, config) import without torch: the CLI checks
    # a run's options before its own torch import
    if name in _HOMES:
        return getattr(importlib.import_module(f"resihp.train.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'resihp.train' has no attribute {name!r}")
