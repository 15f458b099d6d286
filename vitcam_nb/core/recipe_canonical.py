"""The canonical form of a recipe whose layers are absolute blocks of a trace (``Recipe.resolve``): one recipe for
every spelling of the same map, so that ``Recipe.canonical_id`` is one id per map.

What is the same map, as ``vc.cam`` computes it:

* a mean, sum or maximum over blocks is order-free: ``vc.cam`` fuses the blocks in ascending block order
  whatever order the tuple lists them in, so ``(5, 0)`` and ``(0, 5)`` are one map (bitwise) and one id;
* a rollout multiplies the blocks' attention in forward (ascending block) order whatever order the tuple lists
  them in, so ``(5, 0)`` and ``(0, 5)`` of a rollout are one map too: its tuple is sorted as well;
* a tuple of one block is that block, and a mean, sum or maximum of one block is the block's own map
  (``layer_fusion="none"``).

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

__all__ = ["ORDER_FREE", "canonical_form"]

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
