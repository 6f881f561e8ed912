"""``resihp replay SCENARIO.yaml``: compare resilience policies on one scenario."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from resihp.errors import InputError
from resihp.options import SEED_MAX
from resihp.paths import resolve

# Imports inside the verbs are deferred for start-up time: ``resihp`` imports every commands module
# to build its help, and the verbs' work pulls in torch, lightgbm, OR-Tools or matplotlib.


# the names in replay.policies.POLICIES (a test keeps them equal), here for --help without the
# planner
REPLAY_POLICIES = (
    "resihp, checkpoint-restart, oobleck, recycle, greyhound, oobleck+greyhound, recycle+greyhound"
)


def replay_cmd(
    scenario: Annotated[
        Path | None,
        typer.Argument(
            help=(
                "Replay scenario YAML, or a shipped scenario by name (failslow-13b-256; see "
                "traces/scenarios/)"
            )
        ),
    ] = None,
    policies: Annotated[
        str,
        typer.Option(
            metavar="NAME,...",
            help=f"Comma-separated policies, of {REPLAY_POLICIES} (default: all)",
        ),
    ] = "",
    json_out: Annotated[bool, typer.Option("--json", help="Print the JSON summary")] = False,
    plot: Annotated[Path, typer.Option(help="Write throughput timelines to this PNG")] = None,
    seed: Annotated[
        int,
        typer.Option(
            min=0,
            max=SEED_MAX,
            help="Seed for failure generators, workload and noise (default: the scenario's)",
        ),
    ] = None,
    example: Annotated[
        bool, typer.Option("--example", help="Print a complete commented scenario and exit")
    ] = False,
    schema: Annotated[
        bool,
        typer.Option(
            "--schema",
            help="Print every scenario key, its form, default and meaning (Markdown) and exit",
        ),
    ] = False,
) -> None:
    """Replay a failure scenario under each policy through the one engine and compare throughput.
    \f
    Args:
        scenario: a scenario YAML file, or a shipped scenario's name.
        policies: comma-separated policy names (empty: all).
        json_out: print the JSON summary instead of the table.
        plot: a PNG path for the throughput timelines (None: no plot).
        seed: the seed of failure generators, workload and noise (None: the scenario's).
        example: print a complete commented scenario and exit.
        schema: print every scenario key as Markdown and exit.
    """
    from rich.console import Console

    from resihp.progress import progress_bar
    from resihp.replay.policies import make_policies
    from resihp.replay.report import plot as plot_timelines
    from resihp.replay.report import table
    from resihp.replay.run import compare
    from resihp.replay.scenario import load_scenario
    from resihp.replay.scenario_schema import example_yaml, schema_markdown

    if example or schema:
        typer.echo(example_yaml() if example else schema_markdown(), nl=False)
        return
    if scenario is None:
        raise InputError(
            "resihp replay: give a scenario YAML (`resihp replay --example` prints "
            "one; `--schema` lists its keys)"
        )
    if plot is not None and plot.suffix.lower() != ".png":
        raise InputError(f"--plot {plot}: expected a .png file name")
    if policies and not policies.replace(",", "").strip():
        raise InputError(
            f"--policies {policies!r}: expected one or more of {REPLAY_POLICIES}, comma-separated"
        )
    n = len(make_policies(policies or None))
    sc = load_scenario(resolve(scenario, "scenario"))
    total = int(sc.duration_s * n)
    with progress_bar(f"replaying {sc.name}", total, enabled=not json_out) as advance:
        result = compare(sc, policies or None, seed, on_progress=lambda t: advance(int(t)))
    doc = result.summary()
    if plot is not None:
        plot.parent.mkdir(parents=True, exist_ok=True)
        plot_timelines(doc, result.outcomes, result.events, str(plot))
    if json_out:
        print(json.dumps(doc))
    else:
        console = Console()
        if not console.is_terminal:  # piped: do not squeeze the table to 80 columns
            console = Console(width=160)
        console.print(table(doc))
        if plot is not None:
            typer.echo(f"wrote {plot}")


def register(app: typer.Typer) -> None:
    app.command("replay")(replay_cmd)
