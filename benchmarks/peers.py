"""The things vitcam_nb is measured against, each used the way its own documentation recommends at its best.

* the plain-PyTorch baseline of ``trace()``: one forward pass with the same hooks, then one
  ``torch.autograd.grad`` per target with ``retain_graph=True`` (or ``loss.backward()`` with parameter
  gradients and ``retain_grad()`` on the hooked tensors, the way most tutorials do it);
* pytorch-grad-cam 1.5.7 ``GradCAM`` with its ViT ``reshape_transform`` and ``ClassifierOutputTarget``;
* torchcam ``GradCAM`` (if installed) with the same reshape, many layers hooked at once, one backward.

Nothing here calls vitcam_nb, so a vitcam_nb bug cannot make a peer look slower.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

TOKEN_SITES = ("F1", "F3", "F4", "F5", "F6")


def peer_module(block: torch.nn.Module, site: str) -> tuple[torch.nn.Module, str]:
    """The module whose *output* is ``site`` of ``block``, for libraries that hook module outputs only.

    F3 is the input of ``attn.proj``; in timm's ``Attention`` that input is the output of ``attn.norm``,
    an ``nn.Identity`` unless ``scale_norm`` is set (and no gate is used), so hooking ``attn.norm`` reads
    exactly F3. Returns the module and a note saying what was hooked.

    Example:
        >>> import timm
        >>> blk = timm.create_model("vit_tiny_patch16_224").blocks[0]
        >>> peer_module(blk, "F3")[1]
        'attn.norm output (nn.Identity, equals the input of attn.proj)'
    """
    if site == "F1":
        return block.norm1, "norm1 output"
    if site == "F3":
        attn = block.attn
        norm = getattr(attn, "norm", None)
        if isinstance(norm, torch.nn.Identity) and getattr(attn, "gate", None) is None:
            return norm, "attn.norm output (nn.Identity, equals the input of attn.proj)"
        raise ValueError("F3: attn.norm is not an Identity here; wrap attn.proj with wrap_proj_input() first")
    if site == "F4":
        return block.norm2, "norm2 output"
    if site == "F5":
        return block.mlp, "mlp output"
    if site == "F6":
        return block, "block output"
    raise ValueError(f"site {site!r} has no output-hook equivalent for the peers")


def wrap_proj_input(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` whose ``attn.proj`` is ``Sequential(Identity(), proj)`` in every block, so
    that the Identity's output is F3 even where ``attn.norm`` is not an Identity. Numerically unchanged.

    Example:
        >>> import timm
        >>> m = wrap_proj_input(timm.create_model("vit_tiny_patch16_224"))
        >>> type(m.blocks[0].attn.proj[0]).__name__
        'Identity'
    """
    out = copy.deepcopy(model)
    for blk in out.blocks:
        blk.attn.proj = torch.nn.Sequential(torch.nn.Identity(), blk.attn.proj)
        blk.attn.norm = torch.nn.Identity()
    return out


def vit_reshape_transform(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """pytorch-grad-cam's ViT tutorial ``reshape_transform``: drop the prefix tokens, (B, T, C) -> (B, C, h, w).

    Example:
        >>> import timm
        >>> rt = vit_reshape_transform(timm.create_model("vit_tiny_patch16_224"))
        >>> tuple(rt(torch.zeros(1, 197, 192)).shape)
        (1, 192, 14, 14)
    """
    n_prefix = int(model.num_prefix_tokens)
    gh, gw = (int(v) for v in model.patch_embed.grid_size)

    def reshape_transform(tensor: torch.Tensor) -> torch.Tensor:
        result = tensor[:, n_prefix:, :].reshape(tensor.size(0), gh, gw, tensor.size(2))
        return result.transpose(2, 3).transpose(1, 2)

    return reshape_transform


# -- the plain-PyTorch baseline of trace() ---------------------------------------------------------------
@contextlib.contextmanager
def plain_hooks(model: torch.nn.Module, retain_grad: bool = False) -> Iterator[dict]:
    """Hook F1..F6 of every block the plain way (F2 needs ``fused_attn = False``); yields {(layer, site): t}.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224")
        >>> with plain_hooks(m) as store:
        ...     _ = m(torch.zeros(1, 3, 224, 224))
        >>> len(store)
        72
    """
    store: dict[tuple[int, str], torch.Tensor] = {}
    handles = []
    fused = [(blk.attn, blk.attn.fused_attn) for blk in model.blocks]

    def keep(key: tuple[int, str], t: torch.Tensor) -> None:
        if retain_grad and t.requires_grad:
            t.retain_grad()
        store[key] = t

    try:
        for layer, blk in enumerate(model.blocks):
            def out_hook(key: tuple[int, str]) -> Callable:
                return lambda _m, _i, out: keep(key, out)

            handles += [
                blk.norm1.register_forward_hook(out_hook((layer, "F1"))),
                blk.attn.attn_drop.register_forward_hook(out_hook((layer, "F2"))),
                blk.attn.proj.register_forward_pre_hook(lambda _m, args, key=(layer, "F3"): keep(key, args[0])),
                blk.norm2.register_forward_hook(out_hook((layer, "F4"))),
                blk.mlp.register_forward_hook(out_hook((layer, "F5"))),
                blk.register_forward_hook(out_hook((layer, "F6"))),
            ]
            blk.attn.fused_attn = False
        yield store
    finally:
        for h in handles:
            h.remove()
        for m, flag in fused:
            m.fused_attn = flag


def _targets(z: torch.Tensor, k: int) -> list[torch.Tensor]:
    classes = torch.topk(z.detach(), k).indices.tolist()
    expected = (torch.softmax(z.detach(), dim=0) * z).sum()
    return [z[c] for c in classes] + [expected]


def baseline_autograd(model: torch.nn.Module, x: torch.Tensor, k: int) -> dict:
    """One forward with hooks on F1..F6 of every block, then K+1 ``torch.autograd.grad`` calls (top-K logits
    and the expected logit), each w.r.t. the hooked tensors with ``retain_graph=True``. Returns tensors.

    Example:
        >>> import timm
        >>> out = baseline_autograd(timm.create_model("vit_tiny_patch16_224"), torch.zeros(1, 3, 224, 224), 2)
        >>> len(out["grads"]), len(out["acts"])
        (3, 72)
    """
    with plain_hooks(model) as store, torch.enable_grad():
        z = model(x)[0]
        keys = list(store)
        tensors = [store[key] for key in keys]
        grads = [torch.autograd.grad(t, tensors, retain_graph=True) for t in _targets(z, k)]
        return {"acts": {key: t.detach() for key, t in zip(keys, tensors)}, "grads": grads, "logits": z.detach()}


def baseline_backward(model: torch.nn.Module, x: torch.Tensor, k: int) -> dict:
    """The tutorial way: ``retain_grad()`` on the hooked tensors, then K+1 ``loss.backward(retain_graph=True)``
    calls, which also fill every parameter's ``.grad``. Parameter gradients are reset to their prior state.

    Example:
        >>> import timm
        >>> out = baseline_backward(timm.create_model("vit_tiny_patch16_224"), torch.zeros(1, 3, 224, 224), 2)
        >>> len(out["grads"])
        3
    """
    saved = [(p, p.grad) for p in model.parameters()]
    try:
        with plain_hooks(model, retain_grad=True) as store, torch.enable_grad():
            z = model(x)[0]
            keys = list(store)
            grads = []
            for target in _targets(z, k):
                model.zero_grad(set_to_none=True)
                for t in store.values():
                    t.grad = None
                target.backward(retain_graph=True)
                grads.append([store[key].grad for key in keys])
            return {"acts": {key: store[key].detach() for key in keys}, "grads": grads, "logits": z.detach()}
    finally:
        for p, g in saved:
            p.grad = g


def tensor_bytes(result: dict) -> int:
    """Bytes the captured tensors take themselves: numel x itemsize of every activation, attention map and
    gradient of a baseline result (what an ideal store of the same data would need).

    Example:
        >>> tensor_bytes({"acts": {0: torch.zeros(2)}, "grads": [[torch.zeros(2)]]})
        16
    """
    total = sum(t.numel() * t.element_size() for t in result["acts"].values())
    for per_target in result["grads"]:
        total += sum(g.numel() * g.element_size() for g in per_target if g is not None)
    return int(total)


# -- pytorch-grad-cam -------------------------------------------------------------------------------------
def pgc_gradcam(model: torch.nn.Module, layers: list[torch.nn.Module]) -> object:
    """A pytorch-grad-cam ``GradCAM`` on ``layers`` with the ViT ``reshape_transform`` (release it after use).

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224")
        >>> with pgc_gradcam(m, [m.blocks[-1].norm1]) as cam:
        ...     type(cam).__name__
        'GradCAM'
    """
    from pytorch_grad_cam import GradCAM

    return GradCAM(model=model, target_layers=layers, reshape_transform=vit_reshape_transform(model))


def pgc_map(cam: object, x: torch.Tensor, class_index: int) -> np.ndarray:
    """One map with pytorch-grad-cam's public API: forward, backward, weights, resize. (H, W) float32.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224")
        >>> with pgc_gradcam(m, [m.blocks[-1].norm1]) as cam:
        ...     pgc_map(cam, torch.zeros(1, 3, 224, 224), 0).shape
        (224, 224)
    """
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    return cam(input_tensor=x, targets=[ClassifierOutputTarget(class_index)])[0]


def pgc_per_layer(cam: object, x: torch.Tensor, class_index: int) -> np.ndarray:
    """All hooked layers' maps from one forward and one backward, via pytorch-grad-cam's
    ``compute_cam_per_layer`` (public name, not in its tutorials; its ``__call__`` averages the layers).
    ``cam`` must hook its layers in execution order. Returns (n_layers, H, W).

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224")
        >>> with pgc_gradcam(m, [m.blocks[0].norm1, m.blocks[1].norm1]) as cam:
        ...     pgc_per_layer(cam, torch.zeros(1, 3, 224, 224), 0).shape
        (2, 224, 224)
    """
    from pytorch_grad_cam.utils.image import scale_cam_image
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    targets = [ClassifierOutputTarget(class_index)]
    outputs = cam.activations_and_grads(x)
    cam.model.zero_grad()
    loss = sum(t(o) for t, o in zip(targets, outputs))
    loss.backward(retain_graph=True)
    per_layer = cam.compute_cam_per_layer(x, targets, False)
    # compute_cam_per_layer min-max scales before resizing; scale again as __call__ does for one layer.
    return np.stack([scale_cam_image(m[:, 0])[0] for m in per_layer])


# -- torchcam --------------------------------------------------------------------------------------------
def torchcam_available() -> bool:
    """Whether torchcam (with ``reshape_transform`` support, >= 0.5) can be imported.

    Example:
        >>> isinstance(torchcam_available(), bool)
        True
    """
    try:
        from torchcam.methods.core import _CAM
    except ImportError:
        return False
    import inspect

    return "reshape_transform" in inspect.signature(_CAM.__init__).parameters


def torchcam_gradcam(model: torch.nn.Module, names: list[str]) -> object:
    """A torchcam ``GradCAM`` with every layer in ``names`` hooked at once (call ``remove_hooks()`` after).

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224")
        >>> ext = torchcam_gradcam(m, ["blocks.11.norm1"]) if torchcam_available() else None
    """
    from torchcam.methods import GradCAM

    return GradCAM(model, target_layer=names, reshape_transform=vit_reshape_transform(model))


def torchcam_maps(extractor: object, model: torch.nn.Module, x: torch.Tensor, class_index: int,
                  size: tuple[int, int]) -> torch.Tensor:
    """torchcam at its best for many layers: one forward, one backward (graph retained) for every hooked
    layer, then bilinear upsampling to ``size`` and min-max normalisation. Returns (n_layers, H, W).

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224")
        >>> if torchcam_available():
        ...     ext = torchcam_gradcam(m, ["blocks.11.norm1"])
        ...     print(tuple(torchcam_maps(ext, m, torch.zeros(1, 3, 224, 224), 0, (224, 224)).shape))
        ...     ext.remove_hooks()
        (1, 224, 224)
    """
    with torch.enable_grad():
        scores = model(x)
        cams = extractor(class_idx=class_index, scores=scores, retain_graph=True)
    with torch.no_grad():
        grid = torch.cat(cams, dim=0)[:, None]
        up = F.interpolate(grid, size=size, mode="bilinear", align_corners=False)[:, 0]
        lo = up.amin(dim=(-2, -1), keepdim=True)
        span = up.amax(dim=(-2, -1), keepdim=True) - lo
        return torch.where(span > 0, (up - lo) / torch.where(span > 0, span, 1), 0)
