"""``resihp profile import``: torch.profiler traces, Megatron timer logs and resihp run folders as
profiling logs that ``resihp predictor train`` reads."""

import gzip
import json
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import resihp
from resihp.cli import main
from resihp.errors import InputError
from resihp.model.config import GPTConfig
from resihp.model.gpt import DecoderBlock
from resihp.opstrace import read_run_folder
from resihp.perf.logs import read_profile_logs, with_features
from resihp.perf.megatron_log import MegatronBatch
from resihp.perf.predictor import MicroBatchPredictor, holdout_split
from resihp.perf.profile_import import ImportOptions, import_profiles
from resihp.perf.spans import Shape

SHAPE = dict(layers=1, hidden=64, heads=4, ffn_hidden=256)


def _packed(rng: np.random.Generator, n: int) -> list[list[int]]:
    """``n`` micro-batches of 1-4 sequences, 16 to 512 tokens in all."""
    out = []
    for _ in range(n):
        total = int(rng.integers(16, 513))
        parts = int(rng.integers(1, 5))
        cuts = np.sort(rng.choice(np.arange(1, total), size=min(parts, total) - 1, replace=False))
        out.append([int(x) for x in np.diff([0, *cuts, total])])
    return out


@pytest.fixture(scope="module")
def kineto_run(tmp_path_factory):
    """A real torch.profiler trace of a decoder layer trained on packed micro-batches, two rounds
    over them; the profiler's own events (in memory) and the micro-batches it ran."""
    torch.manual_seed(0)
    cfg = GPTConfig(max_seq_len=512, **SHAPE)
    layer = DecoderBlock(cfg)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
    batches = _packed(np.random.default_rng(0), 24)
    names = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            for mb, lens in enumerate(batches):
                x = torch.randn(sum(lens), cfg.hidden)
                tag = f"mb={mb} seq_lens={','.join(map(str, lens))}"
                with record_function(f"fwd {tag}"):
                    loss = layer(x, lens).square().mean()
                with record_function(f"bwd {tag}"):
                    loss.backward()
                opt.step()
                opt.zero_grad()
                names += [f"fwd {tag}", f"bwd {tag}"]
    path = tmp_path_factory.mktemp("kineto") / "trace.json"
    prof.export_chrome_trace(str(path))
    spans = [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.name in set(names)]
    return path, batches, names, spans


def test_kineto_import_rows_are_the_recorded_spans(kineto_run, tmp_path):
    path, batches, names, spans = kineto_run
    result = import_profiles([path], ImportOptions(shape=Shape(**SHAPE), device="cpu:test x1thr"))
    log = result.log
    assert len(log) == len(names) == 2 * 2 * len(batches)
    assert [
        f"{p} mb={m} seq_lens={','.join(map(str, s))}"
        for p, m, s in zip(log["phase"], log["mb_id"], log["seq_lens"])
    ] == names
    # each row's time is the profiler's own span of that name, in order
    assert log["time_s"].tolist() == pytest.approx([us / 1e6 for _, us in spans], abs=2e-6)
    assert (log[["layers", "hidden", "heads", "ffn_hidden"]] == pd.Series(SHAPE)).all().all()
    assert set(log["device"]) == {"cpu:test x1thr"} and (log["tp"] == 1).all()
    assert not result.notes


def test_kineto_import_trains_a_predictor_better_than_a_constant(kineto_run, tmp_path, capsys):
    path = kineto_run[0]
    out = tmp_path / "imported.parquet"
    assert (
        main_rc(
            [
                "profile",
                "import",
                str(path),
                "-o",
                str(out),
                "--layers",
                "1",
                "--hidden",
                "64",
                "--heads",
                "4",
                "--ffn-hidden",
                "256",
                "--device",
                "cpu:test x1thr",
            ]
        )
        == 0
    )
    assert "wrote 96 rows (48 fwd, 48 bwd" in capsys.readouterr().out
    log = read_profile_logs([out])  # the profiling-log contract, validated
    assert main_rc(["predictor", "train", str(out), "-o", str(tmp_path / "m"), "--json"]) == 0
    card = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert card["target"] == "time_s"
    # on the micro-batches it held out: the learned model against the training rows' median
    _, test_idx = holdout_split(log, 0.25, 0)
    train = log.drop(index=log.index[test_idx])
    for phase in ("fwd", "bwd"):
        rows = log.iloc[test_idx][log.iloc[test_idx]["phase"] == phase]
        median = train.loc[train["phase"] == phase, "time_s"].median()
        constant = float(np.mean(np.abs(median / rows["time_s"] - 1))) * 100
        assert card["held_out"][phase]["n"] == len(rows)
        assert card["held_out"][phase]["mape"] < constant, (phase, card["held_out"], constant)
    assert np.all(MicroBatchPredictor.load(tmp_path / "m").predict(log) > 0)


def main_rc(argv: list[str]) -> int:
    saved = sys.argv
    sys.argv = ["resihp", *argv]
    try:
        main()
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        sys.argv = saved
    return 0


def test_kineto_lengths_from_a_side_file_and_gzip(tmp_path):
    layer = DecoderBlock(GPTConfig(max_seq_len=64, **SHAPE))
    lens = {0: [40, 24], 1: [64]}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for mb, seqs in lens.items():
            with record_function(f"forward mb={mb}"):
                y = layer(torch.randn(sum(seqs), 64), seqs).sum()
            with record_function(f"backward mb={mb}"):
                y.backward()
    plain = tmp_path / "t.json"
    prof.export_chrome_trace(str(plain))
    packed = tmp_path / "t.pt.trace.json.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    side = tmp_path / "lengths.json"
    side.write_text(json.dumps({str(k): v for k, v in lens.items()}))
    log = import_profiles([packed], ImportOptions(shape=Shape(**SHAPE), lengths=side)).log
    assert log["seq_lens"].tolist() == [[40, 24], [40, 24], [64], [64]]
    assert log["phase"].tolist() == ["fwd", "bwd", "fwd", "bwd"]
    with pytest.raises(InputError, match=r"t.json: span 'forward mb=0' has no sequence lengths"):
        import_profiles([plain], ImportOptions(shape=Shape(**SHAPE)))


MEGATRON_LOG = """\
------------------------ arguments ------------------------
  ffn_hidden_size ................................. 4096
  global_batch_size ............................... 32
  hidden_size ..................................... 1024
  micro_batch_size ................................ 2
  num_attention_heads ............................. 16
  num_layers ...................................... 24
  pipeline_model_parallel_size .................... 2
  seq_length ...................................... 2048
  tensor_model_parallel_size ...................... 2
  data_parallel_size .............................. 2
-------------------- end of arguments ---------------------
 [2025-01-01 00:00:10] iteration       10/     100 | consumed samples:          320 |
(min, max) time across ranks (ms):
    forward-backward ...............................: (3040.02, 3040.17)
    forward-compute ................................: (1021.47, 1067.12)
    backward-compute ...............................: (1937.35, 1971.70)
 [2025-01-01 00:00:20] iteration       20/     100 | consumed samples:          640 |
max time across ranks (ms):
    forward-compute ................................: 1000.00
    backward-compute ................................: 2000.00
 iteration       30/     100 | time (ms) | forward-compute: 960.00 | backward-compute: 1920.00 |
"""


def test_megatron_timers_per_microbatch(tmp_path):
    path = tmp_path / "train.log"
    path.write_text(MEGATRON_LOG)
    log = import_profiles([path], ImportOptions(device="cuda:NVIDIA H100")).log
    # 32 / (2 x 2) = 8 micro-batches per iteration; a stage runs 24 / 2 layers
    fwd, bwd = log[log["phase"] == "fwd"], log[log["phase"] == "bwd"]
    assert fwd["time_s"].tolist() == pytest.approx([1.06712 / 8, 1.0 / 8, 0.96 / 8])
    assert bwd["time_s"].tolist() == pytest.approx([1.9717 / 8, 2.0 / 8, 1.92 / 8])
    assert fwd["step"].tolist() == [10, 20, 30]
    assert (log["seq_lens"].map(tuple) == (2048, 2048)).all()
    assert log[["layers", "hidden", "heads", "ffn_hidden", "tp"]].iloc[0].tolist() == [
        12,
        1024,
        16,
        4096,
        2,
    ]
    # the options win over the arguments block
    log = import_profiles(
        [path],
        ImportOptions(
            device="cuda:x",
            batch=MegatronBatch(seq_length=1024, micro_batch_size=1, microbatches=4),
        ),
    ).log
    assert log["seq_lens"].iloc[0] == [1024] and log["time_s"].iloc[0] == pytest.approx(1.06712 / 4)


def test_megatron_log_without_its_arguments_says_which_options(tmp_path):
    path = tmp_path / "train.log"
    path.write_text(MEGATRON_LOG.split("-------------------- end of arguments")[1])
    with pytest.raises(
        InputError,
        match=r"train.log: .*give --seq-length, --micro-batch-size, "
        r"--microbatches",
    ):
        import_profiles([path], ImportOptions(device="cuda:x"))


def test_run_folder_import_is_its_compute_rows(tmp_path):
    """A run recorded by ``resihp.attach``: each compute row with its lengths is one span."""
    torch.manual_seed(0)
    layer = DecoderBlock(GPTConfig(max_seq_len=256, **SHAPE))
    opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
    mon = resihp.attach(layer, optimizer=opt, out=tmp_path, name="tiny", **SHAPE)
    for lens in _packed(np.random.default_rng(1), 6):
        with mon.step(seq_lens=lens):
            layer(torch.randn(sum(lens), 64), lens).sum().backward()
            opt.step()
            opt.zero_grad()
    mon.close()
    trace, _ = read_run_folder(tmp_path)
    compute = trace[trace["optype"].isin(["forward-compute", "backward-compute"])]
    log = import_profiles([tmp_path], ImportOptions()).log
    assert len(log) == len(compute) == 12
    assert log["time_s"].tolist() == pytest.approx(compute["duration"].tolist())
    assert log["seq_lens"].tolist() == compute["seq_lens"].map(list).tolist()
    assert (log[["layers", "hidden", "heads", "ffn_hidden"]] == pd.Series(SHAPE)).all().all()
    assert set(log["model"]) == {"tiny"}
    with_features(log)  # the predictor's features can be computed on it


@pytest.mark.parametrize(
    "content,expected",
    [
        (b"hello\n", r"x.txt: not a torch.profiler trace \(.json\), a Megatron-LM log"),
        (b"{not json", r"x.txt: not a torch.profiler trace \(expected Chrome-trace JSON"),
        (
            b'{"traceEvents": 3}',
            r"x.txt: not a torch.profiler trace \(expected a JSON object with a "
            r"traceEvents list\)",
        ),
        (
            b'{"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": "step", "dur": 5}]}',
            r"x.txt: no micro-batch spans in this torch.profiler trace \(expected record_function",
        ),
    ],
)
def test_bad_inputs_are_one_line(tmp_path, capsys, content, expected):
    path = tmp_path / "x.txt"
    path.write_bytes(content)
    assert main_rc(["profile", "import", str(path), "-o", str(tmp_path / "o.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("resihp: error: ")
    assert re.search(expected, err), err
    assert not (tmp_path / "o.parquet").exists()


def test_missing_shape_and_bad_side_file(kineto_run, tmp_path):
    path = kineto_run[0]
    with pytest.raises(
        InputError,
        match=r"trace.json: the model's layers, hidden, heads, "
        r"ffn_hidden are not in this torch.profiler trace; give "
        r"them with --layers",
    ):
        import_profiles([path])
    side = tmp_path / "l.json"
    side.write_text('{"0": [3, -1]}')
    with pytest.raises(InputError, match=r"l.json: entry '0': expected a micro-batch id"):
        import_profiles([path], ImportOptions(lengths=side))
    with pytest.raises(InputError, match=r"no such file or folder"):
        import_profiles([Path(tmp_path / "none")])
