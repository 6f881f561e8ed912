"""The healthy layout (TP x PP x DP degrees), its home groups and pipelines, the uniform plan.

Also the ways a degraded tensor-parallel group can be re-formed."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from resihp.errors import InputError
from resihp.parallel import ParallelDims
from resihp.plan.cost import grad_sync_s
from resihp.plan.plan import Stage
from resihp.plan.specs import ClusterSpec, ModelSpec, stage_memory_gb
from resihp.plan.timing import StageCoster, closed_form_step


def powers_of_two_upto(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if 1 << i <= n]


def home_groups(cluster: ClusterSpec, tp: int) -> list[tuple[int, ...]]:
    """Consecutive ranks of each node in groups of ``tp``; a node's leftover devices form none."""
    return list(_home_groups(cluster.node_ranks, tp))


@lru_cache(maxsize=16)  # re-plans ask again for the same nodes (``with_speeds`` keeps them)
def _home_groups(node_ranks: tuple[tuple[int, ...], ...], tp: int) -> tuple[tuple[int, ...], ...]:
    return tuple(
        tuple(ranks[i : i + tp]) for ranks in node_ranks for i in range(0, len(ranks) - tp + 1, tp)
    )


def touched_replicas(cluster: ClusterSpec, layout: ParallelDims) -> set[int]:
    """The home replicas (``home_pipelines``) with a degraded device in one of their groups."""
    group_of = _home_group_of(cluster.node_ranks, layout.tp)
    used = layout.pp * layout.dp  # home group ``s * dp + r`` is replica r's stage s
    return {g % layout.dp for d in cluster.degraded if (g := group_of.get(d, used)) < used}


@lru_cache(maxsize=16)
def _home_group_of(node_ranks: tuple[tuple[int, ...], ...], tp: int) -> dict[int, int]:
    """Rank -> index of its home group (``home_groups``); not to be changed by callers."""
    return {r: i for i, g in enumerate(_home_groups(node_ranks, tp)) for r in g}


def home_pipelines(cluster: ClusterSpec, layout: ParallelDims) -> list[list[tuple[int, ...]]]:
    """Each replica's home groups, stage by stage: replica r, stage s uses group ``s * dp + r``.

    That is Megatron's order (TP fastest, then DP, then PP), so consecutive stages of a pipeline
    sit on different nodes."""
    groups = home_groups(cluster, layout.tp)
    return [[groups[s * layout.dp + r] for s in range(layout.pp)] for r in range(layout.dp)]


def layer_ranges(counts: Sequence[int]) -> list[tuple[int, int]]:
    ends = np.cumsum(counts).tolist()
    return [(e - c, e) for c, e in zip(counts, ends)]


def uniform_layer_counts(layers: int, pp: int) -> list[int]:
    """Even split; the remainder goes to the middle stages, away from the embedding and the head."""
    counts = [layers // pp] * pp
    order = sorted(range(pp), key=lambda s: (s in (0, pp - 1), abs(s - (pp - 1) / 2)))
    for s in order[: layers % pp]:
        counts[s] += 1
    return counts


def memory_ok(
    model: ModelSpec,
    coster: StageCoster,
    groups: Sequence[tuple[int, ...]],
    counts: Sequence[int],
    m: int,
    budget: float | None = None,
) -> bool:
    """Whether stages of these groups and layer counts fit their devices' memory.

    Args:
        model: the model and its batch.
        coster: prices and checks stages on the cluster.
        groups: each stage's ranks, in pipeline order.
        counts: each stage's layer count.
        m: the micro-batches the pipeline carries.
        budget: a micro-batch's tokens (None: the model's budget)."""
    return coster.stages_fit(
        tuple(Stage(g, r) for g, r in zip(groups, layer_ranges(counts))), m, budget
    )


def replica_load(model: ModelSpec, dp: int, token_budgets: bool = False) -> tuple[int, float]:
    """(micro-batches, each one's tokens over the model's budget) of the busiest of equal replicas.

    That is ``ceil(M / dp)`` whole micro-batches, or with token budgets ``floor(M / dp)`` of them
    that share the global batch's tokens evenly (``resihp.plan.tokens``: budgets only grow).

    Args:
        model: the model and its batch (``M`` micro-batches).
        dp: the number of replicas.
        token_budgets: replicas share the tokens evenly, in larger micro-batches."""
    if not token_budgets or model.microbatches < dp:
        return -(-model.microbatches // dp), 1.0
    m = model.microbatches // dp
    return m, model.global_batch_tokens / (dp * m * model.microbatch_tokens)


def layout_step_time(
    cluster: ClusterSpec,
    model: ModelSpec,
    coster: StageCoster,
    layout: ParallelDims,
    groups: Sequence[tuple[int, ...]] | None = None,
    token_budgets: bool = False,
) -> float | None:
    """Step time of the uniform plan of a layout on healthy devices, or None if it does not fit.

    Args:
        cluster: the cluster.
        model: the model and its batch.
        coster: prices stages and pipelines on the cluster.
        layout: the TP x PP x DP degrees.
        groups: the home groups of ``layout.tp`` when already at hand (None: computed).
        token_budgets: replicas share the tokens evenly (``replica_load``)."""
    groups = groups if groups is not None else home_groups(cluster, layout.tp)
    groups = [groups[s * layout.dp] for s in range(layout.pp)]
    m, scale = replica_load(model, layout.dp, token_budgets)
    counts = uniform_layer_counts(model.layers, layout.pp)
    if not memory_ok(
        model, coster, groups, counts, m, None if scale == 1.0 else scale * model.microbatch_tokens
    ):
        return None
    stages = tuple(Stage(g, r) for g, r in zip(groups, layer_ranges(counts)))
    fb = np.array([coster.stage_fb(s, i == len(stages) - 1, scale) for i, s in enumerate(stages)])
    step = closed_form_step(fb[:, 0], fb[:, 1], m, model.schedule, coster.p2p_s * scale)
    return step + grad_sync_s(model, cluster, max(counts) / layout.tp, layout.dp)


def choose_layout(
    cluster: ClusterSpec, model: ModelSpec, coster: StageCoster, token_budgets: bool = False
) -> ParallelDims:
    """The TP x PP x DP layout with the shortest predicted step on the healthy cluster.

    The model's ``tp``/``pp`` fields, when given, fix those degrees.

    Args:
        cluster: the cluster (healthy or not: its healthy copy is priced).
        model: the model and its batch.
        coster: its cost model prices the layouts.
        token_budgets: replicas may share the tokens evenly (``replica_load``)."""
    healthy = StageCoster(cluster.healthy(), model, coster.cost)
    smallest_node = min(len(r) for r in cluster.node_ranks)
    best: tuple[float, ParallelDims] | None = None
    too_wide = tried = 0  # layouts, and those with more replicas than micro-batches
    tps = (
        [model.tp]
        if model.tp
        else [t for t in powers_of_two_upto(smallest_node) if model.heads % t == 0]
    )
    largest_node = max(len(r) for r in cluster.node_ranks)
    if model.tp and model.tp > largest_node:
        raise InputError(
            f"model {model.name}: tp {model.tp} needs tensor-parallel groups of {model.tp} devices "
            f"inside one node, and cluster {cluster.name}'s largest node has {largest_node}: "
            f"give tp at most {largest_node}, or leave it out for the planner to choose"
        )
    for tp in tps:
        groups = home_groups(cluster, tp)
        n_groups = len(groups)
        pps = [model.pp] if model.pp else range(1, min(model.layers, n_groups) + 1)
        for pp in pps:
            dp = n_groups // pp
            tried += dp >= 1
            if dp < 1 or dp > model.microbatches:
                too_wide += dp > model.microbatches
                continue
            layout = ParallelDims(dp=dp, pp=pp, tp=tp)
            step = layout_step_time(healthy.cluster, model, healthy, layout, groups, token_budgets)
            if step is not None and (best is None or step < best[0] - 1e-12):
                best = (step, layout)
    if best is None and tried and too_wide == tried:
        raise InputError(
            f"cluster {cluster.name}: every TP x PP layout of its {len(cluster.devices):,} "
            f"devices has more replicas than model {model.name}'s {model.microbatches:,} "
            "micro-batches a step (global_batch_tokens / microbatch_tokens; each replica needs "
            "one): raise global_batch_tokens or plan for fewer devices"
        )
    if best is None:
        need = stage_memory_gb(model, model.layers, 1, 1, True, True)
        have = sum(d.memory_gb - cluster.memory_reserve_gb for d in cluster.devices)
        raise InputError(
            f"cluster {cluster.name}: no TP x PP layout fits model {model.name} "
            f"(model state alone needs about {need:.0f} GB, the cluster has {have:.0f} GB free; "
            + (f"fixed tp={model.tp} pp={model.pp}; " if model.tp or model.pp else "")
            + "add devices or memory, or shrink the micro-batch)"
        )
    return best[1]


def binary_chunks(ranks: Sequence[int]) -> list[tuple[int, ...]]:
    """Consecutive chunks with power-of-two sizes, largest first (7 ranks: 4 + 2 + 1)."""
    out, i = [], 0
    for size in sorted(powers_of_two_upto(len(ranks)), reverse=True):
        if len(ranks) - i >= size:
            out.append(tuple(ranks[i : i + size]))
            i += size
    return out


def group_options(
    group: tuple[int, ...], cluster: ClusterSpec, heads: int
) -> list[list[tuple[int, ...]]]:
    """Ways to re-form a home TP group around its degraded members.

    Each is a list of sub-groups that become consecutive pipeline stages: keep it whole, keep only
    the fastest power-of-two subset (ResiHP's selective exclusion), split the live members into
    power-of-two groups, split only the full-speed members (the slower ones excluded, or in groups
    of their own), or drop it. A healthy group has one option: itself.

    Args:
        group: the home group's ranks.
        cluster: the cluster (its devices' speeds).
        heads: the model's attention heads: every sub-group's size divides them."""
    speeds = {r: cluster.devices[r].speed * cluster.devices[r].tflops for r in group}
    top = max(speeds.values())
    if (
        all(v == top for v in speeds.values())
        and top > 0
        and all(cluster.devices[r].speed == 1.0 for r in group)
    ):
        return [[group]]
    alive = sorted((r for r in group if speeds[r] > 0), key=lambda r: (-speeds[r], r))
    options: list[list[tuple[int, ...]]] = []
    if len(alive) == len(group):
        options.append([group])
    for k in powers_of_two_upto(len(alive)):
        options.append([tuple(sorted(alive[:k]))])
    full = [r for r in alive if speeds[r] == top]
    options.append([tuple(sorted(c)) for c in binary_chunks(alive)])
    options.append([tuple(sorted(c)) for c in binary_chunks(full)])
    slower = [r for r in alive if speeds[r] < top]
    if slower:  # the full-speed members and the slower ones each in groups of their own
        options.append([tuple(sorted(c)) for c in binary_chunks(full) + binary_chunks(slower)])
    options.append([])
    unique, seen = [], set()
    for opt in options:
        if all(heads % len(g) == 0 for g in opt) and (key := tuple(opt)) not in seen:
            seen.add(key)
            unique.append(opt)
    return unique
