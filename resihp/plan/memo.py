"""What a ``Planner`` keeps between re-plans of one cluster and model.

The parts of a plan that device speeds do not change (the healthy plan, the capacity bound at full
speed, home pipelines, memory fits, critical paths by stage times, pipeline designs) and the
pipeline solves already done.

A re-plan at 16,384 devices touches a handful of its 256 pipelines; everything about the others
comes from here."""

from __future__ import annotations

from functools import cached_property

from resihp.parallel import ParallelDims
from resihp.plan.designs import Designer, designer_for
from resihp.plan.layout import group_options, home_pipelines, layer_ranges
from resihp.plan.pipeline_solver import PipelineSolution
from resihp.plan.plan import Plan, Stage, Stages
from resihp.plan.specs import ClusterSpec, ModelSpec
from resihp.plan.timing import CapacityBound, StageCoster

CACHE_LIMIT = 200_000  # entries, before the caches start over (a long run meets many fault sets)


class HardwareMemo:
    """What speeds do not change of one hardware and model, built from its first cluster.

    The first cluster a planner sees with this hardware; its healthy plan is evaluated against that
    cluster's bound, as ``healthy_plan`` does."""

    def __init__(
        self,
        cluster: ClusterSpec,
        model: ModelSpec,
        healthy: Plan,
        bound: CapacityBound,
        coster: StageCoster,
    ) -> None:
        self.hardware_key = cluster.hardware_key
        self.cluster = cluster.healthy()
        self.model = model
        self.healthy = healthy
        self.bound = bound  # at full speed
        self.coster = coster  # at full speed; re-plans use ``coster.at_speeds``
        self.solves: dict[tuple, tuple[PipelineSolution, float]] = {}  # optimal answer, seconds
        self._homes: dict[ParallelDims, list[list[tuple[int, ...]]]] = {}
        self._whole: dict[ParallelDims, list[bool]] = {}
        self._stages: dict[tuple[ParallelDims, tuple[int, ...]], list[tuple[Stage, ...]]] = {}
        self._leftover: dict[ParallelDims, frozenset[int]] = {}
        counts = tuple(s.n_layers for s in healthy.pipelines[0].stages)
        self._stages[(healthy.layout, counts)] = [p.stages for p in healthy.pipelines]

    @cached_property
    def designer(self) -> Designer:
        """Pipeline designs of mixed TP sizes and depths at full speed (built at first use)."""
        return designer_for(self.coster)

    def home_pipelines(self, layout: ParallelDims) -> list[list[tuple[int, ...]]]:
        if layout not in self._homes:
            self._homes[layout] = home_pipelines(self.cluster, layout)
        return self._homes[layout]

    def leftover(self, layout: ParallelDims) -> frozenset[int]:
        """The devices no home replica uses."""
        if layout not in self._leftover:
            homes = {r for groups in self.home_pipelines(layout) for g in groups for r in g}
            self._leftover[layout] = frozenset(range(len(self.cluster))) - homes
        return self._leftover[layout]

    def whole_at_full_speed(self, layout: ParallelDims) -> list[bool]:
        """Per home replica: whether ``group_options`` keeps each of its groups whole at full speed.

        Whole: it offers only the group itself, when every device runs at full speed. With devices
        slowed or dead it does so exactly for the groups whose devices are all still at full
        speed."""
        if layout not in self._whole:
            self._whole[layout] = [
                all(group_options(g, self.cluster, self.model.heads) == [[g]] for g in groups)
                for groups in self.home_pipelines(layout)
            ]
        return self._whole[layout]

    def home_stages(self, layout: ParallelDims, counts: list[int]) -> list[tuple[Stage, ...]]:
        """Each home replica's stages with these layer counts.

        One tuple per replica, shared by every plan, so caches keyed by stages find them by
        identity."""
        key = (layout, tuple(counts))
        if key not in self._stages:
            ranges = layer_ranges(counts)
            self._stages[key] = [
                Stages(Stage(g, rng) for g, rng in zip(groups, ranges))
                for groups in self.home_pipelines(layout)
            ]
        return self._stages[key]

    def trim(self) -> None:
        """Start the solve and coster caches over once they pass ``CACHE_LIMIT`` entries."""
        if len(self.solves) + self.coster.cache_entries > CACHE_LIMIT:
            self.solves.clear()
            self.coster = StageCoster(self.cluster, self.model, self.coster.cost)
