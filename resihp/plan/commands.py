"""``resihp plan``: plan a cluster and model (optionally re-plan from the plan in force)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from resihp.errors import InputError
from resihp.paths import resolve

# Imports inside the verbs are deferred for start-up time: ``resihp`` imports every commands module
# to build its help, and the verbs' work pulls in torch, lightgbm, OR-Tools or matplotlib.


def parse_speeds(items: list[str] | None) -> dict[str, float]:
    """``--speed 5=0.4 --speed node3/2=0`` -> {"5": 0.4, "node3/2": 0.0}."""
    out: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        try:
            if not sep or not key:
                raise ValueError
            out[key.strip()] = float(value)
        except ValueError:
            raise InputError(
                f"--speed {item!r}: expected DEVICE=SPEED, e.g. 5=0.4 or node0/3=0 "
                "(speed 1 healthy, 0 dead)"
            ) from None
    return out


def plan_predictor(which: str, cluster, where: str) -> tuple[Path, str | None]:
    """The predictor ``--predictor`` names for ``cluster``, and a warning or None.

    The warning says the cluster does not name what its devices are. One measured on another kind
    of device than the cluster's ``device.type`` is refused: its times are not that device's.

    Args:
        which: the ``--predictor`` value (a folder, an installed model's name, or ``auto``).
        cluster: the ``ClusterSpec`` planned for.
        where: what messages name as the cluster (its file).
    """
    from resihp.perf.device import this_device
    from resihp.perf.registry import (
        CALIBRATE_HINT,
        card_device,
        device_matches,
        find_for_device,
        find_matching,
        installed_models,
        resolve_model,
    )

    wanted = cluster.device_type
    if not wanted:
        path = resolve_model(which, this_device())
        return path, (
            f"warning: {where} does not name its devices (device.type), so the "
            f"predictor {path.name}, measured on {card_device(path)!r}, prices them as "
            "that device"
        )
    if which == "auto":
        here = this_device()  # this machine's own predictor first, where it is of that kind
        path = (find_for_device(here) if device_matches(here, wanted) else None) or find_matching(
            wanted
        )
        if path is None:
            have = sorted({m.device for m in installed_models()})
            raise InputError(
                f"{where}: no predictor measured on its devices ({wanted!r}, "
                f"device.type; installed: {'; '.join(have) or 'none'}); train one "
                "from a profile of that device (`resihp profile import`, `resihp "
                "predictor train`)"
            )
    else:
        path = resolve_model(which, wanted)
    measured = card_device(path)
    if not device_matches(measured, wanted):
        raise InputError(
            f"--predictor {which}: measured on {measured!r}, but {where} runs "
            f"{wanted!r} (its device.type); a predictor holds only on the device it "
            f"was measured on ({CALIBRATE_HINT}, or train one from that device's "
            "profile)"
        )
    return path, None


def plan_table(plan, console: Console) -> None:
    table = Table(
        title=f"{plan.policy} plan: layout tp={plan.layout.tp} pp={plan.layout.pp} "
        f"dp={plan.layout.dp}"
    )
    budgets = any(p.tokens is not None for p in plan.pipelines)
    for col in (
        "dp",
        "home",
        "micro-batches",
        *(["tokens"] if budgets else []),
        "stages: ranks [layers)",
    ):
        table.add_column(col)
    for p in plan.pipelines:
        stages = "  ".join(
            f"{','.join(map(str, s.ranks)) if s.tp <= 4 else f'{s.ranks[0]}..{s.ranks[-1]}'}"
            f"[{s.layers[0]},{s.layers[1]})"
            for s in p.stages
        )
        tokens = [str(p.tokens if p.tokens is not None else "-")] if budgets else []
        table.add_row(str(p.dp_rank), str(p.home), str(p.microbatches), *tokens, stages)
    console.print(table)
    console.print(
        f"step {plan.step_time_s:.3f} s   {plan.tokens_per_s:,.0f} tokens/s   "
        f"{plan.bound_ratio:.3f} of the capacity bound ({plan.capacity_tokens_per_s:,.0f} "
        f"tokens/s)   migration {plan.migration_s:.2f} s   excluded {len(plan.excluded)} ranks   "
        f"solver {plan.solver.get('status')} in {plan.solver.get('solve_s', math.nan):.2f} s"
    )


# the names in plan.baselines.POLICIES (a test keeps them equal), here for --help without OR-Tools
PLAN_POLICIES = "resihp|uniform|resihp-heuristic|drop-replica"


def plan_cmd(
    cluster: Annotated[
        Path,
        typer.Option(
            help=(
                "Cluster YAML (nodes, devices, bandwidth), or a shipped cluster by name "
                "(h100-8-degraded)"
            )
        ),
    ],
    model: Annotated[
        Path,
        typer.Option(
            help="Model YAML (shape, batch, schedule), or a shipped model by name (gpt-7b)"
        ),
    ],
    current: Annotated[
        Path | None, typer.Option(help="Plan in force (JSON) to re-plan from")
    ] = None,
    speed: Annotated[
        list[str] | None,
        typer.Option(
            help=(
                "Override a device's speed: DEVICE=SPEED (rank or node/index; 0 = dead); repeatable"
            )
        ),
    ] = None,
    policy: Annotated[
        str, typer.Option(metavar=PLAN_POLICIES, help="The planner, or a baseline of it")
    ] = "resihp",
    time_limit: Annotated[float, typer.Option(help="Solver time limit, seconds")] = 5.0,
    horizon: Annotated[
        float, typer.Option(help="Steps over which a state migration is amortised")
    ] = 100.0,
    token_budgets: Annotated[
        bool,
        typer.Option(
            "--token-budgets",
            help="Also balance replicas by unequal token shares "
            "(per-replica micro-batch budgets), not only whole micro-batches",
        ),
    ] = False,
    predictor: Annotated[
        str | None,
        typer.Option(
            help="Learned micro-batch predictor as the cost model: a folder, an installed model's "
            "name, or auto (the newest one measured on the cluster's device.type, else on this "
            "machine); one measured on another device than the cluster's is refused"
        ),
    ] = None,
    out: Annotated[Path | None, typer.Option("-o", "--out", help="Write the plan JSON")] = None,
    output: Annotated[
        Path | None, typer.Option("--output", hidden=True)
    ] = None,  # old spelling of --out
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON")] = False,
) -> None:
    """Plan TP groups, layer split and micro-batches around slow and dead devices.
    \f
    Args:
        cluster: cluster YAML (nodes, devices, bandwidth), or a shipped cluster by name
            (h100-8-degraded).
        model: model YAML (shape, batch, schedule), or a shipped model by name (gpt-7b).
        current: plan in force (JSON) to re-plan from.
        speed: override a device's speed: DEVICE=SPEED (rank or node/index; 0 = dead); repeatable.
        policy: the planner, or a baseline of it.
        time_limit: solver time limit, seconds.
        horizon: steps over which a state migration is amortised.
        token_budgets: also balance replicas by unequal token shares (per-replica micro-batch
            budgets), not only whole micro-batches.
        predictor: learned micro-batch predictor as the cost model: a folder, an installed model's
            name, or auto (the newest one measured on the cluster's device.type, else on this
            machine); one measured on another device than the cluster's is refused.
        out: write the plan JSON.
        output: the old spelling of ``out``.
        json_out: print the plan as JSON.
    """
    from resihp.plan.baselines import make_policy
    from resihp.plan.cost import AnalyticCost, PredictorCost
    from resihp.plan.plan import Plan
    from resihp.plan.specs import ClusterSpec, ModelSpec

    if not time_limit > 0:
        raise InputError(f"--time-limit: must be positive seconds, got {time_limit}")
    if not horizon >= 1:
        raise InputError(f"--horizon: must be at least 1 step, got {horizon}")
    cluster = resolve(cluster, "cluster")
    model = resolve(model, "model")
    spec = ClusterSpec.from_yaml(cluster).with_speeds(parse_speeds(speed), where="--speed")
    if predictor:
        predictor, warning = plan_predictor(predictor, spec, str(cluster))
        if warning:
            print(f"resihp: {warning}", file=sys.stderr)
    mspec = ModelSpec.from_yaml(model)
    cost = PredictorCost.load(str(predictor)) if predictor else AnalyticCost()
    planner = make_policy(policy, cost, horizon_steps=horizon, token_budgets=token_budgets)
    now = Plan.load(current) if current else None
    if now is not None:
        now.check_against(spec, where=str(current))
    result = planner.plan(spec, mspec, now, time_limit_s=time_limit)
    out = out or output
    if out:
        result.save(out)
    if json_out:
        print(json.dumps(result.to_dict()))
    else:
        plan_table(result, Console(file=sys.stdout))


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_cmd)
