"""Cluster and model specs, read from YAML (or dicts) and validated up front, and a stage's memory.

One definition each, for the planner and the replay (whose scenario's cluster is a
``ClusterSpec.uniform``)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np

from resihp.errors import InputError
from resihp.parallel import SCHEDULES
from resihp.workload.flops import TransformerShape
from resihp.yamlio import check_keys, read_yaml_mapping


def _read_spec(path: str | Path, what: str) -> dict[str, Any]:
    return read_yaml_mapping(path, what, f"expected a YAML mapping describing the {what}")


# the largest problems the planner takes (a bad spec must not hang it): 64x the 16,384 GPUs of
# the benchmarks, and 32x the micro-batches of a 16M-token step of 8,192-token micro-batches
MAX_DEVICES = 1 << 20
MAX_MICROBATCHES = 1 << 16


def _number(
    data: Mapping,
    key: str,
    where: str,
    default: Any = None,
    *,
    positive: bool = True,
    integer: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
):
    value = data.get(key, default)
    if value is None:
        raise InputError(f"{where}: field {key!r} is missing (expected a number)")
    kind = "integer" if integer else "number"
    if isinstance(value, bool) or not isinstance(value, (int, float) if not integer else int):
        raise InputError(
            f"{where}: field {key!r} must be {'an' if integer else 'a'} {kind}, got {value!r}"
        )
    if not math.isfinite(value):  # NaN passes every comparison below
        raise InputError(f"{where}: field {key!r} must be a finite {kind}, got {value!r}")
    if positive and value <= 0:
        raise InputError(f"{where}: field {key!r} must be a positive {kind}, got {value!r}")
    if minimum is not None and value < minimum:
        raise InputError(f"{where}: field {key!r} must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise InputError(f"{where}: field {key!r} must be <= {maximum}, got {value!r}")
    return value


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator.

    ``rank`` is its global index in node order; ``speed`` 0 means dead. ``tflops``: the sustained
    rate a training step reaches (a replay scenario's peak x MFU), what
    the analytic cost model divides FLOPs by; ``hbm_gbs``: its memory bandwidth (GB/s), the pace of
    the optimizer step."""

    rank: int
    node: int
    name: str
    memory_gb: float
    tflops: float
    speed: float = 1.0
    hbm_gbs: float = 2039.0

    @property
    def alive(self) -> bool:
        return self.speed > 0


@dataclass(frozen=True)
class ClusterSpec:
    """Nodes of devices, with intra- and inter-node bandwidth (GB/s), and the slow links.

    A slow link joins two devices and runs below that bandwidth (``links``: ``(a, b, speed)``,
    ``a < b``, speed in (0, 1), a fraction of the link's healthy bandwidth)."""

    devices: tuple[DeviceSpec, ...]
    intra_node_gbs: float = 300.0
    inter_node_gbs: float = 25.0
    memory_reserve_gb: float = 2.0
    name: str = "cluster"
    links: tuple[tuple[int, int, float], ...] = ()
    # seconds each stage-boundary transfer costs beyond its bytes: a runtime's own overhead per
    # send/recv (gloo on CPUs: Python and the library, not the wire), measured by a live job's
    # pacing (``resihp.train.planning.paced_to``); 0 in cluster specs
    p2p_overhead_s: float = 0.0
    # the kind of device, as a predictor card names it (``cuda:NVIDIA H100``, ``cpu``); "" unsaid
    device_type: str = ""

    DEVICE_KEYS = ("memory_gb", "tflops", "speed", "hbm_gbs")

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterSpec:
        return cls.from_dict(_read_spec(path, "cluster"), where=str(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "cluster") -> ClusterSpec:
        """The cluster a YAML mapping describes, checked (``where`` names it in errors).

        Fields: ``nodes`` (a list of ``{name, devices: N | [ {memory_gb, speed, tflops}, ... ]}``
        or the shorthand ``{count, devices}``), ``device`` (defaults: memory_gb, tflops, speed,
        optional hbm_gbs, and ``type``: the kind of device as a predictor card names it, e.g.
        ``cuda:NVIDIA H100`` or ``cpu``, which ``plan --predictor`` checks a predictor against),
        ``bandwidth`` (``intra_node_gbs``, ``inter_node_gbs``), optional ``speeds`` overrides
        ``{rank or "node/index": speed}``, ``links`` (slow links: a list of ``{ranks: [a, b],
        speed: s}``, s a fraction of the healthy bandwidth) and ``memory_reserve_gb``."""
        if not isinstance(data, Mapping):
            raise InputError(f"{where}: expected a mapping describing the cluster")
        check_keys(
            data,
            ("name", "device", "bandwidth", "memory_reserve_gb", "nodes", "speeds", "links"),
            where,
        )
        defaults = data.get("device", {}) or {}
        if not isinstance(defaults, Mapping):
            raise InputError(f"{where}: field 'device' must be a mapping of device defaults")
        check_keys(defaults, (*cls.DEVICE_KEYS, "type"), f"{where}: device")
        device_type = defaults.get("type", "")
        if not isinstance(device_type, str) or ("type" in defaults and not device_type.strip()):
            raise InputError(
                f"{where}: device: field 'type' must name the kind of device as a "
                f"predictor card does (e.g. 'cuda:NVIDIA H100' or 'cpu'), got "
                f"{device_type!r}"
            )
        bandwidth = data.get("bandwidth", {}) or {}
        if not isinstance(bandwidth, Mapping):
            raise InputError(
                f"{where}: field 'bandwidth' must be a mapping with intra_node_gbs, inter_node_gbs"
            )
        check_keys(bandwidth, ("intra_node_gbs", "inter_node_gbs"), f"{where}: bandwidth")
        nodes = data.get("nodes")
        if isinstance(nodes, Mapping):
            check_keys(nodes, ("count", "devices"), f"{where}: nodes")
            count = _number(nodes, "count", f"{where}: nodes", integer=True, maximum=MAX_DEVICES)
            nodes = [{"name": f"n{i}", "devices": nodes.get("devices")} for i in range(count)]
        if not isinstance(nodes, list) or not nodes:
            raise InputError(
                f"{where}: field 'nodes' must be a non-empty list of nodes or "
                "{count: N, devices: M}"
            )
        devices: list[DeviceSpec] = []
        seen_names: set[str] = set()
        for n, node in enumerate(nodes):
            nwhere = f"{where}: nodes[{n}]"
            if not isinstance(node, Mapping):
                raise InputError(f"{nwhere}: expected a mapping with 'devices'")
            check_keys(node, ("name", "devices"), nwhere)
            name = str(node.get("name", f"n{n}"))
            if name in seen_names:
                raise InputError(f"{nwhere}: node name {name!r} is used twice")
            seen_names.add(name)
            entries = node.get("devices")
            if isinstance(entries, int) and not isinstance(entries, bool):
                if entries < 1:
                    raise InputError(f"{nwhere}: field 'devices' must be positive, got {entries}")
                if len(devices) + entries > MAX_DEVICES:
                    raise InputError(
                        f"{nwhere}: field 'devices': the cluster would have more than "
                        f"{MAX_DEVICES:,} devices, the most resihp plans for"
                    )
                entries = [{}] * entries
            if not isinstance(entries, list) or not entries:
                raise InputError(
                    f"{nwhere}: field 'devices' must be a device count or a list of devices"
                )
            for i, entry in enumerate(entries):
                dwhere = f"{nwhere}.devices[{i}]"
                if not isinstance(entry, Mapping):
                    raise InputError(f"{dwhere}: expected a mapping (memory_gb, speed, tflops)")
                check_keys(entry, cls.DEVICE_KEYS, dwhere)
                merged = {**defaults, **entry}
                devices.append(
                    DeviceSpec(
                        rank=len(devices),
                        node=n,
                        name=f"{name}/{i}",
                        memory_gb=float(_number(merged, "memory_gb", dwhere)),
                        tflops=float(_number(merged, "tflops", dwhere)),
                        speed=float(
                            _number(
                                merged,
                                "speed",
                                dwhere,
                                1.0,
                                positive=False,
                                minimum=0.0,
                                maximum=1.0,
                            )
                        ),
                        hbm_gbs=float(_number(merged, "hbm_gbs", dwhere, DeviceSpec.hbm_gbs)),
                    )
                )
        if len(devices) > MAX_DEVICES:
            raise InputError(
                f"{where}: {len(devices):,} devices, more than the {MAX_DEVICES:,} resihp plans for"
            )
        reserve = _number(data, "memory_reserve_gb", where, 2.0, positive=False, minimum=0.0)
        smallest = min(d.memory_gb for d in devices)
        if reserve >= smallest:
            raise InputError(
                f"{where}: field 'memory_reserve_gb' must be below every device's "
                f"memory_gb (the smallest: {smallest:g}), got {reserve:g}"
            )
        cluster = cls(
            devices=tuple(devices),
            intra_node_gbs=float(
                _number(bandwidth, "intra_node_gbs", f"{where}: bandwidth", 300.0)
            ),
            inter_node_gbs=float(_number(bandwidth, "inter_node_gbs", f"{where}: bandwidth", 25.0)),
            memory_reserve_gb=float(reserve),
            name=str(data.get("name", where)),
            device_type=device_type.strip(),
        )
        overrides = data.get("speeds") or {}
        if not isinstance(overrides, Mapping):
            raise InputError(f"{where}: field 'speeds' must map a rank or 'node/index' to a speed")
        cluster = cluster.with_speeds(overrides, where=f"{where}: speeds")
        links = data.get("links") or []
        if not isinstance(links, list):
            raise InputError(
                f"{where}: field 'links' must be a list of {{ranks: [a, b], speed: s}}"
            )
        found: dict[tuple[int | str, int | str], float] = {}
        for k, link in enumerate(links):
            lwhere = f"{where}: links[{k}]"
            if (
                not isinstance(link, Mapping)
                or not isinstance(link.get("ranks"), list)
                or len(link["ranks"]) != 2
            ):
                raise InputError(f"{lwhere}: expected {{ranks: [a, b], speed: s}}")
            check_keys(link, ("ranks", "speed"), lwhere)
            found[tuple(link["ranks"])] = float(_number(link, "speed", lwhere, maximum=1.0))
        return cluster.with_link_speeds(found, where=f"{where}: links") if found else cluster

    @classmethod
    def uniform(
        cls,
        nodes: int,
        gpus_per_node: int,
        memory_gb: float,
        tflops: float,
        *,
        hbm_gbs: float = DeviceSpec.hbm_gbs,
        intra_node_gbs: float = 300.0,
        inter_node_gbs: float = 25.0,
        memory_reserve_gb: float = 2.0,
        name: str = "cluster",
        device_type: str = "",
    ) -> ClusterSpec:
        """``nodes`` nodes of ``gpus_per_node`` identical healthy devices (``n<node>/<index>``).

        Args:
            nodes: the number of nodes.
            gpus_per_node: the devices on each node.
            memory_gb: each device's memory, in GB.
            tflops: each device's sustained TFLOP/s.
            hbm_gbs: each device's memory bandwidth, in GB/s.
            intra_node_gbs: the bandwidth between two devices of a node, in GB/s.
            inter_node_gbs: the bandwidth between nodes, in GB/s.
            memory_reserve_gb: the memory a stage may not use on each device, in GB.
            name: the cluster's name.
            device_type: the kind of device as a predictor card names it (e.g. ``cpu``; empty:
                not given)."""
        devices = tuple(
            DeviceSpec(
                rank=i,
                node=i // gpus_per_node,
                name=f"n{i // gpus_per_node}/{i % gpus_per_node}",
                memory_gb=memory_gb,
                tflops=tflops,
                hbm_gbs=hbm_gbs,
            )
            for i in range(nodes * gpus_per_node)
        )
        return cls(
            devices,
            intra_node_gbs=intra_node_gbs,
            inter_node_gbs=inter_node_gbs,
            memory_reserve_gb=memory_reserve_gb,
            name=name,
            device_type=device_type,
        )

    def to_dict(self) -> dict[str, Any]:
        nodes: dict[int, list] = {}
        for d in self.devices:
            nodes.setdefault(d.node, []).append(
                {
                    "memory_gb": d.memory_gb,
                    "tflops": d.tflops,
                    "speed": d.speed,
                    "hbm_gbs": d.hbm_gbs,
                }
            )
        names = {d.node: d.name.split("/")[0] for d in self.devices}
        return {
            "name": self.name,
            "bandwidth": {
                "intra_node_gbs": self.intra_node_gbs,
                "inter_node_gbs": self.inter_node_gbs,
            },
            "memory_reserve_gb": self.memory_reserve_gb,
            "nodes": [{"name": names[n], "devices": devs} for n, devs in nodes.items()],
            **({"device": {"type": self.device_type}} if self.device_type else {}),
            **(
                {"links": [{"ranks": [a, b], "speed": v} for a, b, v in self.links]}
                if self.links
                else {}
            ),
        }

    def __len__(self) -> int:
        return len(self.devices)

    @cached_property
    def node_ranks(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of each node, in node order."""
        nodes: dict[int, list[int]] = {}
        for d in self.devices:
            nodes.setdefault(d.node, []).append(d.rank)
        return tuple(tuple(r) for _, r in sorted(nodes.items()))

    @property
    def node_count(self) -> int:
        return len(self.node_ranks)

    @cached_property
    def gpus_per_node(self) -> int:
        """Devices per node, for layouts that need nodes of one size (the replay's)."""
        sizes = sorted({len(r) for r in self.node_ranks})
        if len(sizes) != 1:
            raise InputError(
                f"cluster {self.name}: nodes of different sizes ({sizes}) where one size is needed"
            )
        return sizes[0]

    @cached_property
    def speeds(self) -> np.ndarray:
        return np.array([d.speed for d in self.devices])

    @cached_property
    def tflops(self) -> np.ndarray:
        return np.array([d.tflops for d in self.devices])

    @cached_property
    def min_memory_gb(self) -> float:
        return min(d.memory_gb for d in self.devices)

    @cached_property
    def min_hbm_gbs(self) -> float:
        """The slowest device memory's bandwidth (GB/s)."""
        return min(d.hbm_gbs for d in self.devices)

    def free_memory_gb(self, ranks: Iterable[int] | None = None) -> float:
        """What a stage may hold on each device of ``ranks`` (every device when None), in GB.

        That is the smallest one's memory less the reserve."""
        least = (
            self.min_memory_gb if ranks is None else min(self.devices[r].memory_gb for r in ranks)
        )
        return least - self.memory_reserve_gb

    @cached_property
    def degraded(self) -> frozenset[int]:
        """Ranks of the devices not at full speed, dead ones included, and the ends of slow links.

        These are what a re-plan works around."""
        return frozenset(np.flatnonzero(self.speeds != 1.0).tolist()) | self.slow_link_ranks

    @cached_property
    def link_speeds(self) -> dict[tuple[int, int], float]:
        """``{(a, b): speed}`` (a < b) of the slow links."""
        return {(a, b): v for a, b, v in self.links}

    @cached_property
    def slow_link_ranks(self) -> frozenset[int]:
        return frozenset(r for a, b, _ in self.links for r in (a, b))

    def link_speed(self, a: int, b: int) -> float:
        """The link's fraction of its healthy bandwidth (1.0 unless it is a slow link)."""
        if not self.links:
            return 1.0
        return self.link_speeds.get((a, b) if a < b else (b, a), 1.0)

    def slowest_link_within(self, ranks: Iterable[int]) -> float:
        """The slowest link joining two of ``ranks`` (1.0 if none is slow).

        One pass over the slow links, not over every pair of ranks (a gradient ring's ranks number
        in the thousands)."""
        inside = set(ranks)
        return min((v for a, b, v in self.links if a in inside and b in inside), default=1.0)

    def with_link_speeds(self, speeds: Mapping[tuple, float], where: str = "links") -> ClusterSpec:
        """A copy with some links' speeds replaced.

        ``speeds`` is ``{(a, b): speed}``, a and b ranks or ``node/index`` names; 1.0 makes a link
        healthy again. ``where`` names the input in errors."""
        merged = dict(self.link_speeds)
        for (a, b), value in speeds.items():
            ra, rb = self.rank_of(a, where), self.rank_of(b, where)
            if ra == rb:
                raise InputError(f"{where}: a link joins two different devices, got {a!r} twice")
            if not (isinstance(value, (int, float)) and 0.0 < value <= 1.0):
                raise InputError(
                    f"{where}: speed of link {a!r}-{b!r} must be a number in (0, 1] "
                    f"(1 healthy), got {value!r}"
                )
            merged[(min(ra, rb), max(ra, rb))] = float(value)
        links = tuple((a, b, v) for (a, b), v in sorted(merged.items()) if v < 1.0)
        new = replace(self, links=links)
        for name in ("node_ranks", "hardware_key", "tflops", "speeds", "_by_name"):
            if name in self.__dict__ or name in ("node_ranks", "hardware_key", "tflops"):
                new.__dict__[name] = getattr(self, name)
        return new

    @cached_property
    def dead(self) -> frozenset[int]:
        return frozenset(np.flatnonzero(~(self.speeds > 0)).tolist())

    @cached_property
    def _by_name(self) -> dict[str, int]:
        return {d.name: d.rank for d in self.devices}

    def rank_of(self, key: int | str, where: str = "device") -> int:
        """A device by rank (int or digits) or by ``node/index`` name."""
        if (
            isinstance(key, (int, np.integer))
            and not isinstance(key, bool)
            or isinstance(key, str)
            and key.strip().isdigit()
        ):
            rank = int(key)
        elif isinstance(key, str) and key in self._by_name:
            return self._by_name[key]
        else:
            raise InputError(
                f"{where}: unknown device {key!r} (expected a rank 0..{len(self) - 1} "
                "or a 'node/index' name)"
            )
        if not 0 <= rank < len(self):
            raise InputError(
                f"{where}: unknown device rank {rank} (cluster has ranks 0..{len(self) - 1})"
            )
        return rank

    def with_speeds(
        self, speeds: Mapping[int | str, float] | np.ndarray, where: str = "speeds"
    ) -> ClusterSpec:
        """A copy with some device speeds replaced (1/slowdown from the detector; 0 = dead)."""
        if isinstance(speeds, np.ndarray):
            if speeds.shape != (len(self),):
                raise InputError(f"{where}: expected {len(self)} speeds, got shape {speeds.shape}")
            if speeds.dtype.kind in "iuf":
                return self._with_speed_array(speeds, where)
            speeds = dict(enumerate(speeds.tolist()))
        if not speeds:
            return self
        new = self.speeds.copy()
        for key, value in speeds.items():
            rank = self.rank_of(key, where)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float, np.floating))
                or not 0.0 <= float(value) <= 1.0
            ):
                raise InputError(
                    f"{where}: speed of device {key!r} must be a number in [0, 1] "
                    f"(1 healthy, 0 dead), got {value!r}"
                )
            new[rank] = float(value)
        return self._with_speed_array(new, where)

    def _with_speed_array(self, speeds: np.ndarray, where: str) -> ClusterSpec:
        bad = np.flatnonzero(~((speeds >= 0.0) & (speeds <= 1.0)))
        if len(bad):
            rank = int(bad[0])
            raise InputError(
                f"{where}: speed of device {rank!r} must be a number in [0, 1] "
                f"(1 healthy, 0 dead), got {speeds[rank].item()!r}"
            )
        speeds = speeds.astype(np.float64)  # a copy: the caller's array may change later
        devices = list(self.devices)
        for rank in np.flatnonzero(speeds != self.speeds).tolist():
            devices[rank] = replace(devices[rank], speed=speeds[rank].item())
        new = replace(self, devices=tuple(devices))
        # what only the hardware decides is built once and carried over to every copy (16,384
        # devices: rebuilding it at every re-plan is slow; the planner finds its caches by it)
        for name in ("node_ranks", "hardware_key", "tflops"):
            new.__dict__[name] = getattr(self, name)
        if "_by_name" in self.__dict__:
            new.__dict__["_by_name"] = self._by_name
        new.__dict__["speeds"] = speeds
        return new

    def healthy(self) -> ClusterSpec:
        """The same cluster with every device at full speed and every link healthy."""
        if not self.degraded:
            return self
        cluster = (
            self.with_link_speeds({(a, b): 1.0 for a, b, _ in self.links}) if self.links else self
        )
        return (
            cluster._with_speed_array(np.ones(len(self)), "healthy")
            if cluster.degraded
            else cluster
        )

    def paced(self, factor: float, links: float | None = None) -> ClusterSpec:
        """The same cluster running ``factor`` times slower.

        Every rate (FLOP rate, memory and link bandwidth) is divided by it, so every analytic time
        is ``factor`` times as long; ``links``: link bandwidths divided by this instead. A job's
        measured steps give the factors (``resihp.launch.live``): an analytic model priced on a
        matmul benchmark misses a training loop's overheads by a roughly constant multiple."""
        for value in (factor, 1.0 if links is None else links):
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value > 0):
                raise InputError(f"cluster pace: expected a positive finite factor, got {value!r}")
        links = factor if links is None else links
        devices = tuple(
            replace(d, tflops=d.tflops / factor, hbm_gbs=d.hbm_gbs / factor) for d in self.devices
        )
        return replace(
            self,
            devices=devices,
            intra_node_gbs=self.intra_node_gbs / links,
            inter_node_gbs=self.inter_node_gbs / links,
        )

    @cached_property
    def hardware_key(self) -> tuple:
        """What the healthy layout depends on: nodes, device memory and FLOP rates, links."""
        return (
            tuple((d.node, d.memory_gb, d.tflops) for d in self.devices),
            self.intra_node_gbs,
            self.inter_node_gbs,
            self.memory_reserve_gb,
            self.p2p_overhead_s,
        )

    def bandwidth_gbs(self, a: int, b: int) -> float:
        same = self.devices[a].node == self.devices[b].node
        return self.intra_node_gbs if same else self.inter_node_gbs

    def topology(self) -> nx.Graph:
        """Devices as graph nodes, joined through node switches and one fabric.

        Each node's devices are joined to a node switch (intra-node bandwidth) and the switches to
        one fabric (inter-node bandwidth)."""
        graph = nx.Graph()
        graph.add_node("fabric", kind="fabric")
        for n, ranks in enumerate(self.node_ranks):
            switch = f"node{n}"
            graph.add_node(switch, kind="switch")
            graph.add_edge(switch, "fabric", bandwidth_gbs=self.inter_node_gbs)
            for r in ranks:
                d = self.devices[r]
                graph.add_node(
                    r,
                    kind="device",
                    name=d.name,
                    memory_gb=d.memory_gb,
                    tflops=d.tflops,
                    speed=d.speed,
                )
                graph.add_edge(r, switch, bandwidth_gbs=self.intra_node_gbs)
        return graph


@dataclass(frozen=True)
class ModelSpec:
    """The model and the batch it is trained with, plus the memory costs of its state."""

    layers: int
    hidden: int
    heads: int
    ffn_hidden: int
    vocab: int
    max_seq_len: int
    global_batch_tokens: int
    microbatch_tokens: int
    schedule: str = "1f1b"
    name: str = "model"
    mlp: str = "gelu"  # "gelu": up and down projections; "swiglu": gate, up and down (Llama)
    # bytes of model state per parameter: bf16 weights (2) + bf16 gradients (2) + fp32 Adam
    # master weights, m and v (12); the YAML may give the parts (weight_bytes_per_param, ...)
    state_bytes_per_param: float = 16.0
    activation_bytes_per_token_layer: float | None = None  # default 34 * hidden (flash attention)
    workload: str | None = None  # sequence-length source for the expected micro-batch mix
    tp: int | None = None  # fixed parallel degrees of the healthy layout (None: planner picks)
    pp: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    MLP_MATRICES = {"gelu": 2, "swiglu": 3}

    def __post_init__(self) -> None:
        if self.mlp not in self.MLP_MATRICES:
            raise InputError(
                f"model {self.name}: mlp must be one of {', '.join(self.MLP_MATRICES)}, "
                f"got {self.mlp!r}"
            )
        self.shape()
        for name in ("vocab", "max_seq_len", "global_batch_tokens", "microbatch_tokens"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise InputError(
                    f"model {self.name}: {name} must be a positive integer, got {value!r}"
                )
        if self.schedule not in SCHEDULES:
            raise InputError(
                f"model {self.name}: schedule must be one of {', '.join(SCHEDULES)}, "
                f"got {self.schedule!r}"
            )
        if self.global_batch_tokens % self.microbatch_tokens:
            raise InputError(
                f"model {self.name}: global_batch_tokens ({self.global_batch_tokens}) must "
                f"be a multiple of microbatch_tokens ({self.microbatch_tokens})"
            )
        if self.global_batch_tokens // self.microbatch_tokens > MAX_MICROBATCHES:
            raise InputError(
                f"model {self.name}: global_batch_tokens / microbatch_tokens = "
                f"{self.global_batch_tokens // self.microbatch_tokens:,} micro-batches a "
                f"step, more than the {MAX_MICROBATCHES:,} resihp plans for"
            )
        if self.microbatch_tokens < self.max_seq_len:
            raise InputError(
                f"model {self.name}: microbatch_tokens ({self.microbatch_tokens}) must be "
                f">= max_seq_len ({self.max_seq_len}) so any sequence fits"
            )
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InputError(
                    f"model {self.name}: {name} must be a positive integer, got {value!r}"
                )
        if self.tp is not None and self.tp & (self.tp - 1):
            raise InputError(f"model {self.name}: tp must be a power of two, got {self.tp}")
        if self.pp is not None and self.pp > self.layers:
            raise InputError(
                f"model {self.name}: pp ({self.pp}) exceeds the number of layers ({self.layers})"
            )

    FIELDS = (
        "layers",
        "hidden",
        "heads",
        "ffn_hidden",
        "vocab",
        "max_seq_len",
        "global_batch_tokens",
        "microbatch_tokens",
    )

    @classmethod
    def from_yaml(cls, path: str | Path) -> ModelSpec:
        return cls.from_dict(_read_spec(path, "model"), where=str(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "model") -> ModelSpec:
        if not isinstance(data, Mapping):
            raise InputError(f"{where}: expected a mapping describing the model")
        kwargs: dict[str, Any] = {k: _number(data, k, where, integer=True) for k in cls.FIELDS}
        for key in ("tp", "pp"):
            if data.get(key) is not None:
                kwargs[key] = _number(data, key, where, integer=True)
        parts = [k for k in STATE_PARTS if k in data]
        if parts and "state_bytes_per_param" in data:
            raise InputError(
                f"{where}: give either state_bytes_per_param or its parts "
                f"({', '.join(STATE_PARTS)}), not both"
            )
        if parts:
            kwargs["state_bytes_per_param"] = float(
                sum(
                    _number(data, k, where, STATE_PARTS[k], positive=False, minimum=0.0)
                    for k in STATE_PARTS
                )
            )
        elif "state_bytes_per_param" in data:
            kwargs["state_bytes_per_param"] = float(_number(data, "state_bytes_per_param", where))
        if data.get("activation_bytes_per_token_layer") is not None:
            kwargs["activation_bytes_per_token_layer"] = float(
                _number(data, "activation_bytes_per_token_layer", where)
            )
        schedule = data.get("schedule", "1f1b")
        if schedule not in SCHEDULES:
            raise InputError(
                f"{where}: field 'schedule' must be one of {', '.join(SCHEDULES)}, got {schedule!r}"
            )
        mlp = data.get("mlp", "gelu")
        if mlp not in cls.MLP_MATRICES:
            raise InputError(
                f"{where}: field 'mlp' must be one of {', '.join(cls.MLP_MATRICES)}, got {mlp!r}"
            )
        workload = data.get("workload")
        if workload is not None and not isinstance(workload, str):
            raise InputError(f"{where}: field 'workload' must be a length source name or path")
        known = (
            set(cls.FIELDS)
            | set(STATE_PARTS)
            | {
                "tp",
                "pp",
                "state_bytes_per_param",
                "schedule",
                "workload",
                "name",
                "mlp",
                "activation_bytes_per_token_layer",
            }
        )
        check_keys(data, known, where)
        try:
            return cls(
                **kwargs,
                schedule=schedule,
                workload=workload,
                mlp=mlp,
                name=str(data.get("name", Path(where).stem)),
                extra={k: v for k, v in data.items() if k not in known},
            )
        except InputError as exc:
            raise InputError(f"{where}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.FIELDS}
        out.update(
            name=self.name,
            schedule=self.schedule,
            mlp=self.mlp,
            state_bytes_per_param=self.state_bytes_per_param,
        )
        for key in ("tp", "pp", "workload", "activation_bytes_per_token_layer"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @property
    def microbatches(self) -> int:
        """Micro-batches per global batch."""
        return self.global_batch_tokens // self.microbatch_tokens

    def shape(self, layers: int | None = None, tp: int = 1) -> TransformerShape:
        return TransformerShape(
            layers or self.layers,
            self.hidden,
            self.heads,
            self.ffn_hidden,
            tp,
            self.MLP_MATRICES[self.mlp],
        )

    @property
    def params_per_layer(self) -> int:
        return layer_params(self.hidden, self.ffn_hidden, self.mlp)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> float:
        """All parameters: the layers, the embedding and the (untied) LM head."""
        return float(self.layers * self.params_per_layer + 2 * self.embedding_params)


MLP_MATRICES = ModelSpec.MLP_MATRICES


def layer_params(hidden: int, ffn_hidden: int, mlp: str = "gelu") -> int:
    """Parameters of one decoder layer.

    QKV, projection and the MLP matrices with biases, plus two LayerNorms.

    Args:
        hidden: the hidden size.
        ffn_hidden: the MLP's inner size.
        mlp: the MLP's kind: ``gelu`` (two matrices) or ``swiglu`` (three)."""
    h, f, m = hidden, ffn_hidden, MLP_MATRICES[mlp]
    return 4 * h * h + m * h * f + 9 * h + (m - 1) * f


STATE_PARTS = {
    "weight_bytes_per_param": 2.0,
    "grad_bytes_per_param": 2.0,
    "optimizer_bytes_per_param": 12.0,
}


def layer_memory_gb(model: ModelSpec, tp: int = 1) -> dict[str, float]:
    """One layer's model state and activations per micro-batch in flight, in GB per device.

    Per device of a TP group of ``tp``."""
    act = activation_bytes_per_token_layer(model)
    return {
        "state": model.params_per_layer * model.state_bytes_per_param / tp / 1e9,
        "activations_per_microbatch": model.microbatch_tokens * act / tp / 1e9,
    }


def activation_bytes_per_token_layer(model: ModelSpec) -> float:
    """Activation bytes a layer keeps per token for the backward (before the tensor-parallel split).

    The model's own figure, else 34 x hidden (selective recomputation with sequence parallelism,
    Korthikanti et al., 2022)."""
    return model.activation_bytes_per_token_layer or 34.0 * model.hidden


def in_flight_microbatches(schedule: str, stages: int, stage: int, microbatches: int) -> int:
    """Micro-batches whose activations one stage of a pipeline holds at once.

    1F1B: the pipeline depth minus the stage index, at most ``microbatches``; GPipe: all.

    Args:
        schedule: the pipeline schedule, ``1f1b`` or ``gpipe``.
        stages: the pipeline's depth.
        stage: the stage's index, 0 first.
        microbatches: the micro-batches the pipeline carries per step."""
    return min(microbatches, stages - stage) if schedule == "1f1b" else microbatches


def stage_memory_gb(
    model: ModelSpec,
    layers: int,
    tp: int,
    in_flight: int,
    first: bool,
    last: bool,
    microbatch_tokens: float | None = None,
) -> float:
    """Memory of one device of a stage, in GB.

    The model state of its layer shard (the first stage also the embedding, the last the untied LM
    head; ``model.state_bytes_per_param``, mixed-precision Adam by default) plus the activations of
    ``in_flight`` micro-batches (``activation_bytes_per_token_layer``), all divided over the
    ``tp`` devices.

    Args:
        model: the model and its batch.
        layers: the stage's layer count.
        tp: the stage's tensor-parallel width.
        in_flight: the micro-batches whose activations it holds at once.
        first: it is the first stage (it holds the embedding).
        last: it is the last stage (it holds the LM head).
        microbatch_tokens: a micro-batch's tokens (None: the model's budget)."""
    state = layers * model.params_per_layer
    if first:
        state += model.embedding_params
    if last:
        state += model.embedding_params  # untied LM head
    act_per_token = activation_bytes_per_token_layer(model)
    tokens = microbatch_tokens or model.microbatch_tokens
    activations = in_flight * layers * tokens * act_per_token
    return (state * model.state_bytes_per_param + activations) / tp / 1e9


def pipeline_memory_gb(
    model: ModelSpec,
    layer_counts: Sequence[int],
    tp: int,
    microbatches: int,
    microbatch_tokens: float | None = None,
) -> list[float]:
    """``stage_memory_gb`` of every stage of a pipeline of ``tp``-wide groups.

    Args:
        model: the model and its batch (its schedule).
        layer_counts: each stage's layer count, in pipeline order.
        tp: every stage's tensor-parallel width.
        microbatches: the micro-batches the pipeline runs per step.
        microbatch_tokens: a micro-batch's tokens (None: the model's budget)."""
    p = len(layer_counts)
    return [
        stage_memory_gb(
            model,
            n,
            tp,
            in_flight_microbatches(model.schedule, p, s, microbatches),
            s == 0,
            s == p - 1,
            microbatch_tokens,
        )
        for s, n in enumerate(layer_counts)
    ]
