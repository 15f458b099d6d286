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
from vitcam_nb.compute.fusion import fuse_layers
from vitcam_nb.compute.spatial import upsample
from vitcam_nb.compute.vlm import VLM, VLM_SITES, layer_maps, trace_view_of
from vitcam_nb.compute.vlm_tiles import is_tiled, place, stacked, trace_layout
from vitcam_nb.core.recipe import Recipe

__all__ = ["ANSWER_TARGET_ATTRS", "CROP_COORDS", "CROP_COORD_NAMES", "LM_LAYOUT", "MAP_REPORTS", "crop_facts",
           "lm_facts", "lm_grid", "lm_report", "lm_reports", "lm_values", "stored_report", "vlm_grid_parts"]

#: The trace attributes an answer target writes that describe that image's question and answer: per image.
ANSWER_TARGET_ATTRS = ("target_scores", "answer_ids", "answer_tokens", "image_token_layout", "zero_gradient_cause",
                       "target_checklist", "crops", "crop_tiles", "crop_layout", "crop_source_size")
#: The per-image fact holding each LM-site recipe's checklist and methods on that image's trace (JSON).
MAP_REPORTS = "map_reports"
#: The per-image fact holding each crop's coordinates (JSON; :func:`crop_facts`), and those coordinates.
CROP_COORDS = "crop_coords"
CROP_COORD_NAMES = ("crop_tile", "crop_group", "crop_box_top", "crop_box_left", "crop_box_bottom", "crop_box_right")
#: A site's gradient dtype in :data:`LM_LAYOUT` (the report names the storage precision).
GRAD_DTYPE = "grad_dtype"
#: The per-image fact holding the image-token layout its LM-site maps are placed by (JSON; :func:`lm_facts`).
LM_LAYOUT = "lm_layout"


def vlm_grid_parts(trace: xr.Dataset, recipe: Recipe) -> tuple[np.ndarray, np.ndarray, float]:
    """An LM-site recipe's per-layer maps on the layout's grid (after its ReLU, degeneracy check and per-layer
    normalisation: the calls the ``vlm`` kind makes before it upsamples and fuses), their reasons, the largest scale.
    The grid is the ``vlm`` kind's: the layout's (rows, cols) for one tile, (1, image tokens) for several.

    Example:
        >>> parts, why, scale = vlm_grid_parts(trace, Recipe(site="lm_resid", layer=-1))  # doctest: +SKIP
    """
    _, _, per_layer, reasons, scale = layer_maps(trace, recipe)
    return per_layer, reasons, float(np.max(scale, initial=0))


def lm_grid(trace: xr.Dataset) -> tuple[int, int]:
    """The grid an answer trace's LM-site maps are computed on before they are placed (the ``vlm`` kind's):
    (1, image tokens) over several tiles, else the one tile's (rows, cols).

    Example:
        >>> lm_grid(xr.Dataset(coords={"image_token_tile": ("image_token", [0, 0]),
        ...                           "image_token_row": ("image_token", [0, 0]),
        ...                           "image_token_col": ("image_token", [0, 1])}))
        (1, 2)
    """
    if is_tiled(trace):
        return 1, int(trace.sizes["image_token"])
    return int(trace["image_token_row"].values.max()) + 1, int(trace["image_token_col"].values.max()) + 1


def lm_facts(trace: xr.Dataset) -> dict[str, str]:
    """``{LM_LAYOUT: JSON}``: what an answer store needs to place this image's LM-site maps as the ``vlm`` kind
    does, and to write their report at any upsampling (:func:`lm_report`): the image size and padding the maps
    upsample to, the image-token coords, each LM site's attributes (hook, layout, tile boxes) and gradient dtype, the
    LM's layer count and the answer tokens (an answer's layout is its own: written per image, with its checksum).

    Example:
        >>> sorted(json.loads(lm_facts(trace)[LM_LAYOUT]))  # doctest: +SKIP
        ['answer_token_str', 'col', 'lm_layers', 'pad', 'pos', 'row', 'sites', 'size', 'tile', 'tiled']
    """
    sites = {s: {**{k: v for k, v in trace[s].attrs.items() if isinstance(v, str)},
                 GRAD_DTYPE: str(trace[f"{s}_grad"].dtype)} for s in VLM_SITES if s in trace.variables}
    view = trace_view_of(trace, next(iter(sites)))
    coords = {k: [int(v) for v in trace[f"image_token_{k}"].values] for k in ("pos", "tile", "row", "col")}
    fact = {"size": [view.height, view.width], "pad": [int(v) for v in view.pad], "tiled": bool(is_tiled(trace)),
            "sites": sites, "lm_layers": int(trace.sizes.get("lm_layer", 1)),
            "answer_token_str": [str(v) for v in trace["answer_token_str"].values]
            if "answer_token_str" in trace.variables else None, **coords}
    return {LM_LAYOUT: json.dumps(fact, sort_keys=True)}


def lm_report(report: xr.Dataset, logits: np.ndarray, target_class: np.ndarray, recipe: Recipe
              ) -> tuple[str, str] | None:
    """The checklist (JSON) and methods the ``vlm`` kind writes for an LM-site ``recipe`` on this image's trace,
    written again from what the store keeps of it (``report``: the image's trace attributes and facts, with its
    :data:`LM_LAYOUT`): for a recipe read at an upsampling other than the one stored with the image's report. None
    for a store written before it kept the layout (its stored report is all it has).

    Example:
        >>> text, methods = lm_report(report, logits, classes, recipe.replace(upsample="nearest"))  # doctest: +SKIP
    """
    text = report.attrs.get(LM_LAYOUT)
    if not text:
        return None
    fact = json.loads(text)
    site = recipe.site
    attrs = dict(fact["sites"][site])
    grad = np.zeros(1, np.dtype(attrs.pop(GRAD_DTYPE)))
    shim = _layout_trace(fact, site).assign({
        site: ("image_token", np.zeros(len(fact["pos"]), np.float32), attrs), f"{site}_grad": ("one", grad),
        "logits": ("class", np.asarray(logits)), "target_class": ("target", np.asarray(target_class))})
    coords = {"lm_layer": np.arange(int(fact["lm_layers"])), "y": np.arange(int(fact["size"][0])),
              "x": np.arange(int(fact["size"][1]))}
    if fact.get("answer_token_str") is not None:
        coords["answer_token_str"] = ("answer_token", np.asarray(fact["answer_token_str"], dtype=str))
    shim = shim.assign_coords(coords)
    shim.attrs = {k: v for k, v in report.attrs.items() if k not in (LM_LAYOUT, MAP_REPORTS, "crop_coords")}
    return VLM.checklist(recipe, shim).to_json(), VLM.describe(recipe, shim)


def crop_facts(trace: xr.Dataset) -> dict[str, str]:
    """``{CROP_COORDS: JSON}`` of a trace of several crops (else ``{}``): each crop's coordinates (``crop_tile``,
    ``crop_group``, ``crop_box_*``: where it lies in this image), which ``vc.cam`` gives with its per-crop maps.

    Example:
        >>> crop_facts(xr.Dataset(coords={"crop": [0], "crop_tile": ("crop", ["base"])}))
        {'crop_coords': '{"crop_tile": ["base"]}'}
    """
    if "crop" not in trace.dims:
        return {}
    coords = {c: trace[c].values.tolist() for c in CROP_COORD_NAMES if c in trace.coords}
    return {CROP_COORDS: json.dumps(coords, sort_keys=True)}


def _layout_trace(fact: dict, site: str) -> xr.Dataset:
    """The image-token coords and the site's tile boxes of a stored layout, as :func:`trace_layout` reads them."""
    coords = {f"image_token_{k}": ("image_token", np.asarray(fact[k], np.int64)) for k in ("pos", "tile", "row", "col")}
    return xr.Dataset({site: ("image_token", np.zeros(len(fact["pos"])), fact["sites"][site])}, coords=coords)


def lm_values(parts: np.ndarray, reasons: list[str], layers: list[int], recipe: Recipe, provenance: str
              ) -> tuple[np.ndarray, tuple[str, ...], dict, list[str], list[str]]:
    """An LM-site map of an answer store whose LM grid is not the store's (several tiles, or the layout's own
    grid: Qwen2-VL's merged tokens, Gemma 3's pooled ones), replayed from its stored per-layer maps ``parts`` as the
    ``vlm`` kind computes it: one tile upsampled per layer then fused; several fused per token, then placed tile by
    tile (one map per tile group). Returns (values, leading dim or (), its coords, notes, partial).

    Example:
        >>> values, dim, coords, notes, partial = lm_values(parts, [""], [1], recipe, prov)  # doctest: +SKIP
    """
    fact = json.loads(json.loads(provenance)[LM_LAYOUT])
    size, label = (int(fact["size"][0]), int(fact["size"][1])), f"{recipe.site} layer"
    if not fact["tiled"]:
        pad = (int(fact["pad"][0]), int(fact["pad"][1]))
        values, notes, partial = fuse_layers(upsample(parts, size, recipe.upsample, pad),
                                             np.asarray(reasons, dtype=object), layers, recipe, label=label)
        return values, (), {}, notes, partial
    fused, notes, partial = fuse_layers(parts, np.asarray(reasons, dtype=object), layers, recipe, label=label)
    lay = trace_layout(_layout_trace(fact, recipe.site), recipe.site)
    names, maps = place(lay, fused[0], size, recipe.upsample)
    values, dim, coords = stacked(names, maps, lay, recipe.upsample)
    return values, dim, coords, notes, partial


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
