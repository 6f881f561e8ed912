"""The run configuration is one tree: the CLI, the worker and the checks read the same fields."""

from __future__ import annotations

import json

import pytest
import typer.main

from resihp.errors import InputError
from resihp.launch.commands import run_cmd
from resihp.options import leaves
from resihp.train.config import RunConfig
from resihp.train.worker import parse_args


def _run_params() -> dict:
    command = typer.main.get_command_from_info(
        typer.models.CommandInfo(callback=run_cmd),
        pretty_exceptions_short=True,
        rich_markup_mode=None,
    )
    return {p.name: p for p in command.params}


def test_every_cli_leaf_is_an_option_of_run_with_the_trees_default():
    params, defaults = _run_params(), RunConfig().flags()
    for leaf in leaves(RunConfig):
        if not leaf.on_cli:
            assert leaf.param not in params, leaf.dotted
            continue
        param = params[leaf.param]
        assert f"--{leaf.flag}" in param.opts, leaf.dotted
        if leaf.field.default is None or isinstance(defaults[leaf.param], list):
            continue  # decided from the other options / repeatable
        expected = defaults[leaf.param]
        assert (str(param.default) if leaf.name == "out" else param.default) == expected, (
            leaf.dotted
        )
        if leaf.meta("choices"):
            assert param.metavar == "|".join(leaf.meta("choices"))


def test_flat_and_nested_forms_round_trip(tmp_path):
    cfg = RunConfig.from_flags(
        dp=3,
        pp=1,
        tp=2,
        steps=7,
        max_len=256,
        layer_split=[4],
        dp_weights=[2.0, 1.0, 1.0],
        inject=["slow:rank=1,factor=3,step=2"],
        recovery="replica",
        hang_timeout=4.0,
        live=False,
    )
    assert (
        cfg.model.max_seq_len == 256 and cfg.parallel.tp == 2 and cfg.faults.hang_timeout_s == 4.0
    )
    assert cfg.model.hidden == RunConfig().model.hidden  # the run's default model, not GPTConfig's
    assert RunConfig.from_flags(**cfg.flags()) == cfg
    (tmp_path / "config.json").write_text(cfg.to_json())
    assert RunConfig.from_json(tmp_path / "config.json") == cfg
    assert cfg.updated(dp=2, dp_weights=None).parallel == cfg.parallel.__class__(
        dp=2, pp=1, tp=2, layer_split=[4]
    )


def test_the_worker_reads_the_same_flags(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(RunConfig.from_flags(dp=1, pp=2, steps=4).to_json())
    cfg = parse_args(
        [
            "--config",
            str(path),
            "--steps",
            "9",
            "--layer-split",
            "3,1",
            "--no-live",
            "--inject",
            "slow:rank=1,factor=2,step=1",
            "--timeout",
            "5",
        ]
    )
    assert cfg == RunConfig.from_flags(
        dp=1,
        pp=2,
        steps=9,
        layer_split=[3, 1],
        live=False,
        inject=["slow:rank=1,factor=2,step=1"],
        timeout=5.0,
    )


@pytest.mark.parametrize(
    "flat, message",
    [
        ({"dp": 0}, "parallel.dp (--dp): expected an integer >= 1, got 0"),
        ({"lr": 0.0}, "train.lr (--lr): expected a number > 0, got 0.0"),
        (
            {"schedule": "zigzag"},
            "parallel.schedule (--schedule): expected one of 1f1b, gpipe, got 'zigzag'",
        ),
        ({"heads": 3}, "model.hidden (--hidden): 128 must be divisible by model.heads (--heads) 3"),
        ({"tp": 3}, "parallel.tp (--tp 3): must divide model.heads (--heads 4)"),
        ({"live": "yes"}, "live.live (--live): expected true or false, got 'yes'"),
        ({"steps": 2.5}, "train.steps (--steps): expected an integer, got 2.5"),
        (
            {"dp_weights": [1.0]},
            "parallel.dp_weights (--dp-weights): expected 2 non-negative weights",
        ),
        (
            {"recovery": "replica", "dp": 1},
            "faults.recovery (--recovery replica): needs --dp 2 or more",
        ),
        ({"dpp": 2}, "run config: unknown option(s) dpp"),
    ],
)
def test_errors_name_the_field_and_its_flag(flat, message):
    with pytest.raises(InputError) as info:
        RunConfig.from_flags(**flat)
    assert str(info.value).startswith(message)


def test_a_config_file_with_an_unknown_or_misplaced_field_is_one_line(tmp_path):
    data = json.loads(RunConfig().to_json())
    data["parallel"]["dpp"] = 2
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match=r"config\.json: parallel: unknown field\(s\) dpp$"):
        RunConfig.from_json(path)
    path.write_text("{not json")
    with pytest.raises(InputError, match=r"config\.json: cannot read run config"):
        RunConfig.from_json(path)


def test_snapshots_every_step_by_default_only_with_restart_in_place():
    assert RunConfig().snapshot_interval() == 0
    assert RunConfig.from_flags(recovery="restart").snapshot_interval() == 1
    assert RunConfig.from_flags(recovery="restart", snapshot_every=0).snapshot_interval() == 0
    assert RunConfig.from_flags(snapshot_every=3).snapshot_interval() == 3


def test_plan_and_replay_help_name_every_policy_of_their_registries():
    from resihp.plan.baselines import POLICIES as PLAN
    from resihp.plan.commands import PLAN_POLICIES
    from resihp.replay.commands import REPLAY_POLICIES
    from resihp.replay.policies import POLICIES as REPLAY

    assert PLAN_POLICIES.split("|") == list(PLAN)
    assert REPLAY_POLICIES.split(", ") == list(REPLAY)
