import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from resihp.errors import InputError
from resihp.paths import TRACES
from resihp.replay.failures import LLAMA3_DAYS, LLAMA3_GPUS, LLAMA3_INTERRUPTIONS, scenario_events
from resihp.replay.scenario import load_scenario, parse_duration
from tests.cli_helpers import run_resihp
from tests.replay_fixtures import BASE, write


def test_shipped_scenarios_load():
    names = sorted(p.stem for p in (TRACES / "scenarios").glob("*.yaml"))
    assert {
        "failstop-7b-256",
        "failslow-13b-256",
        "mixed-70b-256",
        "llama3-week-16k",
        "alibaba-7b-256",
    } <= set(names)
    families = set()
    for p in (TRACES / "scenarios").glob("*.yaml"):
        sc = load_scenario(p)
        families.add(sc.family)
        assert (
            sc.duration_s > 0
            and len(sc.cluster) >= sc.parallel.dp * sc.parallel.pp * sc.parallel.tp
        )
    assert {"fail-stop", "fail-slow", "mixed"} <= families


def test_durations():
    assert parse_duration("9h30m", "x") == 9.5 * 3600
    assert parse_duration(90, "x") == 90.0
    assert parse_duration("7d", "x") == 7 * 86400
    with pytest.raises(InputError, match="expected a duration"):
        parse_duration("soon", "x")


@pytest.mark.parametrize(
    "events, match",
    [
        (
            [{"at": "1h", "device": 64, "kind": "stop"}],
            r":\d+: events\[0\].device: unknown device 64",
        ),
        (
            [
                {"at": "2h", "device": 1, "kind": "slow", "factor": 2},
                {"at": "1h", "device": 2, "kind": "stop"},
            ],
            r"events\[1\].at: events must be in time order",
        ),
        (
            [
                {"at": "1h", "device": 1, "kind": "slow", "factor": 2},
                {"at": "2h", "device": 1, "kind": "stop"},
            ],
            r"events\[1\]: device 1 is already slow",
        ),
        (
            [{"at": "1h", "device": 1, "kind": "slow", "factor": 0.5}],
            r"factor: a slowdown factor is at least 1",
        ),
        (
            [{"at": "1h", "device": 1, "kind": "recover"}],
            r"device 1 recovers but is not slow or stopped",
        ),
        (
            [{"at": "1h", "device": 1, "kind": "melt"}],
            r"kind: expected one of slow, link, stop, recover",
        ),
        ([{"at": "9h", "device": 1, "kind": "stop"}], r"after the end of the scenario"),
    ],
)
def test_bad_events_name_the_line(tmp_path, events, match):
    path = write(tmp_path, events=events)
    with pytest.raises(InputError, match=match) as err:
        load_scenario(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_model_that_does_not_fit(tmp_path):
    model = {**BASE["model"], "layers": 80, "hidden": 8192, "heads": 64, "ffn_hidden": 28672}
    path = write(tmp_path, model=model, parallel={"dp": 32, "pp": 2, "tp": 1})
    with pytest.raises(InputError, match="does not fit the cluster"):
        load_scenario(path)


def test_other_bad_fields(tmp_path):
    with pytest.raises(InputError, match="dp\\*pp\\*tp = 128 devices but the cluster has 64"):
        load_scenario(write(tmp_path, parallel={"dp": 8, "pp": 2, "tp": 8}))
    with pytest.raises(InputError, match="unknown field"):
        load_scenario(write(tmp_path, colour="red"))
    with pytest.raises(InputError, match="generators\\[0\\].kind"):
        load_scenario(write(tmp_path, generators=[{"kind": "gremlins"}]))
    with pytest.raises(InputError, match="model.mlp: expected one of gelu, swiglu, got 'relu'"):
        load_scenario(write(tmp_path, model={**BASE["model"], "mlp": "relu"}))
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(InputError, match="bad.yaml:.*not valid YAML"):
        load_scenario(bad)


@pytest.mark.parametrize(
    "generator, match",
    [
        (
            {"kind": "greyhound", "per_day": 1e9},
            "generators.greyhound.per_day: about .* failures over the "
            "scenario's .* days, more than the 1,000,000 a replay takes",
        ),
        ({"kind": "llama3", "scale": 1e12}, "generators.llama3.scale: about"),
        (
            {"kind": "greyhound", "per_day": float("inf")},
            "per_day: expected a finite number >= 0, got inf",
        ),
    ],
)
def test_a_generator_rate_no_replay_could_finish_is_refused(tmp_path, generator, match):
    """1e9 failures a day hung the replay (1e5 took seconds)."""
    with pytest.raises(InputError, match=match):
        scenario_events(load_scenario(write(tmp_path, generators=[generator])))


def test_cli_bad_input_one_line_exit_2(tmp_path):
    path = write(tmp_path, events=[{"at": "1h", "device": 999, "kind": "stop"}])
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "replay", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown device 999" in lines[0] and "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "replay", str(write(tmp_path)), "--policies", "magic"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "unknown policy magic" in proc.stderr


def test_llama3_generator_rate(tmp_path):
    # 16,384 devices for 54 days must see about 419 interruptions (Poisson: within 4 sigma)
    path = write(
        tmp_path,
        cluster={"nodes": 2048, "gpus_per_node": 8},
        duration="54d",
        parallel={"dp": 256, "pp": 8, "tp": 8},
        generators=[{"kind": "llama3"}],
        model={**BASE["model"], "global_batch_tokens": 4194304},
    )
    sc = load_scenario(path)
    stops = [e for e in scenario_events(sc) if e.kind == "stop"]
    expect = (
        LLAMA3_INTERRUPTIONS * len(sc.cluster) / LLAMA3_GPUS * sc.duration_s / (LLAMA3_DAYS * 86400)
    )
    assert abs(len(stops) - expect) < 4 * np.sqrt(expect)
    causes = {e.cause for e in stops}
    assert any("Faulty GPU" in c for c in causes)


def test_generated_events_never_overlap(tmp_path):
    path = write(
        tmp_path,
        generators=[{"kind": "greyhound", "per_day": 200}, {"kind": "llama3", "scale": 300}],
        events=[{"at": "1h", "device": 3, "kind": "slow", "factor": 2}],
    )
    sc = load_scenario(path)
    state = {}
    for e in scenario_events(sc):
        if e.kind == "recover":
            assert state.pop(e.device) in ("slow", "stop")
        else:
            assert e.device not in state, e
            state[e.device] = e.kind
            assert e.kind != "slow" or 1.0 <= e.factor <= 10.0


def test_alibaba_generator_finds_the_job1_straggler(tmp_path):
    devices = list(range(0, 60, 6))
    path = write(
        tmp_path,
        duration="1d",
        generators=[
            {"kind": "alibaba", "job": 1, "devices": devices, "seconds_per_iteration": 288}
        ],
    )
    events = scenario_events(load_scenario(path))
    worst = max((e for e in events if e.kind == "slow"), key=lambda e: e.factor)
    assert worst.device == devices[6] and worst.factor > 1.2  # the publisher's worker 6


def test_swiglu_costs_a_third_matrix_in_flops_and_parameters(tmp_path):
    gelu = load_scenario(write(tmp_path, "g.yaml")).model
    swiglu = load_scenario(
        write(tmp_path, "s.yaml", model={**BASE["model"], "mlp": "swiglu"})
    ).model
    h, f = gelu.hidden, gelu.ffn_hidden
    assert swiglu.params_per_layer - gelu.params_per_layer == h * f + f
    from resihp.workload.flops import linear_flops_per_token

    extra = linear_flops_per_token(swiglu.shape()) - linear_flops_per_token(gelu.shape())
    assert extra == 2.0 * h * f


def test_a_thousand_year_replay_is_refused_with_the_limit(tmp_path):
    """Issue 20: durations are bounded with a clear limit."""
    with pytest.raises(InputError, match=r"duration 365,000 days is past the limit of 366 days"):
        load_scenario(write(tmp_path, duration="365000d"))
    assert load_scenario(write(tmp_path, duration="366d")).duration_s == 366 * 86400


# --- the scenario's keys, documented and checked from one list ---------------------------------
def _resihp(argv: list[str], capsys) -> tuple[int, str, str]:
    return run_resihp(argv, capsys)


def test_the_key_reference_is_up_to_date(capsys):
    from resihp.replay.scenario_schema import schema_markdown

    code, out, _ = _resihp(["replay", "--schema"], capsys)
    assert code == 0 and out == schema_markdown()
    assert (Path(__file__).parents[1] / "docs" / "scenario.md").read_text() == out, (
        "docs/scenario.md is stale: regenerate it with `resihp replay --schema > docs/scenario.md`"
    )


def test_every_accepted_key_is_documented(tmp_path):
    """An unknown key's error lists the allowed ones: exactly the documented keys."""
    from resihp.replay.scenario_schema import BY_NAME, TOP_LEVEL

    cases = {
        "": TOP_LEVEL,
        "model": BY_NAME["model"].names(),
        "parallel": BY_NAME["parallel"].names(),
        "costs": BY_NAME["costs"].names(),
        "replay": BY_NAME["replay"].names(),
        "cluster": BY_NAME["cluster"].names(),
    }
    for section, documented in cases.items():
        data = {**BASE}
        if section:
            data[section] = {**BASE.get(section, {}), "bogus": 1}
        else:
            data["bogus"] = 1
        path = tmp_path / f"{section or 'root'}.yaml"
        path.write_text(__import__("yaml").safe_dump(data, sort_keys=False))
        with pytest.raises(InputError, match="unknown field") as err:
            load_scenario(path)
        listed = str(err.value).split("(expected some of ")[1].rstrip(")").split(", ")
        assert set(listed) == documented, section


def test_the_example_replays(tmp_path, capsys):
    code, out, _ = _resihp(["replay", "--example"], capsys)
    assert code == 0 and out.startswith("# A replay scenario")
    path = tmp_path / "example.yaml"
    path.write_text(out)
    sc = load_scenario(path)
    assert sc.cluster.device_type == "cuda:NVIDIA H100" and len(sc.events) == 1 + 8 + 1
    code, out, err = _resihp(
        ["replay", str(path), "--policies", "resihp,checkpoint-restart", "--json"], capsys
    )
    assert code == 0, err
    doc = __import__("json").loads(out)
    assert [p["name"] for p in doc["policies"]] == ["resihp", "checkpoint-restart"]
    assert all(p["tokens_per_s"] > 0 for p in doc["policies"])


def test_the_plans_cluster_keys_are_accepted(tmp_path):
    """The cluster written as `resihp plan` reads it is the same cluster as the scenario form."""
    plan_form = {
        "device": {"memory_gb": 80, "tflops": 156, "hbm_gbs": 2039},
        "bandwidth": {"intra_node_gbs": 300, "inter_node_gbs": 25},
        "nodes": {"count": 8, "devices": 8},
    }
    old, new = (
        load_scenario(write(tmp_path, "old.yaml")),
        load_scenario(write(tmp_path, "new.yaml", cluster=plan_form)),
    )
    assert new.cluster.devices == old.cluster.devices
    assert (new.cluster.intra_node_gbs, new.cluster.inter_node_gbs) == (300, 25)
    with pytest.raises(InputError, match=r"cluster.speeds: a replay starts healthy"):
        load_scenario(write(tmp_path, "s.yaml", cluster={**plan_form, "speeds": {"3": 0.5}}))


def test_a_field_error_names_the_fields_line(tmp_path):
    path = write(tmp_path, model={**BASE["model"], "heads": "many"})
    lines = path.read_text().splitlines()
    line = next(i for i, t in enumerate(lines, 1) if t.strip().startswith("heads:"))
    with pytest.raises(InputError, match=rf"s.yaml:{line}: model.heads: expected an integer"):
        load_scenario(path)
