"""Names the device a measurement was taken on, and the software that took it."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """``cuda:NVIDIA H100 80GB HBM3`` or ``cpu:AMD EPYC x1thr``: the kind, the model, CPU threads."""
    import torch

    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{cpu_name()} x{torch.get_num_threads()}thr"


def this_device(kind: str = "cpu", threads: int = 1) -> str:
    """The name :func:`device_name` gives this machine's ``kind`` device when a job runs torch with
    ``threads`` intra-op threads (resihp's jobs and profiles use 1)."""
    if kind == "cpu":
        return f"cpu:{cpu_name()} x{threads}thr"
    import torch

    return device_name(torch.device(kind))


def versions() -> dict[str, str]:
    import lightgbm
    import numpy
    import sklearn
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "numpy": numpy.__version__, "lightgbm": lightgbm.__version__,
           "scikit-learn": sklearn.__version__}
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
    return out
