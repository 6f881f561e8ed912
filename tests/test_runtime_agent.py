"""resihp's torchrun agent: CPU runs fork their workers from it, runs that may use CUDA keep
torchrun, and its command line is torchrun's."""

from __future__ import annotations

import subprocess
import sys

import torch

from resihp.runtime.config import RunConfig
from resihp.runtime.launch import forks_workers, torchrun_command


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
