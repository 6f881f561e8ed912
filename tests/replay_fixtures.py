"""Small replay scenarios for tests, written as YAML files the way users write them."""

from __future__ import annotations

from pathlib import Path

import yaml

BASE = {
    "name": "tiny",
    "family": "mixed",
    "cluster": {
        "nodes": 8,
        "gpus_per_node": 8,
        "device": {"name": "A100-80GB", "memory_gb": 80, "peak_tflops": 312, "mfu": 0.5},
    },
    "model": {
        "name": "llama-7b",
        "layers": 32,
        "hidden": 4096,
        "heads": 32,
        "ffn_hidden": 11008,
        "vocab": 32000,
        "max_seq_len": 4096,
        "global_batch_tokens": 1048576,
        "microbatch_tokens": 4096,
    },
    "parallel": {"dp": 4, "pp": 2, "tp": 8},
    "workload": {"source": "text"},
    "duration": "4h",
    "seed": 7,
    "costs": {
        "restart": "10m",
        "checkpoint_interval": "1h",
        "reconfig": "1m",
        "heartbeat_timeout": "30s",
        "repair": "2h",
    },
    "replay": {"window_steps": 16, "observe_steps": 32, "probe_interval": "2h"},
}


def write(tmp: Path, name: str = "s.yaml", events: list | None = None, **changes) -> Path:
    data = {**BASE, **changes}
    if events is not None:
        data["events"] = events
    path = tmp / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
