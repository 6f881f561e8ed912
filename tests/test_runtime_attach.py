import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import resihp
from resihp.detect.config import DetectorConfig
from resihp.errors import InputError
from resihp.opstrace import read_meta, read_run_folder
from resihp.train.attach import DeviceFault
from resihp.train.follow import follow
from resihp.train.nodes import free_port

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize(
    "device,gpu_timing",
    [
        ("cpu", "events"),
        pytest.param("cuda", "events", marks=CUDA),
        pytest.param("cuda", "sync", marks=CUDA),
    ],
)
def test_attach_records_ops_without_changing_training(tmp_path, device, gpu_timing):
    """On a GPU, durations come from CUDA events (rows of a step recorded at the next step or at
    close) or from synchronising around each op; both record the same rows."""
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50)).to(device)  # noqa: E731
    plain, watched = make(), make()
    watched.load_state_dict(plain.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, watched)]
    mon = resihp.attach(
        watched, optimizer=opts[1], out=tmp_path, model_name="toy", gpu_timing=gpu_timing
    )
    losses = {0: [], 1: []}
    for step in range(3):
        ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(step)).to(device)
        for i, (model, opt) in enumerate(zip((plain, watched), opts)):
            ctx = mon.step(seq_lens=[9, 9]) if i else torch.enable_grad()
            with ctx:
                loss = nn.functional.cross_entropy(model(ids).reshape(-1, 50), ids.reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses[i].append(loss.item())
    mon.close()
    assert losses[0] == losses[1]
    trace = mon.trace()
    assert sorted(trace.optype.unique()) == [
        "backward-compute",
        "forward-compute",
        "optimizer",
        "step",
    ]
    assert (trace.groupby("step").size() == 4).all() and trace.step.nunique() == 3
    assert (trace.duration > 0).all() and np.isfinite(trace.duration).all()
    fwd = trace[trace.optype == "forward-compute"]
    assert fwd.seq_lens.map(list).tolist() == [[9, 9]] * 3 and (fwd.tokens == 18).all()
    # the backward ends before the optimizer starts, the forward before the backward
    for _, rows in trace.groupby("step"):
        t = rows.set_index("optype")
        assert (
            t.start_ts["forward-compute"]
            <= t.start_ts["backward-compute"]
            <= t.start_ts["optimizer"]
        )
    assert (tmp_path / "ranks" / "rank0.jsonl").exists() and (
        tmp_path / "ops.rank0.parquet"
    ).exists()
    meta, extra = read_meta(tmp_path / "job.yaml")
    assert meta.world_size == 1 and extra["model_name"] == "toy"
    # hooks are gone after close
    assert not watched._forward_hooks and not watched._forward_pre_hooks


class _SlowAfter(nn.Module):
    """A tiny model whose forward and backward take ``factor`` times longer from a given step
    (sleeps proportional to the work: a fixed cost per token)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(50, 8), nn.Linear(8, 50)
        self.factor = 1.0

    def forward(self, ids):
        time.sleep(1e-3 * ids.numel() * self.factor)
        return _SleepBack.apply(self.out(self.emb(ids)), 2e-3 * ids.numel() * self.factor)


class _SleepBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


# conservative thresholds: this loop's timings are sleeps on a shared machine, and a one-process
# job is compared with itself over time
QUIET = DetectorConfig(sensitivity=0.5)


def _loop(mon, model, opt, steps=60, slow_from=None, factor=5.0):
    rng = np.random.default_rng(0)
    for step in range(steps):
        if slow_from is not None and step >= slow_from:
            model.factor = factor
        n = int(rng.integers(8, 24))
        ids = torch.randint(0, 50, (1, n))
        with mon.step(seq_lens=[n]):
            loss = nn.functional.cross_entropy(model(ids).reshape(-1, 50), ids.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()


def test_in_process_detection_reports_the_straggler_and_calls_back(tmp_path):
    model = _SlowAfter()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    mon = resihp.attach(
        model, optimizer=opt, out=tmp_path, detect=True, on_event=seen.append, detector_config=QUIET
    )
    _loop(mon, model, opt, steps=60, slow_from=30)  # room for the noise of a loaded machine
    mon.close()
    report = mon.report()
    assert report["steps"] == 60
    assert [(s["rank"], s["kind"]) for s in report["stragglers"]] == [(0, "fail-slow")]
    s = report["stragglers"][0]
    assert 27 <= s["onset_step"] <= 33 and s["detected_step"] <= 59
    assert abs(s["slowdown"] - 5.0) / 5.0 < 0.3
    assert [e["rank"] for e in seen] == [0]
    assert json.loads((tmp_path / "live.json").read_text())["stragglers"]
    assert "fail-slow on rank 0" in (tmp_path / "logs" / "rank0.log").read_text()


def test_on_fault_stop_raises_out_of_the_step(tmp_path):
    model = _SlowAfter()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = resihp.attach(model, optimizer=opt, out=tmp_path, on_fault="stop", detector_config=QUIET)
    with pytest.raises(DeviceFault) as err:
        _loop(mon, model, opt, steps=60, slow_from=30)
    mon.close()
    assert err.value.event["rank"] == 0 and err.value.event["kind"] == "fail-slow"
    assert err.value.event["onset_step"] >= 28 and mon._step < 59  # stopped before the loop ended


def test_attach_refuses_an_unknown_on_fault(tmp_path):
    with pytest.raises(InputError, match="on_fault"):
        resihp.attach(nn.Linear(2, 2), out=tmp_path, on_fault="pause")
    with pytest.raises(InputError, match="gpu_timing must be one of events, sync"):
        resihp.attach(nn.Linear(2, 2), out=tmp_path, gpu_timing="cupti")


def test_follow_waits_for_the_job_and_detect_reads_the_run_folder(tmp_path):
    out = tmp_path / "job"
    result = {}
    waiter = threading.Thread(target=lambda: result.update(follow(out, timeout_s=60, poll_s=0.1)))
    waiter.start()
    time.sleep(0.3)  # the side process starts first: no job.yaml yet
    model = _SlowAfter()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = resihp.attach(model, optimizer=opt, out=out)
    _loop(mon, model, opt, steps=25)
    mon.close()
    waiter.join(60)
    assert result["steps"] == 25
    df, meta = read_run_folder(out)
    assert meta == out / "job.yaml" and df.step.nunique() == 25
    with pytest.raises(InputError, match="no job.yaml"):
        follow(tmp_path / "never", timeout_s=0.3, poll_s=0.1)


@pytest.mark.parametrize(
    "store,says",
    [("127.0.0.1:notaport", "expected HOST:PORT"), (None, "cannot reach the job's store")],
)
def test_follow_names_its_own_store_option_in_errors(store, says):
    """A bad or unreachable ``resihp follow --store`` is one line naming ``--store`` (it named
    ``resihp run``'s ``--rdzv-endpoint``, an option follow does not have)."""
    store = store or f"127.0.0.1:{free_port()}"  # nothing listens there
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.cli", "follow", "--store", store, "--start-timeout", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"resihp: error: --store {store!r}" if "HOST" in says else f"resihp: error: --store {store}"
    ), lines
    assert says in lines[0], lines


@pytest.mark.slow
def test_attach_under_torchrun_uses_the_control_plane_and_follow_reads_it_from_the_store(tmp_path):
    """A user's own 2-rank torchrun job with resihp attached: heartbeats and step records go over
    torchrun's agent store (no per-rank stream files); rank 0 writes the run folder; a follower
    with only the store's address sees every step."""

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    example = Path(__file__).resolve().parent.parent / "examples" / "ddp_straggler.py"
    # torchrun's static rendezvous: its agent hosts the workers' store at the master port, so the
    # follower can be started first and wait for the job (it registers, and the job waits for it)
    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resihp.cli",
            "follow",
            "--store",
            f"127.0.0.1:{port}",
            "--json",
            "--start-timeout",
            "120",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    # beside the job, the follower yields the CPU to it (nice 10 by default): it must not slow the
    # ranks it times
    deadline = time.monotonic() + 30
    while _nice(follower.pid) != 10 and follower.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _nice(follower.pid) == 10
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--node-rank",
            "0",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            str(example),
            "--out",
            str(tmp_path / "run"),
            "--steps",
            "30",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    report, ferr = follower.communicate(timeout=240)
    out, err = job.communicate(timeout=240)
    assert job.returncode == 0, err[-2000:]
    assert follower.returncode == 0, ferr[-2000:]
    assert json.loads(report)["steps"] == 30
    assert json.loads((tmp_path / "run" / "controlplane.json").read_text())["store"].endswith(
        f":{port}"
    )
    run = tmp_path / "run"
    assert not list(
        (run / "ranks").glob("*.jsonl")
    )  # nothing per rank on disk: the store carried it
    rows = [json.loads(line) for line in (run / "ops.jsonl").read_text().splitlines()]
    assert {(r["step"], r["rank"]) for r in rows if r["optype"] == "step"} == {
        (s, r) for s in range(30) for r in (0, 1)
    }


def _nice(pid: int) -> int | None:
    """A running process's nice value, None once it is gone."""
    try:
        return os.getpriority(os.PRIO_PROCESS, pid)
    except ProcessLookupError:
        return None
