"""torchrun's elastic agent with the workers forked from it, warm.

``python -m resihp.launch.agent [torchrun's options] -m resihp.train.worker --config PATH`` takes
torchrun's own options (parsed by torchrun's parser into its ``LaunchConfig``) and runs the same
elastic agent (rendezvous, restarts, monitoring, SIGTERM then SIGKILL to the workers) with one
difference: each worker is forked from this process, which has imported torch, the worker and
what the optimizer's first ``add_param_group`` imports (``torch._dynamo``), instead of starting a
new interpreter that imports them again. On two cores that was about 2.5 s of CPU per worker and
most of a small run's start. The launcher runs it for CPU runs on machines with no usable GPU
only (``launch.forks_workers``): a child forked from a process that initialised CUDA's driver
cannot use it, and these imports can, so elsewhere the workers start as torchrun's.

The workers are children of this process as torchrun's are of torchrun; their command line is this
one (it names the run's config), their environment torchrun's variables set by the agent in the
worker's ``os.environ`` (not its initial environment block: ``/proc/PID/environ`` shows this
process's). Each worker says who it is in ``OUT/logs/processes.jsonl`` (``worker.announce``).

``resihp run`` forks this agent, imported once, for each launch of a CPU run
(``resihp.launch.warm``): its workers' command line is then its server's (multiprocessing's
forkserver), which names no config; ``processes.jsonl`` still says which process is which rank.
"""

from __future__ import annotations

import sys

import torch._dynamo  # noqa: F401 - here, before the workers fork: AdamW's add_param_group imports it
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, parse_args

from resihp.procexit import run_then_exit
from resihp.train import worker

WORKER_MODULE = "resihp.train.worker"


def _work(*argv: str) -> None:
    worker.main(list(argv))


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.module or args.training_script != WORKER_MODULE:
        sys.exit(
            f"resihp.launch.agent: expected '-m {WORKER_MODULE}' after the options, got "
            f"{args.training_script!r}"
        )
    args.start_method = "fork"
    config, _cmd, _args = config_from_args(args)
    elastic_launch(config=config, entrypoint=_work)(*args.training_script_args)


if __name__ == "__main__":
    # without torch's and torch._dynamo's teardown: 0.8 s of each launch
    run_then_exit(main)
