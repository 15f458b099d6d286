"""The ViT-CX trace kind: recipes with ``weighting="vitcx"`` (Xie et al., IJCAI 2023) on a single-image trace that
``vc.score`` has given the mask scores. The masks are rebuilt from the stored activations and clusters
(:mod:`vitcam_nb.capture.vitcx`), so the map is again a pure function of the trace.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
    >>> img = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    >>> tr = vc.score(vc.trace(m, img, targets="top1"), m, vc.presets.vit_cx(), img)
    >>> vc.cam(tr, vc.presets.vit_cx()).shape
    (32, 32)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.capture.vitcx import channel_masks, cluster_masks, feature_grid, vitcx_map
from vitcam_nb.compute.maps import map_array, warn_degenerate
from vitcam_nb.compute.pipeline import finish_layers, score_call
from vitcam_nb.compute.report import build_checklist, describe
from vitcam_nb.compute.report_cache import cached_report
from vitcam_nb.compute.view import TraceView
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.kinds import TRACE_KINDS, MapValues, TraceKind
from vitcam_nb.core.recipe import Recipe, is_int
from vitcam_nb.core.weighting import Weighting, register_weighting

__all__ = ["VITCX", "VitcxKind"]

FORMULA = ("ViT-CX: F1 maps of the block resized (bilinear) and min-max normalised, clustered (complete linkage, "
           "cosine distance < 0.1) into masks M_i (cluster sums, min-max); map = sum_i (d_i + p_c) M_i / sum_k M_k "
           "/ N with d_i = p_c(x M_i + n_i (1 - M_i)) - p_c(x + n_i (1 - M_i)), n_i Gaussian noise (std 0.1), "
           "p the softmax (Xie et al. 2023; the d_i stored by vc.score)")


def _not_here(*_args: Any, **_kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    raise RecipeError("weighting: vitcx is a whole-image method computed by its own trace kind from the masks "
                      "vc.score stores; it has no per-channel kernel (vary other fields, or compute it with vc.cam)")


def _values(trace: xr.Dataset, recipe: Recipe) -> MapValues:
    view = TraceView.of(trace)
    if "vitcx_score" not in trace.variables:
        raise RecipeError(f"weighting: vitcx needs the mask scores this trace does not hold; add them with "
                          f"{score_call(recipe)}")
    if recipe.upsample != "bilinear":
        raise RecipeError("upsample: ViT-CX's masks are resized bilinearly before clustering; leave upsample at "
                          "'bilinear'")
    scores = trace["vitcx_score"]
    layer, site = int(scores.attrs["vitcx_layer"]), str(scores.attrs["vitcx_site"])
    n = int(trace.attrs["num_layers"])
    if recipe.site != site or not is_int(recipe.layer) or int(recipe.layer) % n != layer:
        raise RecipeError(f"layer: the trace's ViT-CX masks are of {site} at block {layer}, not {recipe.site} at "
                          f"{recipe.layer!r}; score again with {score_call(recipe)}")
    _, cls = view.target_weights(recipe)
    pos = [int(c) for c in trace["target_class"].values].index(cls)
    size = (view.height, view.width)
    per_channel = channel_masks(feature_grid(trace, layer, site), size)
    masks = cluster_masks(per_channel, trace["vitcx_cluster"].values.astype(np.int64), size)
    logits = trace["logits"].values.astype(np.float64)
    p = np.exp(logits - logits.max())
    raw = vitcx_map(masks, scores.values[pos].astype(np.float64), float(p[cls] / p.sum())).astype(np.float32)
    maps, reasons = finish_layers(view, recipe, raw[None], np.abs(raw)[None], np.zeros(1, bool))
    return maps[0], [r for r in reasons if r], []


class VitcxKind(TraceKind):
    """ViT-CX recipes on single-image traces.

    Example:
        >>> import vitcam_nb as vc
        >>> VITCX.accepts(xr.Dataset(), vc.presets.vit_cx()), VITCX.accepts(xr.Dataset(), vc.Recipe())
        (True, False)
    """

    name = "vitcx"

    def accepts(self, trace: Any, recipe: Recipe | None) -> bool:
        return isinstance(trace, xr.Dataset) and "image" not in trace.dims and recipe is not None and \
            recipe.weighting == "vitcx"

    def compute(self, trace: xr.Dataset, recipe: Recipe) -> MapValues:
        return _values(trace, recipe)

    def cam(self, trace: xr.Dataset, recipe: Recipe) -> xr.DataArray:
        values, notes, partial = _values(trace, recipe)
        reason = warn_degenerate(recipe, notes) if notes else ""
        checklist, methods = cached_report(recipe, trace)
        layer = str(int(trace["vitcx_score"].attrs["vitcx_layer"]))
        return map_array(values, recipe, str(trace.attrs.get("trace_id", "")), checklist, methods, reason, partial,
                         blocks=layer, blocks_of=str(trace.attrs.get("num_layers", "")))

    def gallery(self, trace: xr.Dataset, recipe: Recipe, vary: Mapping[str, Any] | Sequence[str]) -> xr.DataArray:
        raise RecipeError("vary: a ViT-CX map is one per scored block; compute it with vc.cam")

    def checklist(self, recipe: Recipe, trace: Any) -> Checklist:
        return build_checklist(recipe, trace)

    def describe(self, recipe: Recipe, trace: Any) -> str:
        return describe(recipe, trace)


register_weighting(Weighting("vitcx", FORMULA, _not_here, uses_gradient=False, title="ViT-CX", scores="vitcx_score",
                             scored_target="prob"), replace=True)
VITCX = VitcxKind()
# Lookup priority: before flat: its recipes' weighting reads vc.score's outputs on a flat trace.
TRACE_KINDS.register(VITCX.name, VITCX, replace=True, priority=30)
