"""The launcher of the user's own script with replica-level fault tolerance (``resihp replicas``).

One torchrun per data-parallel replica, each running the user's script, all on one job store on
127.0.0.1 that this process hosts with the quorum's first generation. A replica whose torchrun
exits with an error (a rank killed or crashed), or one of whose processes stays stopped
(``SIGSTOP``) for ``stopped_s``, is evicted from the quorum, the step in flight aborted so the
survivors redo it without it, its processes ended, and relaunched alone: its ranks
(``resihp.train.user_replicas.Replicas``) catch up from a live peer and rejoin. The survivors are
never restarted. A rank that hangs while running is not judged here: the survivors' sum with it
times out (``timeout_s``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from resihp.detect.records import JOB_SECRET_ENV, job_secret
from resihp.errors import InputError
from resihp.ft.quorum import DecisionChain, Member, Quorum
from resihp.launch.launch import torchrun_command, worker_env
from resihp.launch.supervisor import GRACE_S, _stop
from resihp.procinfo import process_state
from resihp.train.lifecycle import ProcessTracker
from resihp.train.replica import ATTEMPT_ENV, REPLICA_ENV
from resihp.train.store import JobStore
from resihp.train.user_replicas import JOB_ENV, REPLICAS_ENV


@dataclass
class UserReplicasOutcome:
    """How the job ended: its exit status and each replica lost (and whether relaunched)."""

    returncode: int = 0
    error: str | None = None
    failures: list[dict] = field(default_factory=list)
    wall_s: float = 0.0


def run_user_replicas(
    script: str | os.PathLike,
    args: list[str],
    replicas: int,
    nproc_per_replica: int = 1,
    max_restarts: int = 3,
    timeout_s: float = 60.0,
    poll_s: float = 0.1,
    grace_s: float = GRACE_S,
    stopped_s: float = 5.0,
) -> UserReplicasOutcome:
    """Run ``script`` as ``replicas`` torchruns of ``nproc_per_replica`` ranks; relaunch a lost one.

    Args:
        script: the user's training script (it trains through ``resihp.train.Replicas``).
        args: its arguments.
        replicas: the data-parallel replicas (2 or more).
        nproc_per_replica: the ranks of each replica.
        max_restarts: relaunches per replica; one that fails more often is left out.
        timeout_s: the quorum's timeout in seconds.
        poll_s: seconds between looks at the replicas.
        grace_s: seconds a replica the job ends gets before SIGKILL.
        stopped_s: seconds a process of a replica may stay stopped before the replica is lost.
    """
    if replicas < 2:
        raise InputError(
            f"--replicas: expected 2 or more (the replica is the unit of failure), got {replicas}"
        )
    if nproc_per_replica < 1:
        raise InputError(f"--nproc-per-replica: expected 1 or more, got {nproc_per_replica}")
    if max_restarts < 0:
        raise InputError(f"--max-restarts: expected 0 or more, got {max_restarts}")
    if not Path(script).is_file():
        raise InputError(f"script {script}: no such file; expected the training script to run")
    job = uuid.uuid4().hex[:12]
    t0 = time.time()
    outcome = UserReplicasOutcome()
    with JobStore(timeout_s=max(timeout_s, 60.0)) as js:
        store = js.store
        quorum = Quorum(store, job, nproc_per_replica, timeout_s)
        quorum.set_replicas(replicas)
        chain = DecisionChain(quorum, quorum.start([Member(d, 0) for d in range(replicas)], 0))

        def launch(d: int, attempt: int) -> tuple[subprocess.Popen, ProcessTracker]:
            env = worker_env(
                {
                    REPLICA_ENV: str(d),
                    ATTEMPT_ENV: str(attempt),
                    REPLICAS_ENV: str(replicas),
                    JOB_ENV: job,
                    JOB_SECRET_ENV: job_secret(),
                },
                endpoint=js.endpoint,
                node=d,
            )
            cmd = torchrun_command(
                "",
                nproc_per_replica,
                endpoint=js.endpoint,
                run_id=f"{job}-r{d}-a{attempt}",
                program=[str(script), *args],
            )
            proc = subprocess.Popen(cmd, env=env, start_new_session=True)
            return proc, ProcessTracker(proc.pid)

        live = {d: launch(d, 0) for d in range(replicas)}
        attempts = dict.fromkeys(range(replicas), 0)
        done: set[int] = set()
        stopped: dict[int, float] = {}  # pid -> when it was first seen stopped
        try:
            while live and outcome.error is None:
                time.sleep(poll_s)
                chain.advance()
                chain.abort_evicted()
                for d, (proc, tracker) in list(live.items()):
                    tracker.watch(nproc_per_replica)
                    rc = proc.poll()
                    if rc is None and d not in done:
                        rc = _stopped_for(tracker, stopped, stopped_s)
                    if rc is None or d in done:
                        continue
                    if rc == 0:
                        done.add(d)
                        continue
                    cause = "stopped" if rc == "stopped" else f"exited with status {rc}"
                    member = Member(d, attempts[d])
                    quorum.evict(member, cause)
                    chain.abort_for(member)  # the survivors redo the step in flight without it
                    _stop(proc, tracker, 0.5)
                    chain.advance()
                    members = [m for m in chain.gen.members if not quorum.is_evicted(m)]
                    again = attempts[d] < max_restarts and bool(members) and not quorum.finished()
                    outcome.failures.append(
                        {
                            "replica": d,
                            "attempt": attempts[d],
                            "cause": cause,
                            "at": time.time(),
                            "step": chain.step,
                            "relaunched": again,
                        }
                    )
                    print(
                        f"resihp: replica {d} attempt {attempts[d]} {cause} at step "
                        f"{chain.step}; " + ("relaunched" if again else "left out"),
                        file=sys.stderr,
                        flush=True,
                    )
                    if not members:
                        outcome.error = f"every replica was lost (replica {d}: {cause})"
                    elif again:
                        attempts[d] += 1
                        live[d] = launch(d, attempts[d])
                    else:
                        live.pop(d)
                if live and set(live) <= done:
                    break
                if quorum.finished() and all(d in done or attempts[d] > 0 for d in live):
                    # the survivors are through: a replica still catching up has nothing to join
                    end = time.monotonic() + min(grace_s, 2.0)
                    while time.monotonic() < end and any(
                        p.poll() is None for p, _ in live.values()
                    ):
                        time.sleep(0.1)
                    done.update(d for d, (p, _) in live.items() if p.poll() == 0)
                    break
        finally:
            for proc, tracker in live.values():
                with contextlib.suppress(Exception):
                    _stop(proc, tracker, grace_s if proc.poll() is None else 0.5)
    if outcome.error is None and not done:
        outcome.error = "no replica finished the job"
    outcome.returncode = 0 if outcome.error is None else 1
    outcome.wall_s = time.time() - t0
    return outcome


def _stopped_for(tracker: ProcessTracker, stopped: dict[int, float], limit_s: float) -> str | None:
    """``"stopped"`` once a process of the replica has stayed stopped for ``limit_s``, else None.

    ``stopped`` keeps when each was first seen stopped; a process that runs again is forgotten."""
    now = time.monotonic()
    for pid in tracker.alive():
        if process_state(pid) == "T":
            if now - stopped.setdefault(pid, now) >= limit_s:
                return "stopped"
        else:
            stopped.pop(pid, None)
    return None
