"""A training rank's in-memory snapshots (``--snapshot-every``).

They involve the memory tier of its node (``resihp.ckpt.memory``), the keeper that owns it
(``resihp.ckpt.keeper``), the snapshot after each K-th step and the restore at start
(``resihp.ckpt.snapshot``), with the redundancy the layout gives: a rank's data-parallel peers hold
the same state; a rank with none (dp = 1) has an explicit copy kept for the next rank of its node (a
ring; a pair on two ranks)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

from resihp.ckpt.keeper import (
    ensure_keeper,
    left_tiers,
    newest_on_disk,
    persist_failure,
    reclaim_dead_tiers,
    request_flush,
    request_verify,
    stop_keeper,
)
from resihp.ckpt.memory import MemoryTier, TierFull, plan_shards, shm_root, tier_dir
from resihp.ckpt.snapshot import Restored, Snapshotter, restore, state_tensors
from resihp.detect.events import Event
from resihp.detect.heartbeat import KEEPER_WAIT
from resihp.errors import InputError
from resihp.train.config import RunConfig
from resihp.train.engine import Engine

KEEPER_OWNER = "RESIHP_KEEPER_OWNER"  # the launcher that owns the job's keepers (resihp run)


def same_state(engine: Engine, rank: int) -> list[int]:
    """The ranks holding the same model and AdamW state as ``rank``, itself included.

    They are its data-parallel peers whose pipeline gives its stage the same layers."""
    dims, c = engine.dims, engine.dims.coords(rank)
    mine = engine.replica_ranges[c.dp_rank][c.stage]
    return [
        dims.rank_of(d, c.stage, c.tp_rank)
        for d in range(dims.dp)
        if engine.replica_ranges[d][c.stage] == mine
    ]


def copy_holder(engine: Engine, rank: int, local_ranks: list[int]) -> int | None:
    """Who keeps an explicit copy of ``rank``'s snapshots, or None.

    It is the next rank of its node, when no data-parallel peer holds its state.

    Args:
        engine: the rank's engine (its layout).
        rank: the rank whose snapshots are copied.
        local_ranks: the ranks of its node, in order."""
    if len(same_state(engine, rank)) > 1 or len(local_ranks) < 2:
        return None
    return local_ranks[(local_ranks.index(rank) + 1) % len(local_ranks)]


def layout_of(engine: Engine, cfg: RunConfig, job_id: str) -> dict:
    """What a snapshot must match to be restored (and ``run``: the plan state it carries).

    Args:
        engine: the rank's engine (its layer ranges and plan state).
        cfg: the run's configuration (its model and dimensions).
        job_id: the job's id."""
    return {
        "job_id": job_id,
        "model_hash": cfg.model_hash(),
        "dims": cfg.dims().to_dict(),
        "ranges": [[list(r) for r in ranges] for ranges in engine.replica_ranges],
        "run": {"weights": list(engine.weights), "plan_version": engine.plan_version},
    }


def check_capacity(tier: MemoryTier, need_bytes: int, ranks_here: int) -> None:
    """:meth:`MemoryTier.check_capacity` after the tiers of dead jobs are reclaimed.

    A refusal names the other jobs' tiers still there (path, owner PID, how to remove it).

    Args:
        tier: this rank's memory tier.
        need_bytes: the bytes one rank's slots need.
        ranks_here: the ranks of this node sharing the tier."""
    reclaim_dead_tiers(exclude=tier.dir)
    try:
        tier.check_capacity(need_bytes, ranks_here)
    except InputError as exc:
        others = left_tiers(exclude=tier.dir)
        if not others:
            raise
        raise InputError(
            f"{exc}; other jobs' memory tiers there: " + "; ".join(t.describe() for t in others)
        ) from None


class MemorySnapshots:
    """One rank's memory tier for the job: restore at start, a snapshot after each K-th step.

    ``persist_root`` (``OUT/ckpt``): the keeper writes the universal checkpoints there from the
    snapshots (every ``--ckpt-every`` steps, and the newest when the job stops early), in place
    of the trainers' own saves."""

    def __init__(
        self,
        cfg: RunConfig,
        engine: Engine,
        job_id: str,
        node: int,
        local_ranks: list[int],
        persist_root: Path | None = None,
    ) -> None:
        self.cfg, self.engine, self.job_id = cfg, engine, job_id
        self.persist_root = persist_root
        self._blocks: tuple[tuple, list] | None = None  # (model, optimizer, plan version) -> blocks
        self._due: set[int] = set()  # the steps the keeper writes a checkpoint from
        self.dir: Path = tier_dir(job_id, node)
        self.tier = MemoryTier(self.dir, engine.rank)
        holder = copy_holder(engine, engine.rank, local_ranks)
        holds = sum(
            1
            for r in local_ranks
            if r != engine.rank and copy_holder(engine, r, local_ranks) == engine.rank
        )
        _, nbytes = plan_shards(state_tensors(engine.model, engine.optimizer))
        # two slots per rank, plus the copies this rank keeps (about its own size: same model)
        check_capacity(self.tier, (2 + holds) * nbytes, len(local_ranks))
        # the keeper is owned by the launcher (resihp run: it started node 0's and restarts it if it
        # dies) or by torchrun's agent (plain torchrun); a rank starts it where none runs (another
        # node of a resihp run, or the first rank under torchrun) and restarts it while waiting on
        # it
        owner = int(os.environ.get(KEEPER_OWNER, os.getppid()))
        warm = persist_root is not None
        ensure_keeper(self.dir, owner, warm=warm)
        keep = lambda: ensure_keeper(self.dir, owner, warm=warm)  # noqa: E731
        self.snapshotter = Snapshotter(
            self.tier,
            cfg.snapshot_interval(),
            holder,
            keep,
            cfg.faults.timeout_s,
            lambda: engine.rec.waiting(KEEPER_WAIT),
        )

    def restore(self) -> Restored | None:
        """Collective: the newest step complete in memory for every rank, loaded; or None."""
        e = self.engine
        restored = restore(
            self.tier,
            e.model,
            e.optimizer,
            layout_of(e, self.cfg, self.job_id),
            lambda r: same_state(e, r),
            e.control_group,
            e.injector.during_restore,
        )
        if restored is not None:
            e.weights = list(restored.run.get("weights", e.weights))
            e.plan_version = int(restored.run.get("plan_version", e.plan_version))
        return restored

    def discard_after(self, step: int) -> None:
        """Training goes on after ``step``: unpublish this rank's snapshots of later steps.

        Those (from before the failure) are not this run's future; then pick the slot to write
        next."""
        for h in self.tier.headers():
            if h.rank == self.engine.rank and h.step > step:
                self.tier.header_path(h.slot).unlink(missing_ok=True)
        s = self.snapshotter
        self.snapshotter = Snapshotter(
            self.tier, s.every, s.copy_to, s.keeper_alive, s.timeout_s, s.held
        )

    def after_step(self, step: int) -> None:
        """Start this step's snapshot if one is due, or a checkpoint the keeper writes from it.

        The next optimizer step waits for the copy."""
        e = self.engine
        every = self.cfg.checkpoint.ckpt_every
        ckpt = self.persist_root is not None and every > 0 and (step + 1) % every == 0
        if (
            self.snapshotter.due(step) or ckpt
        ) and e.model is not None:  # a hot spare holds no state
            request = (
                (lambda tensors: self._request(tensors, ckpt))
                if self.persist_root is not None
                else None
            )
            if ckpt:
                self._due.add(step)
            self.snapshotter.snapshot(
                step, e.model, e.optimizer, layout_of(e, self.cfg, self.job_id), request
            )
        self.check()

    def check(self) -> None:
        """Stop (:class:`TierFull`, one line) if a full tier lost a snapshot a checkpoint needed.

        The keeper was to write a checkpoint from it: that checkpoint would be lost without a word.
        A snapshot alone is not taken, and training goes on (the snapshotter says so once)."""
        s = self.snapshotter
        lost = next((step for step in s.skipped if step in self._due), None)
        if lost is None or s.full is None:
            return
        on_disk = newest_on_disk(self.persist_root)
        newest = self.persist_root / f"step{on_disk}" if on_disk >= 0 else "none"
        held = self.tier.newest_step()
        raise TierFull(
            s.full.dir,
            s.full.need,
            s.full.free,
            f"; the checkpoint of step {lost} is written from it and cannot be: stopped (newest "
            f"good checkpoint: {newest}; newest snapshot in memory: "
            f"{'none' if held is None else f'step {held}'})",
        )

    def finish(self) -> None:
        """The last step's snapshot complete (:meth:`check` once more)."""
        self.snapshotter.fence()
        self.check()

    def _request(self, tensors: list, due: bool) -> dict:
        """What the keeper needs to write these tensors into a universal checkpoint."""
        # deferred for start-up time, as in worker.save_checkpoint: DCP only for runs that
        # checkpoint
        from resihp.ckpt.persist import PersistRequest, blocks_of
        from resihp.train.elastic import checkpoint_meta

        e = self.engine
        key = (id(e.model), id(e.optimizer), e.plan_version)
        write = e.dp_rank == 0  # one replica writes the model state (as resihp.ckpt.universal.save)
        if self._blocks is None or self._blocks[0] != key:
            self._blocks = (
                key,
                blocks_of(e.model, e.optimizer, tensors, e.tp, e.model_cfg, e.rank, write),
            )
        meta = checkpoint_meta(e, self.cfg) if e.rank == 0 else None
        return PersistRequest(
            str(self.persist_root),
            self.cfg.checkpoint.ckpt_keep,
            len(e.active),
            write,
            self._blocks[1],
            meta,
            due,
        ).to_dict()

    def close(self) -> None:
        self.snapshotter.close()

    def drain(self) -> None:
        """Wait for the keeper to write the checkpoints it owes (when it writes them)."""
        if self.persist_root is not None:
            request_flush(self.dir, newest=False)


class BoundaryStop:
    """With snapshots on, SIGTERM ends a rank at the next step boundary: it loses no step.

    The rank ends once that step's snapshot has started (closing the tier completes it). A rank
    blocked on a dead peer still ends by the collective's error."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True

    def check(self) -> None:
        if self.requested:
            raise SystemExit(143)


# --- the launcher's side (resihp run) -------------------------------------------------------------
_KEEPERS: dict[str, Path] = {}  # job id -> the tier whose keeper this launcher started


def start_keeper(cfg: RunConfig, node: int) -> Callable[[], None] | None:
    """Start this node's keeper for the job; return what restarts it if it dies, or None.

    The keeper is owned by this process: it removes the tier when this process is gone. The
    supervisor's poll calls what is returned."""
    if not cfg.snapshot_interval():
        return None
    os.environ[KEEPER_OWNER] = str(os.getpid())  # keepers the ranks start are this process's too
    if node != 0:  # the job's id comes from node 0 (at joining): the ranks start this node's keeper
        return None
    directory = tier_dir(cfg.job_id, node)
    reclaim_dead_tiers(exclude=directory)  # a dead job's tier (its launcher and keeper killed) goes
    warm = bool(
        cfg.checkpoint.ckpt_every
    )  # it may write the checkpoints: torch loads while the job starts
    ensure_keeper(directory, os.getpid(), warm=warm)
    _KEEPERS[cfg.job_id] = directory
    return lambda: ensure_keeper(directory, os.getpid(), warm=warm)


def verify_ahead(job_id: str) -> None:
    """The job's trainers have stopped: the keeper checks every slot while the job relaunches."""
    directory = _KEEPERS.get(job_id)
    if directory is not None:
        request_verify(directory)


def flush_checkpoints(cfg: RunConfig, breakpoint: bool) -> dict | None:
    """The job's processes have stopped: node 0's keeper finishes the checkpoints it owes.

    At a ``breakpoint`` (a failure, an interrupt) it also writes the newest step complete in memory
    unless a checkpoint has it. Returns its answer (``step``: that checkpoint's step, or None), or
    None."""
    directory = _KEEPERS.get(cfg.job_id)
    if directory is None or not cfg.checkpoint.ckpt_every:
        return None
    return request_flush(directory, newest=breakpoint)


def stop_keepers(cfg: RunConfig, breakpoint: bool = False) -> dict | None:
    """The job is over: write its checkpoints owed and remove its memory tiers on this machine.

    The checkpoints owed are written by :func:`flush_checkpoints`; the tiers are node 0's, started
    here, or another node's, named by the job id it joined under, from ``OUT/config.json``. Returns
    the first checkpoint node 0's keeper could not write (``resihp.ckpt.keeper.persist_failure``),
    or None."""
    flush_checkpoints(cfg, breakpoint)
    directory = _KEEPERS.pop(cfg.job_id, None)
    failed = persist_failure(directory) if directory is not None else None
    joined = (_read(Path(cfg.out) / "config.json") or {}).get("job_id")
    for job in {cfg.job_id, joined} - {None, ""}:
        for tier in shm_root().glob(f"resihp-{job}-n*"):
            stop_keeper(tier)
    return failed


def restartable(outcome) -> bool:
    """Whether a job's end calls for a restart in place.

    It does after a fail-stop, or workers that died without saying why (a rank ended by a signal or
    an exception brings down its peers, whose heartbeats then end as stopped); not an input error, a
    worker's own reason to stop (a non-finite loss, a full disk) nor an interrupt of the
    launcher."""
    if outcome.interrupted or outcome.input_error:
        return False
    if outcome.failure is not None:
        return True
    said = any(e.get("kind") in ("stop", "input") for e in outcome.errors) or "disk full" in (
        outcome.error or ""
    )
    return outcome.returncode != 0 and not said and not outcome.left_alive


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _step_times(out: Path) -> tuple[float | None, float | None]:
    """The first step's start and the last step's end in a run folder's trace (wall clock)."""
    # deferred for start-up time: workers import this module, never build a frame
    import pandas as pd

    try:
        trace = pd.read_parquet(out / "ops.parquet", columns=["optype", "start_ts", "duration"])
    except (OSError, ValueError, KeyError):
        return None, None
    steps = trace[trace.optype == "step"]
    if not len(steps):
        return None, None
    return float(steps.start_ts.min()), float((steps.start_ts + steps.duration).max())


def recovery_record(
    before: Path,
    after: Path,
    failure: Event | None,
    before_summary: dict,
    after_summary: dict,
    cause: str | None = None,
) -> dict:
    """The run summary's ``recovery`` object for a restart in place.

    It says where the state came from (``memory``, ``peer``, ``disk``, or ``none``: step 0), the
    step training went on at, the steps done twice, and the times: the fail-stop's detection, the
    restore, and the whole stall (the last step's end before the failure to the first step's start
    after it).

    Args:
        before: the run folder of the attempt that failed.
        after: the run folder of the restart.
        failure: the fail-stop event (None: none was detected).
        before_summary: the failed attempt's run summary.
        after_summary: the restart's run summary.
        cause: the cause recorded where no ``failure`` event carries one (None: none)."""
    restored = _read(after / "restore.json")
    resumed = after_summary.get("first_step")
    if restored is not None:
        source, restore_s, resumed = restored["source"], restored["restore_s"], restored["step"] + 1
    elif (after / "resume.json").exists():
        source, restore_s = "disk", None
    else:
        source, restore_s = "none", None
    resumed = int(resumed) if resumed is not None else None
    first, losses = before_summary.get("first_step"), before_summary.get("losses") or []
    done = (
        (int(first) + len(losses)) if first is not None else 0
    )  # steps complete before the failure
    _, last_end = _step_times(before)
    first_start, _ = _step_times(after)
    return {
        "mode": "restart",
        "source": source,
        "cause": failure.cause if failure is not None else cause,
        "rank": failure.rank if failure is not None else None,
        "resumed_step": resumed,
        "lost_steps": max(0, done - resumed) if resumed is not None else None,
        "detected_s": failure.detected_s if failure is not None else None,
        "restore_s": restore_s,
        "stall_s": round(first_start - last_end, 3) if first_start and last_end else None,
    }
