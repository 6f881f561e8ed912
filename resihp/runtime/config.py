"""The configuration of one training run: model size, parallel layout, data, schedule, faults."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from resihp.errors import InputError
from resihp.model.gpt import GPTConfig
from resihp.parallel import ParallelDims
from resihp.runtime.inject import Fault, check_faults, parse_fault
from resihp.runtime.layout import balanced_layers, ranges_from_counts
from resihp.runtime.planchange import PlanChange
from resihp.runtime.schedule import SCHEDULES

RECOVERY_MODES = ("none", "restart", "replica", "replica-drop")
# what the launcher does on a fail-stop: restart the same layout, or relaunch the lost replica alone
# while the others go on (replica: they also train its micro-batches; replica-drop: they skip them)

# upper bounds of the run's sizes and durations: a value past them is a typo, not a plan
LIMITS = {"steps": 10**8, "global_tokens": 2**40, "budget": 2**31, "max_len": 2**31, "threads": 4096,
          "timeout_s": 7 * 86400.0}


@dataclass
class RunConfig:
    # model
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    ffn_hidden: int = 512
    vocab: int = 1024
    mlp: str = "gelu"  # gelu or swiglu (a fused gate/up projection)
    tie_embeddings: bool = False  # the LM head is the token embedding (first and last stage)
    vocab_parallel: bool = False  # embedding and LM head split by vocabulary rows (padded to --tp)
    # layout
    dp: int = 2
    pp: int = 2
    tp: int = 1
    schedule: str = "1f1b"
    layer_split: list[int] | None = None  # layers per stage; None: balanced
    dp_weights: list[float] | None = None  # micro-batch share per replica; None: equal
    # data and optimisation
    steps: int = 10
    source: str = "text"
    global_tokens: int = 8192
    budget: int = 1024
    max_len: int = 1024
    seed: int = 0
    lr: float = 1e-3
    # run
    out: str = "runs/latest"
    inject: list[str] = field(default_factory=list)
    ckpt_every: int = 0  # steps between universal checkpoints (0: none)
    snapshot_every: int = 0  # steps between in-memory snapshots (0: none; 1 with --recovery restart)
    recovery: str = "none"  # none, restart (the same layout, from memory), replica or replica-drop
    resume: str | None = None  # a checkpoint folder to start from (any layout)
    replan: list[dict] = field(default_factory=list)  # scheduled plan changes: {"step", "dp_weights"?, "layer_split"?}
    device: str = "auto"  # cpu, cuda or auto
    threads: int = 1
    timeout_s: float = 60.0  # how long a collective or receive may wait for a peer
    job_id: str = ""  # the job this run belongs to (recorded in its checkpoints; set by the launcher)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise InputError(f"--schedule: expected one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        for name in ("steps", "global_tokens", "budget", "max_len", "threads"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise InputError(f"--lr: expected a positive finite number, got {self.lr}")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise InputError(f"--timeout: expected a positive number of seconds, got {self.timeout_s}")
        for name, limit in LIMITS.items():
            if getattr(self, name) > limit:
                raise InputError(f"--{name.removesuffix('_s').replace('_', '-')}: at most {limit:,.0f}, "
                                 f"got {getattr(self, name)}")
        if self.ckpt_every < 0:
            raise InputError(f"--ckpt-every: expected zero or a positive integer, got {self.ckpt_every}")
        if self.recovery not in RECOVERY_MODES:
            raise InputError(f"--recovery: expected one of {', '.join(RECOVERY_MODES)}, got {self.recovery!r}")
        if self.snapshot_every < 0:
            raise InputError(f"--snapshot-every: expected zero or a positive integer, got {self.snapshot_every}")
        if self.recovery.startswith("replica") and self.dp < 2:
            raise InputError(f"--recovery {self.recovery}: needs --dp 2 or more (the replica is the unit "
                             f"of failure), got --dp {self.dp}")
        if self.recovery.startswith("replica") and (self.snapshot_every or self.ckpt_every or self.resume):
            raise InputError(f"--recovery {self.recovery}: a lost replica recovers from a live peer; "
                             "--snapshot-every, --ckpt-every and --resume are not combined with it yet")
        if self.recovery == "restart" and self.snapshot_every == 0:
            self.snapshot_every = 1  # restart in place restores from memory: snapshot every step
        if self.device not in ("auto", "cpu", "cuda"):
            raise InputError(f"--device: expected auto, cpu or cuda, got {self.device!r}")
        self.model_config()
        self.stage_ranges()
        if self.dp_weights is not None and (len(self.dp_weights) != self.dp or min(self.dp_weights) < 0
                                            or sum(self.dp_weights) <= 0):
            raise InputError(f"--dp-weights: expected {self.dp} non-negative weights with a positive "
                             f"sum, got {self.dp_weights}")
        check_faults(self.faults(), self.dims().world_size)
        for change in self.replan:
            if not isinstance(change, dict) or not isinstance(change.get("step"), int):
                raise InputError(f"replan: each change needs an integer step, got {change!r}")
            PlanChange.parse(change, self.dims(), self.layers, "replan")

    def dims(self) -> ParallelDims:
        return ParallelDims(self.dp, self.pp, self.tp)

    def model_config(self) -> GPTConfig:
        cfg = GPTConfig(layers=self.layers, hidden=self.hidden, heads=self.heads,
                        ffn_hidden=self.ffn_hidden, vocab=self.vocab, max_seq_len=self.max_len,
                        mlp=self.mlp, tie_embeddings=self.tie_embeddings, vocab_parallel=self.vocab_parallel)
        if self.heads % self.tp or self.ffn_hidden % self.tp:
            raise InputError(f"--tp {self.tp}: must divide --heads ({self.heads}) and --ffn-hidden "
                             f"({self.ffn_hidden})")
        return cfg

    def model_hash(self) -> str:
        """A hash of what a checkpoint's tensors depend on (the model's shape), not the layout."""
        text = json.dumps(self.model_config().to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def stage_ranges(self) -> list[tuple[int, int]]:
        if self.layer_split is None:
            return balanced_layers(self.layers, self.pp)
        return ranges_from_counts(self.layer_split, self.layers, self.pp, source="--layer-split")

    def weights(self) -> list[float]:
        return list(self.dp_weights) if self.dp_weights is not None else [1.0] * self.dp

    def faults(self) -> list[Fault]:
        return [parse_fault(text) for text in self.inject]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, path: str | Path) -> RunConfig:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InputError(f"{path}: cannot read run config ({exc})") from None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"{path}: unknown run config field(s) {', '.join(unknown)}")
        return cls(**data)


def stage_memory_bytes(cfg: RunConfig) -> int:
    """A rough upper estimate of one rank's memory: fp32 parameters, gradients and two AdamW
    moments of the largest stage, plus the activations of the micro-batches in flight."""
    h, f, v = cfg.hidden, cfg.ffn_hidden, cfg.vocab
    layer = 4 * h * h + 2 * h * f + 9 * h + f
    worst = 0
    for stage, (first, last) in enumerate(cfg.stage_ranges()):
        params = (last - first) * layer / cfg.tp
        if first == 0:
            params += (v + cfg.max_len) * h
        if last == cfg.layers:
            params += v * h + 2 * h
        in_flight = cfg.pp - stage  # 1F1B bound; GPipe may hold more
        acts = in_flight * cfg.budget * ((last - first) * (16 * h + 4 * f) / cfg.tp
                                         + (3 * v if last == cfg.layers else 0))
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
            f"{cfg.layers} --hidden {cfg.hidden} --ffn-hidden {cfg.ffn_hidden} --vocab {cfg.vocab} "
            f"--budget {cfg.budget}) but {have / 2**30:.1f} GiB is available; shrink the model or "
            f"the micro-batch budget")
