"""Where and how a pass runs: the model moved to the trace's device and back, and deterministic kernels on
CUDA, each a context manager that restores what it found.

Example:
    >>> import torch
    >>> with deterministic(torch.device("cpu")) as settings:
    ...     settings
    (1, 'cpu kernels')
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from vitcam_nb.core.errors import TraceError

__all__ = ["CUDA_DETERMINISTIC", "deterministic", "on_device"]

CUDA_DETERMINISTIC = ("torch.use_deterministic_algorithms(True, warn_only=True), cudnn.deterministic=True, "
                      "cudnn.benchmark=False")


@contextlib.contextmanager
def on_device(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Move the model to ``device`` for the trace and back to where it was afterwards.

    Example:
        >>> m = torch.nn.Linear(1, 1)
        >>> with on_device(m, torch.device("cpu")):
        ...     m.weight.device.type
        'cpu'
    """
    devices = {t.device for t in list(model.parameters()) + list(model.buffers())}
    if not devices or devices == {device}:
        yield
        return
    if len(devices) > 1:
        raise TraceError(f"device: the model spans several devices {sorted(map(str, devices))}; "
                         "pass device=None to trace it where it is")
    original = devices.pop()
    model.to(device)
    try:
        yield
    finally:
        model.to(original)


@contextlib.contextmanager
def deterministic(device: torch.device) -> Iterator[tuple[int, str]]:
    """On CUDA, deterministic kernels for the pass (cuDNN and torch's flag), restored afterwards; the CPU
    kernels used here are deterministic already. Yields what the trace records: ``attrs["deterministic"]``
    (1 or 0) and ``attrs["deterministic_settings"]``.

    Example:
        >>> with deterministic(torch.device("meta")) as (flag, how):
        ...     flag, how
        (0, 'none: meta kernels have no deterministic switch here')
    """
    if device.type == "cpu":
        yield 1, "cpu kernels"
        return
    if device.type != "cuda":
        yield 0, f"none: {device.type} kernels have no deterministic switch here"
        return
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield 1, CUDA_DETERMINISTIC
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = previous[2], previous[3]
