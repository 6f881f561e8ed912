"""A plan change: the part of a new plan a running job applies in place at a step boundary.

It travels as a small JSON dict (``OUT/control/plan.json``, the run config's ``replan`` entries,
the run summary's ``plan_changes``): ``{"version", "dp_weights"?, "layer_split"? (every pipeline)
or "layer_splits"? (one per replica), "layout"?, "reason"?, ...}``. Every rank turns the dict it
receives into a ``PlanChange`` once, checked against the job's parallel dimensions and layer count;
the engine applies only checked changes.

``"layout": {"dp", "pp", "tp", "ranks"?}`` re-forms the job's groups live: the new data x pipeline x
tensor-parallel split over ``ranks`` (world ranks in the new layout's rank order; default all of
them in order); or ``"layout": {"pipelines": [[[ranks of stage 0], ...], ...]}``, per replica per
stage its tensor-parallel group, replicas free to differ in depth and tensor-parallel size (what
the planner's plans give); world ranks left out become hot spares. ``dp_weights`` and
``layer_split(s)`` of the same change are then read against the new layout (default: equal shares,
balanced layers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from resihp.errors import InputError
from resihp.parallel import ParallelDims, Placement
from resihp.train.layout import ranges_from_counts


@dataclass(frozen=True)
class PlanChange:
    dp_weights: tuple[float, ...] | None = None  # micro-batch share per replica
    layer_splits: tuple[tuple[int, ...], ...] | None = (
        None  # layers per stage, one split per replica
    )
    record: Mapping[str, Any] = field(default_factory=dict, compare=False)  # the dict as received
    layout: Placement | None = None  # new groups over the world's ranks; None: the same layout

    @classmethod
    def parse(
        cls,
        data: Mapping[str, Any],
        dims: ParallelDims,
        layers: int,
        where: str = "plan",
        world: int | None = None,
        depths: list[int] | None = None,
    ) -> PlanChange:
        """The change in ``data``, or InputError naming the field that does not fit the job.

        Args:
            data: the change's JSON form.
            dims: the job's parallel dimensions.
            layers: the model's layers.
            where: what the change came from, named in errors.
            world: the job's processes, when the current layout uses only some of them (None:
                ``dims.world_size``).
            depths: each replica's stages, when they differ (None: ``dims.pp`` each)."""
        if not isinstance(data, Mapping):
            raise InputError(f"{where}: expected a plan change mapping, got {type(data).__name__}")
        layout = None
        if data.get("layout") is not None:
            layout = Placement.parse(data["layout"], world or dims.world_size, where)
            # the rest of the change is read against the new layout
            depths = [len(p) for p in layout.pipelines]
            dims = ParallelDims(len(depths), max(depths))
        weights = data.get("dp_weights")
        if weights is not None:
            try:
                weights = tuple(float(w) for w in weights)
            except (TypeError, ValueError):
                weights = None
            if weights is None or len(weights) != dims.dp or min(weights) < 0 or sum(weights) <= 0:
                raise InputError(
                    f"{where} dp_weights: expected {dims.dp} non-negative weights with a "
                    f"positive sum, got {data.get('dp_weights')!r}"
                )
        splits = data.get("layer_splits")
        if splits is None and data.get("layer_split") is not None:
            splits = [data["layer_split"]] * dims.dp
        if splits is not None:
            if not isinstance(splits, (list, tuple)) or len(splits) != dims.dp:
                got = len(splits) if isinstance(splits, (list, tuple)) else repr(splits)
                raise InputError(f"{where} layer_splits: expected {dims.dp} splits, got {got}")
            for d, split in enumerate(splits):
                ranges_from_counts(
                    split, layers, depths[d] if depths else dims.pp, source=f"{where} layer split"
                )
            splits = tuple(tuple(int(c) for c in split) for split in splits)
        return cls(weights, splits, dict(data), layout)

    def replica_ranges(
        self, layers: int, pp: int | None = None
    ) -> list[list[tuple[int, int]]] | None:
        """Each replica's contiguous layer ranges ``[first, last)`` per stage; None: unchanged."""
        if self.layer_splits is None:
            return None
        return [ranges_from_counts(split, layers, pp or len(split)) for split in self.layer_splits]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: the fields as received, and those of a change made here from its own."""
        out = dict(self.record)
        if self.dp_weights is not None:
            out.setdefault("dp_weights", list(self.dp_weights))
        if self.layer_splits is not None and "layer_split" not in out:
            out.setdefault("layer_splits", [list(split) for split in self.layer_splits])
        if self.layout is not None:
            out.setdefault("layout", self.layout.to_dict())
        return out
