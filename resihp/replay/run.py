"""Replaying one scenario under several policies: the function the CLI, benchmark and notebook
call."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from resihp.replay.engine import Replay, ReplayOutcome, shared_pool
from resihp.replay.failures import scenario_events
from resihp.replay.policies import make_policies
from resihp.replay.report import summary
from resihp.replay.scenario import FailureEvent, Scenario


@dataclass
class Comparison:
    scenario: Scenario
    events: list[FailureEvent]
    outcomes: list[ReplayOutcome]
    wall_s: dict[str, float]

    def summary(self, timeline_points: int = 96) -> dict:
        return summary(self.scenario, self.outcomes, self.events, self.wall_s, timeline_points)


def compare(
    scenario: Scenario,
    policies: str | list[str] | None = None,
    seed: int | None = None,
    on_progress: Callable[[float], None] | None = None,
) -> Comparison:
    """Replay every policy on the same events, workload draws and noise (same seed).

    Args:
        scenario: the scenario to replay.
        policies: policy names, a list or comma-separated (None or empty: all).
        seed: the seed of events, workload and noise (None: the scenario's).
        on_progress: called with the replayed seconds so far over all policies.
    """
    events = scenario_events(scenario, seed)
    pool = shared_pool(scenario)
    outcomes, wall = [], {}
    done = 0.0
    for policy in make_policies(policies):
        t0 = time.perf_counter()
        replay = Replay(scenario, policy, seed=seed, events=events, pool=pool)
        outcomes.append(
            replay.run(None if on_progress is None else (lambda t, d=done: on_progress(d + t)))
        )
        wall[policy.name] = time.perf_counter() - t0
        done += scenario.duration_s
    return Comparison(scenario, events, outcomes, wall)
