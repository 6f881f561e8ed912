"""resihp's torchrun agent: CPU runs fork their workers from it, runs that may use CUDA keep
torchrun, and its command line is torchrun's; the warm-agent server forks it for each launch it
serves, and dies with its launcher."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time

import torch

from resihp.launch.launch import forks_workers, torchrun_command, worker_env
from resihp.launch.warm import (
    CHECKPOINTING,
    RUNTIME_ENV,
    ForkedAgent,
    WarmAgents,
    agent_env,
    agent_options,
    compatible,
)
from resihp.train.config import RunConfig
from resihp.train.engine_snapshots import KEEPER_OWNER
from resihp.train.lifecycle import ProcessTracker, start_time
from resihp.train.replica import ATTEMPT_ENV, GPU_OFFSET_ENV, REPLICA_ENV


def test_cpu_runs_fork_their_workers_and_runs_that_may_use_cuda_keep_torchrun():
    assert not forks_workers(RunConfig.from_flags(device="cuda"))
    for device in ("cpu", "auto"):  # never forked where a GPU is visible, even for a CPU run
        assert forks_workers(RunConfig.from_flags(device=device)) == (not torch.cuda.is_available())


def test_the_launch_command_is_torchruns_options_for_either_agent(tmp_path):
    plain = torchrun_command(
        tmp_path / "config.json", 4, max_restarts=2, endpoint="127.0.0.1:29999"
    )
    cmd = torchrun_command(
        tmp_path / "config.json", 4, max_restarts=2, endpoint="127.0.0.1:29999", forked=True
    )
    assert (
        plain[plain.index("torch.distributed.run") + 1 :]
        == cmd[cmd.index("resihp.launch.agent") + 1 :]
    )
    agent = cmd[cmd.index("resihp.launch.agent") + 1 :]
    assert agent[agent.index("--nproc-per-node") + 1] == "4"
    assert agent[agent.index("--max-restarts") + 1] == "2"
    assert agent[-4:] == ["-m", "resihp.train.worker", "--config", str(tmp_path / "config.json")]


def test_an_agent_for_another_script_is_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "resihp.launch.agent", "--nproc-per-node", "1", "train.py"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "resihp.launch.agent: expected '-m resihp.train.worker' after the options, got 'train.py'"
    )


def test_the_server_serves_only_a_launch_it_is_the_same_process_for(tmp_path):
    forked = torchrun_command(tmp_path / "config.json", 2, endpoint="127.0.0.1:29999", forked=True)
    assert agent_options(forked)[-2:] == ["--config", str(tmp_path / "config.json")]
    assert agent_options(torchrun_command(tmp_path / "config.json", 2)) is None  # torchrun's own
    base = agent_env({"PATH": "/usr/bin"})
    launch = worker_env(
        {REPLICA_ENV: "1", ATTEMPT_ENV: "0", GPU_OFFSET_ENV: "2"},
        endpoint="127.0.0.1:29999",
        node=1,
        managed=True,
    )
    assert compatible(base, base | {k: v for k, v in launch.items() if k in RUNTIME_ENV})
    assert (
        set(launch) - set(agent_env()) <= RUNTIME_ENV
    )  # what a launch adds is read after start-up
    # a run with a memory tier names its keepers' owner once it starts (every launch of it warm)
    assert compatible(base, base | {KEEPER_OWNER: "4242"})
    assert not compatible(base, base | {"OMP_NUM_THREADS": "4"})  # read when torch loads OpenMP
    assert not compatible(base, {k: v for k, v in base.items() if k != "PYTHONUNBUFFERED"})


def test_a_run_that_checkpoints_has_its_agents_forked_with_what_its_workers_resume_with():
    # multiprocessing's forkserver skips a preload module that does not import: each must
    for name in CHECKPOINTING:
        importlib.import_module(name)
    assert not RunConfig.from_flags(dp=2).checkpointing()
    assert RunConfig.from_flags(dp=2, ckpt_every=3).checkpointing()
    assert RunConfig.from_flags(dp=2, recovery="restart").checkpointing()  # a memory tier
    assert RunConfig.from_flags(dp=2, resume="somewhere").checkpointing()


def test_a_forked_agent_runs_the_launch_it_is_handed_and_other_launches_start_their_own():
    agents = WarmAgents()
    agents.start(agent_env())
    # a launch for another script: the forked agent says so in one line, as the agent does
    proc = agents.popen(
        [sys.executable, "-m", "resihp.launch.agent", "--nproc-per-node", "1", "train.py"],
        agent_env(),
    )
    assert (
        isinstance(proc, ForkedAgent) and os.getpgid(proc.pid) == proc.pid
    )  # a session of its own
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1 and stderr.strip().splitlines()[-1] == (
        "resihp.launch.agent: expected '-m resihp.train.worker' after the options, got 'train.py'"
    )
    # a launch under another thread count starts its own process
    other = agents.popen(
        [sys.executable, "-c", "import os; print(os.environ['OMP_NUM_THREADS'])"],
        agent_env() | {"OMP_NUM_THREADS": "3"},
    )
    assert not isinstance(other, ForkedAgent) and other.wait(timeout=60) == 0
    other.stderr.close()
    # the server gone (killed), a launch starts cold rather than under a server started again with
    # this process's environment
    os.kill(agents._server, signal.SIGKILL)
    end = time.monotonic() + 30
    while start_time(agents._server) is not None and time.monotonic() < end:
        time.sleep(0.05)
    cold = agents.popen(
        [sys.executable, "-m", "resihp.launch.agent", "--nproc-per-node", "1", "train.py"],
        agent_env(),
    )
    assert not isinstance(cold, ForkedAgent) and cold.wait(timeout=120) == 1
    cold.stderr.close()
    agents.close()


LAUNCHER = """
import sys, time
from resihp.launch.warm import WARM_AGENTS, agent_env
from resihp.launch.launch import torchrun_command
WARM_AGENTS.start(agent_env())
# an agent of a two-node job whose other node never comes: it waits in its rendezvous
agent = WARM_AGENTS.popen(torchrun_command(sys.argv[1], 1, nnodes=2, forked=True), agent_env())
print(agent.pid, flush=True)
time.sleep(600)
"""


def _children(pid: int) -> list[int]:
    return [
        int(c)
        for t in os.listdir(f"/proc/{pid}/task")
        for c in open(f"/proc/{pid}/task/{t}/children").read().split()
    ]


def test_a_killed_launcher_takes_the_server_and_its_forked_agents(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path / "config.json")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        agent = int(launcher.stdout.readline())
        server = next(c for c in _children(launcher.pid) if agent in _children(c))
        assert ProcessTracker(agent).alive() == [agent]
        launcher.kill()
        launcher.wait(timeout=30)
        end = time.monotonic() + 30
        while time.monotonic() < end and any(start_time(p) is not None for p in (server, agent)):
            time.sleep(0.05)
        assert start_time(server) is None and start_time(agent) is None
    finally:
        launcher.kill()
        launcher.wait()
