"""The pre-softmax attention scores as a stored site: recomputed from the block's own q and k during the pass,
so that they are a tensor of the forward graph and their gradient comes from the same batched backward.

For a timm ``Attention`` (``fused_attn`` off), hooks keep the outputs of ``q_norm`` and ``k_norm``; a forward
pre-hook on ``attn_drop`` then computes ``S = (q * scale) @ k^T`` with the ops timm uses, checks that
``softmax(S)`` is the matrix it was given (no mask, nothing else in between), and hands ``softmax(S)`` on in its
place. The values are the same; the output now depends on the model through ``S``, which the site keeps.

Example:
    >>> import timm, torch
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1).eval()
    >>> m.blocks[0].attn.fused_attn = False
    >>> kept = []
    >>> handles = score_hooks(m.blocks[0].attn, kept.append)
    >>> _ = m(torch.zeros(1, 3, 32, 32))
    >>> for h in handles: h.remove()
    >>> tuple(kept[0].shape)
    (1, 3, 17, 17)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vitcam_nb.core.errors import TraceError

__all__ = ["score_hooks"]


def score_hooks(attn: torch.nn.Module, keep: Callable[[torch.Tensor], None]) -> list:
    """Hooks on a timm attention module that pass its pre-softmax scores to ``keep`` (once per forward) and make
    the softmax matrix downstream a function of them; returns the handles to remove.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1)
        >>> len(score_hooks(m.blocks[0].attn, print))
        3
    """
    seen: dict[str, torch.Tensor] = {}

    def keep_q(_m: torch.nn.Module, _i: object, out: torch.Tensor) -> None:
        seen["q"] = out

    def keep_k(_m: torch.nn.Module, _i: object, out: torch.Tensor) -> None:
        seen["k"] = out

    def rebuild(_m: torch.nn.Module, args: tuple) -> tuple:
        if "q" not in seen or "k" not in seen:
            raise TraceError("sites: attn_scores: the attention's q_norm/k_norm did not run before its softmax")
        probs = args[0]
        scores = (seen.pop("q") * attn.scale) @ seen.pop("k").transpose(-2, -1)
        rebuilt = scores.softmax(dim=-1)
        tol = 1e-3 if rebuilt.dtype in (torch.float16, torch.bfloat16) else 1e-5
        if rebuilt.shape != probs.shape or not torch.allclose(rebuilt, probs, rtol=tol, atol=tol):
            raise TraceError("sites: attn_scores: softmax(scale * q k^T) is not the attention this block computed "
                             "(a mask or another step sits between them); this model has no attn_scores site")
        keep(scores)
        return (rebuilt, *args[1:])

    return [attn.q_norm.register_forward_hook(keep_q), attn.k_norm.register_forward_hook(keep_k),
            attn.attn_drop.register_forward_pre_hook(rebuild)]
