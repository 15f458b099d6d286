"""What a benchmark ran on: the machine (CPU, cores, load, memory, GPU) and the versions of everything measured."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

import torch


def machine_info(device: str) -> dict:
    """CPU model, cores, load average, memory, torch threads and, on CUDA, the GPU name.

    Example:
        >>> "cpu_model" in machine_info("cpu")
        True
    """
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    info = {
        "cpu_model": cpu,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "memory_total_bytes": mem,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def versions() -> dict:
    """Versions of everything measured.

    Example:
        >>> "torch" in versions()
        True
    """
    from importlib import metadata

    out = {}
    for dist in ("vitcam_nb", "torch", "timm", "numpy", "xarray", "h5netcdf", "grad-cam", "torchcam"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out
