"""resihp's torchrun agent: CPU runs fork their workers from it, runs that may use CUDA keep
torchrun, and its command line is torchrun's; a spare agent runs the launch it is handed."""

from __future__ import annotations

import subprocess
import sys

import torch

from resihp.runtime.config import RunConfig
from resihp.runtime.launch import forks_workers, torchrun_command, worker_env
from resihp.runtime.replica import ATTEMPT_ENV, GPU_OFFSET_ENV, REPLICA_ENV
from resihp.runtime.spares import RUNTIME_ENV, Spares, agent_options, compatible, spare_env


def test_cpu_runs_fork_their_workers_and_runs_that_may_use_cuda_keep_torchrun():
    assert not forks_workers(RunConfig.from_flags(device="cuda"))
    for device in ("cpu", "auto"):  # never forked where a GPU is visible, even for a CPU run
        assert forks_workers(RunConfig.from_flags(device=device)) == (not torch.cuda.is_available())


def test_the_launch_command_is_torchruns_options_for_either_agent(tmp_path):
    plain = torchrun_command(tmp_path / "config.json", 4, max_restarts=2, endpoint="127.0.0.1:29999")
    cmd = torchrun_command(tmp_path / "config.json", 4, max_restarts=2, endpoint="127.0.0.1:29999",
                           forked=True)
    assert plain[plain.index("torch.distributed.run") + 1:] == cmd[cmd.index("resihp.runtime.agent") + 1:]
    agent = cmd[cmd.index("resihp.runtime.agent") + 1:]
    assert agent[agent.index("--nproc-per-node") + 1] == "4"
    assert agent[agent.index("--max-restarts") + 1] == "2"
    assert agent[-4:] == ["-m", "resihp.runtime.worker", "--config", str(tmp_path / "config.json")]


def test_an_agent_for_another_script_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "resihp.runtime.agent", "--nproc-per-node", "1",
                           "train.py"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "resihp.runtime.agent: expected '-m resihp.runtime.worker' after the options, got 'train.py'")


def test_a_spare_serves_only_a_launch_it_is_the_same_process_for(tmp_path):
    forked = torchrun_command(tmp_path / "config.json", 2, endpoint="127.0.0.1:29999", forked=True)
    assert agent_options(forked)[-2:] == ["--config", str(tmp_path / "config.json")]
    assert agent_options(torchrun_command(tmp_path / "config.json", 2)) is None  # torchrun's own
    base = spare_env({"PATH": "/usr/bin"})
    launch = worker_env({REPLICA_ENV: "1", ATTEMPT_ENV: "0", GPU_OFFSET_ENV: "2"}, endpoint="127.0.0.1:29999",
                        node=1, managed=True)
    assert compatible(base, base | {k: v for k, v in launch.items() if k in RUNTIME_ENV})
    assert set(launch) - set(spare_env()) <= RUNTIME_ENV  # what a launch adds is read after start-up
    assert not compatible(base, base | {"OMP_NUM_THREADS": "4"})  # read when torch loads OpenMP
    assert not compatible(base, {k: v for k, v in base.items() if k != "PYTHONUNBUFFERED"})


def test_a_spare_runs_the_launch_it_is_handed_and_an_idle_one_is_ended():
    spares = Spares()
    spares.start(spare_env(), 2)
    ends = [proc for proc, _ in spares._idle]
    # a launch for another script: the spare's agent says so in one line, as the agent does
    proc = spares.popen([sys.executable, "-m", "resihp.runtime.agent", "--nproc-per-node", "1", "train.py"],
                        spare_env())
    assert proc in ends
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1 and stderr.strip().splitlines()[-1] == (
        "resihp.runtime.agent: expected '-m resihp.runtime.worker' after the options, got 'train.py'")
    idle = next(p for p in ends if p is not proc)
    assert idle.poll() is None
    spares.close()
    assert idle.poll() is not None and spares._idle == []
    # a launch under another thread count starts its own process
    other = spares.popen([sys.executable, "-c", "import os; print(os.environ['OMP_NUM_THREADS'])"],
                         spare_env() | {"OMP_NUM_THREADS": "3"})
    assert other not in ends and other.wait(timeout=60) == 0
