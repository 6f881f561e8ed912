"""Names the device a measurement was taken on, and the software that took it."""

from __future__ import annotations

import platform
import shutil
import subprocess
import time
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
    """``cuda:NVIDIA H100 80GB HBM3`` or ``cpu:AMD EPYC x1thr``: the kind, the model, CPU
    threads."""
    import torch

    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{cpu_name()} x{torch.get_num_threads()}thr"


def this_device(kind: str = "cpu", threads: int = 1) -> str:
    """The name :func:`device_name` gives this machine's ``kind`` device.

    For a job that runs torch with ``threads`` intra-op threads (resihp's jobs and profiles use
    1)."""
    if kind == "cpu":
        return f"cpu:{cpu_name()} x{threads}thr"
    import torch

    return device_name(torch.device(kind))


def available_memory_gb(kind: str = "cpu") -> float:
    """Memory free for a job now: the kernel's MemAvailable on a CPU, the device's free memory on
    a GPU."""
    if kind == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0] / 2**30
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    raise OSError("/proc/meminfo has no MemAvailable")


def measured_tflops(
    kind: str = "cpu", threads: int = 1, size: int = 512, seconds: float = 0.2
) -> float:
    """Dense matmul rate of one device measured now, in TFLOP/s.

    The median of repeated ``size``-square float32 matmuls over about ``seconds``.

    Args:
        kind: the torch device kind (``cpu``, ``cuda``).
        threads: torch threads on a CPU.
        size: the square matrices' side.
        seconds: about how long to measure.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _matmul_tflops(torch.device(kind), size, seconds)
    finally:
        torch.set_num_threads(before)


def _matmul_tflops(device: torch.device, size: int, seconds: float) -> float:
    import torch

    kind = device.type
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    sync = torch.cuda.synchronize if kind == "cuda" else (lambda: None)
    a @ b
    sync()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        t0 = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 2 * size**3 / times[len(times) // 2] / 1e12


def versions() -> dict[str, str]:
    import lightgbm
    import numpy
    import sklearn
    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "lightgbm": lightgbm.__version__,
        "scikit-learn": sklearn.__version__,
    }
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
    return out


def measurement_env(device: torch.device) -> dict[str, str]:
    """The device and software a measurement was taken with.

    Recorded in profiling logs, so a model trained elsewhere still names the machine and versions
    its data came from."""
    import torch

    out = {
        "device": device_name(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(
            cuda=str(torch.version.cuda),
            cudnn=str(torch.backends.cudnn.version()),
            gpu_memory_gib=f"{props.total_memory / 2**30:.1f}",
            multiprocessors=str(props.multi_processor_count),
            driver=_nvidia_driver(),
        )
    else:
        out["cpu"] = cpu_name()
    return out


def _nvidia_driver() -> str:
    """The NVIDIA driver's version as nvidia-smi reports it, or "unknown" (torch does not say)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown"
    try:
        done = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (
        done.stdout.strip().splitlines()[0]
        if done.returncode == 0 and done.stdout.strip()
        else "unknown"
    )
