"""Drop mode's reference: one process trains the run's model on the micro-batches of each step's
recorded members only (the summary's ``members``), with the loss averaged over the tokens they
hold, as the survivors of a ``--recovery replica-drop`` run do while a replica is away."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.gloo_ranks import spawn_ranks

# the issue's run (DP 2 x TP 2 of the default model, 4,096 tokens a step), as flags, and the steps
# of its one-process reference (``issue_run_losses`` in ``tests/conftest.py``)
ISSUE_RUN = dict(dp=2, pp=1, tp=2, global_tokens=4096)
ISSUE_STEPS = 32


def _replay(rank: int, world: int, tmp: str) -> dict:
    from resihp.train.config import RunConfig
    from resihp.train.data import replica_microbatches
    from resihp.train.engine import Engine

    spec = json.loads((Path(tmp) / "replay.json").read_text())
    full = RunConfig.from_flags(**spec["flags"])
    members, weights = spec["members"], full.weights()
    one = full.updated(
        dp=1,
        pp=1,
        tp=1,
        dp_weights=None,
        layer_split=None,
        recovery="none",
        inject=[],
        live=False,
        out=tmp,
    )

    class MembersOnly(Engine):
        def microbatches(self, data):
            return [
                mb for r in members[self.rec.step] for mb in replica_microbatches(data, r, weights)
            ]

        def loss_tokens(self, data):
            return sum(mb.tokens for mb in self.microbatches(data))

    engine = MembersOnly(one, torch.device("cpu"))
    return {"losses": [engine.train_step(step).loss for step in range(len(members))]}


def replay_membership(flags: dict, members: list[list[int]], tmp: Path) -> list[float]:
    """The per-step losses of one process replaying ``members`` (per step, the replicas trained)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "replay.json").write_text(json.dumps({"flags": flags, "members": members}))
    return spawn_ranks(_replay, 1, tmp)[0]["losses"]
