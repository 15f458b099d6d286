"""The canonical form of a recipe whose layers are absolute blocks of a trace (``Recipe.resolve``): one recipe for
every spelling of the same map, so that ``Recipe.canonical_id`` is one id per map.

What is the same map, as ``vc.cam`` computes it:

* a mean, sum or maximum over blocks is order-free: ``vc.cam`` fuses the blocks in ascending block order
  whatever order the tuple lists them in, so ``(5, 0)`` and ``(0, 5)`` are one map (bitwise) and one id;
* a rollout multiplies the blocks' attention in forward (ascending block) order whatever order the tuple lists
  them in, so ``(5, 0)`` and ``(0, 5)`` of a rollout are one map too: its tuple is sorted as well;
* a tuple of one block is that block, and a mean, sum or maximum of one block is the block's own map
  (``layer_fusion="none"``);
* ``class_="topK"`` is the class the trace ranks K-th by logit (ties in class order, as ``vc.cam`` ranks them)
  when that class is one for the whole trace: a single-image trace or a Swin tree (one image), or a many-image
  store whose images all rank the same class K-th. ``vc.cam`` then differentiates that class's logit for both
  spellings, so ``"top1"`` and the explicit argmax are one map (bitwise) and one id. Where the images of a store
  rank different classes K-th, ``"topK"`` is a map of its own (one class per image) and keeps its spelling. A map
  store (``vc.map_many``) resolves it the same way, after checking that it holds the recipe as asked; the
  ``canonical_id`` column of its recipe table is the id on any trace of the model, so it keeps ``"topK"``. An
  attention rollout has no class (a Recipe refuses any but ``"top1"`` there): it keeps ``"top1"``.

* ``weight_tokens="all"`` on a trace with no prefix tokens (every token a patch: a video model, a ViT without a
  class token) pools the same tokens as ``"patch"``, so ``vc.cam`` gives one map (bitwise): it becomes ``"patch"``.
  ``attn_rows`` keeps its spelling there: ``"mean"`` and ``"patch_mean"`` average the same rows, but of differently
  laid out arrays, which numpy may sum in another order.

Other fields are taken as written: two recipes that differ in another field keep two ids even where their maps
happen to agree on some trace (a sum and a mean of two blocks under a min-max normalisation, or two degenerate
maps, both returned as zeros).

Example:
    >>> import vitcam_nb as vc
    >>> canonical_form(vc.Recipe(layer=(5, 0, 3), layer_fusion="max")).layer
    (0, 3, 5)
    >>> r = canonical_form(vc.Recipe(layer=(4,), layer_fusion="mean"))
    >>> r.layer, r.layer_fusion
    (4, 'none')
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xarray as xr

__all__ = ["ORDER_FREE", "canonical_form", "ranked_class", "ranked_entries", "resolve_class", "resolve_tokens"]

#: Layer fusions whose result does not depend on the order of the blocks (vc.cam fuses them in block order).
ORDER_FREE = ("none", "mean", "sum", "max")


def canonical_form(recipe: Any) -> Any:
    """``recipe`` (a :class:`vitcam_nb.Recipe` with absolute layers: ints, "stage.block" made global, no "all")
    in its canonical form: block tuples sorted, a tuple of one block that block, one block of an order-free fusion
    with ``layer_fusion="none"``.

    Example:
        >>> import vitcam_nb as vc
        >>> canonical_form(vc.Recipe(site="F2", layer=(5, 2), layer_fusion="rollout")).layer
        (2, 5)
    """
    layer = recipe.layer
    if isinstance(layer, tuple):
        layer = tuple(sorted(layer)) if len(layer) > 1 else layer[0]
    changes: dict[str, Any] = {}
    if layer != recipe.layer:
        changes["layer"] = layer
    if not isinstance(layer, tuple) and recipe.layer_fusion in ORDER_FREE[1:]:
        changes["layer_fusion"] = "none"
    return recipe.replace(**changes) if changes else recipe


def ranked_class(logits: Any, rank: int) -> int | None:
    """The class ``logits`` (one row per image, classes last) rank ``rank``-th (1: the highest), ties in class
    order as ``vc.cam`` breaks them; None when the images rank different classes there or there are fewer classes.

    Example:
        >>> ranked_class(np.array([0.5, 2.0, 2.0]), 2), ranked_class(np.array([[1.0, 0.0], [0.0, 1.0]]), 1) is None
        (2, True)
    """
    rows = np.asarray(logits, np.float64).reshape(-1, np.shape(logits)[-1]) if np.ndim(logits) else None
    if rows is None or rows.shape[0] == 0 or not 1 <= rank <= rows.shape[1]:
        return None
    picked = {int(np.argsort(-row, kind="stable")[rank - 1]) for row in rows}
    return picked.pop() if len(picked) == 1 else None


def ranked_entries(attrs: Any) -> int | None:
    """How many leading entries of a trace's ``logits`` a ``"topK"`` ranks: an answer trace's answer tokens (its
    ``answer_ids``; the sequence log-prob and the vocabulary logsumexps after them are never a ranked class, as
    ``vc.cam`` ranks them); None: every entry.

    Example:
        >>> ranked_entries({"answer_ids": "7,8"}), ranked_entries({})
        (2, None)
    """
    n = len([s for s in str(dict(attrs or {}).get("answer_ids", "")).split(",") if s.strip()])
    return n or None


def resolve_class(recipe: Any, trace: Any) -> Any:
    """``recipe`` with ``class_="topK"`` made the class ``trace`` ranks K-th, when that is one class for the whole
    trace (module docstring); otherwise ``recipe`` unchanged.

    Example:
        >>> import vitcam_nb as vc
        >>> tr = xr.Dataset({"logits": ("class", np.array([0.1, 3.0, 2.0], np.float32))})
        >>> resolve_class(vc.Recipe(class_="top2"), tr).class_, resolve_class(vc.Recipe(class_=0), tr).class_
        (2, 0)
    """
    if not isinstance(recipe.class_, str) or recipe.layer_fusion == "rollout":
        return recipe  # an attention rollout has no class: a Recipe refuses any but "top1" there
    data = trace.ds if isinstance(trace, xr.DataTree) else trace  # a Swin tree holds the logits at its root
    if not isinstance(data, xr.Dataset) or "logits" not in data.variables:
        return recipe
    logits = data["logits"]
    if logits.dims not in (("class",), ("image", "class")):
        return recipe  # detection scores and other layouts are ranked by their own kinds
    values = logits.values
    n = ranked_entries(data.attrs)
    if n is not None:
        values = values[..., :n]
    cls = ranked_class(values, int(recipe.class_[3:]))
    return recipe if cls is None else recipe.replace(class_=cls)


def resolve_tokens(recipe: Any, trace: Any) -> Any:
    """``recipe`` with ``weight_tokens="all"`` made ``"patch"`` when every token of ``trace`` is a patch token (no
    class, register or distillation token), where both pool the same tokens (module docstring); otherwise
    ``recipe`` unchanged.

    Example:
        >>> import vitcam_nb as vc
        >>> no_cls = xr.Dataset(coords={"token_kind": ("token", np.array(["patch"] * 4))})
        >>> with_cls = xr.Dataset(coords={"token_kind": ("token", np.array(["cls"] + ["patch"] * 4))})
        >>> [resolve_tokens(vc.Recipe(weight_tokens="all"), t).weight_tokens for t in (no_cls, with_cls)]
        ['patch', 'all']
    """
    if recipe.weight_tokens != "all":
        return recipe
    data = trace.ds if isinstance(trace, xr.DataTree) else trace
    kinds = data.variables.get("token_kind") if isinstance(data, xr.Dataset) else None
    if kinds is None or kinds.size == 0 or not bool(np.all(kinds.values == "patch")):
        return recipe
    return recipe.replace(weight_tokens="patch")
