"""Where and how a pass runs: the device checked before the model is touched, the model moved there and back,
one trace at a time per model, autocast refused, deterministic kernels on CUDA, parameters frozen for the pass and
freed memory handed back to the system as the pass goes; each context manager restores what it found.

Example:
    >>> import torch
    >>> with deterministic(torch.device("cpu")) as settings:
    ...     settings
    (1, 'cpu kernels')
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vitcam_nb.core import module_walk
from vitcam_nb.core.errors import TraceError

__all__ = ["CUDA_DETERMINISTIC", "check_autocast", "check_device", "deterministic", "exclusive", "frozen_parameters",
           "glibc_function", "on_device", "release_freed_memory", "releasing_during_backward",
           "releasing_during_forward"]

CUDA_DETERMINISTIC = ("torch.use_deterministic_algorithms(True, warn_only=True), cudnn.deterministic=True, "
                      "cudnn.benchmark=False")


_DEVICES = "None (the model's own device), \"cpu\", \"cuda\", \"cuda:N\" or \"mps\""
# The module ids of each running trace's model: an entry lives only while its trace runs, and the caller holds the
# model (so its modules' ids stay theirs) meanwhile.
_BUSY: dict[int, set[int]] = {}
_BUSY_LOCK = threading.Lock()


def check_device(device: object, model_device: torch.device) -> torch.device:
    """The device a trace runs on, refused before the model is touched when it cannot hold the model's weights:
    not a device name, ``meta`` (no values), CUDA or MPS absent, or a CUDA index that does not exist.

    Example:
        >>> check_device("cpu", torch.device("cpu"))
        device(type='cpu')
        >>> check_device("meta", torch.device("cpu"))  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceError: device: 'meta' holds no values ...
    """
    if device is None:
        if model_device.type == "meta":
            raise TraceError("model: its parameters are on the meta device and hold no values; load weights "
                             "first (model.to_empty(device='cpu') then load_state_dict)")
        return model_device
    if not isinstance(device, (str, torch.device)) or isinstance(device, bool):
        raise TraceError(f"device: expected {_DEVICES}, got {type(device).__name__} {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise TraceError(f"device: {device!r} is not a device name; expected {_DEVICES}") from exc
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise TraceError(f"device: {device!r} asks for CUDA, which this machine does not have (torch "
                             f"{torch.__version__}); use device='cpu' or None")
        count = torch.cuda.device_count()
        if dev.index is not None and not 0 <= dev.index < count:
            raise TraceError(f"device: {device!r} does not exist; this machine has CUDA devices 0..{count - 1}")
        return dev
    if dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise TraceError(f"device: {device!r} asks for MPS, which this machine does not have; use 'cpu'")
        return dev
    if dev.type == "meta":
        raise TraceError(f"device: {device!r} holds no values (moving the model there would drop its weights); "
                         f"expected {_DEVICES}")
    raise TraceError(f"device: {device!r} is not supported for tracing; expected {_DEVICES}")


def check_autocast() -> None:
    """Refuse a trace inside ``torch.autocast``: it would compute in another dtype than the trace records.

    Example:
        >>> check_autocast()  # outside autocast: nothing to say
    """
    try:
        active = [kind for kind in ("cpu", "cuda") if torch.is_autocast_enabled(kind)]
    except TypeError:  # torch < 2.4 has one query per device type
        active = [kind for kind, on in (("cpu", torch.is_autocast_cpu_enabled()),
                                        ("cuda", torch.is_autocast_enabled())) if on]
    if active:
        raise TraceError(f"model: torch.autocast is active ({', '.join(active)}); the trace would compute in a "
                         "lower precision than its compute_dtype records. Call vitcam_nb.trace outside the "
                         "autocast block, or cast the model itself (model.half()) so the trace records it")


@contextlib.contextmanager
def exclusive(model: torch.nn.Module) -> Iterator[None]:
    """One trace at a time per module: a trace of a model that is, contains, is contained in or shares a
    module with a model being traced (from another thread, or from inside the first trace) is refused rather
    than sharing its hooks, ``fused_attn`` flags, parameter flags and device moves.

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(1, 1))
        >>> with exclusive(m):
        ...     with exclusive(m[0]):  # doctest: +IGNORE_EXCEPTION_DETAIL
        ...         pass
        Traceback (most recent call last):
        TraceError: model: this model is already being traced ...
    """
    token = object()
    modules = {id(module) for module in module_walk.modules(model)}
    with _BUSY_LOCK:
        if any(modules & busy for busy in _BUSY.values()):
            raise TraceError("model: this model is already being traced, or a model that contains it, is contained "
                             "in it or shares a module with it (by another thread, or from inside a trace); trace "
                             "it from one thread at a time, or give each thread its own copy (copy.deepcopy(model))")
        _BUSY[id(token)] = modules
    try:
        yield
    finally:
        with _BUSY_LOCK:
            del _BUSY[id(token)]


@contextlib.contextmanager
def on_device(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Move the model to ``device`` for the trace and back to where it was afterwards.

    Example:
        >>> m = torch.nn.Linear(1, 1)
        >>> with on_device(m, torch.device("cpu")):
        ...     m.weight.device.type
        'cpu'
    """
    devices = module_walk.devices(model)
    if not devices or devices == {device}:
        yield
        return
    if len(devices) > 1:
        raise TraceError(f"device: the model spans several devices {sorted(map(str, devices))}; "
                         "pass device=None to trace it where it is")
    original = devices.pop()
    try:
        # Inside the try: a move that fails half-way (out of memory) is undone too.
        model.to(device)
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


def glibc_function(name: str) -> Callable[..., Any] | None:
    """glibc's function ``name`` through ctypes, or None where the C library has none (macOS, musl, Windows).

    Example:
        >>> glibc_function("no_such_function") is None
        True
    """
    try:
        return getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError, TypeError):
        return None


_TRIM = glibc_function("malloc_trim")


def release_freed_memory() -> None:
    """Hand memory the process has freed back to the operating system (glibc's ``malloc_trim``; a no-op
    elsewhere). Without it, the many mid-sized tensors a pass frees stay resident as heap holes, and resident
    memory peaks at about twice what is alive while the gradients are copied into the Dataset.

    Example:
        >>> release_freed_memory()  # returns nothing; resident memory may drop
    """
    if _TRIM is not None:
        _TRIM(0)


@contextlib.contextmanager
def releasing_during_backward(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Call :func:`release_freed_memory` each time the backward pass reaches one of ``tensors`` (a gradient hook
    that leaves the gradient unchanged), so the forward graph's freed buffers leave resident memory while the
    gradients grow. The hooks are on the tensors, never on the model, and are removed on exit.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> y = x * 3
        >>> with releasing_during_backward([y]):
        ...     torch.autograd.grad(y.sum(), [x])[0].tolist()
        [3.0, 3.0]
    """
    handles = []
    try:
        for t in tensors:
            if t.requires_grad:
                handles.append(t.register_hook(_release_hook))
        yield
    finally:
        for h in handles:
            h.remove()


def _release_hook(_grad: torch.Tensor) -> None:
    release_freed_memory()


@contextlib.contextmanager
def releasing_during_forward(blocks: list[torch.nn.Module]) -> Iterator[None]:
    """Call :func:`release_freed_memory` after each of ``blocks`` runs forward, so the block's freed transients
    (its qkv, scores and MLP hidden tensors) leave resident memory; the hooks are removed on exit.

    Example:
        >>> lin = torch.nn.Linear(1, 1)
        >>> with releasing_during_forward([lin]):
        ...     _ = lin(torch.ones(1))
        >>> len(lin._forward_hooks)
        0
    """
    handles = []
    try:
        for block in blocks:
            handles.append(block.register_forward_hook(lambda *_: release_freed_memory()))
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def frozen_parameters(model: torch.nn.Module) -> Iterator[None]:
    """``requires_grad`` off on every parameter for the pass (the trace differentiates activations only, so
    autograd then keeps no layer inputs for weight gradients), each parameter's own flag restored on exit, also
    on error or interrupt.

    Example:
        >>> m = torch.nn.Linear(1, 1)
        >>> with frozen_parameters(m):
        ...     m.weight.requires_grad
        False
        >>> m.weight.requires_grad
        True
    """
    params = [p for p in module_walk.parameters(model) if p.requires_grad]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p in params:
            p.requires_grad_(True)
