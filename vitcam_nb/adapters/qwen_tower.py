"""The vision tower of Qwen2-VL and Qwen2.5-VL (``model.visual``) as the kit reads it: its site table, the
explicit attention that makes F2 a tensor, the packed input (``pixel_values`` of the processor) and the order of
its tokens.

The tower runs on a PACKED sequence with no batch dimension: ``(N, C)``, one row per 14 px patch of every image,
grouped by 2x2 merge block (``spatial_merge_size``); Qwen2.5-VL permutes the merge blocks into window order
before its first block (:func:`~vitcam_nb.adapters.vlm_layouts.qwen.qwen_tower_cells` says which patch each
position holds). Each block is pre-norm, ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``, with a fused ``qkv``
projection and 2-D rotary embeddings on q and k; attention runs per image (``cu_seqlens``) and, in Qwen2.5-VL, per
window except at ``fullatt_block_indexes``. There is no class token. The sites (names as for every family,
:data:`vitcam_nb.core.schema.SITE_MEANINGS`):

- F1 ``norm1`` output (a LayerNorm in Qwen2-VL, an RMSNorm in Qwen2.5-VL), F4 ``norm2`` output;
- F2 the softmax attention per head over the whole image: block-diagonal, each image (Qwen2-VL) or window
  (Qwen2.5-VL windowed blocks) one block, exactly 0 between tokens that never attend to each other, with gradient
  0 there (the attention output reads only the blocks); read from an explicit forward installed for the trace;
- F3 ``attn.proj`` input (heads concatenated, after the rotary q/k attention), attn_out the attention output;
- F5 ``mlp`` output (Qwen2-VL: fc1, GELU, fc2; Qwen2.5-VL: the gated SiLU MLP), F6 the block output;
- resid_pre the block input, resid_mid ``norm2`` input.

The captured ``(N, C)`` tensors become the kit's ``(1, token, channel)`` here, their tokens put in raster order of
the patch grid by the tower's own cell map, so the standard trace form maps each token to the patch it covers.

Example:
    >>> sorted(QWEN_TOWER_SITES)[:3]
    ['F1', 'F2', 'F3']
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vitcam_nb.adapters.hf import HfSiteSpec, eager_attention
from vitcam_nb.adapters.vlm_layouts.qwen import qwen_tower_cells
from vitcam_nb.core.errors import ArgumentTypeError, TraceError

__all__ = ["BLOCKS", "PROBS", "QWEN_TOWER_SITES", "explicit_tower_attention", "grid_of", "merged_order",
           "pack_order",
           "packed_pixels", "qwen_sites", "unpatchify"]

BLOCKS = "model.visual.blocks"
#: the module the explicit attention passes its probabilities through during a trace (the F2 hook)
PROBS = "vitcam_probs"

QWEN_TOWER_SITES = {
    "F1": ("norm1", "output", "norm1 output before attention (LayerNorm in Qwen2-VL, RMSNorm in Qwen2.5-VL)"),
    "F2": (f"attn.{PROBS}", "output", "softmax attention per head over the image's patches: block-diagonal per "
                                      "attention chunk (the image; Qwen2.5-VL's windows in its windowed blocks), 0 "
                                      "elsewhere"),
    "F3": ("attn.proj", "input", "attention output, heads concatenated, before the output projection"),
    "F4": ("norm2", "output", "norm2 output before the MLP"),
    "F5": ("mlp", "output", "MLP output (Qwen2-VL fc1-GELU-fc2; Qwen2.5-VL gated SiLU MLP)"),
    "F6": ("", "output", "residual stream after the MLP (block output)"),
    "resid_pre": ("", "input", "residual stream entering the block"),
    "attn_out": ("attn", "output", "attention output after proj"),
    "resid_mid": ("norm2", "input", "residual stream after the attention residual"),
}


def qwen_sites(path: str = BLOCKS) -> dict[str, HfSiteSpec]:
    """The tower's site table, module paths relative to a block of the list at ``path``.

    Example:
        >>> qwen_sites()["F3"].hook("")
        'model.visual.blocks.{layer}.attn.proj:input'
    """
    return {site: HfSiteSpec(module, io, meaning, path) for site, (module, io, meaning) in QWEN_TOWER_SITES.items()}


def grid_of(grid_thw: Any) -> tuple[int, int, int]:
    """The one image's (t, h, w) in patches from ``image_grid_thw``, refusing several images or a video.

    Example:
        >>> grid_of([[1, 4, 6]])
        (1, 4, 6)
    """
    try:
        rows = np.asarray(grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw,
                          dtype=np.int64).reshape(-1, 3)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"model_kwargs: image_grid_thw must be the processor's (1, 3) grid, got {grid_thw!r}") \
            from exc
    if rows.shape[0] != 1:
        raise TraceError(f"model_kwargs: image_grid_thw holds {rows.shape[0]} images; trace one image per prompt")
    t, h, w = (int(v) for v in rows[0])
    if t != 1 or h <= 0 or w <= 0:
        raise TraceError(f"model_kwargs: image_grid_thw {[t, h, w]} is not one image (t=1)")
    return t, h, w


def pack_order(model: torch.nn.Module, grid_thw: Any) -> torch.Tensor:
    """``order[r]``: the tower position holding raster patch ``r`` (row-major over the h x w patches), in the order
    the tower's blocks see them (Qwen2.5-VL: window order).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> m = NS(config=NS(vision_config=NS(spatial_merge_size=2, window_size=None, patch_size=14)))
        >>> pack_order(m, [[1, 2, 4]]).tolist()
        [0, 1, 4, 5, 2, 3, 6, 7]
    """
    t, h, w = grid_of(grid_thw)
    vc = model.config.vision_config
    win = getattr(vc, "window_size", None) if hasattr(vc, "fullatt_block_indexes") else None
    _, rows, cols = qwen_tower_cells((t, h, w), int(vc.spatial_merge_size), window_size=win,
                                     patch_size=int(vc.patch_size))
    return torch.from_numpy(np.argsort(rows * w + cols, kind="stable"))


def merged_order(model: torch.nn.Module, grid_thw: Any) -> torch.Tensor:
    """``rows[k]``: the row of the merger's output (one per merge block, in the tower's order) that the LM reads as
    image token ``k`` (raster over the merged grid). Qwen2-VL: the identity; Qwen2.5-VL: window order undone.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> m = NS(config=NS(vision_config=NS(spatial_merge_size=2, window_size=56, patch_size=14,
        ...                                   fullatt_block_indexes=[])))
        >>> merged_order(m, [[1, 2, 6]]).tolist()  # windows of 2x2 blocks: blocks 0, 1 then 2
        [0, 1, 2]
        >>> merged_order(m, [[1, 4, 6]]).tolist()  # blocks (0,0) (0,1) (1,0) (1,1) form window 0
        [0, 1, 4, 2, 3, 5]
    """
    t, h, w = grid_of(grid_thw)
    vc = model.config.vision_config
    m = int(vc.spatial_merge_size)
    win = getattr(vc, "window_size", None) if hasattr(vc, "fullatt_block_indexes") else None
    _, rows, cols = qwen_tower_cells((t, h, w), m, window_size=win, patch_size=int(vc.patch_size))
    block = (rows[::m * m] // m) * (w // m) + cols[::m * m] // m  # the raster index of each tower block
    return torch.from_numpy(np.argsort(block, kind="stable"))


def _patch_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    vc = model.config.vision_config
    return int(getattr(vc, "in_channels", 3)), int(vc.temporal_patch_size), int(vc.patch_size)


def packed_pixels(model: torch.nn.Module, image: object, grid_thw: Any) -> torch.Tensor:
    """The processor's ``pixel_values`` ``(N, C*T*P*P)`` (or ``(1, N, ...)``) as a float32 ``(1, N, C*T*P*P)``
    tensor, refused by name unless it is one image of the ``image_grid_thw`` grid.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> m = NS(config=NS(vision_config=NS(in_channels=3, temporal_patch_size=2, patch_size=2)))
        >>> tuple(packed_pixels(m, torch.zeros(8, 24), [[1, 2, 4]]).shape)
        (1, 8, 24)
    """
    if isinstance(image, np.ndarray) and np.issubdtype(image.dtype, np.floating):
        image = torch.from_numpy(image)
    if not isinstance(image, torch.Tensor) or not image.is_floating_point():
        raise ArgumentTypeError("image: Qwen2-VL takes its processor's pixel_values (a float tensor (N_patches, "
                                f"C*T*P*P)) as the image, got {type(image).__name__}"
                                + (f" of dtype {image.dtype}" if isinstance(image, (torch.Tensor, np.ndarray)) else ""))
    c, tp, p = _patch_shape(model)
    t, h, w = grid_of(grid_thw)
    shape = tuple(int(v) for v in image.shape)
    if image.ndim == 3 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) != 2 or shape[1] != c * tp * p * p:
        raise TraceError(f"image: expected pixel_values of shape (N_patches, {c * tp * p * p}) = (N, C*T*P*P) for "
                         f"C={c}, T={tp}, P={p}; got {tuple(image.shape)}")
    if shape[0] != t * h * w:
        raise TraceError(f"image: {shape[0]} patches but image_grid_thw {[t, h, w]} packs {t * h * w}; give the "
                         "pixel_values and image_grid_thw of one processor call on one image")
    x = image.detach().to("cpu", torch.float32).reshape(1, *shape).clone()
    if not torch.isfinite(x).all():
        raise TraceError("image: contains NaN or inf values; expected finite pixel values")
    frames = x.reshape(shape[0], c, tp, p * p)
    if tp > 1 and not torch.equal(frames, frames[:, :, :1].expand_as(frames)):
        raise TraceError(f"image: the {tp} temporal copies of a patch differ (a video's frames?); pixel_values of "
                         "one image repeat each patch temporal_patch_size times")
    return x


def unpatchify(model: torch.nn.Module, x: torch.Tensor, grid_thw: Any) -> torch.Tensor:
    """The normalised image ``(C, h*P, w*P)`` the packed ``x`` ``(1, N, C*T*P*P)`` was cut from: each patch placed
    at its cell (merge-block order, as the processor packs it), the first of its temporal copies.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> m = NS(config=NS(vision_config=NS(in_channels=1, temporal_patch_size=1, patch_size=1,
        ...                                   spatial_merge_size=2, window_size=None)))
        >>> unpatchify(m, torch.arange(8.0).reshape(1, 8, 1), [[1, 2, 4]])[0].tolist()
        [[0.0, 1.0, 4.0, 5.0], [2.0, 3.0, 6.0, 7.0]]
    """
    c, tp, p = _patch_shape(model)
    t, h, w = grid_of(grid_thw)
    _, rows, cols = qwen_tower_cells((t, h, w), int(model.config.vision_config.spatial_merge_size))
    patches = x.reshape(-1, c, tp, p, p)[:, :, 0]  # (N, C, P, P)
    out = torch.zeros(c, h, p, w, p, dtype=x.dtype)
    # two index arrays around a slice: the indexed view is (N, C, P, P), one patch per cell
    out[:, torch.from_numpy(rows), :, torch.from_numpy(cols), :] = patches
    return out.reshape(c, h * p, w * p)


def _explicit_forward(attn: torch.nn.Module, rotary: Any) -> Any:
    """The family's attention (fused qkv, its own rotary function, softmax per ``cu_seqlens`` chunk in float32, as
    its eager path computes it) with the probabilities of all chunks passed through ``attn.vitcam_probs`` as one
    block-diagonal (heads, N, N) tensor, each chunk's output read back from its block."""

    def forward(hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **_kw: Any) -> torch.Tensor:
        n = hidden_states.shape[0]
        q, k, v = attn.qkv(hidden_states).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = position_embeddings
        q, k = rotary(q, k, cos, sin)
        q, k, v = (s.transpose(0, 1) for s in (q, k, v))  # (heads, N, head_dim)
        bounds = [int(b) for b in cu_seqlens.tolist()]
        chunks = [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
        blocks = [F.pad(torch.softmax(torch.matmul(q[:, s:e], k[:, s:e].transpose(1, 2)) * attn.scaling, dim=-1,
                                      dtype=torch.float32).to(q.dtype), (s, n - e)) for s, e in chunks]
        probs = getattr(attn, PROBS)(torch.cat(blocks, dim=1))
        out = torch.cat([torch.matmul(probs[:, s:e, s:e], v[:, s:e]) for s, e in chunks], dim=1)
        return attn.proj(out.transpose(0, 1).reshape(n, -1))

    return forward


@contextlib.contextmanager
def explicit_tower_attention(model: torch.nn.Module) -> Iterator[None]:
    """Every tower block's attention as :func:`_explicit_forward` (eager attention everywhere else), restored on
    exit, also on error.

    Example:
        >>> from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
        >>> vision = dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, mlp_ratio=1)
        >>> text = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        ...             num_key_value_heads=1, vocab_size=32, rope_parameters={"rope_type": "default",
        ...             "mrope_section": [1, 1, 2], "rope_theta": 1e4})
        >>> m = Qwen2VLForConditionalGeneration(Qwen2VLConfig(vision_config=vision, text_config=text))
        >>> with explicit_tower_attention(m):
        ...     hasattr(m.model.visual.blocks[0].attn, PROBS)
        True
        >>> hasattr(m.model.visual.blocks[0].attn, PROBS)
        False
    """
    attns = [blk.attn for blk in model.get_submodule(BLOCKS)]
    saved = [(a, a.__dict__.get("forward")) for a in attns]
    try:
        with eager_attention(model):
            for a in attns:
                rotary = importlib.import_module(type(a).__module__).apply_rotary_pos_emb_vision  # the family's own
                a.add_module(PROBS, torch.nn.Identity())
                a.forward = _explicit_forward(a, rotary)
            yield
    finally:
        for a, fwd in saved:
            a._modules.pop(PROBS, None)
            if fwd is None:
                a.__dict__.pop("forward", None)
            else:
                a.forward = fwd
