"""Token budgets per replica: the fine-grained complement of moving whole micro-batches.

With few micro-batches per replica (4 at 16k GPUs), moving one micro-batch off a slow replica
overloads another by a whole micro-batch. Instead each replica keeps its micro-batch count and
its share of the global batch's tokens is set so that replicas finish together. A replica's step
is linear in its micro-batch size (compute, tensor-parallel and pipeline traffic all scale with
tokens), so this is a linear program, solved with OR-Tools GLOP:

    minimise T  s.t.  T >= a_r * tau_r,  sum_r m_r * tau_r = global tokens,
                      microbatch_tokens <= tau_r <= memory limit of replica r

then rounded to whole tokens with the global batch kept exactly. Budgets only grow from the
model's micro-batch size: smaller ones would trade away GPU efficiency that a cost model linear in
tokens does not see (and would shrink the bubble below what the capacity bound assumes); a slow
replica instead runs fewer micro-batches (``proportional_counts``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from ortools.linear_solver import pywraplp

from resihp.plan.plan import Plan, unplaced
from resihp.plan.timing import StageCoster


def budget_limit(coster: StageCoster, plan_pipeline) -> float:
    """Largest micro-batch (tokens) every stage of the replica can hold in memory."""
    return coster.budget_limit(plan_pipeline.stages, plan_pipeline.microbatches)


def balance_tokens(plan: Plan, coster: StageCoster) -> Plan:
    """A copy of the plan whose replicas' token shares equalise their predicted finish times.

    Micro-batch counts and layouts are unchanged. Returns the plan itself when nothing can move."""
    model = coster.model
    pipes = plan.pipelines
    if len(pipes) < 2:
        return plan
    tau0 = model.microbatch_tokens
    # seconds per token of micro-batch size; replicas with equal rows share one LP variable
    rows: dict[tuple[float, int, float], list[int]] = {}
    for i, p in enumerate(pipes):
        rate = coster.pipeline_step(p.stages, p.microbatches) / tau0
        rows.setdefault((rate, p.microbatches, budget_limit(coster, p)), []).append(i)
    solver = pywraplp.Solver.CreateSolver("GLOP")
    span = solver.NumVar(0.0, solver.infinity(), "span")
    taus = []
    for k, (rate, _m, limit) in enumerate(rows):
        lo = float(model.microbatch_tokens)
        tau = solver.NumVar(lo, max(lo, limit - 1.0), f"tau{k}")
        solver.Add(span >= rate * tau)
        taus.append(tau)
    solver.Add(
        sum(m * len(members) * tau for (_, m, _), members, tau in zip(rows, rows.values(), taus))
        == float(model.global_batch_tokens)
    )
    solver.Minimize(span)
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        return plan
    shares = np.zeros(len(pipes))
    for ((_, m, _), members), tau in zip(rows.items(), taus):
        shares[members] = m * tau.solution_value()
    tokens = np.floor(shares).astype(np.int64)
    short = model.global_batch_tokens - int(tokens.sum())
    for i in np.argsort(-(shares - tokens))[: max(0, short)]:
        tokens[i] += 1
    if tokens.sum() != model.global_batch_tokens:
        return plan
    new = [
        replace(p, tokens=None if t == p.microbatches * tau0 else int(t))
        for p, t in zip(pipes, tokens.tolist())
    ]
    return replace(plan, pipelines=new)


def proportional_counts(plan: Plan, coster: StageCoster, fewer: bool = False) -> Plan:
    """A copy with micro-batch counts sized to each replica's speed.

    So that token budgets can then close the rest of the gap (a slow replica cannot shrink its
    micro-batches, but it can run one fewer, or none). Shares are proportional to tokens per second
    at the present counts; each count is the most micro-batches of at least the model's budget that
    fit the share, and at least as many as the memory limit on micro-batch size requires; ``fewer``:
    where memory caps the micro-batch below the share, the count stays and the replica takes less
    than its share (the others absorb the rest), instead of one more micro-batch that may take
    longer than the share.

    Args:
        plan: the plan to resize.
        coster: the stage coster.
        fewer: where memory caps a replica's micro-batch below its share, keep its count.
    """
    model = coster.model
    pipes = plan.pipelines
    if len(pipes) < 2:
        return plan
    speed = np.array(
        [
            p.share(model)
            / coster.pipeline_step(
                p.stages, p.microbatches, p.budget(model) / model.microbatch_tokens
            )
            for p in pipes
        ]
    )
    ideal = speed / speed.sum() * model.global_batch_tokens
    counts = []
    for p, x in zip(pipes, ideal):
        m = int(x // model.microbatch_tokens)  # 0: too slow for even one micro-batch, dropped
        limit = budget_limit(coster, p)
        if m and x / m > limit - 1 and not fewer:
            m = int(np.ceil(x / (limit - 1)))
        counts.append(m)
    new = [
        replace(p, dp_rank=i, microbatches=m, tokens=m * model.microbatch_tokens)
        for i, (p, m) in enumerate((p, m) for p, m in zip(pipes, counts) if m > 0)
    ]
    return replace(plan, pipelines=new, excluded=unplaced(plan.world_size, new))


def balanced(plan: Plan, coster: StageCoster) -> list[Plan]:
    """``plan`` with counts proportional to speed and token budgets balanced.

    Both ways of meeting a memory cap on a replica's micro-batch (``proportional_counts``), each
    once."""
    out = [balance_tokens(proportional_counts(plan, coster), coster)]
    fewer = balance_tokens(proportional_counts(plan, coster, fewer=True), coster)
    if fewer.pipelines != out[0].pipelines:
        out.append(fewer)
    return out
