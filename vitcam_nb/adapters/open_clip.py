"""The adapter for open_clip image towers (``pip install vitcam_nb[clip]``).

:class:`OpenClipAdapter` lets :func:`vitcam_nb.trace` read every site of an open_clip ``VisionTransformer``,
given either the whole ``CLIP`` model (the traced output is ``model.encode_image(x)``) or its bare
``model.visual`` tower (``model.visual(x)``). open_clip blocks use ``nn.MultiheadAttention``, whose fused
kernels never expose the softmax matrix, so for the duration of a trace each block's attention runs an
explicit, mathematically identical computation with the softmax passing through a hookable ``attn_probs``
identity (site F2); everything is restored afterwards.

Text prompts as targets are :func:`vitcam_nb.targets.prompts`.

open_clip itself is imported only inside functions, so ``import vitcam_nb`` never needs it.

Example:
    >>> import open_clip, vitcam_nb as vc  # doctest: +SKIP
    >>> model, _, _ = open_clip.create_model_and_transforms("ViT-B-32")  # doctest: +SKIP
    >>> OpenClipAdapter().site_table(model)["F2"].hook(OpenClipAdapter.block_template)  # doctest: +SKIP
    'visual.transformer.resblocks.{layer}.attn.attn_probs:output'
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vitcam_nb.adapters.base import Adapter, SiteSpec
from vitcam_nb.adapters.registry import declare_family
from vitcam_nb.core.errors import ArgumentTypeError, TraceError

__all__ = ["CLIP_SITES", "ClipSiteSpec", "OpenClipAdapter", "image_embedding_dim", "is_open_clip_vit",
           "is_whole_clip", "visual_tower"]

# open_clip.constants.OPENAI_DATASET_MEAN/STD, the default of open_clip's PreprocessCfg.
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
# open_clip's resize_mode -> the timm crop_mode that performs the same eval transform.
_CROP_MODES = {"shortest": "center", "squash": "squash", "longest": "border"}
PROBS_MODULE = "attn_probs"
#: Identities the explicit attention passes q, k, v (N, heads, L, head_dim) and the pre-softmax scores through,
#: so the optional sites q, k, v and attn_scores are hookable.
QKV_MODULES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "attn_scores": "attn_scores", "q_out": "attn_q_out",
               "k_out": "attn_k_out"}


@dataclass(frozen=True)
class ClipSiteSpec(SiteSpec):
    """A site of an open_clip block; ``root`` is the path of the vision tower inside the traced model
    ("visual." for a whole CLIP model), so the checklist's hook names the module from the model's top.

    Example:
        >>> ClipSiteSpec("ln_1", "output", root="visual.").hook("transformer.resblocks.{layer}")
        'visual.transformer.resblocks.{layer}.ln_1:output'
    """

    root: str = ""

    def hook(self, block_template: str) -> str:
        return self.root + super().hook(block_template)


def _sites(f2_module: str, root: str = "") -> dict[str, ClipSiteSpec]:
    return {
        "F1": ClipSiteSpec("ln_1", "output", "LayerNorm output before multi-head attention", root),
        "F2": ClipSiteSpec(f2_module, "output", "softmax attention matrix per head", root),
        "F3": ClipSiteSpec("attn.out_proj", "input",
                           "attention output, heads concatenated, before the output projection", root),
        "F4": ClipSiteSpec("ln_2", "output", "LayerNorm output before the MLP", root),
        "F5": ClipSiteSpec("mlp", "output", "MLP output", root),
        "F6": ClipSiteSpec("", "output", "residual stream after the MLP (block output)", root),
        "resid_pre": ClipSiteSpec("", "input", "residual stream entering the block", root),
        "attn_out": ClipSiteSpec("attn", "output", "attention module output after out_proj", root),
        "resid_mid": ClipSiteSpec("ln_2", "input", "residual stream after the attention residual", root),
        "q": ClipSiteSpec(f"attn.{QKV_MODULES['q']}", "output", "attention queries per head (before the scale)", root),
        "k": ClipSiteSpec(f"attn.{QKV_MODULES['k']}", "output", "attention keys per head", root),
        "v": ClipSiteSpec(f"attn.{QKV_MODULES['v']}", "output", "attention values per head", root),
        "q_out": ClipSiteSpec(f"attn.{QKV_MODULES['q_out']}", "output", "queries, heads concatenated, through out_proj "
                              "(values only: not on the path to the output)", root),
        "k_out": ClipSiteSpec(f"attn.{QKV_MODULES['k_out']}", "output", "keys, heads concatenated, through out_proj "
                              "(values only: not on the path to the output)", root),
        "attn_scores": ClipSiteSpec(f"attn.{QKV_MODULES['attn_scores']}", "output",
                                    "pre-softmax attention scores per head (scaled q k^T, before any mask)", root),
    }


CLIP_SITES: dict[str, SiteSpec] = _sites(f"attn.{PROBS_MODULE}")


def is_open_clip_vit(module: object) -> bool:
    """Whether ``module`` is an open_clip ``VisionTransformer``, told by class name so that open_clip is not
    imported just to look at a model.

    Example:
        >>> is_open_clip_vit(object())
        False
    """
    return any(c.__name__ == "VisionTransformer" and c.__module__.startswith("open_clip")
               for c in type(module).__mro__)


def is_whole_clip(model: object) -> bool:
    """Whether ``model`` is a whole open_clip ``CLIP`` model (with ``encode_image`` and a ViT ``visual``).

    Example:
        >>> is_whole_clip(object())
        False
    """
    return (type(model).__module__.startswith("open_clip") and callable(getattr(model, "encode_image", None))
            and is_open_clip_vit(getattr(model, "visual", None)))


def visual_tower(model: torch.nn.Module) -> torch.nn.Module:
    """The open_clip ``VisionTransformer`` of a whole CLIP model, or the model itself if it is one.

    Example:
        >>> visual_tower(clip_model) is clip_model.visual  # doctest: +SKIP
        True
    """
    if is_whole_clip(model):
        return model.visual
    if is_open_clip_vit(model):
        return model
    raise ArgumentTypeError(f"model: expected an open_clip CLIP model or its VisionTransformer (model.visual), "
                            f"got {type(model).__module__}.{type(model).__name__}")


def image_embedding_dim(model: torch.nn.Module) -> int | None:
    """Size of the embedding the traced model returns, from the weights (None if it cannot be told).

    Example:
        >>> image_embedding_dim(clip_model)  # doctest: +SKIP
        512
    """
    v = visual_tower(model)
    proj = getattr(v, "proj", None)
    if isinstance(proj, torch.Tensor):
        return int(proj.shape[1])
    return None


def _explicit_attention(mha: torch.nn.MultiheadAttention):
    """A forward for ``mha`` equal to nn.MultiheadAttention's, written out so that the softmax matrix passes
    through ``mha.attn_probs`` and the output projection is a call of ``mha.out_proj`` (its hooks fire)."""

    def forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if query.ndim != 3:
            raise TraceError(f"model: open_clip attention got an unbatched input of shape {tuple(query.shape)}")
        if not mha.batch_first:  # (L, N, E) -> (N, L, E)
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        n, tgt_len, embed = query.shape
        src_len = key.shape[1]
        heads = mha.num_heads
        head_dim = embed // heads
        if mha._qkv_same_embed_dim:
            w_q, w_k, w_v = mha.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
        b_q, b_k, b_v = mha.in_proj_bias.chunk(3) if mha.in_proj_bias is not None else (None, None, None)

        def split(t, w, b):  # (N, L, E) -> (N, heads, L, head_dim)
            return F.linear(t, w, b).view(n, -1, heads, head_dim).transpose(1, 2)

        q, k, v = (getattr(mha, QKV_MODULES[s])(split(t, w, b))
                   for s, t, w, b in (("q", query, w_q, b_q), ("k", key, w_k, b_k), ("v", value, w_v, b_v)))
        scores = getattr(mha, QKV_MODULES["attn_scores"])((q * (1.0 / math.sqrt(head_dim))) @ k.transpose(-2, -1))
        for site, t in (("q_out", q), ("k_out", k)):  # Grad-ECLIP's code compares q and k after out_proj
            joined = t.transpose(1, 2).reshape(n, -1, embed)
            getattr(mha, QKV_MODULES[site])(F.linear(joined, mha.out_proj.weight, mha.out_proj.bias))
        if attn_mask is None and is_causal:
            attn_mask = torch.ones(tgt_len, src_len, dtype=torch.bool, device=q.device).triu(1)
        if attn_mask is not None:
            mask = attn_mask.view(n, heads, tgt_len, src_len) if attn_mask.ndim == 3 else attn_mask
            scores = scores.masked_fill(mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        if key_padding_mask is not None:
            pad = key_padding_mask.view(n, 1, 1, src_len)
            scores = scores.masked_fill(pad, float("-inf")) if pad.dtype == torch.bool else scores + pad
        probs = torch.softmax(scores, dim=-1)
        probs = F.dropout(probs, mha.dropout, mha.training)
        probs = getattr(mha, PROBS_MODULE)(probs)
        out = (probs @ v).transpose(1, 2).reshape(n, tgt_len, embed)
        if not mha.batch_first:
            out = out.transpose(0, 1)
        out = mha.out_proj(out)
        weights = None
        if need_weights:
            weights = probs.mean(dim=1) if average_attn_weights else probs
        return out, weights

    return forward


@declare_family(needs="open_clip", priority=140)
class OpenClipAdapter(Adapter):
    """open_clip ``VisionTransformer`` towers, traced inside a whole ``CLIP`` model or on their own.

    Sites: F1 = ``ln_1`` output, F2 = the softmax matrix (``attn.attn_probs``, attached for the trace),
    F3 = ``attn.out_proj`` input, F4 = ``ln_2`` output, F5 = ``mlp`` output (before layer scale), F6 = block
    output; extended ``resid_pre``, ``attn_out`` (``attn`` output), ``resid_mid`` (``ln_2`` input). The token
    layout is the class token first, then the ``conv1`` patch grid in raster order.

    Example:
        >>> OpenClipAdapter().prefix_kinds(clip_model)  # doctest: +SKIP
        ['cls']
    """

    family = "open_clip"
    block_template = "transformer.resblocks.{layer}"
    sites = CLIP_SITES

    def matches(self, model: torch.nn.Module) -> bool:
        return is_whole_clip(model) or is_open_clip_vit(model)

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return list(visual_tower(model).transformer.resblocks)

    def prefix_kinds(self, model: torch.nn.Module) -> list[str]:
        # VisionTransformer._embeds always prepends class_embedding, whatever pool_type is.
        return ["cls"]

    def grid_module(self, model: torch.nn.Module) -> torch.nn.Module:
        return visual_tower(model).conv1

    def grid_from_output(self, model: torch.nn.Module, output: torch.Tensor) -> tuple[int, int]:
        return int(output.shape[-2]), int(output.shape[-1])

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [blk.attn for blk in self.blocks(model)]

    def describe(self, model: torch.nn.Module) -> dict[str, object]:
        v = visual_tower(model)
        attn = v.transformer.resblocks[0].attn
        width = int(v.transformer.width)
        patch = tuple(int(p) for p in v.patch_size)
        pool = "attn_pool" if getattr(v, "attn_pool", None) is not None else str(v.pool_type)
        return {
            "num_heads": int(attn.num_heads),
            "head_dim": width // int(attn.num_heads),
            "embed_dim": width,
            "global_pool": pool,
            "patch_size": patch[0] if patch[0] == patch[1] else f"{patch[0]}x{patch[1]}",
            "dynamic_img_size": 0,
            "embedding_output": "CLIP.encode_image" if is_whole_clip(model) else "VisionTransformer.forward",
        }

    def site_table(self, model: torch.nn.Module) -> dict[str, SiteSpec]:
        return dict(_sites(f"attn.{PROBS_MODULE}", "visual." if is_whole_clip(model) else ""))

    @contextlib.contextmanager
    def patched(self, model: torch.nn.Module) -> Iterator[None]:
        """Run each block's attention explicitly (softmax through ``attn.attn_probs``) and undo it on exit.

        Example:
            >>> with OpenClipAdapter().patched(clip_model):  # doctest: +SKIP
            ...     emb = clip_model.encode_image(x)
        """
        undo: list = []
        try:
            for i, blk in enumerate(self.blocks(model)):
                attn = blk.attn
                if not isinstance(attn, torch.nn.MultiheadAttention):
                    # CustomResidualAttentionBlock (qk_norm, scaled cosine, ...): its own Attention class,
                    # whose non-SDPA path fails in open_clip 3.3 (bmm on 4-D tensors); not supported yet.
                    raise TraceError(f"model: block {i} has open_clip's custom attention "
                                     f"{type(attn).__name__} (qk_norm/scaled_cosine/scale_* options); the "
                                     "open_clip adapter supports blocks with nn.MultiheadAttention only")
                if attn.bias_k is not None or attn.add_zero_attn:
                    raise TraceError(f"model: block {i}'s attention uses bias_k/bias_v or add_zero_attn, which "
                                     "the explicit attention of the open_clip adapter does not implement")
                if PROBS_MODULE in attn._modules or "forward" in attn.__dict__:
                    raise TraceError(f"model: block {i}'s attention already has an {PROBS_MODULE!r} submodule or "
                                     "a patched forward (a trace already in progress?)")
                for name in (PROBS_MODULE, *QKV_MODULES.values()):
                    attn.add_module(name, torch.nn.Identity())
                    undo.append(lambda a=attn, n=name: delattr(a, n))
                # An instance attribute shadows the class's forward; deleting it restores the original exactly.
                attn.forward = _explicit_attention(attn)
                undo.append(lambda a=attn: a.__dict__.pop("forward", None))
            yield
        finally:
            for fn in reversed(undo):
                fn()

    def arrange(self, model: torch.nn.Module, site: str, layer: int, tensor: torch.Tensor) -> torch.Tensor:
        if site in ("q", "k", "v"):  # (..., heads, L, head_dim) from the explicit attention -> (..., L, E)
            t = tensor.transpose(-3, -2)
            return t.reshape(*t.shape[:-2], t.shape[-2] * t.shape[-1])
        # Old open_clip runs its blocks sequence-first (L, N, D); F2, the scores and the projected q/k are always
        # built batch-first.
        batch_first = getattr(visual_tower(model).transformer, "batch_first", True)
        if site in ("F2", "attn_scores", "q_out", "k_out") or batch_first:
            return tensor
        return tensor.transpose(0, 1) if tensor.ndim == 3 else tensor.transpose(1, 2)

    def data_config(self, model: torch.nn.Module) -> dict | None:
        """open_clip's eval preprocessing as a timm data config: resize the short side to ``image_size``
        (bicubic unless the model's ``preprocess_cfg`` says otherwise), centre crop, mean/std.

        Example:
            >>> OpenClipAdapter().data_config(clip_model)["crop_pct"]  # doctest: +SKIP
            1.0
        """
        v = visual_tower(model)
        cfg = dict(getattr(v, "preprocess_cfg", None) or {})
        size = v.image_size
        h, w = (int(size), int(size)) if isinstance(size, (int, np.integer)) else (int(size[0]), int(size[1]))
        mean = cfg.get("mean") or getattr(v, "image_mean", None) or OPENAI_MEAN
        std = cfg.get("std") or getattr(v, "image_std", None) or OPENAI_STD
        interpolation = cfg.get("interpolation") or "bicubic"
        if interpolation not in ("bicubic", "bilinear"):
            interpolation = "bicubic"  # open_clip's eval transform uses bicubic for anything else ("random")
        resize_mode = cfg.get("resize_mode") or "shortest"
        return {
            "input_size": (3, h, w),
            "mean": tuple(float(m) for m in mean),
            "std": tuple(float(s) for s in std),
            "interpolation": interpolation,
            "crop_pct": 1.0,
            "crop_mode": _CROP_MODES.get(resize_mode, "center"),
        }

    def check_input(self, model: torch.nn.Module, x: torch.Tensor) -> None:
        """Refuse an input whose size the fixed positional embedding cannot take.

        Example:
            >>> OpenClipAdapter().check_input(clip_model, torch.zeros(1, 3, 224, 224))  # doctest: +SKIP
        """
        expected = self.data_config(model)["input_size"][1:]
        got = tuple(int(s) for s in x.shape[-2:])
        if got != expected:
            raise TraceError(f"image: the model expects {expected[0]}x{expected[1]} input, got {got[0]}x{got[1]}; "
                             "pass a PIL image or uint8 array to have it resized")
