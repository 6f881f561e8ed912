"""Plans that move pipeline boundaries away from slow links.

A slow link between data-parallel peers slows the gradient reduction of the stage they hold: the
reduction moves that stage's shards, so fewer layers on that stage means fewer bytes over the slow
link (a slow pipeline link is priced into its stages' times, ``StageCoster``, and the allocation
moves micro-batches away from it). These candidates take a plan and shift one or more layers off
each stage whose reduction crosses a slow link, to a neighbouring stage, in every replica alike;
the planner's evaluator keeps one only if its step time (compute, bubbles, reduction) is better.
Or a slow link's end swaps places with another stage of its own pipeline (``rank_swaps``): the
link then joins neither a gradient reduction nor a pipeline boundary it did before, at the price of
moving those stages' state (the evaluator charges the migration). Or the replica holding an end
leaves the job (``replica_drops``), its micro-batches spread over the others: when a stage's
reduction runs at a slow network card's pace (several times slower on a congested fabric), losing
one replica's compute can cost far less than that ring, and the evaluator weighs the two.
"""

from __future__ import annotations

from dataclasses import replace

from resihp.plan.plan import Pipeline, Plan, Stage
from resihp.plan.specs import ClusterSpec, ModelSpec
from resihp.plan.timing import StageCoster


def slow_sync_stages(plan: Plan, cluster: ClusterSpec) -> list[int]:
    """Stage indices whose replicas' gradient reduction crosses a slow link."""
    if (
        not cluster.links
        or len(plan.pipelines) < 2
        or len({len(p.stages) for p in plan.pipelines}) != 1
    ):
        return []
    out = []
    for s in range(len(plan.pipelines[0].stages)):
        if cluster.slowest_link_within(r for p in plan.pipelines for r in p.stages[s].ranks) < 1.0:
            out.append(s)
    return out


def _shift(stages: tuple[Stage, ...], s: int, to: int, k: int) -> tuple[Stage, ...] | None:
    """``k`` layers moved from stage ``s`` to its neighbour ``to`` (s +- 1); None if ``s`` would
    be left with none."""
    counts = [st.n_layers for st in stages]
    if counts[s] - k < 1:
        return None
    counts[s] -= k
    counts[to] += k
    out, start = [], stages[0].layers[0]
    for st, n in zip(stages, counts):
        out.append(Stage(st.ranks, (start, start + n)))
        start += n
    return tuple(out)


def boundary_moves(plan: Plan, cluster: ClusterSpec, max_shift: int = 4) -> list[Plan]:
    """Copies of ``plan`` with layers moved off each slow-reduction stage to either neighbour.

    Up to ``max_shift`` layers, the same move in every replica (unevaluated).

    Args:
        plan: the plan to vary.
        cluster: the cluster (its slow links).
        max_shift: the most layers moved.
    """
    out = []
    for s in slow_sync_stages(plan, cluster):
        for to in (s - 1, s + 1):
            if not 0 <= to < len(plan.pipelines[0].stages):
                continue
            for k in range(1, max_shift + 1):
                moved = [_shift(p.stages, s, to, k) for p in plan.pipelines]
                if any(m is None for m in moved):
                    break
                pipes = [
                    Pipeline(p.dp_rank, m, p.microbatches, p.home, p.tokens)
                    for p, m in zip(plan.pipelines, moved)
                ]
                out.append(replace(plan, pipelines=pipes, solver={}, step_time_s=float("nan")))
    return out


def rank_swaps(plan: Plan, cluster: ClusterSpec) -> list[Plan]:
    """Copies of ``plan`` in which a stage at a slow link trades its ranks with another stage.

    The stage holding an end of a slow link trades with another stage of the same pipeline (same
    tensor-parallel size; layers stay with their stage position), unevaluated."""
    out = []
    for a, b, speed in cluster.links:
        if speed >= 1.0:
            continue
        for end in (a, b):
            for i, p in enumerate(plan.pipelines):
                s = next((k for k, st in enumerate(p.stages) if end in st.ranks), None)
                if s is None:
                    continue
                for t, other in enumerate(p.stages):
                    if t == s or other.tp != p.stages[s].tp:
                        continue
                    stages = list(p.stages)
                    stages[s], stages[t] = (
                        Stage(other.ranks, p.stages[s].layers),
                        Stage(p.stages[s].ranks, other.layers),
                    )
                    pipes = list(plan.pipelines)
                    pipes[i] = Pipeline(p.dp_rank, tuple(stages), p.microbatches, p.home, p.tokens)
                    out.append(replace(plan, pipelines=pipes, solver={}, step_time_s=float("nan")))
    return out


def replica_drops(plan: Plan, cluster: ClusterSpec) -> list[Plan]:
    """Copies of ``plan`` without the pipeline holding an end of a slow link, unevaluated.

    Its micro-batches (and token share) are spread over the remaining pipelines as evenly as they
    go."""
    out, seen = [], set()
    if len(plan.pipelines) < 2:
        return out
    for a, b, speed in cluster.links:
        if speed >= 1.0:
            continue
        for end in (a, b):
            i = next((k for k, p in enumerate(plan.pipelines) if end in p.ranks), None)
            if i is None or i in seen:
                continue
            seen.add(i)
            out.append(
                replace(
                    plan, pipelines=_spread(plan.pipelines, i), solver={}, step_time_s=float("nan")
                )
            )
    return out


def _spread(pipelines: list[Pipeline], drop: int) -> list[Pipeline]:
    """The pipelines without ``drop``, which gives each of the others an even part of its
    micro-batches (the first ones one more) and of its tokens when shares are set."""
    gone, rest = pipelines[drop], [p for k, p in enumerate(pipelines) if k != drop]
    n = len(rest)
    extra_mb = [gone.microbatches // n + (k < gone.microbatches % n) for k in range(n)]
    tokens: list[int | None] = [p.tokens for p in rest]
    if gone.tokens is not None and all(t is not None for t in tokens):
        extra = [gone.tokens // n + (k < gone.tokens % n) for k in range(n)]
        tokens = [t + e for t, e in zip(tokens, extra)]
    elif gone.tokens is not None or any(t is not None for t in tokens):
        tokens = [None] * n  # mixed shares: every pipeline at the model's budget
    return [
        Pipeline(p.dp_rank, p.stages, p.microbatches + e, p.home, t)
        for p, e, t in zip(rest, extra_mb, tokens)
    ]


def with_link_event(
    cluster: ClusterSpec,
    model: ModelSpec,
    ranks: tuple[int, int],
    slowdown: float,
    traffic: str,
    measured: dict[str, float] | None = None,
    coster: StageCoster | None = None,
) -> ClusterSpec:
    """The cluster as a ``link-slow`` finding describes it.

    Args:
        cluster: the cluster planned for.
        model: the model.
        ranks: the link's two ends; it runs at 1/slowdown of its bandwidth.
        slowdown: how many times slower the link runs (x).
        traffic: ``pipeline`` or ``gradient-sync``.
        measured: the healthy transfers and compute the job measured
            (``OnlineDetector.healthy_transfers``; None: not measured).
        coster: the planner's coster for ``cluster``; with ``measured``, the cluster's bandwidth
            is set so that the planner's healthy transfer of that traffic stands to its compute as
            the measured ones did (pipeline: seconds per token of activations; gradient sync:
            seconds of a stage's reduction), so the slow link is priced at its real share.
    """
    gbs = _bandwidth_gbs(model, traffic, measured or {}, coster)
    if gbs is not None:
        cluster = replace(cluster, intra_node_gbs=gbs, inter_node_gbs=gbs)
    return cluster.with_link_speeds({tuple(ranks): 1.0 / max(float(slowdown), 1.0)})


def _bandwidth_gbs(
    model: ModelSpec, traffic: str, measured: dict[str, float], coster: StageCoster | None
) -> float | None:
    measured_compute = measured.get("compute", 0.0)
    if coster is None or not measured_compute > 0:
        return None
    per_stage = max(1, model.layers // max(model.pp or 1, 1))
    f, b = coster.stage_fb(Stage((0,), (0, per_stage)), last=False)
    scale = (f + b) / model.microbatch_tokens / measured_compute  # planner seconds per measured one
    if traffic == "pipeline" and measured.get("pipeline", 0.0) > 0:
        # the planner's message: tokens x hidden x 2 bytes over the bandwidth
        return model.hidden * 2 / (measured["pipeline"] * scale * 1e9)
    if traffic == "gradient-sync" and measured.get("gradient-sync", 0.0) > 0:
        # the planner's reduction (two replicas): layers on the stage x layer bytes over it
        return model.params_per_layer * 2 * per_stage / (measured["gradient-sync"] * scale * 1e9)
    return None
