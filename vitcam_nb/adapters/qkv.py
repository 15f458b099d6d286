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
import operator
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from vitcam_nb.adapters.base import SiteSpec
from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError
from vitcam_nb.core.schema import PROJECTED_QK_SITES, QKV_SITES, SCORES_SITE

__all__ = ["PROJECTED_IO", "SCORES_IO", "SPLIT_IO", "projected_hooks", "projected_qk_sites", "single_head_attention",
           "single_head_layers", "split_qkv", "timm_qkv_sites"]

#: The ``io`` of a site whose tensor the capture recomputes from the attention's q and k (no module holds it).
SCORES_IO = "scores"
#: ``SPLIT_IO + site`` reads the q, k or v third of a fused qkv projection's output (``output:q``, ...).
SPLIT_IO = "output:"
#: ``PROJECTED_IO + "q"`` (or ``"k"``) on an attention module reads q (k), heads concatenated, through the module's
#: output projection (``proj`` or ``out_proj``), computed on the side from the projection output that holds it.
PROJECTED_IO = "projected:"

# attention module -> how many single_head_attention contexts hold it (weak: a deleted model leaves no entry)
_SINGLE_HEAD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plain_timm_attention(attn: object) -> bool:
    """timm's own ``Attention`` class (not BEiT's or EVA's, whose q/k/v biases bypass the ``qkv`` module), with no
    query/key normalisation, so the ``qkv`` output is exactly the q, k and v the scores are made of, and with no
    output norm or gate (``scale_norm``, ``gated``), so ``proj`` applied to q or k is what ``q_out``/``k_out`` say."""
    from timm.models.vision_transformer import Attention

    return (type(attn) is Attention and isinstance(getattr(attn, "qkv", None), torch.nn.Linear)
            and isinstance(attn.q_norm, torch.nn.Identity) and isinstance(attn.k_norm, torch.nn.Identity)
            and isinstance(getattr(attn, "norm", torch.nn.Identity()), torch.nn.Identity)
            and getattr(attn, "gate", None) is None)


def timm_qkv_sites(blocks: list[torch.nn.Module]) -> dict[str, SiteSpec]:
    """The sites ``q``, ``k``, ``v``, ``q_out``, ``k_out`` and ``attn_scores`` of timm blocks whose attention is a
    plain ``Attention`` (empty otherwise: asking for them is then refused with the sites the model has).

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1)
        >>> list(timm_qkv_sites(list(m.blocks)))
        ['q', 'k', 'v', 'q_out', 'k_out', 'attn_scores']
    """
    if not blocks or not all(_plain_timm_attention(getattr(b, "attn", None)) for b in blocks):
        return {}
    sites = {s: SiteSpec("attn.qkv", SPLIT_IO + s, f"attention {name}, heads concatenated (third {i + 1} of the "
                                                 "qkv projection output)")
             for i, (s, name) in enumerate(zip(QKV_SITES, ("queries (before the 1/sqrt(d) scale)", "keys",
                                                            "values")))}
    sites.update(projected_qk_sites("attn", "proj"))
    sites[SCORES_SITE] = SiteSpec("attn", SCORES_IO, "pre-softmax attention scores per head, scale * q k^T "
                                                     "recomputed from q_norm and k_norm outputs during the pass")
    return sites


def projected_qk_sites(attention: str, out_proj: str, spec: Callable[..., SiteSpec] = SiteSpec) -> dict[str, SiteSpec]:
    """The sites ``q_out`` and ``k_out`` on the attention module at ``attention`` (block-relative path) whose
    output projection is ``out_proj``; ``spec`` makes each site (a family's own SiteSpec with its extra fields).

    Example:
        >>> projected_qk_sites("attn", "proj")["k_out"].hook("blocks.{layer}")
        'blocks.{layer}.attn:projected:k'
    """
    return {site: spec(attention, PROJECTED_IO + site[0], f"{name}, heads concatenated, through {out_proj} (values "
                       "only: not on the path to the output)")
            for site, name in zip(PROJECTED_QK_SITES, ("queries (before the scale)", "keys"))}


def projected_hooks(attn: torch.nn.Module, which: str, keep: Callable[[torch.Tensor], None]) -> list:
    """Forward hooks that pass ``which`` (``"q"`` or ``"k"``) through ``attn``'s output projection to ``keep``:
    timm's fused ``qkv`` third then ``proj``, or Hugging Face's ``q_proj``/``k_proj`` output then ``out_proj``.
    Returns the handles to remove.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1)
        >>> got = []
        >>> _ = projected_hooks(m.blocks[0].attn, "k", got.append)
        >>> _ = m(torch.zeros(1, 3, 224, 224))
        >>> tuple(got[0].shape)
        (1, 197, 192)
    """
    if isinstance(getattr(attn, "qkv", None), torch.nn.Linear):
        source, proj = attn.qkv, attn.proj

        def take(out: torch.Tensor) -> torch.Tensor:
            return split_qkv(which, out)
    else:
        source, proj = getattr(attn, f"{which}_proj"), attn.out_proj

        def take(out: torch.Tensor) -> torch.Tensor:
            return out

    def hook(_m: torch.nn.Module, _i: object, out: torch.Tensor) -> None:
        keep(F.linear(take(out), proj.weight, proj.bias))

    return [source.register_forward_hook(hook)]


def split_qkv(site: str, tensor: torch.Tensor) -> torch.Tensor:
    """The ``q``, ``k`` or ``v`` third of a fused ``qkv`` projection output (last dimension ordered q, k, v).

    Example:
        >>> split_qkv("v", torch.arange(3.0).reshape(1, 1, 3)).tolist()
        [[[2.0]]]
    """
    width = tensor.shape[-1] // 3
    i = QKV_SITES.index(site)
    return tensor[..., i * width:(i + 1) * width]


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from vitcam_nb.adapters.registry import find_adapter
    from vitcam_nb.adapters.wrappers import unwrap

    try:
        adapter = find_adapter(model)
    except TypeError:  # a wrapper (torch.compile, DataParallel, ...): the model inside is the one traced
        model = unwrap(model)[0]
        adapter = find_adapter(model)
    return adapter.attention_modules(model)


@contextlib.contextmanager
def single_head_attention(model: torch.nn.Module, layers: Sequence[int] = (-1,)) -> Iterator[None]:
    """Run the attention of ``layers`` as ONE head over all channels (scale ``1/sqrt(width)``) while the context
    is open, as Grad-ECLIP's official ``generate_emap.py`` recomputes CLIP's last block; restored on exit.

    Trace inside it for the ``grad_eclip`` preset to match that code (the gradient then flows through the
    single-head forward). A trace taken inside records the blocks in its attribute ``single_head_attention``
    (and its trace id then differs from the unmodified model's); ``grad_eclip`` refuses a trace without them.
    Works for attention modules with ``num_heads``/``head_dim``/``scale`` attributes (timm, open_clip's explicit
    attention during a trace, Hugging Face CLIP) or ``num_attention_heads``/``attention_head_size``/``scaling``
    (Hugging Face ViT-style self-attention: ViT, DeiT, YOLOS); any other module is refused (``TypeError``) before
    a block is changed.

    Args:
        model: the model (or a wrapper around it) to change for the duration of the context.
        layers: block indices (negative counts from the end).

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=2)
        >>> with single_head_attention(m):
        ...     m.blocks[1].attn.num_heads, m.blocks[1].attn.head_dim, single_head_layers(m)
        (1, 192, (1,))
        >>> m.blocks[1].attn.num_heads, single_head_layers(m)
        (3, ())
    """
    modules = _attention_modules(model)
    n = len(modules)
    try:
        bad = [layer for layer in layers if not -n <= operator.index(layer) < n]
    except TypeError:
        bad = list(layers)
    if bad or not layers:
        raise ArgumentError(f"layers: expected block indices in [-{n}, {n - 1}] (this model has "
                            f"{n} attention blocks), got {list(layers)!r}")
    # -1 and n-1 name the same block: change it once
    chosen = list(dict.fromkeys(modules[operator.index(layer)] for layer in layers))
    names = [_head_attributes(attn) for attn in chosen]  # every block checked before any is changed
    saved: list[tuple[object, str, object]] = []
    marked: list[torch.nn.Module] = []
    try:
        for attn, (heads, dim, scale) in zip(chosen, names):
            width = int(getattr(attn, heads)) * int(getattr(attn, dim))
            for name, value in ((heads, 1), (dim, width), (scale, width ** -0.5)):
                if hasattr(attn, name):
                    saved.append((attn, name, getattr(attn, name)))
                    setattr(attn, name, value)
            _SINGLE_HEAD[attn] = _SINGLE_HEAD.get(attn, 0) + 1
            marked.append(attn)
        yield
    finally:
        for attn, name, value in reversed(saved):
            setattr(attn, name, value)
        for attn in marked:
            _SINGLE_HEAD[attn] -= 1
            if not _SINGLE_HEAD[attn]:
                del _SINGLE_HEAD[attn]


#: (heads, head width, scale) attribute names an attention module reads at every call: timm, open_clip and Hugging
#: Face CLIP; Hugging Face ViT-style self-attention (ViT, DeiT, YOLOS, ...).
_HEAD_ATTRIBUTES = (("num_heads", "head_dim", "scale"), ("num_attention_heads", "attention_head_size", "scaling"))


def _head_attributes(attn: torch.nn.Module) -> tuple[str, str, str]:
    """The names of ``attn``'s head count, head width and scale (the scale may be absent: then computed inside)."""
    for heads, dim, scale in _HEAD_ATTRIBUTES:
        if isinstance(getattr(attn, heads, None), int) and isinstance(getattr(attn, dim, None), int):
            return heads, dim, scale
    known = "; ".join(f"{h}, {d} (and {s})" for h, d, s in _HEAD_ATTRIBUTES)
    raise ArgumentTypeError(f"model: single_head_attention changes an attention module's head count and head width; "
                            f"{type(attn).__name__} has neither attribute pair it knows ({known})")


def single_head_layers(model: torch.nn.Module, modules: Sequence[torch.nn.Module] | None = None) -> tuple[int, ...]:
    """The blocks of ``model`` whose attention runs as one head now (inside :func:`single_head_attention`);
    ``modules``: the model's attention modules, when the caller already has them.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=3)
        >>> with single_head_attention(m, layers=(0, -1)):
        ...     single_head_layers(m)
        (0, 2)
    """
    modules = _attention_modules(model) if modules is None else modules
    return tuple(i for i, attn in enumerate(modules) if _SINGLE_HEAD.get(attn, 0) > 0)
