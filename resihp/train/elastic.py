"""Excluding a stopped device by an elastic restart from the latest universal checkpoint.

The restart keeps the same global batch, so the optimizer's mathematics do not change: the
survivors re-formed around the
lost device as the planner says (``reform_around``: its replica kept where the planner keeps it,
with fewer stages, a smaller tensor-parallel group or fewer micro-batches), else the surviving
uniform layout (``layout_without``: one data-parallel replica fewer, or one pipeline stage fewer
when there is a single replica). Resuming (``resihp run --resume``) from a checkpoint in any
layout, and what a checkpoint records beside its tensors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from resihp.ckpt.integrity import newest_good, step_of
from resihp.ckpt.reshard_rules import decide, derived_seed, same_layout, state_of_run
from resihp.ckpt.universal import load, read_meta
from resihp.parallel import Placement
from resihp.plan.plan import Plan
from resihp.plan.planner import Planner
from resihp.train.config import RunConfig
from resihp.train.engine import Engine
from resihp.train.inject import carried_faults
from resihp.train.planchange import PlanChange
from resihp.train.planning import paced_to, plan_at_start, planner_specs


def latest_checkpoint(cfg: RunConfig) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest good checkpoint of this job and model, and each newer one skipped, with why.

    The checkpoint is in the run's checkpoint folder (``RunConfig.ckpt_root``), verifies against
    its manifest and was written by this job (``cfg.job_id``) for this model; else it is the
    checkpoint the run resumed from (a relaunch that failed before its own first checkpoint goes
    back to where it started)."""
    found, skipped = newest_good(cfg.ckpt_root(), job_id=cfg.job_id, model_hash=cfg.model_hash())
    started = Path(cfg.checkpoint.resume) if cfg.checkpoint.resume else None
    if found is None and started is not None and step_of(started) >= 0 and started.is_dir():
        found = started
    return found, skipped


def layout_without(cfg: RunConfig, rank: int, resume: Path, out: Path) -> RunConfig | None:
    """The run config that continues without ``rank``'s replica (or stage); None if nothing is left.

    Args:
        cfg: the run's configuration.
        rank: the lost world rank.
        resume: the checkpoint to restart from.
        out: the relaunch's run folder."""
    dims = cfg.dims()
    lost = dims.coords(rank)
    if cfg.parallel.dp > 1:
        weights = cfg.weights()
        del weights[lost.dp_rank]
        changes = dict(dp=cfg.parallel.dp - 1, dp_weights=weights if sum(weights) > 0 else None)
    elif cfg.parallel.pp > 1:
        changes = dict(pp=cfg.parallel.pp - 1, layer_split=None)
    else:
        return None
    return relaunch_config(cfg, resume, out, **changes, inject=[], replan=[])


def relaunch_config(cfg: RunConfig, resume: Path, out: Path, **changes) -> RunConfig:
    """``cfg`` for a relaunch into ``out`` from checkpoint ``resume``, with ``changes``.

    A relaunch that keeps snapshots is a job of its own (job id ``<job>-r``): the first launch's
    keeper persists the slots of the world it was started for, so the relaunch's memory tier is a
    fresh one.

    Args:
        cfg: the run's configuration.
        resume: the checkpoint to restart from.
        out: the relaunch's run folder.
        **changes: configuration leaves to change, in flat form (``RunConfig.updated``)."""
    job = f"{cfg.job_id}-r" if cfg.snapshot_interval() and cfg.job_id else cfg.job_id
    return cfg.relaunched_into(out, **changes, resume=str(resume), job_id=job)


@dataclass
class Reformed:
    """The relaunch around a lost rank.

    It holds its run config (the survivors renumbered in order, a uniform launch layout over them
    and, scheduled at the first step, the planner's layout), the plan, each new rank's old world
    rank, and the planner's calibration to the steps measured before the loss
    (``planning.paced_to``; None without enough of them)."""

    cfg: RunConfig
    plan: Plan
    ranks: list[int]
    change: dict
    calibration: dict | None = None


def reform_around(
    cfg: RunConfig,
    rank: int,
    resume: Path,
    out: Path,
    time_limit_s: float = 2.0,
    measured: list[float] = (),
    compute: list[float] | None = None,
) -> Reformed | None:
    """The planner's layout over every rank but ``rank`` (its speed 0), to restart into.

    The job relaunches with the survivors only, loads checkpoint ``resume`` into a uniform launch
    layout and, before its first step, re-forms into the plan's process groups by a layout change
    (the live path: ``Engine.apply``), which reshards from memory. None where no survivor is left or
    the plan places none.

    Args:
        cfg: the run's configuration.
        rank: the lost world rank.
        resume: the checkpoint to restart from.
        out: the relaunch's run folder.
        time_limit_s: the planner's time limit, in seconds.
        measured: the step times of the launch layout before the loss, in seconds, which pace the
            planner's costs.
        compute: the same steps' ``planning.trace_compute_seconds`` (compute and transfers apart;
            None: not known)."""
    dims = cfg.dims()
    survivors = [r for r in range(dims.world_size) if r != rank]
    if not survivors:
        return None
    planner = Planner()
    cluster, model = planner_specs(cfg)
    current = plan_at_start(cfg, cluster, model)  # what ``measured`` ran under
    cluster, calibration = paced_to(cluster, model, current, list(measured), planner, compute)
    plan = planner.plan(cluster.with_speeds({rank: 0.0}), model, current, time_limit_s=time_limit_s)
    pipes = sorted((p for p in plan.pipelines if p.microbatches > 0), key=lambda p: p.dp_rank)
    new = {old: i for i, old in enumerate(survivors)}
    used = [r for p in pipes for s in p.stages for r in s.ranks]
    if not pipes or rank in used:
        return None
    first = int(resume.name.removeprefix("step")) + 1
    planned = PlanChange(
        dp_weights=tuple(float(p.microbatches) for p in pipes),
        layer_splits=tuple(tuple(s.n_layers for s in p.stages) for p in pipes),
        layout=Placement.of([[new[r] for r in s.ranks] for s in p.stages] for p in pipes),
    )
    change = {"step": first, "reason": {"kind": "fail-stop", "rank": rank}, **planned.to_dict()}
    n = len(survivors)
    pp = max(d for d in range(1, min(n, cfg.model.layers) + 1) if n % d == 0)
    ahead = [f.spec() for f in carried_faults(cfg.fault_list(), survivors, first)]
    relaunch = relaunch_config(
        cfg,
        resume,
        out,
        dp=n // pp,
        pp=pp,
        tp=1,
        layer_split=None,
        dp_weights=None,
        inject=ahead,
        replan=[change],
    )
    return Reformed(relaunch, plan, survivors, change, calibration)


# --- resuming from a checkpoint in any layout -----------------------------------------------------
def run_state(engine: Engine, cfg: RunConfig) -> dict:
    """This run's non-tensor state (``resihp.ckpt.reshard_rules``), as its checkpoints record it."""
    return state_of_run(
        cfg.train.seed,
        cfg.data.source,
        cfg.data.global_tokens,
        cfg.model.max_seq_len,
        cfg.data.budget,
        engine.weights,
        [[b - a for a, b in ranges] for ranges in engine.replica_ranges],
        cfg.train.lr,
        engine.placement.to_dict(),
    )


def checkpoint_meta(engine: Engine, cfg: RunConfig) -> dict:
    """What ``meta.json`` records beside the tensors."""
    dims = engine.dims  # the layout in force (None: replicas of different shapes, see state.layout)
    return {
        "dp": len(engine.pipelines),
        "pp": dims.pp if dims else None,
        "tp": dims.tp if dims else None,
        "layer_splits": [[b - a for a, b in ranges] for ranges in engine.replica_ranges],
        "model": cfg.model.to_dict(),
        "seed": cfg.train.seed,
        "source": cfg.data.source,
        "job_id": cfg.job_id,
        "model_hash": cfg.model_hash(),
        "state": run_state(engine, cfg),
    }


def rank_tensors(engine: Engine) -> dict[str, torch.Tensor]:
    """This rank's own tensors for a checkpoint: its torch generator state."""
    return {f"rng.torch.rank{engine.rank}": torch.get_rng_state()}


@dataclass
class Resumed:
    checkpoint: Path
    first_step: int
    decisions: list[dict]

    def to_dict(self) -> dict:
        return {
            "checkpoint": str(self.checkpoint),
            "first_step": self.first_step,
            "decisions": self.decisions,
        }


def resume(engine: Engine, cfg: RunConfig, path: Path, first_step: int) -> Resumed:
    """Collective: load a checkpoint into this rank's model and AdamW state, from any layout.

    Non-tensor state follows its rule (``resihp.ckpt.reshard_rules``: a refused change is an
    InputError naming the flag).

    Args:
        engine: this rank's engine.
        cfg: the run's configuration.
        path: the checkpoint (``resihp.ckpt.universal.resolve`` of ``--resume``).
        first_step: the step the run goes on from."""
    saved = read_meta(path)
    now = run_state(engine, cfg)
    decisions = decide(saved.get("state", {}), now, str(path))
    same = same_layout(saved.get("state", {}), now)
    extra = (
        {f"rng.torch.rank{engine.rank}": torch.empty_like(torch.get_rng_state())} if same else {}
    )
    load(path, engine.model, engine.optimizer, engine.tp, engine.model_cfg, extra)
    if same:
        torch.set_rng_state(extra[f"rng.torch.rank{engine.rank}"])
    else:
        c = engine.coords
        torch.manual_seed(derived_seed(cfg.train.seed, first_step, (c.dp_rank, c.stage, c.tp_rank)))
    return Resumed(path, first_step, decisions)
