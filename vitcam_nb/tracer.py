"""The caching tracer: one forward pass and one batched backward pass store every block's activations and
gradients, at every site, in a labeled ``xarray.Dataset`` (DESIGN.md sections 3 and 4)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import xarray as xr

from vitcam_nb.adapters import Adapter, find_adapter
from vitcam_nb.errors import TraceError
from vitcam_nb.preprocess import prepare_input, preprocessing_json
from vitcam_nb.provenance import array_sha256, settings_id, weights_sha256
from vitcam_nb.targets import ClassTargets, Target, as_target

SCHEMA_VERSION = 1
CORE_SITES = ("F1", "F2", "F3", "F4", "F5", "F6")
EXTENDED_SITES = ("resid_pre", "attn_out", "resid_mid")
EXPECTED_TARGET = "expected_logit"
_DTYPES = {"float32": np.float32, "float16": np.float16}


def target_name(class_index: int) -> str:
    """Name of the logit target of a class in the trace's ``target`` coordinate.

    Example:
        >>> target_name(207)
        'logit_207'
    """
    return f"logit_{class_index}"


class _Capture:
    """Hooks that read each (layer, site) tensor by key and restore every model flag on exit."""

    def __init__(self, model: torch.nn.Module, adapter: Adapter, layers: list[int], sites: list[str]):
        self.model, self.adapter, self.layers, self.sites = model, adapter, layers, sites
        self.tensors: dict[tuple[int, str], torch.Tensor] = {}
        self.grid: tuple[int, int] | None = None
        self._handles: list = []
        self._modes: list[tuple[torch.nn.Module, bool]] = []
        self._fused: list[tuple[torch.nn.Module, bool]] = []
        self._patch: contextlib.AbstractContextManager | None = None

    def _hook(self, module: torch.nn.Module, io: str, key: tuple[int, str]) -> None:
        if io == "output":
            def hook(_m, _i, out):
                self._keep(key, out)
            self._handles.append(module.register_forward_hook(hook))
        else:
            def pre_hook(_m, args):
                self._keep(key, args[0] if args else None)
            self._handles.append(module.register_forward_pre_hook(pre_hook))

    def _keep(self, key: tuple[int, str], tensor: object) -> None:
        # Hugging Face layers return tuples whose first element is the hidden state.
        if isinstance(tensor, (tuple, list)) and tensor and isinstance(tensor[0], torch.Tensor):
            tensor = tensor[0]
        if not isinstance(tensor, torch.Tensor):
            raise TraceError(f"sites: {key[1]} at layer {key[0]} produced {type(tensor).__name__}, not a tensor")
        if key in self.tensors:
            raise TraceError(f"sites: {key[1]} at layer {key[0]} fired twice in one forward pass; the adapter's "
                             "site table does not fit this model, or gradient checkpointing reruns the block "
                             "(switch it off for the trace: model.set_grad_checkpointing(False))")
        self.tensors[key] = tensor

    def __enter__(self) -> _Capture:
        try:
            self._modes = [(m, m.training) for m in self.model.modules()]
            self._fused = [(m, m.fused_attn) for m in self.adapter.attention_modules(self.model)
                           if hasattr(m, "fused_attn")]
            self._patch = self.adapter.patched(self.model)
            self._patch.__enter__()
            blocks = self.adapter.blocks(self.model)
            table = self.adapter.site_table(self.model)
            extra = self.adapter.extra_sites(self.model)
            for site in self.sites:
                if site in extra:
                    for i, (module, io) in enumerate(extra[site]):
                        self._hook(module, io, (i, site))
                    continue
                spec = table[site]
                for layer in self.layers:
                    module = blocks[layer].get_submodule(spec.module) if spec.module else blocks[layer]
                    self._hook(module, spec.io, (layer, site))

            def grid_hook(_m, _i, out):
                self.grid = self.adapter.grid_from_output(self.model, out)
            self._handles.append(self.adapter.grid_module(self.model).register_forward_hook(grid_hook))
            for m, _ in self._fused:
                m.fused_attn = False
            self.model.eval()
        except BaseException:
            self._restore()
            raise
        return self

    def _restore(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._patch is not None:
            patch, self._patch = self._patch, None
            patch.__exit__(None, None, None)
        for m, flag in self._fused:
            m.fused_attn = flag
        for m, mode in self._modes:
            m.training = mode

    def __exit__(self, *exc: object) -> None:
        self._restore()


@contextlib.contextmanager
def _on_device(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Move the model to ``device`` for the trace and back to where it was afterwards."""
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
def _deterministic(device: torch.device) -> Iterator[None]:
    """On CUDA, deterministic kernels for the trace (cuDNN and torch's flag), restored afterwards; the CPU
    kernels used here are deterministic already."""
    if device.type != "cuda":
        yield
        return
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = previous[2], previous[3]


def _check_family(model: object, dtype: str) -> Adapter:
    """Refuse a non-module, an unsupported family or an unknown storage dtype; return the model's adapter."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    adapter = find_adapter(model)
    if dtype not in _DTYPES:
        raise TraceError(f"dtype: expected one of {list(_DTYPES)}, got {dtype!r}")
    return adapter


def _check_model(model: object, dtype: str) -> tuple[Adapter, int]:
    """:func:`_check_family`, and refuse a model without logits; return the model's adapter and class count."""
    adapter = _check_family(model, dtype)
    num_classes = int(getattr(model, "num_classes", 0) or 0)
    if num_classes <= 0:
        raise TraceError("model: has no classifier head (num_classes=0); class targets need logits")
    return adapter, num_classes


def _resolve_layers(layers: object, n_layers: int) -> list[int]:
    if layers is None:
        return list(range(n_layers))
    items = [layers] if isinstance(layers, (int, np.integer)) and not isinstance(layers, bool) else layers
    if not isinstance(items, Sequence) or isinstance(items, str) or len(items) == 0:
        raise TraceError(f"layers: expected None, an int or a non-empty list of ints, got {layers!r}")
    out = set()
    for i in items:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TraceError(f"layers: expected ints in [-{n_layers}, {n_layers - 1}], got {i!r}")
        if not -n_layers <= i < n_layers:
            raise TraceError(f"layers: {i} is out of range for a model with {n_layers} blocks "
                             f"(allowed -{n_layers}..{n_layers - 1})")
        out.add(int(i) % n_layers)
    return sorted(out)


def _resolve_sites(sites: object, adapter: Adapter, model: torch.nn.Module) -> list[str]:
    allowed = list(adapter.site_table(model)) + list(adapter.extra_sites(model))
    if sites is None:
        return [s for s in allowed if s in CORE_SITES or s not in adapter.sites]
    items = [sites] if isinstance(sites, str) else sites
    if not isinstance(items, Sequence) or len(items) == 0:
        raise TraceError(f"sites: expected a site name or a non-empty list of them, got {sites!r}")
    for s in items:
        if s not in allowed:
            known = ("a site this model does not have" if s in adapter.sites or s in CORE_SITES + EXTENDED_SITES
                     else "unknown site")
            raise TraceError(f"sites: {known} {s!r}; this {adapter.family} model has {allowed}")
    return [s for s in allowed if s in items]


def _parse_targets(targets: object, num_classes: int) -> tuple[str, object]:
    """Validate class ``targets`` before the forward pass; returns ("top", k) or ("classes", [ints])."""
    parsed = ClassTargets(targets)
    parsed.check_count(num_classes)
    return ("top", parsed.k) if parsed.k is not None else ("classes", parsed.classes)


def _class_labels(model: torch.nn.Module, num_classes: int, labels: Sequence[str] | None) -> list[str]:
    if labels is not None:
        if isinstance(labels, str) or len(labels) != num_classes:
            raise TraceError(f"labels: expected a sequence of {num_classes} class names, got {labels!r:.80}")
        return [str(v) for v in labels]
    cfg = getattr(model, "pretrained_cfg", None) or {}
    names = cfg.get("label_names") if isinstance(cfg, dict) else None
    if names is not None and len(names) == num_classes:
        return [str(v) for v in names]
    if num_classes == 1000:
        from timm.data import ImageNetInfo

        info = ImageNetInfo()
        return [info.index_to_description(i).split(",")[0] for i in range(1000)]
    return [f"class {i}" for i in range(num_classes)]


def _model_name(model: torch.nn.Module) -> tuple[str, str]:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    arch = cfg.get("architecture") if isinstance(cfg, dict) else None
    tag = cfg.get("tag") if isinstance(cfg, dict) else None
    return str(arch or type(model).__name__), str(tag or "")


def trace(
    model: torch.nn.Module,
    image: object,
    targets: str | int | Sequence[int] | Target = "top5",
    *,
    sites: Sequence[str] | str | None = None,
    layers: int | Sequence[int] | None = None,
    dtype: str = "float32",
    device: str | torch.device | None = None,
    labels: Sequence[str] | None = None,
) -> xr.Dataset:
    """Trace ``model`` on ``image``: one forward pass, one batched backward pass, everything stored.

    Activations and gradients of every requested site and block are kept in an ``xarray.Dataset``
    (schema in DESIGN.md section 4). Gradients are taken for the logits of the chosen classes and for
    the expected logit ``E = sum_j p_j z_j`` (``p`` detached), so probability and log-probability
    targets are derived exactly later. The model is returned as it was given: hooks, ``fused_attn``
    flags, train/eval mode, device and gradient state are restored, also when an exception is raised.

    Args:
        model: a timm VisionTransformer (or a family with a registered adapter).
        image: PIL image, HxWx3 uint8 array (preprocessed with the model's timm data config), or a
            (1,3,H,W) float tensor used as given.
        targets: "top5" (default), "topK", an int class, a list of ints, or a target from
            :mod:`vitcam_nb.targets` (similarity to vectors, text prompts, image-text matching).
        sites: subset of F1..F6 and the extended sites resid_pre, attn_out, resid_mid (default F1..F6).
        layers: block indices to keep (default all; negative counts from the end).
        dtype: storage dtype, "float32" or "float16" (computation stays in the model's dtype).
        device: where to run (default: the model's device); results always come back to CPU.
        labels: class names (default: the model's ``pretrained_cfg["label_names"]`` or ImageNet's).

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> tr = vc.trace(m, np.zeros((224, 224, 3), np.uint8), targets="top2")
        >>> tr["grad"].dims
        ('target', 'layer', 'site', 'token', 'channel')
    """
    adapter = _check_family(model, dtype)
    target = as_target(targets, labels)
    target.check(model)
    # Class labels are known (and wrong ones refused) before the forward pass; other targets name their scores.
    class_labels = target.class_labels(model, int(model.num_classes)) if isinstance(target, ClassTargets) else None
    layer_ids = _resolve_layers(layers, len(adapter.blocks(model)))
    site_ids = _resolve_sites(sites, adapter, model)
    params = list(model.parameters())
    model_device = params[0].device if params else torch.device("cpu")
    run_device = torch.device(device) if device is not None else model_device
    compute_dtype = params[0].dtype if params else torch.float32

    prepared = prepare_input(model, image)
    _check_size(model, prepared.tensor)
    adapter.check_input(model, prepared.tensor)
    prefix = adapter.prefix_kinds(model)
    extra = adapter.extra_sites(model)

    with _on_device(model, run_device), _deterministic(run_device), \
            _Capture(model, adapter, layer_ids, site_ids) as cap, \
            torch.inference_mode(False), torch.enable_grad():
        x = prepared.tensor.to(run_device, compute_dtype).clone().requires_grad_(True)
        z = target.scores(model, x)
        missing = [f"{s}@{layer}" for layer in layer_ids for s in site_ids
                   if s not in extra and (layer, s) not in cap.tensors]
        missing += [f"{s}@{i}" for s in site_ids if s in extra for i in range(len(extra[s]))
                    if (i, s) not in cap.tensors]
        if missing or cap.grid is None:
            raise TraceError(f"sites: hooks never fired for {missing or ['patch grid']}; the adapter's site "
                             "table does not fit this model")
        classes = _check_scores(z, target.choose(z) if isinstance(z, torch.Tensor) else None)
        expected = (torch.softmax(z.detach(), dim=0) * z).sum()
        outputs = torch.stack([z[c] for c in classes] + [expected])
        keys = list(cap.tensors)
        try:
            grads = torch.autograd.grad(
                outputs, [cap.tensors[k] for k in keys],
                grad_outputs=torch.eye(len(outputs), device=z.device, dtype=z.dtype),
                is_grads_batched=True, allow_unused=True,
            )
        except RuntimeError as exc:
            if "atching rule" not in str(exc) and "vmap" not in str(exc):
                raise
            raise TraceError("model: a gradient hook already on the model (e.g. another CAM library's) cannot "
                             f"run in the batched backward pass; remove it first ({exc})") from exc
        acts, grad_by_key = {}, {}
        for k, g in zip(keys, grads):
            act = cap.tensors[k].detach()
            if g is None:
                g = torch.zeros((len(outputs), *act.shape[1:]), dtype=act.dtype, device=act.device)
            if k[1] not in extra:
                act, g = adapter.arrange(model, k[1], k[0], act), adapter.arrange(model, k[1], k[0], g)
            acts[k], grad_by_key[k] = act, g
        grid = cap.grid

    common = dict(prepared=prepared, logits=z.detach(), classes=classes, prefix=prefix,
                  class_labels=class_labels or target.class_labels(model, int(z.shape[0])), run_device=run_device,
                  compute_dtype=compute_dtype, target=target)
    if getattr(adapter, "hierarchical", False):
        from vitcam_nb.stages import assemble_stages

        return assemble_stages(_assemble, model=model, adapter=adapter, site_ids=site_ids, layer_ids=layer_ids,
                               acts=acts, grads=grad_by_key, store_dtype=_DTYPES[dtype], **common)
    return _assemble(model=model, adapter=adapter, layer_ids=layer_ids, site_ids=site_ids, acts=acts,
                     grads=grad_by_key, grid=grid, store_dtype=_DTYPES[dtype], **common)


def _check_scores(z: object, classes: object) -> list[int]:
    """A target's scores must be a 1-D float tensor and its choice distinct valid indices into them."""
    if not isinstance(z, torch.Tensor) or z.ndim != 1 or not z.is_floating_point() or z.numel() == 0:
        shape = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
        raise TraceError(f"targets: the target's scores() must return a non-empty 1-D float tensor, got {shape}")
    n = int(z.shape[0])
    if not isinstance(classes, Sequence) or not classes or len(set(classes)) != len(classes) or any(
            isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= c < n for c in classes):
        raise TraceError(f"targets: the target's choose() must return a non-empty list of distinct ints in "
                         f"0..{n - 1}, got {classes!r}")
    return [int(c) for c in classes]


def _check_size(model: torch.nn.Module, x: torch.Tensor) -> None:
    pe = getattr(model, "patch_embed", None)
    if pe is None:
        return
    got = tuple(int(v) for v in x.shape[-2:])
    if getattr(model, "dynamic_img_size", False):
        patch = tuple(int(v) for v in pe.patch_size)
        if not getattr(pe, "dynamic_img_pad", False) and (got[0] % patch[0] or got[1] % patch[1]):
            raise TraceError(f"image: {got[0]}x{got[1]} is not a multiple of the patch size "
                             f"{patch[0]}x{patch[1]}; crop or resize it")
        return
    if not getattr(pe, "strict_img_size", False):
        return
    expected = tuple(int(v) for v in pe.img_size)
    if got != expected:
        raise TraceError(f"image: the model expects {expected[0]}x{expected[1]} input, got {got[0]}x{got[1]}; "
                         "pass a PIL image or uint8 array to have it resized, or create the model with "
                         "dynamic_img_size=True")


def _to_numpy(t: torch.Tensor | None, shape: tuple | None, dtype: type) -> np.ndarray:
    if t is None:  # allow_unused: the target does not depend on this tensor at all
        return np.zeros(shape, dtype)
    out = t.detach().to("cpu", torch.float32).numpy().astype(dtype, copy=False)
    return out if shape is None else out.reshape(shape)


def _assemble(*, model, adapter, prepared, logits, classes, class_labels, layer_ids, site_ids, acts, grads,
              grid, prefix, store_dtype, run_device, compute_dtype, target=None) -> xr.Dataset:
    import timm

    import vitcam_nb

    gh, gw = grid
    n_prefix = len(prefix)
    n_tokens = n_prefix + gh * gw
    kinds = np.array(prefix + ["patch"] * (gh * gw))
    rows = np.concatenate([np.full(n_prefix, -1), np.repeat(np.arange(gh), gw)])
    cols = np.concatenate([np.full(n_prefix, -1), np.tile(np.arange(gw), gh)])
    n_targets = len(classes) + 1
    extra = adapter.extra_sites(model)
    token_sites = [s for s in site_ids if s != "F2" and s not in extra]
    info = adapter.describe(model)

    data_vars = {}
    coords = {
        "layer": ("layer", np.array(layer_ids, np.int64)),
        "token": ("token", np.arange(n_tokens, dtype=np.int64)),
        "token_kind": ("token", kinds),
        "patch_row": ("token", rows.astype(np.int64)),
        "patch_col": ("token", cols.astype(np.int64)),
        "target": ("target", np.array([target_name(c) for c in classes] + [EXPECTED_TARGET])),
        "target_class": ("target", np.array(classes + [-1], np.int64)),
        "target_label": ("target", np.array([class_labels[c] for c in classes] + ["expected logit"])),
        "class": ("class", np.arange(len(class_labels), dtype=np.int64)),
        "class_label": ("class", np.array(class_labels)),
    }
    if token_sites:
        sample = acts[(layer_ids[0], token_sites[0])]
        if sample.shape[-2] != n_tokens:
            raise TraceError(f"model: {sample.shape[-2]} tokens at the blocks but the patch grid {gh}x{gw} "
                             f"with {n_prefix} prefix tokens gives {n_tokens}")
        n_channels = int(sample.shape[-1])
        act = np.empty((len(layer_ids), len(token_sites), n_tokens, n_channels), store_dtype)
        grad = np.empty((n_targets, len(layer_ids), len(token_sites), n_tokens, n_channels), store_dtype)
        for li, layer in enumerate(layer_ids):
            for si, site in enumerate(token_sites):
                act[li, si] = _to_numpy(acts.pop((layer, site)), (n_tokens, n_channels), store_dtype)
                # Popping drops each torch tensor once copied, so torch and numpy copies never all coexist.
                grad[:, li, si] = _to_numpy(grads.pop((layer, site)), (n_targets, n_tokens, n_channels),
                                            store_dtype)
        coords["site"] = ("site", np.array(token_sites))
        coords["channel"] = ("channel", np.arange(n_channels, dtype=np.int64))
        data_vars["act"] = (("layer", "site", "token", "channel"), act)
        data_vars["grad"] = (("target", "layer", "site", "token", "channel"), grad)
    if "F2" in site_ids:
        n_heads = int(acts[(layer_ids[0], "F2")].shape[1])
        shape = (n_heads, n_tokens, n_tokens)
        attn = np.empty((len(layer_ids), *shape), store_dtype)
        attn_grad = np.empty((n_targets, len(layer_ids), *shape), store_dtype)
        for li, layer in enumerate(layer_ids):
            attn[li] = _to_numpy(acts.pop((layer, "F2")), shape, store_dtype)
            attn_grad[:, li] = _to_numpy(grads.pop((layer, "F2")), (n_targets, *shape), store_dtype)
        coords["head"] = ("head", np.arange(n_heads, dtype=np.int64))
        for axis in ("query", "key"):
            coords[axis] = (axis, np.arange(n_tokens, dtype=np.int64))
            coords[f"{axis}_kind"] = (axis, kinds)
            coords[f"{axis}_patch_row"] = (axis, rows.astype(np.int64))
            coords[f"{axis}_patch_col"] = (axis, cols.astype(np.int64))
        data_vars["attn"] = (("layer", "head", "query", "key"), attn)
        data_vars["attn_grad"] = (("target", "layer", "head", "query", "key"), attn_grad)
    for site in [s for s in site_ids if s in extra]:
        n = len(extra[site])
        site_acts = [_to_numpy(acts.pop((i, site)), None, store_dtype) for i in range(n)]
        site_grads = [_to_numpy(grads.pop((i, site)), None, store_dtype) for i in range(n)]
        more_vars, more_coords = adapter.assemble_extra(model, site, site_acts, site_grads, target)
        data_vars.update(more_vars)
        coords.update(more_coords)
    data_vars["logits"] = (("class",), logits.to("cpu", torch.float32).numpy().copy())
    h, w = prepared.display.shape[:2]
    data_vars["image"] = (("y", "x", "rgb"), prepared.display)
    coords["y"] = ("y", np.arange(h, dtype=np.int64))
    coords["x"] = ("x", np.arange(w, dtype=np.int64))
    coords["rgb"] = ("rgb", np.array(["r", "g", "b"]))

    model_name, tag = _model_name(model)
    w_hash = weights_sha256(model)
    in_hash = array_sha256(prepared.tensor)
    settings = {"weights": w_hash, "input": in_hash, "classes": classes, "layers": layer_ids,
                "sites": site_ids, "dtype": np.dtype(store_dtype).name, "schema": SCHEMA_VERSION}
    target = target or ClassTargets()
    if target.kind != "class":  # class-target trace ids stay what they were before other targets existed
        settings["target"] = target.settings()
    attrs = {
        "schema_version": SCHEMA_VERSION,
        "trace_id": settings_id(settings),
        "model_name": model_name,
        "model_family": adapter.family,
        "pretrained_tag": tag,
        "weights_sha256": w_hash,
        "input_sha256": in_hash,
        "img_size": f"{h}x{w}",
        "img_height": int(h),
        "img_width": int(w),
        "grid_h": int(gh),
        "grid_w": int(gw),
        "num_prefix_tokens": n_prefix,
        "num_layers": len(adapter.blocks(model)),
        "fused_attn": 0,
        "preprocessing": preprocessing_json(prepared.preprocessing),
        "vitcam_nb_version": vitcam_nb.__version__,
        "torch_version": str(torch.__version__),
        "timm_version": timm.__version__,
        "numpy_version": np.__version__,
        "xarray_version": xr.__version__,
        "device": str(run_device),
        "dtype": np.dtype(store_dtype).name,
        "compute_dtype": str(compute_dtype).replace("torch.", ""),
        "deterministic": 1,  # CPU kernels are; on CUDA _deterministic() switched deterministic kernels on
        "deterministic_settings": "cpu kernels" if run_device.type == "cpu" else
        "torch.use_deterministic_algorithms(True, warn_only=True), cudnn.deterministic=True, cudnn.benchmark=False",
        **target.attrs(),
        **info,
    }
    table = adapter.site_table(model)
    attrs["model_sites"] = ",".join([*table, *extra])
    for site in site_ids:
        if site in table:
            attrs[f"hook_{site}"] = table[site].hook(adapter.block_template)
    return xr.Dataset(data_vars, coords=coords, attrs=attrs)
