"""Detection on a job that writes resihp streams (the engine, or ``resihp.attach``), no planner.

It reads the job's ``job.yaml`` (waiting for the job to start), assembles complete steps from the
ranks' JSON-lines streams and feeds them to the online detector.

``follow(out)`` runs in a side process (``resihp follow RUN``); ``Follower`` is the same loop in a
thread of the job itself (``resihp.attach(..., detect=True)`` on rank 0).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from resihp.detect.config import DetectorConfig
from resihp.detect.events import DEVICE_FAULTS
from resihp.detect.observe import layout_parts
from resihp.detect.online import OnlineDetector, noise_warnings
from resihp.errors import InputError
from resihp.opstrace import TRACE_STREAM, JobMeta, json_lines, read_meta
from resihp.train.config import RunConfig
from resihp.train.controlplane import StepReader, ended, node_ranks, read_job
from resihp.train.recorder import rows_frame
from resihp.train.store import JobStore

log = logging.getLogger("resihp.follow")


class StreamTail:
    """New complete lines of a run folder's JSON-lines streams since the last call.

    The streams are node 0's stream of complete steps (``ops.jsonl``, written by ``resihp run``'s
    launcher from the control plane) or each rank's own (``ranks/rank<R>.jsonl``, written by
    ``resihp.attach``)."""

    def __init__(self, out: Path, world: int) -> None:
        self.paths = [out / TRACE_STREAM, *(out / "ranks" / f"rank{r}.jsonl" for r in range(world))]
        self.offsets = [0] * len(self.paths)
        self.lines = [0] * len(
            self.paths
        )  # complete lines read so far (for an error's line number)

    def read(self) -> list[dict]:
        rows = []
        for i, path in enumerate(self.paths):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[i])
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
            self.offsets[i] += end
            rows += json_lines(data[:end], path, self.lines[i] + 1)
            self.lines[i] += data.count(b"\n", 0, end)
        return rows


class StepAssembler:
    """Complete steps (rows from every rank) out of a run folder's streams, in step order."""

    def __init__(self, out: Path, world: int) -> None:
        self.world = world
        self.tail = StreamTail(out, world)
        self.pending: dict[int, list[dict]] = defaultdict(list)
        self.next_step: int | None = None

    def complete_steps(self) -> list[tuple[int, list[dict]]]:
        for row in self.tail.read():
            self.pending[int(row["step"])].append(row)
        if self.next_step is None and self.pending:
            self.next_step = min(self.pending)
        done = []
        while self.next_step is not None:
            rows = self.pending.get(self.next_step, [])
            if len({r["rank"] for r in rows if r["optype"] == "step"}) < self.world:
                break
            done.append((self.next_step, self.pending.pop(self.next_step)))
            self.next_step += 1
        return done


def wait_for_job(out: str | Path, timeout_s: float | None = None, poll_s: float = 0.5) -> Path:
    """The job meta of a run folder, once the job's rank 0 has written it.

    A side process started before the job waits here; ``InputError`` after ``timeout_s``.

    Args:
        out: the job's run folder.
        timeout_s: how long to wait, in seconds (None: no limit).
        poll_s: the wait between looks, in seconds."""
    meta = Path(out) / "job.yaml"
    if Path(out).exists() and not Path(out).is_dir():
        raise InputError(
            f"{out}: a file, not a run folder (the folder a job writes with "
            "resihp.attach(out=...) or resihp run -o ...)"
        )
    t0 = time.time()
    while not meta.exists():
        if timeout_s is not None and time.time() - t0 > timeout_s:
            raise InputError(
                f"{out}: no job.yaml after {timeout_s:g} s (has the job started, "
                "with resihp.attach(out=...) or resihp run -o ...?)"
            )
        time.sleep(poll_s)
    return meta


class StoreSteps:
    """Complete steps read from a job's control plane, not its run folder.

    The control plane is ``resihp run``'s store, from any machine that reaches it; ``finished``
    once node 0 says the job ended."""

    def __init__(self, endpoint: str, timeout_s: float = 60.0) -> None:
        self.endpoint = endpoint
        self.js = JobStore(endpoint, host=False, timeout_s=timeout_s, option="--store")
        job = read_job(self.js.store, timeout_s, verify=False)  # it reads, it steers nothing
        if job is None:
            raise InputError(
                f"--store {endpoint}: no resihp job announced there within {timeout_s:g} s"
            )
        self.job_id = job["job_id"]
        if job.get("meta"):  # resihp.attach's job: its meta as rank 0 wrote it
            self.meta_dict = job["meta"]
            self.meta = JobMeta(
                *(int(self.meta_dict[k]) for k in ("dp_size", "pp_size", "tp_size", "world_size"))
            )
        else:
            cfg = RunConfig.from_flags(**job["config"])
            dims, model = cfg.dims(), cfg.model
            self.meta = JobMeta(dims.dp, dims.pp, dims.tp, dims.world_size)
            self.meta_dict = {
                **self.meta.to_dict(),
                "layers": model.layers,
                "hidden": model.hidden,
                "heads": model.heads,
                "ffn_hidden": model.ffn_hidden,
                "vocab": model.vocab,
                "max_seq_len": model.max_seq_len,
            }
        layout = node_ranks(job["nnodes"], job["nproc_per_node"], job.get("sizes"))
        self.reader = StepReader(self.js.store, self.job_id, layout)
        self.gone = False

    def complete_steps(self) -> list[tuple[int, list[dict]]]:
        try:
            return [(s.step, s.rows) for s in self.reader.complete_steps()]
        except (RuntimeError, dist.DistError):  # the job and its store are gone
            self.gone = True
            return []

    def finished(self) -> bool:
        if self.gone:
            return True
        try:
            return ended(self.js.store, self.job_id, verify=False) is not None
        except (RuntimeError, dist.DistError):  # node 0 and its store are gone: the job is over
            return True


class LiveDetection:
    """The detector over one job's records, fed by ``poll``; ``report`` is what it holds now.

    The records are a run folder's streams, or ``source``: a job's store."""

    def __init__(
        self,
        out: str | Path | None,
        config: DetectorConfig | None = None,
        on_event: Callable[[dict], None] | None = None,
        source: StoreSteps | None = None,
    ) -> None:
        self.out = Path(out) if out is not None else None
        self.source = source
        if source is not None:
            meta, meta_dict = source.meta, source.meta_dict
            self.steps = source
        else:
            meta, meta_dict = read_meta(self.out / "job.yaml")
            self.steps = StepAssembler(self.out, meta.world_size)
        self.meta, self.meta_dict = meta, meta_dict
        self.detector = OnlineDetector(meta, config=config, meta_dict=meta_dict)
        self.world = meta.world_size
        self.events: list[dict] = []
        self.seen = 0
        self.on_event = on_event
        self.warned = False
        self._lock = threading.Lock()

    def poll(self) -> list[dict]:
        new = []
        steps = self.steps.complete_steps()
        if steps:
            # every step complete since the last poll in one frame, one pass of the detector: the
            # same events as step by step, at a fraction of the CPU; a monitor that takes a core's
            # worth of a job's time (or, in the job's own thread, its interpreter) slows ranks at
            # random, and a 2-core job measured 4 false alarms in 10 healthy runs of 80 steps
            self.seen += len(steps)
            df = rows_frame([row for _, rows in steps for row in rows])
            for part, meta in layout_parts(df, self.meta):
                if part.optype.eq("replan-layout").any():
                    # a live re-plan gave ranks new places from this step: learned afresh, as the
                    # job's own live loop does (their old baselines say nothing of the new work)
                    self.detector = OnlineDetector(
                        meta,
                        config=self.detector.cfg,
                        meta_dict={**(self.meta_dict or {}), **meta.to_dict()},
                    )
                part = part[~part.optype.str.startswith("replan")]
                for event in self.detector.observe(part) if len(part) else []:
                    record = {**event.to_dict(), "seen_at": time.time()}
                    with self._lock:
                        self.events.append(record)
                    new.append(record)
                    _log_event(record)
                    if self.on_event:
                        self.on_event(record)
        noise = self.detector.noise()
        if not self.warned and len(noise) == self.world:
            self.warned = True
            for line in noise_warnings({str(r): v for r, v in noise.items()}, self.detector.cfg):
                log.warning(line)
        return new

    def finished(self) -> bool:
        if self.source is not None:
            return self.source.finished()
        if (self.out / "summary.json").exists():  # resihp run's launcher wrote it: the job is over
            return True
        return all(
            (self.out / "ranks" / f"rank{r}.done").exists() for r in range(self.world)
        )  # attach's

    def report(self) -> dict:
        """Current stragglers, every event so far, steps seen and each rank's noise.

        Stragglers are device faults still open (rank, slowdown, onset, phase); each rank's noise
        comes with the smallest slowdown it lets through."""
        with self._lock:
            events = [dict(e) for e in self.events]
        open_ = {}
        for ev in self.detector.open_events():
            if ev.kind in DEVICE_FAULTS and ev.rank is not None:
                open_[(ev.kind, ev.rank)] = ev
        stragglers = [
            {
                "rank": ev.rank,
                "kind": ev.kind,
                "slowdown": round(float(ev.slowdown), 3),
                "onset_step": ev.onset_step,
                "detected_step": ev.detected_step,
                **({"phase": ev.phase} if ev.phase is not None else {}),
            }
            for ev in sorted(open_.values(), key=lambda e: e.rank)
        ]
        return {
            "stragglers": stragglers,
            "events": events,
            "steps": self.seen,
            "noise": {str(r): v for r, v in self.detector.noise().items()},
            "budget": self.detector.budget(),
        }


def _log_event(e: dict) -> None:
    where = f"rank {e['rank']}" if e.get("rank") is not None else f"stage {e.get('stage')}"
    phase = f" ({e['phase']} only)" if e.get("phase") else ""
    level = logging.WARNING if e["kind"] in DEVICE_FAULTS else logging.INFO
    log.log(
        level,
        "%s on %s from step %s (detected at %s): x%.2f%s",
        e["kind"],
        where,
        e["onset_step"],
        e["detected_step"],
        e["slowdown"],
        phase,
    )


def follow(
    out: str | Path | None,
    detector_config: DetectorConfig | None = None,
    poll_s: float = 0.5,
    timeout_s: float | None = None,
    on_event: Callable[[dict], None] | None = None,
    start_timeout_s: float | None = None,
    store: str | None = None,
) -> dict:
    """Detect live on a job, feeding every complete step to the online detector until it is over.

    Returns ``report()``'s document (``{"events": [...], "steps": n, "stragglers": [...],
    "noise": {...}}``).

    Args:
        out: the job's run folder (None: read the control plane at ``store``).
        detector_config: the detector's settings (None: the defaults).
        poll_s: the wait between reads, in seconds.
        timeout_s: stop after this many seconds (None: when the job is over).
        on_event: called with each event's record (its JSON form and ``seen_at``) as it is found
            (None: not called).
        start_timeout_s: how long to wait for the job's ``job.yaml``, in seconds (None:
            ``timeout_s``).
        store: ``HOST:PORT`` of node 0's ``--rdzv-endpoint``: read the job's control plane there
            (None: read the run folder)."""
    t0 = time.time()
    start = start_timeout_s if start_timeout_s is not None else timeout_s
    if store is not None:  # the job's control plane, from any machine that reaches node 0
        det = LiveDetection(
            None, detector_config, on_event, source=StoreSteps(store, start or 60.0)
        )
    else:
        wait_for_job(out, start, poll_s)
        det = LiveDetection(out, detector_config, on_event)
    while True:
        finished = det.finished()
        det.poll()
        if finished or (timeout_s is not None and time.time() - t0 > timeout_s):
            return det.report()
        time.sleep(poll_s)


class Follower(threading.Thread):
    """``follow`` in a daemon thread of the job (rank 0 of ``resihp.attach(..., detect=True)``).

    ``stop`` drains the steps written so far. A failure of the detector is kept in ``error`` and
    logged; the training goes on."""

    def __init__(
        self,
        out: str | Path,
        config: DetectorConfig | None = None,
        on_event: Callable[[dict], None] | None = None,
        poll_s: float = 0.5,
    ) -> None:
        super().__init__(name="resihp-detect", daemon=True)
        self.out, self.config, self.on_event, self.poll_s = Path(out), config, on_event, poll_s
        self.detection: LiveDetection | None = None
        self.error: str | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            wait_for_job(self.out, timeout_s=60, poll_s=self.poll_s)
            self.detection = LiveDetection(self.out, self.config, self.on_event)
            while not self._stop_event.wait(self.poll_s):
                self.detection.poll()
            self.detection.poll()
        except Exception as exc:  # noqa: BLE001 - the training job must not die of its monitor
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("detector stopped: %s", self.error)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)

    def report(self) -> dict:
        if self.detection is None:
            return {
                "stragglers": [],
                "events": [],
                "steps": 0,
                "noise": {},
                "budget": {},
                **({"error": self.error} if self.error else {}),
            }
        return {**self.detection.report(), **({"error": self.error} if self.error else {})}
