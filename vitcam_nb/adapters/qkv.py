"""The optional per-head query, key, value and pre-softmax score sites of timm attention blocks: which blocks
have them, where they are read, and how the fused ``qkv`` projection output is split into ``q``, ``k``, ``v``.

timm's ``Attention`` projects all three at once (``qkv``: (B, N, 3 * heads * head_dim), ordered q, k, v and then
head by head), so ``q``, ``k`` and ``v`` are the thirds of that output, heads concatenated as channel groups (as
F3); the capture splits the output and hands the model the thirds put back together, so each third is a tensor
of the forward graph (its gradient exists) and the values are unchanged. The scores ``scale * q k^T`` have no
module of their own; site ``attn_scores`` is hooked on the attention module and recomputed from
``q_norm``/``k_norm`` during the pass (``vitcam_nb.capture.scores``).

Example:
    >>> import torch
    >>> split_qkv("k", torch.arange(6.0).reshape(1, 1, 6)).tolist()
    [[[2.0, 3.0]]]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from vitcam_nb.adapters.base import SiteSpec
from vitcam_nb.core.schema import QKV_SITES, SCORES_SITE

__all__ = ["SCORES_IO", "SPLIT_IO", "single_head_attention", "split_qkv", "timm_qkv_sites"]

#: The ``io`` of a site whose tensor the capture recomputes from the attention's q and k (no module holds it).
SCORES_IO = "scores"
#: ``SPLIT_IO + site`` reads the q, k or v third of a fused qkv projection's output (``output:q``, ...).
SPLIT_IO = "output:"


def _plain_timm_attention(attn: object) -> bool:
    """timm's own ``Attention`` class (not BEiT's or EVA's, whose q/k/v biases bypass the ``qkv`` module), with no
    query/key normalisation, so the ``qkv`` output is exactly the q, k and v the scores are made of."""
    from timm.models.vision_transformer import Attention

    return (type(attn) is Attention and isinstance(getattr(attn, "qkv", None), torch.nn.Linear)
            and isinstance(attn.q_norm, torch.nn.Identity) and isinstance(attn.k_norm, torch.nn.Identity))


def timm_qkv_sites(blocks: list[torch.nn.Module]) -> dict[str, SiteSpec]:
    """The sites ``q``, ``k``, ``v`` and ``attn_scores`` of timm blocks whose attention is a plain ``Attention``
    (empty otherwise: asking for them is then refused with the sites the model has).

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1)
        >>> sorted(timm_qkv_sites(list(m.blocks)))
        ['attn_scores', 'k', 'q', 'v']
    """
    if not blocks or not all(_plain_timm_attention(getattr(b, "attn", None)) for b in blocks):
        return {}
    sites = {s: SiteSpec("attn.qkv", SPLIT_IO + s, f"attention {name}, heads concatenated (third {i + 1} of the "
                                                 "qkv projection output)")
             for i, (s, name) in enumerate(zip(QKV_SITES, ("queries (before the 1/sqrt(d) scale)", "keys",
                                                            "values")))}
    sites[SCORES_SITE] = SiteSpec("attn", SCORES_IO, "pre-softmax attention scores per head, scale * q k^T "
                                                     "recomputed from q_norm and k_norm outputs during the pass")
    return sites


def split_qkv(site: str, tensor: torch.Tensor) -> torch.Tensor:
    """The ``q``, ``k`` or ``v`` third of a fused ``qkv`` projection output (last dimension ordered q, k, v).

    Example:
        >>> split_qkv("v", torch.arange(3.0).reshape(1, 1, 3)).tolist()
        [[[2.0]]]
    """
    width = tensor.shape[-1] // 3
    i = QKV_SITES.index(site)
    return tensor[..., i * width:(i + 1) * width]


@contextlib.contextmanager
def single_head_attention(model: torch.nn.Module, layers: Sequence[int] = (-1,)) -> Iterator[None]:
    """Run the attention of ``layers`` as ONE head over all channels (scale ``1/sqrt(width)``) while the context
    is open, as Grad-ECLIP's official ``generate_emap.py`` recomputes CLIP's last block; restored on exit.

    Trace inside it for the ``grad_eclip`` preset to match that code (the gradient then flows through the
    single-head forward). Works for attention modules with ``num_heads``/``head_dim``/``scale`` attributes
    (timm, open_clip's explicit attention during a trace, Hugging Face CLIP).

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1)
        >>> with single_head_attention(m):
        ...     m.blocks[0].attn.num_heads, m.blocks[0].attn.head_dim
        (1, 192)
        >>> m.blocks[0].attn.num_heads
        3
    """
    from vitcam_nb.adapters.registry import find_adapter

    modules = find_adapter(model).attention_modules(model)
    saved: list[tuple[object, str, object]] = []
    try:
        for layer in layers:
            attn = modules[layer]
            width = int(attn.num_heads) * int(attn.head_dim)
            for name, value in (("num_heads", 1), ("head_dim", width), ("scale", width ** -0.5)):
                if hasattr(attn, name):
                    saved.append((attn, name, getattr(attn, name)))
                    setattr(attn, name, value)
        yield
    finally:
        for attn, name, value in reversed(saved):
            setattr(attn, name, value)
