"""The maps of an answer store's LM-site recipes (:mod:`vitcam_nb.compute.map_vlm` plans the store): each
recipe's per-layer maps on the layout's grid as the ``vlm`` trace kind computes them before it upsamples and fuses
(:mod:`vitcam_nb.compute.vlm`), and each image's checklist and methods of those recipes, written with its maps and
read back by the store's reader (they name that image's answer tokens and layout).

Example:
    >>> stored_report(xr.Dataset(attrs={MAP_REPORTS: '{"abc": ["{}", "m"]}'}), "abc")
    ('{}', 'm')
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import xarray as xr

from vitcam_nb.adapters.hf_vlm import LM_SITES
from vitcam_nb.compute.pipeline import combine, compact, finish_layers, grid_maps, weight_mask
from vitcam_nb.compute.vlm import VLM, answer_rows, check_recipe, lm_layer_positions, trace_view
from vitcam_nb.core.recipe import Recipe

__all__ = ["ANSWER_TARGET_ATTRS", "MAP_REPORTS", "lm_reports", "stored_report", "vlm_grid_parts"]

#: The trace attributes an answer target writes that describe that image's question and answer: per image.
ANSWER_TARGET_ATTRS = ("target_scores", "answer_ids", "answer_tokens", "image_token_layout", "zero_gradient_cause",
                       "target_checklist")
#: The per-image fact holding each LM-site recipe's checklist and methods on that image's trace (JSON).
MAP_REPORTS = "map_reports"


def vlm_grid_parts(trace: xr.Dataset, recipe: Recipe) -> tuple[np.ndarray, np.ndarray, float]:
    """An LM-site recipe's per-layer maps on the layout's grid (after its ReLU, degeneracy check and per-layer
    normalisation: the calls the ``vlm`` kind makes before it upsamples and fuses), their reasons, the largest scale.

    Example:
        >>> parts, why, scale = vlm_grid_parts(trace, Recipe(site="lm_resid", layer=-1))  # doctest: +SKIP
    """
    check_recipe(trace, recipe)
    site = recipe.site
    view = trace_view(trace, site)
    weights = view.target_weights(recipe)[0]
    layers = lm_layer_positions(recipe.layer, view.num_layers, site)
    act, grad = trace[site].values, trace[f"{site}_grad"].values
    if site == "projector":
        act, grad = act[None], grad[:, None]
    if site == "lm_attn":
        rows, _ = answer_rows(trace, recipe)
        A = act[layers][..., rows, :].astype(np.float32, copy=False).mean(axis=-2)
        G = combine(grad, weights, (layers,))[..., rows, :].mean(axis=-2)
        A, G = np.ascontiguousarray(np.swapaxes(A, -1, -2)), np.ascontiguousarray(np.swapaxes(G, -1, -2))
        groups = A.shape[-1]
    else:
        A = act[layers].astype(np.float32, copy=False)
        G = combine(grad, weights, (layers,))
        groups = 1
    maps, scale, zero_grad = grid_maps(view, recipe, A, G, compact(weight_mask(view, recipe)), compact(view.patch),
                                       groups)
    per_layer, reasons = finish_layers(view, recipe, maps, scale, zero_grad)
    # The layout's cells in the tower's raster: the grid is the tower's (answer_plan), so cell (r, c) is (r, c).
    return per_layer, reasons, float(np.max(scale, initial=0))


def lm_reports(trace: xr.Dataset, recipes: Sequence[Recipe]) -> dict[str, str]:
    """``{MAP_REPORTS: JSON}``: each LM-site recipe's checklist and methods on this image's trace, by recipe id.

    Example:
        >>> json.loads(lm_reports(trace, [Recipe(site="lm_resid")])[MAP_REPORTS])  # doctest: +SKIP
    """
    out = {r.id: [VLM.checklist(r, trace).to_json(), VLM.describe(r, trace)] for r in recipes if r.site in LM_SITES}
    return {MAP_REPORTS: json.dumps(out, sort_keys=True)} if out else {}


def stored_report(report: xr.Dataset, recipe_id: str) -> tuple[str, str] | None:
    """The checklist and methods an answer store wrote for an LM-site recipe on this image (None: not one).

    Example:
        >>> stored_report(xr.Dataset(attrs={MAP_REPORTS: '{"abc": ["{}", "m"]}'}), "abc")
        ('{}', 'm')
    """
    found = json.loads(str(report.attrs.get(MAP_REPORTS, "{}"))).get(recipe_id)
    return (str(found[0]), str(found[1])) if found else None
