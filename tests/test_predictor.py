import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from resihp.cli import app
from resihp.errors import InputError
from resihp.perf.logs import read_profile_logs
from resihp.perf.predictor import LinearBaseline, MicroBatchPredictor
from resihp.perf.training import evaluate_model, train_predictor
from resihp.workload.flops import TransformerShape


def test_profile_log_has_the_contract_columns(tiny_profile):
    log = read_profile_logs([tiny_profile])
    for col in ("device", "model", "layers", "hidden", "heads", "ffn_hidden", "tp", "phase",
                "seq_lens", "time_s"):
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
    """On the shipped CPU model: one long sequence costs more than many short ones of equal tokens."""
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
    log = pd.DataFrame({"seq_lens": seqs, "layers": 1, "hidden": 8, "heads": 2, "ffn_hidden": 8,
                        "tp": 1, "phase": "fwd", "time_s": 2e-4 * tokens + 3e-7 * sum_sq})
    coef = LinearBaseline().fit(log).coef_[(1, 8, 2, 8, 1, "fwd")]
    assert coef == pytest.approx([2e-4, 3e-7], rel=1e-6)


runner = CliRunner()


def _bad_log(tmp_path, **changes):
    row = {"device": "cpu:x", "model": "m", "layers": 1, "hidden": 8, "heads": 2, "ffn_hidden": 8,
           "tp": 1, "phase": "fwd", "seq_lens": [4, 4], "time_s": 0.01, "budget": 16}
    row.update(changes)
    path = tmp_path / "bad.parquet"
    pd.DataFrame([row] * 3).to_parquet(path)
    return path


@pytest.mark.parametrize("changes, message", [
    ({"time_s": float("nan")}, "column time_s row 0: expected a positive finite"),
    ({"seq_lens": [4, -1]}, "sequence lengths must be positive"),
    ({"seq_lens": [10, 10]}, "exceed the micro-batch budget 16"),
    ({"seq_lens": []}, "empty list"),
    ({"phase": "sideways"}, "column phase row 0"),
])
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
        (["predictor", "train", str(notparquet), "-o", str(tmp_path / "m")], "not a readable Parquet"),
        (["predictor", "train", str(tmp_path / "nope.parquet"), "-o", str(tmp_path / "m")], "no such"),
        (["predictor", "eval", "-m", str(model), str(tiny_profile)], "field format"),
        (["profile", "-o", str(tmp_path / "p.parquet"), "--lengths", str(tmp_path / "none.txt")],
         "cannot read lengths"),
    ]
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code != 0
        assert isinstance(result.exception, InputError), result.output
        assert message in str(result.exception) and "\n" not in str(result.exception)
