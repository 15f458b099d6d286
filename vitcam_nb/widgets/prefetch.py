"""Neighbour prefetch for the Explorer: after each answer the kernel computes the views one step away on the
layer slider and the site list and sends them to the page, which keeps them in a small cache and paints a
cached view at once, without waiting for the kernel (the request still goes out, so Python's ``ex.recipe``
follows the page). Each entry is keyed by the draft the page would send, i.e. the shown recipe with one field
changed, and holds what the kernel answers for it (the recipe after the widget's coercion, grid and report).

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=3)
    >>> tr = vc.trace(m, np.zeros((32, 32, 3), np.uint8))
    >>> facts = TraceFacts.of(tr)
    >>> [(d["layer"], d["site"]) for d, _ in neighbour_drafts(vc.Recipe(layer=1, site="F3"), facts)]
    [(0, 'F3'), (2, 'F3'), (1, 'F2'), (1, 'F4')]
"""

from __future__ import annotations

import json
from typing import Any

import xarray as xr

from vitcam_nb.core.recipe import Recipe
from vitcam_nb.widgets.controls import coerce_request
from vitcam_nb.widgets.encoding import grid_bytes
from vitcam_nb.widgets.facts import TraceFacts
from vitcam_nb.widgets.results import compute_grid

__all__ = ["neighbour_drafts", "prefetch_message"]


def neighbour_drafts(recipe: Recipe, facts: TraceFacts) -> list[tuple[dict, str]]:
    """The drafts one step away from ``recipe`` on the layer slider (a single layer only) and in the site list,
    each as the page builds it (the recipe's JSON with one field replaced) with the field it changes.

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> facts = TraceFacts.of(vc.trace(m, np.zeros((32, 32, 3), np.uint8)))
        >>> [d["layer"] for d, f in neighbour_drafts(vc.Recipe(layer=-1), facts) if f == "layer"]
        [0]
    """
    base = json.loads(recipe.to_json())
    out: list[tuple[dict, str]] = []
    site_layers, num_layers = facts.layers_of(recipe.site)  # a VLM's LM sites have the LM's layers
    layers = [int(v) for v in site_layers]
    single = isinstance(recipe.layer, int) and not isinstance(recipe.layer, bool)
    if single and layers and recipe.layer_fusion == "none":
        current = recipe.layer % num_layers
        if current in layers:
            i = layers.index(current)
            out += [({**base, "layer": layers[j]}, "layer") for j in (i - 1, i + 1) if 0 <= j < len(layers)]
    sites = list(facts.sites)
    if recipe.site in sites:
        i = sites.index(recipe.site)
        out += [({**base, "site": sites[j]}, "site") for j in (i - 1, i + 1) if 0 <= j < len(sites)]
    return out


def prefetch_message(trace: xr.Dataset, recipe: Recipe, facts: TraceFacts) -> tuple[dict[str, Any], list[bytes]]:
    """The custom message with the neighbours of ``recipe``: ``{"kind": "prefetch", "entries": [...]}`` and one
    float32 grid buffer per entry. A neighbour the widget would refuse is left out (its round trip says why).

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> tr = vc.trace(m, np.zeros((32, 32, 3), np.uint8))
        >>> msg, buffers = prefetch_message(tr, vc.Recipe(layer=0, site="F1"), TraceFacts.of(tr))
        >>> len(msg["entries"]) == len(buffers), msg["entries"][0]["grid_shape"]
        (True, [4, 4])
    """
    entries, buffers = [], []
    for draft, field in neighbour_drafts(recipe, facts):
        try:
            result = compute_grid(trace, Recipe.from_dict(coerce_request(dict(draft), [field], facts)))
        except Exception:  # noqa: BLE001 - a refused neighbour is simply not prefetched
            continue
        entries.append({"draft": draft, "recipe_json": result.recipe.to_json(), "recipe_id": result.recipe.id,
                        "grid_shape": list(result.grid.shape), "checklist": result.checklist,
                        "checklist_md": result.checklist_md, "methods": result.methods,
                        "degenerate": result.degenerate, "notes": result.notes})
        buffers.append(grid_bytes(result.grid))
    return {"kind": "prefetch", "entries": entries}, buffers
