"""The interface between the replay engine and the policies: what a policy sees and returns.

``Policy`` is the one interface every replayed system implements; ``Context`` is what it may know
(the scenario, the devices known dead, its cost model with the speeds it believes); ``Window`` is a
run of simulated steps with their ops records; ``Reaction`` is what it does about them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from resihp.detect.observe import trace_columns
from resihp.opstrace import JobMeta
from resihp.plan.cost import flops_per_s, tp_allreduce_s
from resihp.replay.costmodel import MicroBatchPool
from resihp.replay.layout import ReplicaLayout, uniform_layout
from resihp.replay.scenario import Scenario


@dataclass
class Detection:
    """A policy's detector naming a device (or only the job, ``device=None``) as slow or dead."""

    time_s: float
    step: int
    kind: str
    device: int | None
    slowdown: float = float("nan")
    peer: int | None = None  # a slow link's other end


@dataclass
class Reaction:
    """What a policy does: a new layout after ``downtime_s`` seconds without progress.

    ``rollback`` loses the work since the last checkpoint; ``at`` is the index of the observed step
    it acted at."""

    layout: ReplicaLayout | None = None
    downtime_s: float = 0.0
    rollback: bool = False
    at: int | None = None
    label: str = ""
    detections: list[Detection] = field(default_factory=list)
    migration_s: float = 0.0


@dataclass
class Window:
    """Simulated steps handed to a policy: global step numbers, step times, tokens, ops records."""

    steps: np.ndarray
    start_s: float
    step_time: np.ndarray
    tokens: np.ndarray
    layout: ReplicaLayout
    _ops: Callable[[], pd.DataFrame]
    meta: JobMeta | None = None
    rank_device: np.ndarray | None = None  # logical rank -> device id (-1: no device)
    rank_work: np.ndarray | None = None  # logical rank -> expected forward seconds per micro-batch
    _columns: Callable[[], dict[str, np.ndarray]] | None = None
    rank_place: np.ndarray | None = None  # logical rank -> (dp_rank, stage, tp_rank), -1: none
    # (step x logical rank) seconds per token of each rank's transfers to the next stage (NaN: none)
    transfers: np.ndarray | None = None
    _step_columns: Callable[[int, int], dict[str, np.ndarray]] | None = None

    def ops(self) -> pd.DataFrame:
        """The docs/DESIGN.md ops trace of these steps.

        Forward/backward compute of the first ``ops_microbatches`` micro-batches of every replica,
        on every tensor-parallel rank, with ``seq_lens`` and ``tokens``; ``rank`` is the logical
        rank of ``meta``, ``device`` the device.

        Durations are each rank's own compute kernel time (the wait for a slower tensor-parallel
        peer inside the collectives is not in it), so a slow device shows on its own rank only."""
        return self._ops()

    def columns(self) -> dict[str, np.ndarray]:
        """The same records as ``ops()``, as numpy columns without building the frame.

        In ``resihp.detect.observe.trace_columns`` form, ``optype`` a ``pd.Categorical``; {} for no
        records."""
        if self._columns is None:
            df = self.ops()
            return trace_columns(df) if not df.empty else {}
        return self._columns()

    def step_columns(self, first: int, stop: int) -> dict[str, np.ndarray]:
        """``columns()`` of the steps ``steps[first:stop]`` alone.

        Built for those steps only where the window's maker can."""
        if self._step_columns is not None:
            return self._step_columns(first, stop)
        cols = self.columns()
        if not cols:
            return {}
        step = np.asarray(cols["step"])
        keep = np.flatnonzero((step >= self.steps[first]) & (step <= self.steps[stop - 1]))
        return {c: v[keep] for c, v in cols.items()}


class Policy:
    """The interface every replayed policy implements (see ``resihp.replay.policies``)."""

    name = "policy"
    observes = False

    def start(self, ctx: Context) -> ReplicaLayout:
        return ctx.uniform_layout(set())

    def on_stop(self, ctx: Context, devices: list[int]) -> Reaction:
        raise NotImplementedError

    def on_recover(self, ctx: Context, devices: list[int]) -> Reaction | None:
        return None

    def observe(self, ctx: Context, window: Window) -> Reaction | None:
        return None

    def wake_at(self, ctx: Context) -> float | None:
        """When the policy wants to look at the job next, besides after changes and probes.

        The engine simulates a window then and hands it to ``observe``; None: no such time."""
        return None


class Context:
    """What a policy may know and use: the scenario, the dead devices, the time, the cost model.

    The cost model is for its own predictions, with the nominal speeds it believes, never the true
    ones."""

    def __init__(self, scenario: Scenario, pool: MicroBatchPool) -> None:
        self.scenario = scenario
        self.pool = pool
        self.known_dead: set[int] = set()
        self.now = 0.0
        self.step = 0
        self.last_checkpoint_s = 0.0
        self.layout: ReplicaLayout | None = None
        self._bench: Callable[[int], float] | None = None  # set by the engine (see ``benchmark``)
        self._bench_link: Callable[[int, int], float] | None = None  # (see ``benchmark_link``)
        m, p = scenario.model, scenario.parallel
        self.total_microbatches = m.global_batch_tokens // m.microbatch_tokens
        self.job_devices = np.arange(p.dp * p.pp * p.tp)
        self.rate = flops_per_s(float(scenario.cluster.tflops.min()))  # identical devices
        self.mean_fwd_flops = float(pool.fwd_flops_per_layer.mean())
        self.mean_head_flops = float(pool.head_flops.mean())
        self.mean_tokens = float(pool.tokens.mean())

    def benchmark(self, device: int) -> float:
        """The speed a short benchmark measures on ``device`` now, relative to a healthy device.

        0 when dead: what a real job can run on a device it has excluded and so cannot observe in
        training. Only for devices out of the plan in force; the others are judged by the
        detector."""
        if self._bench is None:
            raise RuntimeError("benchmark: no engine attached to this context")
        return self._bench(device)

    def benchmark_link(self, a: int, b: int) -> float:
        """The bandwidth a short transfer between ``a`` and ``b`` measures now, relative to healthy.

        What a job can probe on a link its plan no longer uses."""
        if self._bench_link is None:
            raise RuntimeError("benchmark_link: no engine attached to this context")
        return self._bench_link(a, b)

    def uniform_layout(self, exclude: set[int], dp: int | None = None) -> ReplicaLayout:
        """Megatron-style placement over the whole nodes that hold no excluded device."""
        c, p = self.scenario.cluster, self.scenario.parallel
        g = c.gpus_per_node
        nodes = [
            n
            for n in range(len(self.job_devices) // g)
            if not any(d in exclude for d in range(n * g, (n + 1) * g))
        ]
        devices = np.array([d for n in nodes for d in range(n * g, (n + 1) * g)], dtype=np.int64)
        return uniform_layout(
            devices, g, dp or p.dp, p.pp, p.tp, self.scenario.model.layers, self.total_microbatches
        )

    def stage_seconds(
        self,
        layers: np.ndarray,
        width: np.ndarray,
        speed: np.ndarray,
        last: np.ndarray | bool = False,
    ) -> np.ndarray:
        """Expected forward+backward seconds of one mean micro-batch on a stage (no noise).

        Args:
            layers: the stage's layers (one entry per stage, broadcast with the others).
            width: the stage's tensor-parallel group size.
            speed: the stage's speed as a fraction of a healthy device's (its slowest device).
            last: whether the stage is the pipeline's last (it also runs the LM head).
        """
        flops = np.asarray(layers) * self.mean_fwd_flops + np.where(last, self.mean_head_flops, 0.0)
        comm = (
            4.0
            * np.asarray(layers)
            * tp_allreduce_s(self.scenario.model, self.scenario.cluster, self.mean_tokens, width)
        )
        return 3.0 * flops / (np.asarray(width) * self.rate * np.asarray(speed)) + comm

    def predicted_step_time(self, layout: ReplicaLayout, speeds: np.ndarray) -> float:
        """1F1B estimate with mean micro-batches: sum of stage times + (m - 1) x slowest stage."""
        worst = 0.0
        padded = np.concatenate([speeds, [np.inf]])
        for r in layout.replicas:
            if r.microbatches == 0:
                continue
            sp = np.array([padded[list(g)].min() for g in r.groups])
            if (sp <= 0).any():
                return float("inf")
            last = np.arange(len(r.groups)) == len(r.groups) - 1
            per = self.stage_seconds(
                np.array(r.layers), np.array([len(g) for g in r.groups]), sp, last
            ) * np.array(r.load)
            worst = max(worst, per.sum() + (r.microbatches - 1) * per.max())
        return worst
