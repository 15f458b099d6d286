"""A model sent to the workers of a dask.distributed Client, for the batch runs sharded over them
(:func:`vitcam_nb.trace_many`, :func:`vitcam_nb.map_many`).

How the model travels: not pickled. Its architecture is rebuilt on each worker by ``timm.create_model`` from a
spec (``{"timm": name, **kwargs}``; default the model's timm name), its weights are loaded once per worker from
safetensors (a worker plugin, so a worker that joins or restarts loads them too), and the weights hash of the
rebuilt model must equal the caller's, or the batch is refused. The weights go as a file the call writes in the
temporary folder when every worker reads it there (workers on this machine: a ``LocalCluster``, a multi-GPU
node), which spares sending hundreds of megabytes through the scheduler to each worker; otherwise as bytes in
the plugin. The file is removed when the call unloads the model. Where GPUs exist each worker pins one:
``cuda:0`` of what ``CUDA_VISIBLE_DEVICES`` leaves it (dask-cuda's LocalCUDACluster gives each worker its own),
else the GPU numbered by the worker's name modulo the GPU count.

Who may write: a batch is written by its worker only while the call that sent it still holds the store's lock
(:func:`check_sender`). Cancelling a task does not stop one already running, so a batch of a call that was
interrupted (or failed) may still be computing when a later call resumes or replaces the store; it then writes
nothing, instead of its maps or traces into the later call's store.

Example:
    >>> active_client() is None  # no Client running here
    True
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import torch

from vitcam_nb.capture.heap import raise_mmap_threshold, restore_mmap_threshold
from vitcam_nb.capture.plan import model_name
from vitcam_nb.capture.store_lock import LOCK_NAME
from vitcam_nb.core.errors import TraceError, TraceFileError
from vitcam_nb.core.provenance import weights_sha256

try:  # the plugin's base class; without distributed there is no Client to shard over
    from distributed import WorkerPlugin as _PluginBase
except ImportError:  # pragma: no cover
    _PluginBase = object

__all__ = ["ModelSending", "active_client", "check_sender", "drop_model", "loaded_model", "send_model"]

#: Models loaded on this worker process, by key: (model, device, lock).
_MODELS: dict[str, tuple[torch.nn.Module, str, threading.Lock]] = {}


def active_client() -> Any:
    """The active dask.distributed Client, or None (none running, or distributed not installed).

    Example:
        >>> active_client() is None
        True
    """
    try:
        from distributed import get_client
    except ImportError:
        return None
    try:
        return get_client()
    except ValueError:
        return None


def _pin(device: str, worker_name: Any) -> str:
    """The device a worker computes on: the caller's, with one GPU per worker where there are several."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return device
    count = torch.cuda.device_count()
    if count <= 1:  # one GPU visible (dask-cuda gives each worker its own): that one
        return "cuda:0"
    try:
        return f"cuda:{int(worker_name) % count}"
    except (TypeError, ValueError):
        return f"cuda:{sum(map(ord, str(worker_name))) % count}"


def _build(spec: dict, weights: bytes | str, sha: str, training: bool) -> torch.nn.Module:
    import timm
    from safetensors.torch import load, load_file

    kwargs = {k: v for k, v in spec.items() if k != "timm"}
    model = timm.create_model(spec["timm"], pretrained=False, **kwargs)
    try:
        state = load(weights) if isinstance(weights, bytes) else load_file(weights)
    except OSError as exc:
        raise TraceError(f"worker_model: this worker cannot read the weights file {weights} the call wrote ({exc}); "
                         "a worker on another machine needs the weights sent: start the call again") from exc
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise TraceError(f"worker_model: {spec} builds a model whose weights do not fit the caller's ({exc}); pass "
                         "worker_model={'timm': name, **the create_model kwargs the model was built with}") from exc
    model.train(training)
    if weights_sha256(model) != sha:
        raise TraceError(f"worker_model: the model rebuilt from {spec} has other weights than the caller's "
                         f"(sha256 {weights_sha256(model)[:12]}…, caller {sha[:12]}…)")
    return model


class _ModelPlugin(_PluginBase):
    """A worker plugin that loads the model once on each worker (and on workers that join later)."""

    def __init__(self, key: str, spec: dict, weights: bytes | str, sha: str, training: bool, device: str) -> None:
        self.key, self.spec, self.weights, self.sha, self.training, self.device = key, spec, weights, sha, training, \
            device
        self.name = f"vitcam_nb-model-{key}"

    def setup(self, worker: Any) -> None:
        if self.key not in _MODELS:
            model = _build(self.spec, self.weights, self.sha, self.training)
            _MODELS[self.key] = (model, _pin(self.device, getattr(worker, "name", 0)), threading.Lock())
            raise_mmap_threshold()  # dask's workers map every block above 128 KiB anew (vitcam_nb.capture.heap)

    def teardown(self, worker: Any) -> None:
        if _MODELS.pop(self.key, None) is not None:
            restore_mmap_threshold()


def _spec(model: torch.nn.Module, worker_model: dict | None, caller: str) -> dict:
    """The spec each worker rebuilds the model from; one timm cannot build is refused here."""
    import timm

    spec = dict(worker_model) if worker_model is not None else {"timm": model_name(model)[0]}
    if not isinstance(spec.get("timm"), str) or not timm.is_model(spec["timm"]):
        raise TraceError(f"worker_model: a distributed {caller} rebuilds the model on each worker with "
                         f"timm.create_model; expected {{'timm': a timm model name, **its create_model kwargs}}, "
                         f"got {spec!r}")
    return spec


def send_model(client: Any, model: torch.nn.Module, worker_model: dict | None, device: str, caller: str
               ) -> tuple[str, str]:
    """Send ``model`` to every worker of ``client`` (a worker plugin); its key for :func:`loaded_model` and the
    plugin's name for :func:`drop_model`. A spec timm cannot build is refused before anything is sent.

    Example:
        >>> key, name = send_model(client, model, None, "cpu", "trace_many")  # doctest: +SKIP
    """
    return ModelSending(client, model, worker_model, device, caller).names()


class ModelSending:
    """:func:`send_model` under way in a background thread: the calling process computes its first batch (which
    shapes the store) while the workers import their libraries and rebuild the model, instead of waiting for them
    first. The spec is checked and the weights taken (their tensors as they are now) before this returns; the
    workers' answer, or their refusal, comes from :meth:`names`.

    Example:
        >>> sending = ModelSending(client, model, None, "cpu", "map_many")  # doctest: +SKIP
        >>> key, name = sending.names()  # doctest: +SKIP
    """

    def __init__(self, client: Any, model: torch.nn.Module, worker_model: dict | None, device: str,
                 caller: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.client = client
        spec = _spec(model, worker_model, caller)
        weights = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitcam_nb-send-model")
        self._future = pool.submit(_register, client, spec, weights, weights_sha256(model), model.training, device)
        pool.shutdown(wait=False)

    def names(self) -> tuple[str, str]:
        """The model's key for :func:`loaded_model` and its plugin's name, once every worker has it (a worker's
        refusal, such as a spec that builds other weights, raises here)."""
        return self._future.result()

    def drop(self) -> None:
        """Unload the model from the workers once it has reached them (nothing to unload if sending failed)."""
        try:
            _, name = self._future.result()
        except Exception:  # never sent: a refusal already raised from names(), or no batch needed the workers
            return
        drop_model(self.client, name)


def _register(client: Any, spec: dict, state: dict[str, torch.Tensor], sha: str, training: bool, device: str
              ) -> tuple[str, str]:
    """Register the plugin that loads ``state`` into the model ``spec`` builds on every worker; (key, name)."""
    from safetensors.torch import save

    weights = save(state)
    # One key per call: two calls sending the same model (two threads of one process) each unload only their own.
    key = f"{sha[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path = _shared_file(client, weights)
    plugin = _ModelPlugin(key, spec, weights if path is None else path, sha, training, device)
    if path is not None:
        _FILES[plugin.name] = path
    try:
        client.register_plugin(plugin, name=plugin.name)
    except BaseException:
        _remove(_FILES.pop(plugin.name, None))
        raise
    return key, plugin.name


#: The weights files this process wrote for its workers, by plugin name (removed by drop_model).
_FILES: dict[str, str] = {}


def _shared_file(client: Any, weights: bytes) -> str | None:
    """Write ``weights`` to a new file in the temporary folder; its path if every worker of ``client`` reads a file
    of that size there, else None (the file removed: the weights then travel in the plugin)."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix="vitcam_nb-weights-", suffix=".safetensors")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(weights)
        sizes = client.run(_file_size, path)
    except Exception:  # no room to write it, or a worker that cannot answer: send the bytes
        _remove(path)
        return None
    if not sizes or any(size != len(weights) for size in sizes.values()):
        _remove(path)
        return None
    return path


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _remove(path: str | None) -> None:
    if path is not None:
        try:
            os.remove(path)
        except OSError:
            pass


def loaded_model(key: str) -> tuple[torch.nn.Module, str, threading.Lock]:
    """On a worker: the model :func:`send_model` sent, the device it computes on and the lock its passes take.

    Example:
        >>> model, device, lock = loaded_model(key)  # doctest: +SKIP
    """
    return _MODELS[key]


def check_sender(path: str, token: str) -> None:
    """On a worker, just before it writes a batch's chunks: refuse (``TraceFileError``, nothing written) unless the
    call that sent the batch still holds the store's lock, its ``token`` in the lock file. That call took the lock
    before sending any batch and keeps it until every batch has finished; a lock that is gone or another call's
    means the sender stopped, and the store may be another call's by now.

    Example:
        >>> import tempfile
        >>> check_sender(tempfile.mkdtemp(), "0123")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceFileError: path: ... is no longer written by the call that sent this batch ...
    """
    try:
        owner = json.loads((Path(path) / LOCK_NAME).read_text())
    except (OSError, ValueError):  # no lock file (released), or not one this kit wrote
        owner = None
    if not isinstance(owner, dict) or owner.get("token") != token:
        raise TraceFileError(f"path: {path} is no longer written by the call that sent this batch (that call "
                             "stopped: interrupted, failed, or another call holds the store's lock now); the "
                             "batch's chunks were not written. Rerun the call to resume the store")


def drop_model(client: Any, name: str) -> None:
    """Unload the model from the workers (a Client closing meanwhile takes them with it).

    Example:
        >>> drop_model(client, name)  # doctest: +SKIP
    """
    try:
        client.unregister_worker_plugin(name)
    except Exception:  # a Client closing meanwhile: its workers go with their models
        pass
    _remove(_FILES.pop(name, None))
