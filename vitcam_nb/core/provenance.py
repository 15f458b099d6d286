"""Content hashes that identify a model's weights, an input and a whole trace, and what is known of where the
weights came from.

Two weight hashes exist and must not be compared with each other: :func:`weights_sha256` hashes the state
dict's tensors (what a trace's ``weights_sha256`` attribute holds), while a bundled model's card and
``vitcam-nb models`` give the SHA-256 of its safetensors *file* (``weights_file_sha256``).

Example:
    >>> weights_origin(torch.nn.LayerNorm(3))
    'random-init'
"""

from __future__ import annotations

import hashlib
import json
import weakref
from pathlib import Path

import numpy as np
import torch

from vitcam_nb.core import module_walk
from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.state_walk import state_entries

_WEIGHTS_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _state_signature(model: torch.nn.Module) -> tuple:
    # _version changes on every in-place write, so an unchanged signature means unchanged weights.
    return tuple((name, t.data_ptr(), t._version, t.shape, t.dtype) for name, t in state_entries(model))


def _facts(model: torch.nn.Module) -> dict:
    # What is known of the weights as they are now (their hash, whether they are untrained), kept per model object
    # and started afresh when a tensor was replaced or written in place: one walk of the state a call.
    signature = _state_signature(model)
    cached = _WEIGHTS_CACHE.get(model)
    if cached is None or cached[0] != signature:
        cached = (signature, {})
        _WEIGHTS_CACHE[model] = cached
    return cached[1]


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of the model's state dict (names, dtypes, shapes and bytes, in name order).

    Hashing a ViT-B takes a fraction of a second, so the result is cached per model object and
    recomputed only when a tensor was replaced or written in place.

    Example:
        >>> import torch
        >>> len(weights_sha256(torch.nn.Linear(2, 2)))
        64
    """
    return _sha256(model, _facts(model))


def _sha256(model: torch.nn.Module, facts: dict) -> str:
    if "sha256" not in facts:
        facts["sha256"] = _hash_state(model)
    return facts["sha256"]


def _hash_state(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy of the largest tensor
    return h.hexdigest()


_NORMS = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.BatchNorm2d, torch.nn.BatchNorm1d)
# One load_model built from a bundled file, pretrained or file weights: {"origin": "bundled ..." / "pretrained ..." /
# "file ...", "weights_sha256": the tensors' hash when loaded}; the origin is stated only while the weights are still
# those (a copy whose parameters were randomised, or weights written in place, keep the config but not the weights).
LOADED_KEY = "vitcam_nb_weights"


def untrained(model: torch.nn.Module) -> bool:
    """True when every affine normalisation layer still holds its initial value (weight 1, bias 0): the
    model was never trained, whatever its config's pretrained tag says. Trained weights never keep them all.

    Example:
        >>> untrained(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)))
        True
    """
    norms = [m for m in module_walk.modules(model)
             if isinstance(m, _NORMS) and getattr(m, "weight", None) is not None]
    if not norms or any(m.weight.is_meta for m in norms):  # meta tensors hold no values to compare
        return False
    with torch.no_grad():
        return (_all_equal([m.weight for m in norms], 1)
                and _all_equal([m.bias for m in norms if m.bias is not None], 0))


def _all_equal(tensors: list[torch.Tensor], value: float) -> bool:
    # One comparison per device and dtype rather than three small ops per layer: a generative VLM has dozens of norm
    # layers, and this ran on every trace. The same answer as comparing each tensor (``==`` is exact either way).
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t.reshape(-1))
    return all(bool((torch.cat(group) == value).all()) for group in groups.values())


def weights_facts(model: torch.nn.Module) -> tuple[str, str]:
    """``(weights_sha256(model), weights_origin(model))`` with one walk of the model's state (a trace states both).

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> weights_facts(lin) == (weights_sha256(lin), weights_origin(lin))
        True
    """
    facts = _facts(model)
    return _sha256(model, facts), _origin(model, facts)


def weights_origin(model: torch.nn.Module) -> str:
    """What is known of the weights: ``"bundled <name> (file sha256 <hash>)"`` for a model
    :func:`vitcam_nb.load_model` loaded from the package, ``"pretrained <name> from <source> (file sha256 <hash>)"``
    or ``"file <name> (file sha256 <hash>)"`` for one it loaded with ``pretrained=True`` or ``weights=PATH``, each
    while its tensors are still those it loaded (their hash is checked); else ``"random-init"``
    (:func:`untrained`), else ``"unknown"`` (a timm config tag says which weights the architecture was published
    with, not which ones are loaded).

    Example:
        >>> weights_origin(torch.nn.Linear(2, 2))
        'unknown'
    """
    return _origin(model, _facts(model))


def _origin(model: torch.nn.Module, facts: dict) -> str:
    cfg = getattr(model, "pretrained_cfg", None)
    cfg = cfg if isinstance(cfg, dict) else {}
    loaded = cfg.get(LOADED_KEY)
    # The loaded file wins over the norm-layer heuristic: a file may keep every norm at its default (a linear probe
    # trained on a random backbone) and is still the file.
    if isinstance(loaded, dict) and loaded.get("weights_sha256") == _sha256(model, facts):
        return str(loaded["origin"])
    if "untrained" not in facts:  # the norm layers' values: unchanged while the state's signature is
        facts["untrained"] = untrained(model)
    return "random-init" if facts["untrained"] else "unknown"


def array_sha256(array: np.ndarray | torch.Tensor) -> str:
    """SHA-256 of an array's dtype, shape and bytes.

    Example:
        >>> array_sha256(np.zeros(3, np.float32))[:8]
        '81855535'
    """
    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().contiguous().numpy()
    array = np.ascontiguousarray(array)
    h = hashlib.sha256(f"{array.dtype.str}|{array.shape}|".encode())
    h.update(array.tobytes())
    return h.hexdigest()


def settings_id(settings: dict) -> str:
    """Short stable id of a JSON-able settings dict (sorted keys, compact separators).

    Example:
        >>> settings_id({"a": 1}) == settings_id({"a": 1})
        True
    """
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_traced_source(attrs: dict, model: torch.nn.Module, x: torch.Tensor, consequence: str = "") -> None:
    """Refuse (``TraceError``) a model or a model input other than those a trace with ``attrs`` was made from:
    what is computed from them would belong to another model or image. ``consequence`` says what, in the message.

    Example:
        >>> m = torch.nn.Linear(2, 2); x = torch.zeros(1, 2)
        >>> check_traced_source({"weights_sha256": weights_sha256(m), "input_sha256": array_sha256(x)}, m, x)
    """
    have, want = weights_sha256(model), str(attrs.get("weights_sha256", ""))
    if have != want:
        raise TraceError(f"model: its weights (sha256 {have[:12]}…) are not those the trace was made with "
                         f"({want[:12]}…); {consequence}pass the traced model")
    got, traced = array_sha256(x), str(attrs.get("input_sha256", ""))
    if got != traced:
        raise TraceError(f"image: its model input (sha256 {got[:12]}…) is not the traced input ({traced[:12]}…); "
                         "pass the image the trace was made from")


# Relative tolerance, of max(1, max |traced score|), between a trace's scores and the scores the same model gives
# again on the same input: float32 kernels of another grad mode or attention path differ in the last bits; a
# half-precision model, or another device type (CUDA's TF32 convolutions against the CPU), differs more.
_SCORE_RTOL = {"float64": 1e-4, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
_OTHER_DEVICE_RTOL = 1e-2


def check_traced_scores(attrs: dict, traced: np.ndarray, scores: np.ndarray | torch.Tensor, device: str,
                        consequence: str = "") -> None:
    """Refuse (``TraceError``, both values in the message) a model whose scores on the traced input (``scores``,
    computed on ``device``) are not the trace's (``traced``, its ``logits``): the weights and input hashes match,
    but the model behaves otherwise than the traced one (another ``global_pool``, a forward hook, a patched
    forward, another target), so what is computed from it would not belong to the trace.

    Example:
        >>> attrs = {"compute_dtype": "float32", "device": "cpu", "target_kind": "class"}
        >>> check_traced_scores(attrs, np.array([1.0, 2.0]), np.array([1.0, 2.0 + 1e-6]), "cpu")
        >>> traced, other = np.array([1.0, 2.0]), np.array([1.0, 2.5])
        >>> check_traced_scores(attrs, traced, other, "cpu")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ...
        TraceError: model: on the traced input its scores are not the trace's logits: class 1 is 2.5 here, 2 ...
    """
    if isinstance(scores, torch.Tensor):
        scores = scores.detach().double().cpu().numpy()
    got, want = np.asarray(scores, np.float64).ravel(), np.asarray(traced, np.float64).ravel()
    kind = str(attrs.get("target_kind", "class"))
    what, fix = ("model", "model") if kind == "class" else ("model, targets", "model and target")
    fix = f"{consequence}pass the {fix} exactly as traced"
    if got.shape != want.shape:
        raise TraceError(f"{what}: on the traced input it gives {got.size} scores, the trace holds {want.size} "
                         f"logits; the model behaves otherwise than the traced one; {fix}")
    rtol = _SCORE_RTOL.get(str(attrs.get("compute_dtype", "float32")), _SCORE_RTOL["float16"])
    if str(attrs.get("device", device)).split(":")[0] != str(device).split(":")[0]:
        rtol = max(rtol, _OTHER_DEVICE_RTOL)
    finite = np.isfinite(want)
    tol = rtol * max(1.0, float(np.abs(want[finite]).max()) if finite.any() else 1.0)
    with np.errstate(invalid="ignore"):  # inf - inf: equal infinities count as equal below, NaN never
        gap = np.abs(got - want)
    same = (got == want) | (gap <= tol)
    if same.all():
        return
    diff = np.where(same, 0.0, np.nan_to_num(gap, nan=np.inf))
    i = int(np.argmax(diff))
    name = "class" if kind == "class" else "score"
    raise TraceError(f"{what}: on the traced input its scores are not the trace's logits: {name} {i} is "
                     f"{got[i]:.6g} here, {want[i]:.6g} in the trace (|difference| {diff[i]:.3g} > tolerance "
                     f"{tol:.3g}; {int((~same).sum())} of {got.size} scores differ); the model behaves otherwise "
                     f"than the traced one (another global_pool, a forward hook, a patched forward or another "
                     f"target); {fix}")


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes.

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "x"); _ = open(p, "wb").write(b"")
        >>> file_sha256(p)[:8]
        'e3b0c442'
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
