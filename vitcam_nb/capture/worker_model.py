"""A model sent to the workers of a dask.distributed Client, for the batch runs sharded over them
(:func:`vitcam_nb.trace_many`, :func:`vitcam_nb.map_many`).

How the model travels: not pickled. Its architecture is rebuilt on each worker by ``timm.create_model`` from a
spec (``{"timm": name, **kwargs}``; default the model's timm name), its tensors are loaded once per worker from
safetensors (a worker plugin, so a worker that joins or restarts loads them too): the state dict and the
non-persistent buffers, so that the worker's model holds exactly the caller's tensors. Its ``pretrained_cfg``
is the caller's too: that is where :func:`vitcam_nb.load_model` states where the weights came from (a file, the
published ones, a bundled model), so the worker's traces and maps state the same origin as the caller's (the
origin holds only while the weights hash equals the one it was stated for, which the rebuilt model's does). Where
every tensor of the model comes so, it is built on torch's meta device, without the random initialisation its
weights would replace. The weights hash of the rebuilt model must equal the caller's, or the batch is refused. The
tensors go as a file the call writes (in a folder in memory, ``/dev/shm``, where it has room; else the temporary
folder) when every worker reads it there (workers on this machine: a ``LocalCluster``, a multi-GPU node), which
spares sending hundreds of megabytes through the scheduler to each worker; otherwise as bytes in the plugin. The
file is removed when the call unloads the model. Where GPUs exist each worker pins one: ``cuda:0`` of what
``CUDA_VISIBLE_DEVICES`` leaves it (dask-cuda's LocalCUDACluster gives each worker its own), else the GPU numbered
by the worker's name modulo the GPU count.

Who may write: a batch is written by its worker only while the call that sent it still holds the store's lock
(:func:`sender_writes`). Cancelling a task does not stop one already running, so a batch of a call that was
interrupted (or failed) may still be computing when a later call resumes or replaces the store; it then writes
nothing, instead of its maps or traces into the later call's store; one already writing then is waited for by the
later call before it touches the store.

Example:
    >>> active_client() is None  # no Client running here
    True
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from vitcam_nb.capture.heap import raise_mmap_threshold, restore_mmap_threshold
from vitcam_nb.capture.plan import model_name
from vitcam_nb.capture.store_lock import LOCK_NAME, batch_writing
from vitcam_nb.core.errors import TraceError, TraceFileError
from vitcam_nb.core.provenance import weights_sha256

try:  # the plugin's base class; without distributed there is no Client to shard over
    from distributed import WorkerPlugin as _PluginBase
except ImportError:  # pragma: no cover
    _PluginBase = object

__all__ = ["ModelSending", "active_client", "check_sender", "drop_model", "loaded_model", "send_model",
           "sender_writes"]

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


#: The key prefix under which the model's non-persistent buffers travel beside its state dict (no state-dict key
#: starts with it: the names of a state dict have no spaces).
_BUFFER = "non-persistent buffer "


def _sent_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What travels to the workers: the state dict, and the buffers outside it (copies: they may share storage)."""
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    for name, buffer in model.named_buffers():
        if name not in state:
            state[_BUFFER + name] = buffer.detach().to("cpu").clone().contiguous()
    return state


def _split_buffers(sent: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """What :func:`_sent_tensors` sent, split again: the state dict, and the non-persistent buffers by name."""
    buffers = {k[len(_BUFFER):]: v for k, v in sent.items() if k.startswith(_BUFFER)}
    return {k: v for k, v in sent.items() if not k.startswith(_BUFFER)}, buffers


def _attribute_tensors(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds a tensor outside its parameters and buffers (a plain attribute, or in a list, tuple
    or dict attribute)."""
    for key, value in vars(module).items():
        if key in ("_parameters", "_buffers"):  # the tensors that are sent
            continue
        values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, torch.Tensor) for v in values):
            return True
    return False


def _build_without_init(name: str, kwargs: dict, state: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
                        ) -> torch.nn.Module | None:
    """The model ``timm.create_model(name, **kwargs)`` builds, made on torch's meta device (no memory, no random
    initialisation: about 0.7 s less for a ViT-B) and given uninitialised memory, for every one of its tensors comes
    from the caller: ``state`` and the non-persistent ``buffers``. None, for the full build, where the model holds a
    tensor that would not come from the caller (computed at construction and kept outside its parameters and
    buffers) or cannot be built so."""
    import timm

    try:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False, **kwargs)
    except Exception:  # a model whose construction computes with its tensors' values: build it in full
        return None
    own = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    own |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    if own != set(state) | set(buffers) or any(_attribute_tensors(m) for m in model.modules()):
        return None
    model.to_empty(device="cpu")
    return model


def _build(spec: dict, weights: bytes | str, sha: str, training: bool, cfg: dict | None) -> torch.nn.Module:
    """The caller's model, rebuilt on a worker: ``spec``'s architecture, the caller's tensors (``weights``: bytes or
    a file; their hash must be ``sha``), train/eval mode and ``pretrained_cfg`` (``cfg``; None keeps timm's)."""
    import timm
    from safetensors.torch import load, load_file

    try:
        state = load(weights) if isinstance(weights, bytes) else load_file(weights)
    except OSError as exc:
        raise TraceError(f"worker_model: this worker cannot read the weights file {weights} the call wrote ({exc}); "
                         "a worker on another machine needs the weights sent: start the call again") from exc
    state, buffers = _split_buffers(state)
    kwargs = {k: v for k, v in spec.items() if k != "timm"}
    try:
        model = _build_without_init(spec["timm"], kwargs, state, buffers)
        if model is None:
            model = timm.create_model(spec["timm"], pretrained=False, **kwargs)
        model.load_state_dict(state, strict=True)
        for name, value in buffers.items():  # what the caller's model holds, even where it differs from a new one's
            model.get_buffer(name).copy_(value)
    except RuntimeError as exc:
        raise TraceError(f"worker_model: {spec} builds a model whose weights do not fit the caller's ({exc}); pass "
                         "worker_model={'timm': name, **the create_model kwargs the model was built with}") from exc
    model.train(training)
    if cfg is not None:  # the caller's config states the weights' origin (vitcam_nb.core.provenance.weights_origin)
        model.pretrained_cfg = model.default_cfg = copy.deepcopy(cfg)
    if weights_sha256(model) != sha:
        raise TraceError(f"worker_model: the model rebuilt from {spec} has other weights than the caller's "
                         f"(sha256 {weights_sha256(model)[:12]}…, caller {sha[:12]}…)")
    return model


class _ModelPlugin(_PluginBase):
    """A worker plugin that loads the model once on each worker (and on workers that join later)."""

    def __init__(self, key: str, spec: dict, weights: bytes | str, sha: str, training: bool, device: str,
                 cfg: dict | None) -> None:
        self.key, self.spec, self.weights, self.sha, self.training, self.device = key, spec, weights, sha, training, \
            device
        self.cfg = cfg
        self.name = f"vitcam_nb-model-{key}"

    def setup(self, worker: Any) -> None:
        if self.key not in _MODELS:
            model = _build(self.spec, self.weights, self.sha, self.training, self.cfg)
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
    """:func:`send_model` under way in a background thread: the calling process goes on (``map_many`` reads and
    prepares its first images, ``trace_many`` traces its first batch, which shapes its store) while the workers
    import their libraries and rebuild the model, instead of waiting for them first. The spec is checked and the
    weights taken (their tensors as they are now) before this returns; the workers' answer, or their refusal,
    comes from :meth:`names`.

    Example:
        >>> sending = ModelSending(client, model, None, "cpu", "map_many")  # doctest: +SKIP
        >>> key, name = sending.names()  # doctest: +SKIP
    """

    def __init__(self, client: Any, model: torch.nn.Module, worker_model: dict | None, device: str,
                 caller: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.client = client
        spec = _spec(model, worker_model, caller)
        weights = _sent_tensors(model)
        cfg = getattr(model, "pretrained_cfg", None)
        cfg = copy.deepcopy(cfg) if isinstance(cfg, dict) else None  # as it is now, like the weights
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitcam_nb-send-model")
        self._future = pool.submit(_register, client, spec, weights, weights_sha256(model), model.training, device,
                                   cfg)
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


def _register(client: Any, spec: dict, state: dict[str, torch.Tensor], sha: str, training: bool, device: str,
              cfg: dict | None) -> tuple[str, str]:
    """Register the plugin that loads ``state`` (and the caller's ``pretrained_cfg``, ``cfg``) into the model
    ``spec`` builds on every worker; (key, name)."""
    from safetensors.torch import save

    # One key per call: two calls sending the same model (two threads of one process) each unload only their own.
    key = f"{sha[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path = _shared_file(client, state)
    plugin = _ModelPlugin(key, spec, save(state) if path is None else path, sha, training, device, cfg)
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
#: Where the weights file is written when it has room: a folder in memory (on Linux), so that writing it costs a
#: copy, not a disk write (0.10 s against 0.66 s for a ViT-B's 344 MB here); else the temporary folder.
_MEMORY_FOLDER = "/dev/shm"


def _weights_folder(nbytes: int) -> str:
    import shutil
    import tempfile

    try:
        if shutil.disk_usage(_MEMORY_FOLDER).free > 2 * nbytes:
            return _MEMORY_FOLDER
    except OSError:
        pass
    return tempfile.gettempdir()


def _shared_file(client: Any, state: dict[str, torch.Tensor]) -> str | None:
    """Write ``state`` as a new safetensors file; its path if every worker of ``client`` reads a file of that size
    there, else None (the file removed: the weights then travel in the plugin)."""
    import tempfile

    from safetensors.torch import save_file

    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    fd, path = tempfile.mkstemp(prefix="vitcam_nb-weights-", suffix=".safetensors", dir=_weights_folder(nbytes))
    os.close(fd)
    try:
        save_file(state, path)
        size = os.path.getsize(path)
        sizes = client.run(_file_size, path)
    except Exception:  # no room to write it, or a worker that cannot answer: send the bytes
        _remove(path)
        return None
    if not sizes or any(s != size for s in sizes.values()):
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


@contextlib.contextmanager
def sender_writes(path: str, token: str) -> Iterator[None]:
    """On a worker, around writing a batch's chunks: the batch is written only while the call that sent it still
    holds the store's lock (:func:`check_sender`), and a call that takes the lock next waits until it is written
    (:func:`~vitcam_nb.capture.store_lock.batch_writing`), so no batch writes into a store after its call stopped.

    Example:
        >>> with sender_writes(path, lock.token):  # doctest: +SKIP
        ...     write_region(path, start, arrays)
    """
    with batch_writing(Path(path)):
        check_sender(path, token)
        yield


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
