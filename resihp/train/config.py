"""The configuration of one training run: model size, parallel layout, data, schedule, faults."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from resihp.detect.config import DetectorConfig
from resihp.errors import InputError
from resihp.model.config import GPTConfig
from resihp.options import (
    SEED_MAX,
    Section,
    build,
    check_section,
    flat_values,
    from_nested,
    opt,
    updated,
)
from resihp.parallel import SCHEDULES, ParallelDims
from resihp.train.inject import Fault, check_faults, parse_fault
from resihp.train.layout import balanced_layers, ranges_from_counts
from resihp.train.planchange import PlanChange

RECOVERY_MODES = ("auto", "none", "restart", "replica", "replica-drop")
# what the launcher does on a fail-stop: restart the same layout, or relaunch the lost replica alone
# while the others go on (replica: they also train its micro-batches; replica-drop: they skip them);
# auto: replica where the run allows it (RunConfig.resolved_recovery), else none


def _run_model() -> GPTConfig:
    """The run's default model: small enough for a few CPU processes."""
    return GPTConfig(layers=4, hidden=128, heads=4, ffn_hidden=512, vocab=1024, max_seq_len=1024)


@dataclass(frozen=True)
class ParallelConfig(Section):
    SECTION: ClassVar[str] = "parallel"

    dp: int = opt(2, help="Data-parallel replicas", minimum=1, panel="Parallel")
    pp: int = opt(2, help="Pipeline stages", minimum=1, panel="Parallel")
    tp: int = opt(1, help="Tensor-parallel ranks per stage", minimum=1, panel="Parallel")
    schedule: str = opt("1f1b", choices=SCHEDULES, help="Pipeline schedule", panel="Parallel")
    layer_split: list[int] | None = opt(
        None, panel="Parallel", help="Layers per stage, e.g. 3,1 (default: balanced)"
    )
    dp_weights: list[float] | None = opt(
        None, panel="Parallel", help="Micro-batch share per replica, e.g. 2,1 (default: equal)"
    )

    def dims(self) -> ParallelDims:
        return ParallelDims(self.dp, self.pp, self.tp)


@dataclass(frozen=True)
class DataConfig(Section):
    SECTION: ClassVar[str] = "data"

    source: str = opt(
        "text", panel="Data", help="Sequence-length source: text, code or a lengths file"
    )
    global_tokens: int = opt(
        8192, minimum=1, maximum=2**40, panel="Data", help="Tokens per training step (all replicas)"
    )
    budget: int = opt(1024, minimum=1, maximum=2**31, panel="Data", help="Micro-batch token budget")


@dataclass(frozen=True)
class TrainConfig(Section):
    SECTION: ClassVar[str] = "train"

    steps: int = opt(
        20,
        minimum=1,
        maximum=10**8,
        panel="Training",
        help="Training steps in all (a resumed run goes on to this step count)",
    )
    lr: float = opt(1e-3, above=0, finite=True, panel="Training", help="AdamW learning rate")
    seed: int = opt(
        0,
        minimum=0,
        maximum=SEED_MAX,
        panel="Training",
        help="Seed of the model's initialisation and the data order",
    )


@dataclass(frozen=True)
class FaultConfig(Section):
    SECTION: ClassVar[str] = "faults"

    inject: list[str] = opt(
        factory=list,
        panel="Faults and recovery",
        help=(
            "slow:rank=R,factor=F,step=S (compute x F), link:ranks=A+B,factor=F,step=S (every "
            "transfer between A and B x F: pipeline sends/receives and their share of "
            "collectives), stop:rank=R,step=S (SIGKILL), error:rank=R,step=S (a Python "
            "exception) or hang:rank=R,step=S[,how=block|stop] (repeatable)"
        ),
    )
    recovery: str = opt(
        "auto",
        choices=RECOVERY_MODES,
        panel="Faults and recovery",
        help=(
            "On a fail-stop: none; restart (relaunch the same layout; every rank restores from "
            "memory, a peer's memory, else the newest checkpoint); replica (only the lost "
            "data-parallel replica restarts and catches up from a live peer while the others "
            "train on, taking over its micro-batches; live re-planning then moves micro-batch "
            "shares, and layers between the stages of each replica, but never ranks between "
            "groups); replica-drop (the same, its micro-batches skipped while it is away); auto: "
            "replica when --dp > 1 on one node of CPUs without --ckpt-every, --snapshot-every or "
            "--resume, else none"
        ),
    )
    timeout_s: float = opt(
        60.0,
        flag="timeout",
        above=0,
        maximum=7 * 86400.0,
        finite=True,
        panel="Faults and recovery",
        help="Seconds a rank may wait for a peer, and for all ranks to join",
    )
    heartbeat_timeout_s: float = opt(
        10.0,
        flag="heartbeat-timeout",
        above=0,
        maximum=86400.0,
        finite=True,
        panel="Faults and recovery",
        help="Seconds without a heartbeat before a rank counts as stopped",
    )
    hang_timeout_s: float | None = opt(
        None,
        flag="hang-timeout",
        above=0,
        maximum=86400.0,
        finite=True,
        panel="Faults and recovery",
        help=(
            "Seconds a training rank may make no progress while its heartbeat goes on before it "
            "counts as hung (default: 5 x the median step time, at least --heartbeat-timeout)"
        ),
    )


@dataclass(frozen=True)
class CheckpointConfig(Section):
    SECTION: ClassVar[str] = "checkpoint"

    ckpt_every: int = opt(
        0,
        minimum=0,
        panel="Checkpoints",
        help=(
            "Steps between universal checkpoints; with it, a stopped rank is excluded by an "
            "elastic restart. With --snapshot-every on one node the node's keeper writes them "
            "from memory, off the training path, and writes the newest snapshot when the "
            "job stops early"
        ),
    )
    ckpt_keep: int = opt(
        0,
        minimum=0,
        panel="Checkpoints",
        help=("Keep only the newest N universal checkpoints (0: keep all)"),
    )
    snapshot_every: int | None = opt(
        None,
        minimum=0,
        panel="Checkpoints",
        help=(
            "Steps between in-memory snapshots (/dev/shm, kept by a per-node keeper); default 1 "
            "with --recovery restart, else none"
        ),
    )
    ckpt_dir: str | None = opt(
        None,
        panel="Checkpoints",
        help=(
            "Folder of the universal checkpoints (default OUT/ckpt); required with --ckpt-every on "
            "several nodes: one folder every node writes to (a shared filesystem), as a checkpoint "
            "holds every rank's shards"
        ),
    )
    resume: str | None = opt(
        None,
        panel="Checkpoints",
        help=(
            "Start from a checkpoint folder, or a run folder's newest checkpoint that verifies, "
            "in any layout; --steps stays the total step count"
        ),
    )


@dataclass(frozen=True)
class LiveConfig(Section):
    SECTION: ClassVar[str] = "live"

    live: bool = opt(
        True,
        panel="Live re-planning",
        help=("Run the live detector and planner beside the job and apply their plan changes"),
    )
    calibration_steps: int = opt(
        DetectorConfig.calibration_steps,
        minimum=3,
        maximum=100000,
        panel="Live re-planning",
        help=(
            "Steps of each rank the live detector learns its healthy baseline on before it can "
            "find a fail-slow there (and again after a plan change moves work)"
        ),
    )
    min_slowdown: float = opt(
        DetectorConfig.min_slowdown,
        minimum=1.0,
        maximum=1000.0,
        finite=True,
        panel="Live re-planning",
        help=(
            "The least slowdown of a rank the live detector reports and the planner re-plans "
            "around (raise it where the machine's own noise reaches the default)"
        ),
    )
    alarm_floor: float = opt(
        DetectorConfig.alarm_floor,
        minimum=1.0,
        maximum=1000.0,
        finite=True,
        panel="Live re-planning",
        help=(
            "Effect-size floor: the live detector raises no fail-slow or link-slow whose measured "
            "factor (x slower than expected) is below it"
        ),
    )
    # scheduled plan changes, {"step", "dp_weights"?, "layer_split"?} (set through a config file)
    replan: list[dict] = opt(factory=list, cli=False)


@dataclass(frozen=True)
class RunConfig:
    """One training run: the tree the CLI's options, the workers and the checks all read."""

    model: GPTConfig = field(default_factory=_run_model)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    live: LiveConfig = field(default_factory=LiveConfig)
    out: str = opt(
        "runs/latest", decls=("-o",), help="Run folder: ops.parquet, job.yaml, summary.json"
    )
    device: str = opt("auto", choices=("auto", "cpu", "cuda"), help="Where the ranks train")
    threads: int = opt(1, minimum=1, maximum=4096, help="Intra-op threads per rank")
    job_id: str = opt("", cli=False)  # the job this run belongs to (set by the launcher)

    def __post_init__(self) -> None:
        check_section(self)
        faults, parallel, ckpt = self.faults, self.parallel, self.checkpoint
        replica = faults.recovery.startswith("replica")
        if replica and parallel.dp < 2:
            raise InputError(
                f"faults.recovery (--recovery {faults.recovery}): needs --dp 2 or more (the "
                f"replica is the unit of failure), got --dp {parallel.dp}"
            )
        if replica and ckpt.snapshot_every:
            raise InputError(
                f"faults.recovery (--recovery {faults.recovery}): a lost replica recovers "
                "from a live peer; --snapshot-every is not combined with it yet "
                "(--ckpt-every and --resume are)"
            )
        self.model.check_tp(parallel.tp)
        self.stage_ranges()
        if parallel.dp_weights is not None and (
            len(parallel.dp_weights) != parallel.dp
            or min(parallel.dp_weights) < 0
            or sum(parallel.dp_weights) <= 0
        ):
            raise InputError(
                f"parallel.dp_weights (--dp-weights): expected {parallel.dp} non-negative "
                f"weights with a positive sum, got {parallel.dp_weights}"
            )
        check_faults(self.fault_list(), self.dims().world_size, self.train.steps)
        for change in self.live.replan:
            if not isinstance(change, dict) or not isinstance(change.get("step"), int):
                raise InputError(f"live.replan: each change needs an integer step, got {change!r}")
            PlanChange.parse(change, self.dims(), self.model.layers, "live.replan")

    @classmethod
    def from_flags(cls, **flat: Any) -> RunConfig:
        """The tree from flat options (``dp=2, steps=40``: each leaf by its flag's name).

        That is the CLI's form; leaves not given keep their defaults."""
        return build(cls, flat, "run config")

    def updated(self, **flat: Any) -> RunConfig:
        """A copy with the leaves named in flat form changed, checked again."""
        return updated(self, **flat)

    def ckpt_root(self) -> Path:
        """Where this run's universal checkpoints go: ``--ckpt-dir``, else ``OUT/ckpt``."""
        return (
            Path(self.checkpoint.ckpt_dir) if self.checkpoint.ckpt_dir else Path(self.out) / "ckpt"
        )

    def relaunched_into(self, out: str | Path, **changes: Any) -> RunConfig:
        """A copy for a relaunch into ``out`` (``OUT/restart``, ...), with ``changes``.

        Its checkpoints go beside it, under ``OUT/restart/ckpt`` or, with ``--ckpt-dir D``,
        ``D/restart``."""
        ckpt_dir = self.checkpoint.ckpt_dir
        moved = str(Path(ckpt_dir) / Path(out).name) if ckpt_dir else None
        return self.updated(**changes, out=str(out), ckpt_dir=moved)

    def flags(self) -> dict[str, Any]:
        return flat_values(self)

    def dims(self) -> ParallelDims:
        return self.parallel.dims()

    def resolved_recovery(self, nnodes: int = 1, gpus: bool = False) -> str:
        """The recovery mode ``auto`` stands for in this run; any other mode as given.

        Replica-level fault tolerance where the run allows it (data parallel, one node, CPUs:
        ``gpus`` says whether the ranks train on GPUs, where the mode is not checked yet; no disk or
        memory checkpoints, no resume), else none."""
        if self.faults.recovery != "auto":
            return self.faults.recovery
        ckpt = self.checkpoint
        replica = (
            self.parallel.dp > 1
            and nnodes == 1
            and not gpus
            and not (ckpt.ckpt_every or ckpt.snapshot_every or ckpt.resume)
        )
        return "replica" if replica else "none"

    def snapshot_interval(self) -> int:
        """Steps between in-memory snapshots.

        As given, else 1 with --recovery restart (restart in place restores from memory), else 0
        (none)."""
        every = self.checkpoint.snapshot_every
        return every if every is not None else int(self.faults.recovery == "restart")

    def checkpointing(self) -> bool:
        """Whether the run's workers write or read checkpoints (on disk or in memory) or resume."""
        ckpt = self.checkpoint
        return bool(ckpt.ckpt_every or self.snapshot_interval() or ckpt.resume)

    def model_hash(self) -> str:
        """A hash of what a checkpoint's tensors depend on (the model's shape), not the layout."""
        text = json.dumps(self.model.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def stage_ranges(self) -> list[tuple[int, int]]:
        if self.parallel.layer_split is None:
            return balanced_layers(self.model.layers, self.parallel.pp)
        return ranges_from_counts(
            self.parallel.layer_split, self.model.layers, self.parallel.pp, source="--layer-split"
        )

    def weights(self) -> list[float]:
        dp_weights = self.parallel.dp_weights
        return list(dp_weights) if dp_weights is not None else [1.0] * self.parallel.dp

    def fault_list(self) -> list[Fault]:
        return [parse_fault(text) for text in self.faults.inject]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_dict(cls, data: dict, where: str = "run config") -> RunConfig:
        """From the nested form ``to_json`` writes."""
        return from_nested(cls, data, where)

    @classmethod
    def from_json(cls, path: str | Path) -> RunConfig:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InputError(f"{path}: cannot read run config ({exc})") from None
        return cls.from_dict(data, str(path))


def stage_memory_bytes(cfg: RunConfig) -> int:
    """A rough upper estimate of one rank's memory, in bytes.

    It counts the fp32 parameters, gradients and two AdamW moments of the largest stage, plus the
    activations of the micro-batches in flight."""
    h, f, v = cfg.model.hidden, cfg.model.ffn_hidden, cfg.model.vocab
    layer = 4 * h * h + 2 * h * f + 9 * h + f
    worst = 0
    for stage, (first, last) in enumerate(cfg.stage_ranges()):
        params = (last - first) * layer / cfg.parallel.tp
        if first == 0:
            params += (v + cfg.model.max_seq_len) * h
        if last == cfg.model.layers:
            params += v * h + 2 * h
        in_flight = cfg.parallel.pp - stage  # 1F1B bound; GPipe may hold more
        acts = (
            in_flight
            * cfg.data.budget
            * (
                (last - first) * (16 * h + 4 * f) / cfg.parallel.tp
                + (3 * v if last == cfg.model.layers else 0)
            )
        )
        worst = max(worst, int(4 * (4 * params + acts)))
    return worst


def available_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(cfg: RunConfig, ranks_here: int) -> None:
    """Refuse a model that cannot fit in this machine's memory before launching anything."""
    need, have = stage_memory_bytes(cfg) * ranks_here, available_memory_bytes()
    if need > 0.9 * have:
        raise InputError(
            f"model too large: about {need / 2**30:.1f} GiB for {ranks_here} ranks (--layers "
            f"{cfg.model.layers} --hidden {cfg.model.hidden} --ffn-hidden {cfg.model.ffn_hidden} "
            f"--vocab {cfg.model.vocab} --budget {cfg.data.budget}) but {have / 2**30:.1f} GiB "
            "is available; shrink the model or the micro-batch budget"
        )
