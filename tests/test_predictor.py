import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from resihp.cli import app
from resihp.errors import InputError
from resihp.perf.logs import read_profile_logs
from resihp.perf.predictor import LinearBaseline, MicroBatchPredictor
from resihp.perf.training import evaluate_model, train_predictor
from resihp.workload.flops import TransformerShape
from tests.cli_helpers import run_resihp


def test_profile_log_has_the_contract_columns(tiny_profile):
    log = read_profile_logs([tiny_profile])
    for col in (
        "device",
        "model",
        "layers",
        "hidden",
        "heads",
        "ffn_hidden",
        "tp",
        "phase",
        "seq_lens",
        "time_s",
    ):
        assert col in log.columns
    assert set(log["phase"]) == {"fwd", "bwd"}
    assert (log["time_s"] > 0).all()
    assert log["device"].iloc[0].startswith("cpu:")


def test_train_save_load_predict(tiny_profile, tmp_path):
    card = train_predictor([tiny_profile], tmp_path / "m", holdout=0.25)
    assert set(card["held_out"]) == {"fwd", "bwd"}
    assert card["training_data"]["logs"][0]["sha256"]
    loaded = MicroBatchPredictor.load(tmp_path / "m")
    log = read_profile_logs([tiny_profile])
    pred = loaded.predict(log)
    assert np.all(np.isfinite(pred)) and np.all(pred > 0)
    # the same answer through the plain-lengths entry point
    fwd = log[log["phase"] == "fwd"]
    shape = TransformerShape(1, 64, 2, 128)
    direct = loaded.predict_seq_lens(list(fwd["seq_lens"]), "fwd", shape)
    assert direct == pytest.approx(pred[(log["phase"] == "fwd").to_numpy()])
    result = evaluate_model(tmp_path / "m", [tiny_profile])
    assert result["fwd"]["n"] == len(fwd) and "linear_baseline" in result["bwd"]


def test_predictions_follow_attention_cost():
    """On the shipped CPU model: one long sequence costs more than many short ones of equal
    tokens."""
    from resihp.paths import MODELS

    directories = sorted(p for p in MODELS.iterdir() if (p / "card.json").exists())
    assert directories, "no predictor shipped in models/"
    predictor = MicroBatchPredictor.load(directories[0])
    card = predictor.card_
    shape = TransformerShape(2, 256, 4, 1024)
    long, short = predictor.predict_seq_lens([[1024], [64] * 16], "fwd", shape)
    assert long > short
    assert card["held_out"]["fwd"]["mape"] < card["held_out"]["fwd"]["linear_baseline"]["mape"]


def test_linear_baseline_recovers_exact_coefficients():
    rng = np.random.default_rng(1)
    seqs = [rng.integers(1, 200, size=rng.integers(1, 6)).tolist() for _ in range(50)]
    tokens = np.array([sum(s) for s in seqs])
    sum_sq = np.array([sum(x * x for x in s) for s in seqs])
    log = pd.DataFrame(
        {
            "seq_lens": seqs,
            "layers": 1,
            "hidden": 8,
            "heads": 2,
            "ffn_hidden": 8,
            "tp": 1,
            "phase": "fwd",
            "time_s": 2e-4 * tokens + 3e-7 * sum_sq,
        }
    )
    coef = LinearBaseline().fit(log).coef_[(1, 8, 2, 8, 1, "fwd")]
    assert coef == pytest.approx([2e-4, 3e-7], rel=1e-6)


runner = CliRunner()


def _bad_log(tmp_path, **changes):
    row = {
        "device": "cpu:x",
        "model": "m",
        "layers": 1,
        "hidden": 8,
        "heads": 2,
        "ffn_hidden": 8,
        "tp": 1,
        "phase": "fwd",
        "seq_lens": [4, 4],
        "time_s": 0.01,
        "budget": 16,
    }
    row.update(changes)
    path = tmp_path / "bad.parquet"
    pd.DataFrame([row] * 3).to_parquet(path)
    return path


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"time_s": float("nan")}, "column time_s row 0: expected a positive finite"),
        ({"seq_lens": [4, -1]}, "sequence lengths must be positive"),
        ({"seq_lens": [10, 10]}, "exceed the micro-batch budget 16"),
        ({"seq_lens": []}, "empty list"),
        ({"phase": "sideways"}, "column phase row 0"),
    ],
)
def test_bad_logs_give_one_line_errors(tmp_path, changes, message):
    with pytest.raises(InputError, match=message):
        read_profile_logs([_bad_log(tmp_path, **changes)])


def test_cli_errors_are_one_line(tmp_path, tiny_profile):
    empty = tmp_path / "empty.parquet"
    pd.DataFrame({"time_s": []}).to_parquet(empty)
    notparquet = tmp_path / "x.parquet"
    notparquet.write_text("hello")
    model = tmp_path / "old"
    model.mkdir()
    (model / "card.json").write_text(json.dumps({"format": "resihp-microbatch-predictor/0"}))
    cases = [
        (["predictor", "train", str(empty), "-o", str(tmp_path / "m")], "missing column"),
        (
            ["predictor", "train", str(notparquet), "-o", str(tmp_path / "m")],
            "not a readable Parquet",
        ),
        (
            ["predictor", "train", str(tmp_path / "nope.parquet"), "-o", str(tmp_path / "m")],
            "no such",
        ),
        (["predictor", "eval", "-p", str(model), str(tiny_profile)], "field format"),
        (
            ["profile", "-o", str(tmp_path / "p.parquet"), "--lengths", str(tmp_path / "none.txt")],
            "cannot read lengths",
        ),
    ]
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code != 0
        assert isinstance(result.exception, InputError), result.output
        assert message in str(result.exception) and "\n" not in str(result.exception)


# --- a profile robust to a drifting device (issue 12) ------------------------------------------
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from resihp.perf.profiler import measurement_order, noise_floor  # noqa: E402
from resihp.perf.registry import check_device, device_slug, find_for_device, resolve_model  # noqa: E402


@given(st.integers(1, 12), st.integers(1, 5), st.integers(0, 10_000))
def test_measurement_order_spreads_every_repeat(n, repeats, seed):
    order = measurement_order(n, repeats, np.random.default_rng(seed))
    assert sorted(order.tolist()) == sorted(list(range(n)) * repeats)
    if n >= 2:  # a repeat never follows itself, and each round holds every micro-batch once
        assert all(sorted(order[r * n : (r + 1) * n]) == list(range(n)) for r in range(repeats))
        assert not np.any(order[1:] == order[:-1])
    again = measurement_order(n, repeats, np.random.default_rng(seed))
    assert np.array_equal(order, again)


def test_profile_times_a_reference_between_shuffled_measurements(measured_profile):
    batches, result = measured_profile
    log, speed = result.log, result.speed
    assert len(log) == 2 * len(batches) and set(log["phase"]) == {"fwd", "bwd"}
    assert list(log["source"].unique()) == ["code", "changelog"]
    assert len(speed) == len(batches) * 3 + 1  # one reference before, between and after all
    assert (speed["ref_wall_s"] > 0).all() and speed["t_s"].is_monotonic_increasing
    for row in log.itertuples():
        times, refs, costs = map(np.asarray, (row.times_s, row.ref_times_s, row.costs))
        assert len(times) == len(costs) == 3
        assert costs == pytest.approx(times / refs)
        assert row.cost == pytest.approx(np.sort(costs)[:2].mean())  # the faster two of three
        assert row.time_s == pytest.approx(np.median(times))
        assert row.cpu_cost == pytest.approx(np.sort(np.asarray(row.cpu_costs))[:2].mean())
    # each reference time around a measurement is a mean of two timed references of the trace
    refs = speed["ref_wall_s"].to_numpy()
    around = set(np.round((refs[:-1] + refs[1:]) / 2, 12))
    assert all(round(r, 12) in around for rs in log["ref_times_s"] for r in rs)
    assert json.loads(log["reference"].iloc[0])["seq_lens"] == list(result.reference.seq_lens)
    # the device and software it was measured with travel in the log, into a model's card
    env = json.loads(log["env"].iloc[0])
    assert env["device"] == log["device"].iloc[0] and env["torch"] == torch.__version__


def test_a_card_names_the_machine_its_profiles_were_measured_on(tmp_path):
    """The shipped GPU model was trained on a CPU from profiles measured on a GPU: its card says
    which GPU, driver and versions measured them (the logs' env column)."""
    root = Path(__file__).resolve().parent.parent
    logs = sorted((root / "traces/profiles/cuda-nvidia-h200").glob("*.parquet"))
    assert len(logs) == 3
    card = train_predictor(logs, tmp_path / "m", seed=0)
    assert card["training_data"]["target"] == "cost"  # wall cost on a GPU
    (on,) = card["measured_on"]
    assert on["device"] == "cuda:NVIDIA H200" and on["driver"] and on["cuda"] and on["torch"]
    shipped = json.loads((root / "models/cuda-nvidia-h200/card.json").read_text())
    assert shipped["measured_on"] == card["measured_on"] and shipped["device"] == on["device"]


def test_noise_floor_before_and_after_normalisation():
    log = pd.DataFrame(
        {
            "phase": ["fwd", "fwd"],
            "times_s": [[1.0, 1.1, 0.9], [2.0, 2.0, 2.0]],
            "costs": [[1.0, 1.0, 1.0], [2.0, 2.2, 2.0]],
        }
    )
    floor = noise_floor(log)["fwd"]
    assert floor["raw_pct"] == pytest.approx((0.1 + 0.1) / 6 * 100)
    assert floor["normalised_pct"] == pytest.approx(0.1 / 6 * 100)


def test_a_normalised_model_converts_with_the_reference(tiny_profile, tmp_path):
    card = train_predictor([tiny_profile], tmp_path / "m")
    assert card["training_data"]["target"] == "cpu_cost"  # auto: the normalised CPU cost
    reference = card["reference"]
    assert reference["clock"] == "cpu" and reference["seconds"] > 0
    predictor = MicroBatchPredictor.load(tmp_path / "m")
    shape = TransformerShape(1, 64, 2, 128)
    seconds = predictor.predict_seq_lens([[256], [64] * 4], "fwd", shape)
    units = predictor._predict_features(predictor_features([[256], [64] * 4], shape))
    assert seconds == pytest.approx(units * reference["seconds"])
    slower = predictor.at_reference(2 * reference["seconds"])
    assert slower.predict_seq_lens([[256]], "fwd", shape) == pytest.approx(2 * seconds[:1])
    raw = train_predictor([tiny_profile], tmp_path / "raw", target="time_s")
    assert raw["reference"] is None
    with pytest.raises(InputError, match="learned raw seconds"):
        MicroBatchPredictor.load(tmp_path / "raw").at_reference(1.0)


def predictor_features(seq_lens, shape):
    from resihp.workload.features import flops_features, length_features

    lengths = length_features(seq_lens)
    shapes = pd.DataFrame({k: np.full(len(lengths), v) for k, v in shape.to_dict().items()})
    return pd.concat([lengths, flops_features(lengths, shapes, "fwd"), shapes], axis=1).assign(
        phase="fwd"
    )


def test_cross_source_split_holds_out_each_source(tiny_profile, tmp_path):
    card = train_predictor([tiny_profile], tmp_path / "m")
    cross = card["held_out_cross_source"]
    log = read_profile_logs([tiny_profile])
    assert set(cross["by_source"]) == set(log["source"]) == {"code", "text", "changelog"}
    for phase in ("fwd", "bwd"):
        per_source = [cross["by_source"][s][phase]["n"] for s in sorted(cross["by_source"])]
        assert sum(per_source) == cross[phase]["n"] == (log["phase"] == phase).sum()
        assert cross[phase]["worst_mape"] >= cross[phase]["mape"] > 0
        assert cross[phase]["linear_baseline"]["mape"] > 0


def _fake_model(root, name, device, created="2026-01-01T00:00:00Z"):
    (root / name).mkdir(parents=True)
    (root / name / "card.json").write_text(json.dumps({"device": device, "created": created}))
    return root / name


def test_registry_finds_the_model_of_this_device(tmp_path, monkeypatch):
    monkeypatch.setenv("RESIHP_MODELS", str(tmp_path))
    assert device_slug("cpu:AMD EPYC x1thr") == "cpu-amd-epyc-x1thr"
    _fake_model(tmp_path, "old", "cpu:Test Chip x1thr", "2026-01-01T00:00:00Z")
    new = _fake_model(tmp_path, "new", "cpu:Test Chip x1thr", "2026-02-01T00:00:00Z")
    _fake_model(tmp_path, "other", "cpu:Other Chip x1thr")
    assert find_for_device("cpu:Test Chip x1thr") == new
    assert resolve_model("auto", "cpu:Test Chip x1thr") == new
    assert resolve_model("other", "cpu:Test Chip x1thr") == tmp_path / "other"  # by name
    with pytest.raises(
        InputError,
        match=r"no micro-batch predictor for device 'cpu:Nope'.*"
        r"resihp predictor calibrate",
    ):
        resolve_model("auto", "cpu:Nope")
    with pytest.raises(InputError, match="not a predictor directory and not an installed model"):
        resolve_model("missing", "cpu:Test Chip x1thr")
    with pytest.raises(InputError, match="measured on 'cpu:Other Chip x1thr'.*calibrate"):
        check_device(tmp_path / "other", "cpu:Other Chip x1thr", "cpu:Test Chip x1thr")


def test_calibrate_makes_a_model_for_this_device(tmp_path, monkeypatch):
    """The real command end to end on a few micro-batches (its accuracy is the benchmark's job)."""
    from resihp.perf.device import device_name

    monkeypatch.setenv("RESIHP_MODELS", str(tmp_path / "models"))
    result = runner.invoke(
        app, ["predictor", "calibrate", "--microbatches", "6", "--repeats", "2", "--json"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    torch_device = device_name(__import__("torch").device("cpu"))
    assert summary["device"] == torch_device
    out = tmp_path / "models" / device_slug(torch_device)
    assert summary["model"] == str(out)
    assert sorted(p.name for p in (out / "profiles").glob("*.parquet")) == [
        "h128-l2.parquet",
        "h256-l2.parquet",
    ]
    assert (out / "profiles" / "h256-l2.speed.csv").exists()
    card = json.loads((out / "card.json").read_text())
    assert card["calibration"]["seconds"] > 0 and card["reference"]["seconds"] > 0
    assert set(card["held_out_cross_source"]["by_source"]) == {"code", "text", "changelog"}
    assert resolve_model("auto", torch_device) == out


def test_detector_takes_only_a_model_of_the_jobs_device(tiny_profile, tmp_path, monkeypatch):
    from resihp.detect.expected import load_expected

    monkeypatch.setenv("RESIHP_MODELS", str(tmp_path))
    train_predictor([tiny_profile], tmp_path / "mine")
    device = json.loads((tmp_path / "mine" / "card.json").read_text())["device"]
    shape = TransformerShape(1, 64, 2, 128)
    expected = load_expected("auto", shape, device)
    assert np.all(expected([[128], [32, 32]], "fwd") > 0)
    assert load_expected("mine", shape, device)([[128]], "bwd")[0] > 0
    with pytest.raises(InputError, match="no micro-batch predictor for device 'cpu:Elsewhere'"):
        load_expected("auto", shape, "cpu:Elsewhere")
    with pytest.raises(InputError, match="this job runs on 'cpu:Elsewhere'"):
        load_expected(str(tmp_path / "mine"), shape, "cpu:Elsewhere")


def test_speed_remeasures_the_reference_of_a_normalised_model(tiny_profile, tmp_path, monkeypatch):
    from resihp.perf.device import this_device

    monkeypatch.setenv("RESIHP_MODELS", str(tmp_path))
    train_predictor([tiny_profile], tmp_path / "mine")
    card = json.loads((tmp_path / "mine" / "card.json").read_text())
    card["device"] = this_device()  # as if calibrated on this machine (the log is a fixed one)
    (tmp_path / "mine" / "card.json").write_text(json.dumps(card))
    result = runner.invoke(app, ["predictor", "speed", "--repeats", "2", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["model"] == str(tmp_path / "mine") and doc["clock"] == "cpu"
    assert doc["reference_s"] > 0 and doc["slowdown"] == pytest.approx(
        doc["reference_s"] / card["reference"]["seconds"]
    )
    train_predictor([tiny_profile], tmp_path / "raw", target="time_s")
    result = runner.invoke(app, ["predictor", "speed", "-p", str(tmp_path / "raw")])
    assert isinstance(result.exception, InputError)


def test_faster_half_mean_leaves_out_the_slowed_repeats():
    from resihp.perf.profiler import faster_half_mean

    assert faster_half_mean(np.array([1.0, 3.0, 1.2])) == pytest.approx(1.1)
    assert faster_half_mean(np.array([2.0, 1.0])) == 1.0
    assert faster_half_mean(np.array([5.0])) == 5.0
    assert faster_half_mean(np.array([4.0, 1.0, 2.0, 9.0, 3.0])) == pytest.approx(2.0)


def test_a_damaged_model_file_is_one_line_not_an_abort(tiny_profile, tmp_path):
    train_predictor([tiny_profile], tmp_path / "m")
    fwd = tmp_path / "m" / "fwd.lgb.txt"
    text = fwd.read_bytes()
    fwd.write_bytes(text[: len(text) // 2])  # truncated: LightGBM itself would abort the process
    with pytest.raises(InputError, match="does not match the sha256"):
        MicroBatchPredictor.load(tmp_path / "m")
    card = json.loads((tmp_path / "m" / "card.json").read_text())
    del card["files"]  # a card written before checksums: the file's own end markers are checked
    (tmp_path / "m" / "card.json").write_text(json.dumps(card))
    with pytest.raises(InputError, match="not a complete LightGBM model"):
        MicroBatchPredictor.load(tmp_path / "m")
    fwd.write_bytes(text)
    assert (
        MicroBatchPredictor.load(tmp_path / "m").predict_seq_lens(
            [[64]], "fwd", TransformerShape(1, 64, 2, 128)
        )[0]
        > 0
    )


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda card: [card], "expected a JSON object"),
        (
            lambda card: {k: v for k, v in card.items() if k != "base_coef"},
            "field base_coef: expected per phase",
        ),
        (
            lambda card: {**card, "base_coef": {**card["base_coef"], "fwd": "x"}},
            "field base_coef: expected",
        ),
        (lambda card: {**card, "device": 3}, "field device: expected the device's name"),
    ],
)
def test_a_damaged_card_is_one_line(tiny_profile, tmp_path, damage, message):
    """Each was a KeyError, AttributeError or NumPy error from load."""
    train_predictor([tiny_profile], tmp_path / "m")
    card = json.loads((tmp_path / "m" / "card.json").read_text())
    (tmp_path / "m" / "card.json").write_text(json.dumps(damage(card)))
    with pytest.raises(InputError, match=message):
        MicroBatchPredictor.load(tmp_path / "m")


def test_a_file_where_a_model_directory_goes_is_one_line(tiny_profile, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(InputError, match="not a predictor directory"):
        MicroBatchPredictor.load(tmp_path / "afile")
    with pytest.raises(InputError, match="afile: cannot make the model directory"):
        train_predictor([tiny_profile], tmp_path / "afile")
    assert (tmp_path / "afile").read_text() == "x"


def test_a_log_too_small_to_hold_out_from_is_one_line(tiny_profile, tmp_path):
    log = pd.read_parquet(tiny_profile)
    one = log[log["mb_id"] == log["mb_id"].iloc[0]] if "mb_id" in log.columns else log.iloc[:2]
    one.to_parquet(tmp_path / "one.parquet")
    with pytest.raises(InputError, match="too few to hold out"):
        train_predictor([tmp_path / "one.parquet"], tmp_path / "m")


def test_out_is_the_option_and_output_still_works(tiny_profile, tmp_path):
    for flag in ("-o", "--out", "--output"):
        result = runner.invoke(
            app,
            [
                "predictor",
                "train",
                str(tiny_profile),
                flag,
                str(tmp_path / flag.strip("-")),
                "--json",
            ],
        )
        assert result.exit_code == 0, result.output
        assert (tmp_path / flag.strip("-") / "card.json").exists()
    result = runner.invoke(app, ["predictor", "train", str(tiny_profile)])
    assert isinstance(result.exception, InputError) and "-o/--out" in str(result.exception)


def test_a_gap_in_the_cost_column_is_an_error_not_another_target(tiny_profile, tmp_path):
    """One NaN in cpu_cost made ``--target auto`` learn the wall-clock cost instead (48% held-out
    MAPE against 4%), without a word; an all-empty column still means "not measured here"."""
    log = pd.read_parquet(tiny_profile)
    gap = log.copy()
    gap.loc[gap.index[3], "cpu_cost"] = np.nan
    gap.to_parquet(tmp_path / "gap.parquet")
    with pytest.raises(
        InputError, match="gap.parquet: column cpu_cost row 3: expected a positive finite"
    ):
        train_predictor([tmp_path / "gap.parquet"], tmp_path / "m")
    empty = log.assign(cpu_cost=np.nan)
    empty.to_parquet(tmp_path / "empty.parquet")
    card = train_predictor([tmp_path / "empty.parquet"], tmp_path / "m2")
    assert card["target"] != "cpu_cost", card["target"]


# --- a predictor measured on another device than the cluster's ----------------------------------
from resihp.perf.registry import device_matches  # noqa: E402


def _plan(argv: list[str], capsys) -> tuple[int, str, str]:
    """``resihp plan ...``: (exit code, stdout, stderr)."""
    return run_resihp(["plan", *argv], capsys)


def test_device_names_match_by_kind_and_model():
    assert device_matches("cuda:NVIDIA H100 80GB HBM3", "cuda:NVIDIA H100")
    assert device_matches("cuda:NVIDIA H100 80GB HBM3", "cuda")
    assert device_matches("cpu:AMD EPYC x1thr", "cpu")
    assert not device_matches("cpu:AMD EPYC x1thr", "cuda:NVIDIA H100")
    assert not device_matches("cuda:NVIDIA H200", "cuda:NVIDIA H100")


def test_plan_refuses_a_cpu_predictor_for_a_gpu_cluster(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RESIHP_MODELS", str(tmp_path / "models"))
    _fake_model(tmp_path / "models", "mine", "cpu:Some CPU x1thr")
    code, _, err = _plan(
        ["--cluster", "h100-8", "--model", "gpt-7b", "--predictor", "auto"], capsys
    )
    assert code == 2 and err.count("\n") == 1, err
    assert "h100-8.yaml: no predictor measured on its devices ('cuda:NVIDIA H100'" in err
    code, _, err = _plan(
        [
            "--cluster",
            "h100-8",
            "--model",
            "gpt-7b",
            "--predictor",
            str(tmp_path / "models" / "mine"),
        ],
        capsys,
    )
    assert code == 2 and err.count("\n") == 1, err
    assert "measured on 'cpu:Some CPU x1thr', but" in err and "runs 'cuda:NVIDIA H100'" in err


def test_plan_flags_a_cluster_that_does_not_name_its_device(tmp_path, monkeypatch, capsys):
    from resihp.paths import resolve

    monkeypatch.setenv("RESIHP_MODELS", str(tmp_path / "none"))
    text = resolve("cpu-4", "cluster").read_text()
    assert "type: cpu, " in text
    untyped = tmp_path / "cpu4.yaml"
    untyped.write_text(text.replace("type: cpu, ", ""))
    args = [
        "--model",
        "cpu-small",
        "--predictor",
        "cpu-amd-epyc-x1thr",
        "--time-limit",
        "1",
        "--json",
    ]
    code, out, err = _plan(["--cluster", str(untyped), *args], capsys)
    assert code == 0 and json.loads(out)["pipelines"]
    assert err.count("\n") == 1 and "cpu4.yaml does not name its devices (device.type)" in err
    assert "measured on 'cpu:AMD EPYC x1thr'" in err
    code, out, err = _plan(["--cluster", "cpu-4", *args], capsys)  # a cpu cluster, a cpu model
    assert code == 0 and err == ""


def test_a_cluster_device_type_is_a_name():
    from resihp.plan.specs import ClusterSpec

    spec = {"nodes": {"count": 1, "devices": 2}, "device": {"memory_gb": 8, "tflops": 1}}
    assert ClusterSpec.from_dict(spec).device_type == ""
    typed = ClusterSpec.from_dict(
        {**spec, "device": {**spec["device"], "type": "cuda:NVIDIA A100"}}
    )
    assert typed.device_type == "cuda:NVIDIA A100"
    assert ClusterSpec.from_dict(typed.to_dict()).device_type == "cuda:NVIDIA A100"
    with pytest.raises(
        InputError,
        match=r"cluster: device: field 'type' must name the kind of "
        r"device as a predictor card does",
    ):
        ClusterSpec.from_dict({**spec, "device": {**spec["device"], "type": 3}})
