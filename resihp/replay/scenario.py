"""Replay scenario files (docs/DESIGN.md "Replay scenario YAML"): parsing and validation.

A scenario names the cluster, the model and its initial parallel layout, the workload (a
sequence-length source), the duration, failure events and/or failure generators with their rates,
and the costs of restart, checkpointing and reconfiguration. Every error names the file, the line
and the field.

The cluster is the planner's ``ClusterSpec`` (``ClusterSpec.uniform``: nodes of identical devices,
each at the sustained rate ``peak_tflops x mfu``) and the model its ``ModelSpec``; the initial
layout must fit the planner's memory model (``resihp.plan.specs.pipeline_memory_gb``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from resihp.errors import InputError
from resihp.parallel import ParallelDims, apportion
from resihp.plan.specs import MLP_MATRICES, ClusterSpec, ModelSpec, pipeline_memory_gb
from resihp.replay.scenario_schema import PLAN_CLUSTER_KEYS, TOP_LEVEL, keys_of
from resihp.replay.yamlsrc import LineDict, load_yaml

KINDS = ("slow", "link", "stop", "recover")  # link: the device's network link slowed by factor
GENERATORS = ("llama3", "greyhound", "alibaba")
_UNITS = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


@dataclass(frozen=True)
class Costs:
    """Seconds lost to each kind of recovery work; see each policy for which ones it pays."""

    restart_s: float = 600.0
    checkpoint_interval_s: float = 3600.0
    reconfig_s: float = 60.0
    heartbeat_timeout_s: float = 30.0
    repair_s: float = 4 * 3600.0


@dataclass(frozen=True)
class FailureEvent:
    at_s: float
    device: int
    kind: str
    factor: float = 1.0
    line: int = 0
    cause: str = ""


@dataclass(frozen=True)
class Generator:
    kind: str
    params: dict
    line: int = 0


@dataclass(frozen=True)
class ReplaySettings:
    """How the engine samples: steps simulated after each change, and periodic probe windows."""

    window_steps: int = 32
    observe_steps: int = 96
    probe_interval_s: float = 6 * 3600.0
    ops_microbatches: int = 8


@dataclass(frozen=True)
class Scenario:
    name: str
    path: str
    cluster: ClusterSpec
    model: ModelSpec
    parallel: ParallelDims
    workload: str
    duration_s: float
    costs: Costs
    events: tuple[FailureEvent, ...] = ()
    generators: tuple[Generator, ...] = ()
    noise_job: int = 2
    seed: int = 0
    settings: ReplaySettings = field(default_factory=ReplaySettings)
    family: str = ""


MAX_DURATION_S = 366 * 86400.0  # the longest replay: a year of training


def parse_duration(value: object, where: str) -> float:
    """Seconds from a number (seconds) or a string with a unit: ``90s``, ``30m``, ``12h``,
    ``7d``."""
    if isinstance(value, bool):
        raise InputError(f"{where}: expected a duration like 3600, 90m, 12h or 7d, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).replace(" ", "")
        parts = re.findall(r"([0-9]*\.?[0-9]+)(min|s|m|h|d)", text)
        if not parts or "".join(a + b for a, b in parts) != text:
            raise InputError(
                f"{where}: expected a duration like 3600, 90m, 12h, 9h30m or 7d, got {value!r}"
            )
        seconds = sum(float(a) * _UNITS[b] for a, b in parts)
    if not seconds >= 0 or seconds == float("inf"):
        raise InputError(f"{where}: expected a finite non-negative duration, got {value!r}")
    return seconds


class _Reader:
    """Typed field access on one mapping, with errors that say file:line: section.field."""

    def __init__(self, path: Path, data: object, section: str, parent_line: int = 0) -> None:
        self.path, self.section = path, section
        line = data.line if isinstance(data, LineDict) else parent_line
        self.where = f"{path}:{line}: {section}" if line else f"{path}: {section}"
        if not isinstance(data, dict):
            raise InputError(f"{self.where}: expected a mapping, got {type(data).__name__}")
        self.data = data

    def at(self, key: str) -> str:
        """``file:line: section.key``, the line the key is on."""
        line = getattr(self.data, "key_lines", {}).get(key)
        name = f"{self.section}.{key}" if self.section else key
        return f"{self.path}:{line}: {name}" if line else f"{self.where}.{key}"

    def check_keys(self, allowed: set[str]) -> None:
        unknown = sorted(set(self.data) - allowed)
        if unknown:
            raise InputError(
                f"{self.where}: unknown field(s) {', '.join(map(str, unknown))} "
                f"(expected some of {', '.join(sorted(allowed))})"
            )

    def number(
        self,
        key: str,
        default: float | None = None,
        minimum: float = 0.0,
        integer: bool = False,
        strict: bool = False,
    ) -> float:
        if key not in self.data:
            if default is None:
                raise InputError(f"{self.where}: missing field {key}")
            return default
        value = self.data[key]
        kind = "an integer" if integer else "a number"
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (integer and not isinstance(value, int))
        ):
            raise InputError(f"{self.at(key)}: expected {kind}, got {value!r}")
        if value < minimum or (strict and value == minimum) or value != value:
            op = ">" if strict else ">="
            raise InputError(f"{self.at(key)}: expected {kind} {op} {minimum:g}, got {value!r}")
        return int(value) if integer else float(value)

    def text(self, key: str, default: str | None = None) -> str:
        if key not in self.data:
            if default is None:
                raise InputError(f"{self.where}: missing field {key}")
            return default
        value = self.data[key]
        if not isinstance(value, str) or not value:
            raise InputError(f"{self.at(key)}: expected a non-empty string, got {value!r}")
        return value

    def duration(self, key: str, default: float | None = None) -> float:
        if key not in self.data:
            if default is None:
                raise InputError(f"{self.where}: missing field {key}")
            return default
        return parse_duration(self.data[key], self.at(key))

    def sub(self, key: str, required: bool = True) -> _Reader:
        if key not in self.data:
            if required:
                raise InputError(f"{self.where}: missing section {key}")
            return _Reader(self.path, LineDict(), f"{self.section}.{key}" if self.section else key)
        name = f"{self.section}.{key}" if self.section else key
        line = getattr(self.data, "key_lines", {}).get(key) or getattr(self.data, "line", 0)
        return _Reader(self.path, self.data[key], name, line)


def _cluster(r: _Reader, name: str) -> ClusterSpec:
    """``cluster``: nodes, gpus_per_node, device {name, type, memory_gb, peak_tflops, mfu,
    hbm_gbps} (an A100-80GB at 50% MFU by default), intra_node_gbps, inter_node_gbps,
    memory_reserve_gb; or a cluster in the form ``resihp plan`` reads, of identical nodes."""
    if _plan_form(r.data):
        return _plan_cluster(r, name)
    r.check_keys(keys_of("cluster"))
    d = r.sub("device", required=False)
    d.check_keys(keys_of("cluster.device"))
    d.text("name", "A100-80GB")  # named for the reader; the figures below are what counts
    mfu = d.number("mfu", 0.5, strict=True)
    if mfu > 1:
        raise InputError(f"{d.at('mfu')}: a fraction of peak, expected at most 1, got {mfu}")
    return ClusterSpec.uniform(
        r.number("nodes", minimum=1, integer=True),
        r.number("gpus_per_node", minimum=1, integer=True),
        memory_gb=d.number("memory_gb", 80.0, strict=True),
        tflops=d.number("peak_tflops", 312.0, strict=True) * mfu,
        hbm_gbs=d.number("hbm_gbps", 2039.0, strict=True),
        intra_node_gbs=r.number("intra_node_gbps", 300.0, strict=True),
        inter_node_gbs=r.number("inter_node_gbps", 25.0, strict=True),
        memory_reserve_gb=r.number("memory_reserve_gb", 2.0),
        name=name,
        device_type=d.text("type", ""),
    )


def _plan_form(data: dict) -> bool:
    """Whether a scenario's cluster is written as the planner's cluster files are."""
    device = data.get("device")
    return (
        "bandwidth" in data
        or not isinstance(data.get("nodes", 0), int)
        or (isinstance(device, dict) and "tflops" in device)
    )


def _plan_cluster(r: _Reader, name: str) -> ClusterSpec:
    """A cluster in the planner's form (``ClusterSpec.from_dict``), healthy and of identical
    nodes: the replay's failures come from its events and generators."""
    r.check_keys(PLAN_CLUSTER_KEYS)
    for key in ("speeds", "links"):
        if r.data.get(key):
            raise InputError(
                f"{r.at(key)}: a replay starts healthy; give slow devices and links as events"
            )
    spec = ClusterSpec.from_dict({**r.data, "name": name}, where=r.where)
    sizes = {len(ranks) for ranks in spec.node_ranks}
    if len(sizes) != 1 or len({(d.memory_gb, d.tflops, d.hbm_gbs) for d in spec.devices}) != 1:
        raise InputError(f"{r.where}: a replay's cluster has identical nodes of identical devices")
    return spec


def _model(r: _Reader) -> ModelSpec:
    r.check_keys(keys_of("model"))
    ints = {
        k: r.number(k, minimum=1, integer=True)
        for k in (
            "layers",
            "hidden",
            "heads",
            "ffn_hidden",
            "vocab",
            "max_seq_len",
            "global_batch_tokens",
            "microbatch_tokens",
        )
    }
    schedule = r.text("schedule", "1f1b")
    if schedule != "1f1b":
        raise InputError(f"{r.at('schedule')}: only 1f1b is replayed, got {schedule!r}")
    if ints["hidden"] % ints["heads"]:
        raise InputError(
            f"{r.where}: hidden ({ints['hidden']}) must be divisible by heads ({ints['heads']})"
        )
    if ints["microbatch_tokens"] < ints["max_seq_len"]:
        raise InputError(
            f"{r.at('microbatch_tokens')}: must hold one longest sequence "
            f"(max_seq_len {ints['max_seq_len']}), got {ints['microbatch_tokens']}"
        )
    mlp = r.text("mlp", "gelu")
    if mlp not in MLP_MATRICES:
        raise InputError(f"{r.at('mlp')}: expected one of {', '.join(MLP_MATRICES)}, got {mlp!r}")
    try:
        return ModelSpec(name=r.text("name", "model"), schedule=schedule, mlp=mlp, **ints)
    except InputError as exc:
        raise InputError(f"{r.where}: {exc}") from None


def _events(
    path: Path, items: object, cluster: ClusterSpec, duration_s: float, line: int
) -> tuple[FailureEvent, ...]:
    if items is None:
        return ()
    if not isinstance(items, list):
        raise InputError(f"{path}:{line}: events: expected a list of events")
    events: list[FailureEvent] = []
    state: dict[int, str] = {}
    for i, item in enumerate(items):
        r = _Reader(path, item, f"events[{i}]", line)
        r.check_keys(keys_of("events"))
        at = r.duration("at")
        if at > duration_s:
            raise InputError(
                f"{r.where}.at: {at:g} s is after the end of the scenario ({duration_s:g} s)"
            )
        if events and at < events[-1].at_s:
            raise InputError(
                f"{r.where}.at: events must be in time order; {at:g} s comes after "
                f"{events[-1].at_s:g} s"
            )
        kind = r.text("kind")
        if kind not in KINDS:
            raise InputError(f"{r.where}.kind: expected one of {', '.join(KINDS)}, got {kind!r}")
        if ("device" in r.data) == ("node" in r.data):
            raise InputError(
                f"{r.where}: give exactly one of device (0..{len(cluster) - 1}) or node "
                f"(0..{cluster.node_count - 1})"
            )
        if "device" in r.data:
            dev = r.number("device", minimum=0, integer=True)
            if dev >= len(cluster):
                raise InputError(
                    f"{r.where}.device: unknown device {dev}; the cluster has devices "
                    f"0..{len(cluster) - 1}"
                )
            devices = [dev]
        else:
            node = r.number("node", minimum=0, integer=True)
            if node >= cluster.node_count:
                raise InputError(
                    f"{r.where}.node: unknown node {node}; the cluster has nodes "
                    f"0..{cluster.node_count - 1}"
                )
            devices = list(cluster.node_ranks[node])
        factor = 1.0
        if kind in ("slow", "link"):
            factor = r.number("factor")
            if factor < 1.0:
                raise InputError(
                    f"{r.where}.factor: a slowdown factor is at least 1 (2.0 = twice as "
                    f"slow), got {factor:g}"
                )
        for dev in devices:
            current = state.get(dev, "healthy")
            if kind == "recover" and current == "healthy":
                raise InputError(f"{r.where}: device {dev} recovers but is not slow or stopped")
            if kind in ("slow", "link", "stop") and current != "healthy":
                raise InputError(
                    f"{r.where}: device {dev} is already {current}; events overlap "
                    "(add a recover event first)"
                )
            state[dev] = "healthy" if kind == "recover" else ("stopped" if kind == "stop" else kind)
            events.append(
                FailureEvent(
                    at,
                    dev,
                    kind,
                    factor,
                    r.data.line if isinstance(r.data, LineDict) else 0,
                    r.text("cause", ""),
                )
            )
    return tuple(events)


def _generators(path: Path, items: object, line: int) -> tuple[Generator, ...]:
    if items is None:
        return ()
    if not isinstance(items, list):
        raise InputError(f"{path}:{line}: generators: expected a list")
    out = []
    for i, item in enumerate(items):
        r = _Reader(path, item, f"generators[{i}]", line)
        kind = r.text("kind")
        if kind not in GENERATORS:
            raise InputError(
                f"{r.where}.kind: expected one of {', '.join(GENERATORS)}, got {kind!r}"
            )
        params = {k: v for k, v in r.data.items() if k != "kind"}
        out.append(Generator(kind, params, getattr(r.data, "line", 0)))
    return tuple(out)


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario YAML; raise InputError naming file, line and field."""
    path = Path(path)
    root = _Reader(path, load_yaml(path), "")
    root.where = str(path)
    root.check_keys(TOP_LEVEL)
    name = root.text("name", path.stem)
    cluster = _cluster(root.sub("cluster"), name)
    model = _model(root.sub("model"))
    p = root.sub("parallel")
    p.check_keys(keys_of("parallel"))
    parallel = ParallelDims(*(p.number(k, minimum=1, integer=True) for k in ("dp", "pp", "tp")))
    world = parallel.dp * parallel.pp * parallel.tp
    if world > len(cluster):
        raise InputError(
            f"{p.where}: dp*pp*tp = {world} devices but the cluster has {len(cluster)}"
        )
    if cluster.gpus_per_node % parallel.tp:
        raise InputError(
            f"{p.where}.tp: tensor-parallel groups stay inside a node; tp {parallel.tp} "
            f"does not divide gpus_per_node {cluster.gpus_per_node}"
        )
    if parallel.pp > model.layers:
        raise InputError(f"{p.where}.pp: {parallel.pp} stages for {model.layers} layers")
    mbs = model.global_batch_tokens // model.microbatch_tokens
    if mbs < parallel.dp:
        raise InputError(
            f"{root.where}: model.global_batch_tokens gives {mbs} micro-batches, fewer "
            f"than dp {parallel.dp}"
        )
    w = root.sub("workload")
    w.check_keys(keys_of("workload"))
    workload = w.text("source")
    duration = root.duration("duration")
    if duration <= 0:
        raise InputError(f"{root.where}: duration must be positive")
    if duration > MAX_DURATION_S:
        raise InputError(
            f"{root.where}: duration {duration / 86400:,.0f} days is past the limit of "
            f"{MAX_DURATION_S / 86400:.0f} days (a replay of a training job, not a century)"
        )
    c = root.sub("costs", required=False)
    c.check_keys(keys_of("costs"))
    costs = Costs(
        restart_s=c.duration("restart", Costs.restart_s),
        checkpoint_interval_s=c.duration("checkpoint_interval", Costs.checkpoint_interval_s),
        reconfig_s=c.duration("reconfig", Costs.reconfig_s),
        heartbeat_timeout_s=c.duration("heartbeat_timeout", Costs.heartbeat_timeout_s),
        repair_s=c.duration("repair", Costs.repair_s),
    )
    if costs.checkpoint_interval_s <= 0:
        raise InputError(f"{c.where}.checkpoint_interval: must be positive")
    n = root.sub("noise", required=False)
    n.check_keys(keys_of("noise"))
    noise_job = n.number("alibaba_job", 2, minimum=1, integer=True)
    s = root.sub("replay", required=False)
    s.check_keys(keys_of("replay"))
    settings = ReplaySettings(
        window_steps=s.number("window_steps", 32, minimum=4, integer=True),
        observe_steps=s.number("observe_steps", 96, minimum=4, integer=True),
        probe_interval_s=s.duration("probe_interval", 6 * 3600.0),
        ops_microbatches=s.number("ops_microbatches", 8, minimum=1, integer=True),
    )
    scenario = Scenario(
        name=name,
        path=str(path),
        cluster=cluster,
        model=model,
        parallel=parallel,
        workload=workload,
        duration_s=duration,
        costs=costs,
        events=_events(
            path, root.data.get("events"), cluster, duration, _line(root.data, "events")
        ),
        generators=_generators(path, root.data.get("generators"), _line(root.data, "generators")),
        noise_job=noise_job,
        seed=root.number("seed", 0, integer=True),
        settings=settings,
        family=root.text("family", ""),
    )
    check_fits(scenario, where=f"{path}: parallel")
    return scenario


def _line(data: LineDict, key: str) -> int:
    return data.key_lines.get(key) or data.line


def check_fits(scenario: Scenario, where: str) -> None:
    """Check that the initial layout fits in device memory; else a one-line ``InputError``.

    The uniform layout's layer split, each stage with the micro-batches 1F1B keeps in flight,
    within a device's memory less the reserve; ``where`` names the scenario in the error."""
    m, p = scenario.model, scenario.parallel
    counts = apportion(m.layers, np.ones(p.pp), minimum=1)
    need = pipeline_memory_gb(m, counts, p.tp, -(-m.microbatches // p.dp))
    s = int(np.argmax(need))
    have = scenario.cluster.free_memory_gb()
    if need[s] > have:
        raise InputError(
            f"{where}: the model does not fit the cluster: stage {s} of {counts[s]} "
            f"layers on tp={p.tp} needs {need[s]:.1f} GB per device, a device has "
            f"{have:g} GB free (raise pp or tp)"
        )
