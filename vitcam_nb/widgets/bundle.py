"""What an exported Explorer page holds: the recipes of the chosen axes (every combination), each one's
token-grid map (computed by the same code as the kernel Explorer, identical maps stored once, quantised) and
its checklist, methods paragraph and recipe id, packed as two zlib-compressed, base64-encoded blobs that the
page inflates with the browser's DecompressionStream. Of a video trace the page holds every frame of the clip and,
per recipe, each frame's map as the kernel Explorer shows it (identical frames stored once) and the clip's range.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    >>> tr = vc.trace(m, np.zeros((32, 32, 3), np.uint8), targets="top1")
    >>> b = build_bundle(tr, axes={"site": ["F1", "F4"], "weighting": ["gradcam"], "target": ["logit"]},
    ...                  progress=False)
    >>> b.meta["count"], [name for name, _ in b.meta["axes"]]
    (4, ['site', 'layer', 'weighting', 'target', 'class_'])
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import itertools
import json
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.core.errors import ArgumentTypeError, ExportError, RecipeError
from vitcam_nb.core.recipe import TARGETS, Recipe, is_int
from vitcam_nb.core.weighting import channel_weighting_names
from vitcam_nb.widgets.controls import as_recipe, coerce_request, controls
from vitcam_nb.widgets.encoding import image_rgba
from vitcam_nb.widgets.facts import TraceFacts, default_recipe
from vitcam_nb.widgets.offers import keep_shown, key, left_out_text, shown_presets
from vitcam_nb.widgets.results import GridResult, compute_grid, error_text, frame_slice

__all__ = ["DEFAULT_AXES", "QUANTIZE", "Bundle", "build_bundle", "export_axes", "quantize_grids"]

#: The recipe fields an export varies by default (others stay at the starting recipe's value).
DEFAULT_AXES = ("site", "layer", "weighting", "target", "class_")
#: How maps are stored: uint8 (per-map affine codes, 1/255 of its range), float16, or float32 (exact).
QUANTIZE = ("uint8", "float16", "float32")
_FIELDS = tuple(f.name for f in dataclasses.fields(Recipe))
_MARGIN = 0.9


@dataclass
class Bundle:
    """The data of one exported page: ``meta`` (plain JSON: controls, axes, shapes, storage), and the
    base64 text of the compressed ``maps`` (image RGBA, then the quantised grids) and ``texts`` (one entry
    per recipe) blobs.

    Example:
        >>> len(build_bundle(tr, axes={"site": ["F1"]}, progress=False).maps) > 0  # doctest: +SKIP
        True
    """

    meta: dict[str, Any]
    maps: str
    texts: str

    @property
    def size(self) -> int:
        """Bytes of the three parts as the page embeds them.

        Example:
            >>> build_bundle(tr, progress=False).size  # doctest: +SKIP
            312345
        """
        return len(json.dumps(self.meta)) + len(self.maps) + len(self.texts)


def _class_values(facts: TraceFacts) -> list:
    # One value per traced class: "topN" where the class is the N-th highest score (what the default recipe
    # uses), its index otherwise; the two name the same map, so both would only double the file.
    rank = {facts.ranked[n - 1]: n for n in facts.top_ranks()}
    return [f"top{rank[c]}" if c in rank else c for c in facts.classes]


def _absolute_layer(value: Any, facts: TraceFacts) -> Any:
    return value % facts.max_layers if is_int(value) else value


_SCALARS = (str, int, float, type(None))


def _axis_values(name: str, values: Sequence, facts: TraceFacts) -> list:
    """The values of one axis as plain JSON values, refused (naming the axis) where no recipe could hold them;
    a layer out of the model's range is refused as vc.cam refuses it, not wrapped onto another layer."""
    out = []
    for value in values:
        value = value.item() if isinstance(value, np.generic) else value
        if isinstance(value, (list, tuple)):
            value = [v.item() if isinstance(v, np.generic) else v for v in value]
        parts = value if isinstance(value, list) else [value]
        if not all(isinstance(v, _SCALARS) for v in parts):
            raise ArgumentTypeError(f"axes: {name!r} values must be strings, numbers or lists of them, got {value!r}")
        if name == "layer":
            for layer in (v for v in parts if is_int(v)):
                if not -facts.max_layers <= layer < facts.max_layers:
                    raise RecipeError(f"axes: layer {layer} is out of range for a model with {facts.max_layers} "
                                      f"blocks (allowed {-facts.max_layers}..{facts.max_layers - 1})")
        out.append(value)
    return out


def export_axes(facts: TraceFacts, axes: Mapping[str, Sequence] | None) -> dict[str, list]:
    """The values of every varied field: the defaults (:data:`DEFAULT_AXES`, on the traced sites, layers and
    classes, every weighting and target), replaced or extended by ``axes``; single layers as absolute indices
    (the page's slider names layers that way).

    Example:
        >>> export_axes(TraceFacts.of(tr), {"site": ["F4"]})["site"]  # doctest: +SKIP
        ['F4']
    """
    # the layers of every site (a VLM's LM may have more layers than its tower has blocks)
    defaults: dict[str, list] = {"site": list(facts.sites), "layer": list(facts.all_layers),
                                 "weighting": list(channel_weighting_names()), "target": list(TARGETS),
                                 "class_": _class_values(facts)}
    if axes is not None and not isinstance(axes, Mapping):
        raise ArgumentTypeError(f"axes: expected a dict of recipe field -> list of values, got {type(axes).__name__}")
    out = dict(defaults)
    for name, values in (axes or {}).items():
        if name not in _FIELDS:
            raise ExportError(f"axes: {name!r} is not a recipe field; allowed fields are {list(_FIELDS)}")
        if isinstance(values, str) and values == "all" and name in defaults:
            continue
        if isinstance(values, (str, int)) or not isinstance(values, Sequence) or len(values) == 0:
            raise ExportError(f"axes: {name!r} needs a non-empty list of values (or 'all' for {list(defaults)}), "
                             f"got {values!r}")
        out[name] = _axis_values(name, values, facts)
    if "layer" in out:
        out["layer"] = [_absolute_layer(v, facts) for v in out["layer"]]
    return {name: _unique(vals) for name, vals in out.items()}


def _unique(values: list) -> list:
    # One entry per distinct value, first kept (by JSON identity: a list of layers is not hashable).
    seen: dict[str, Any] = {}
    for value in values:
        seen.setdefault(key(value), value)
    return list(seen.values())


def quantize_grids(grids: np.ndarray, quantize: str) -> tuple[bytes, np.ndarray | None]:
    """The stored bytes of (n, h, w) float32 grids, and for uint8 the (n, 2) float32 [low, high] of each map
    (code k stands for ``low + k (high - low) / 255``).

    Example:
        >>> data, ranges = quantize_grids(np.array([[[0.0, 2.0]]], np.float32), "uint8")
        >>> list(data), ranges.tolist()
        ([0, 255], [[0.0, 2.0]])
    """
    if not isinstance(quantize, str) or quantize not in QUANTIZE:
        raise ExportError(f"quantize: expected one of {list(QUANTIZE)}, got {quantize!r}")
    grids = np.asarray(grids, np.float32)
    if quantize == "float32":
        return grids.astype("<f4").tobytes(), None
    if quantize == "float16":
        return grids.astype("<f2").tobytes(), None
    flat = grids.reshape(len(grids), -1)
    lo = flat.min(axis=1) if flat.size else np.zeros(len(grids), np.float32)
    hi = flat.max(axis=1) if flat.size else np.zeros(len(grids), np.float32)
    span = np.where(hi > lo, hi - lo, 1).astype(np.float32)
    codes = np.rint((flat - lo[:, None]) / span[:, None] * 255).clip(0, 255).astype(np.uint8)
    return codes.tobytes(), np.stack([lo, hi], axis=1).astype("<f4")


def _store(result: GridResult, frames: int, grids: list[np.ndarray], seen: dict[bytes, int]) -> int | list[int]:
    """Add the map of a result to the page's grids (identical maps stored once); its index, or of a video trace
    the index of each frame's map (what the kernel Explorer shows at that frame)."""
    def one(grid: np.ndarray) -> int:
        digest = hashlib.sha256(grid.tobytes() + str(grid.shape).encode()).digest()
        if digest not in seen:
            seen[digest] = len(grids)
            grids.append(grid)
        return seen[digest]
    if not frames:
        return one(result.grid)
    return [one(frame_slice(result.grid, f, frames)) for f in range(frames)]


def _pack(data: bytes) -> str:
    return base64.b64encode(zlib.compress(data, 9)).decode("ascii")


def _restrict(options: dict[str, Any], values: Mapping[str, list], start: Mapping[str, Any],
              facts: TraceFacts) -> dict[str, Any]:
    """The control table of the page: each control offers the exported values only (one value: disabled)."""
    fields = []
    for field in options["fields"]:
        field = dict(field)
        allowed = values.get(field["name"], [start[field["name"]]])
        if field["kind"] == "layer":
            field["layers"] = [v for v in allowed if is_int(v)] or [_absolute_layer(start["layer"], facts)]
            # a VLM's projector and LM sites: their own layers, those the page holds
            field["by_site"] = {s: {**spec, "layers": [v for v in spec["layers"] if v in field["layers"]]}
                                for s, spec in field.get("by_site", {}).items()}
            if not field["by_site"]:
                del field["by_site"]
        else:
            labels = {json.dumps(v): text for v, text in field["values"]}
            field["values"] = [[v, labels.get(json.dumps(v), str(v))] for v in allowed]
        fields.append(field)
    return {**options, "fields": fields}


def build_bundle(trace: xr.Dataset, recipe: Recipe | None = None, axes: Mapping[str, Sequence] | None = None,
                 quantize: str = "uint8", progress: bool = True, max_bytes: float | None = None,
                 start_required: bool = True) -> Bundle:
    """Compute every recipe of the axes (see :func:`export_axes`) on ``trace`` as the kernel Explorer does
    (:func:`~vitcam_nb.widgets.results.compute_grid`), and pack maps and texts for the page. A combination the
    trace cannot give (e.g. a weighting refused at F2) is stored as its refusal message; an axis value whose
    every combination is refused, and a preset the page does not reach, are left out (``meta["left_out"]``
    says which and why). With ``max_bytes``, computing stops (ExportError) as soon as the compressed texts of
    the recipes computed so far need more. An asked ``recipe`` the table does not hold is refused unless
    ``start_required`` is False (a page's second trace opens on its first map).

    Example:
        >>> b = build_bundle(tr, axes={"site": ["F1"]}, quantize="float16", progress=False)  # doctest: +SKIP
        >>> b.meta["quantize"]  # doctest: +SKIP
        'float16'
    """
    from vitcam_nb.core.progress import progress_bar as tqdm

    if not isinstance(quantize, str) or quantize not in QUANTIZE:
        raise ExportError(f"quantize: expected one of {list(QUANTIZE)}, got {quantize!r}")
    facts = TraceFacts.of(trace)
    base = default_recipe(facts) if recipe is None else as_recipe(recipe)
    values = export_axes(facts, axes)
    names = list(values)
    start = {**base.to_dict(), "layer": _absolute_layer(base.layer, facts)}
    rank = {facts.ranked[n - 1]: n for n in facts.top_ranks()}
    if is_int(start["class_"]) and start["class_"] in rank and start["class_"] not in values.get("class_", []):
        start["class_"] = f"top{rank[start['class_']]}"  # the class axis names the ranked class so: the same map
    entries: list[dict[str, Any]] = []
    grids: list[np.ndarray] = []
    seen: dict[bytes, int] = {}
    combos = list(itertools.product(*(values[n] for n in names)))
    so_far, packed = zlib.compressobj(9), 0
    for combo in tqdm(combos, desc="export maps", disable=not progress, leave=False):
        draft = {**start, **dict(zip(names, combo))}
        try:
            chosen = Recipe.from_dict(coerce_request(draft, [], facts))
            result = compute_grid(trace, chosen)
        except (RecipeError, ValueError, KeyError, IndexError, TypeError) as exc:
            entries.append({"e": error_text(exc)})
            continue
        entries.append({"g": _store(result, facts.frames, grids, seen), "r": result.recipe.to_json(),
                        "id": result.recipe.id, "c": result.checklist, "md": result.checklist_md,
                        "m": result.methods, "d": result.degenerate, "n": result.notes,
                        **({"v": result.value_range} if facts.frames else {})})
        if max_bytes is not None:
            # The page's texts hold these entries in this order; their compressed size so far (in base64) is
            # what the page needs at the least, less a margin for what the refusals between them change.
            packed += len(so_far.compress(json.dumps(entries[-1], separators=(",", ":")).encode("utf-8")))
            if packed * 4 / 3 * _MARGIN > max_bytes:
                raise ExportError(f"max_mb: after {len(entries)} of {len(combos)} recipes the page is already over "
                                  "its limit; nothing was written. Narrow axes=")
    if not grids:
        raise ExportError(f"axes: none of the {len(combos)} recipes of these axes can be computed on this trace "
                          f"(the first is refused with: {entries[0]['e']}); choose axes whose recipes it gives")
    values, combos, entries, left = keep_shown(names, values, combos, entries)
    shape = list(grids[0].shape)
    if any(list(g.shape) != shape for g in grids):
        raise ExportError("axes: the chosen recipes give grids of different shapes; export one stage at a time"
                          + ("; of a video trace, upsample 'none' (the token grid) apart from the other upsamplings"
                             if facts.frames else ""))
    codes, ranges = quantize_grids(np.stack(grids), quantize)
    # A video page holds every frame of the clip, one after the other.
    image = image_rgba(facts.image) if facts.clip is None else b"".join(image_rgba(f) for f in facts.clip)
    ranges_bytes = ranges.tobytes() if ranges is not None else b""
    opts = _restrict(controls(facts), values, start, facts)
    labels = {f["name"]: f["label"] for f in opts["fields"]}
    opts["presets"], presets_left = shown_presets(opts["presets"], names, values, entries, start, facts.max_layers,
                                                  left, labels)
    first = next((i for i, e in enumerate(entries) if "e" not in e), 0)
    want = [key(start[n]) for n in names]
    start_index = next((i for i, c in enumerate(combos) if [key(v) for v in c] == want and "e" not in entries[i]),
                       None)
    if start_index is None and recipe is not None and start_required:  # it would open on another recipe
        asked = next((entries[i]["e"] for i, c in enumerate(combos) if [key(v) for v in c] == want), None)
        raise ExportError(f"recipe: {base.to_string()} is not among the page's recipes ("
                          + (f"refused on this trace: {asked}" if asked else "a value of it is not on the axes "
                             + str({n: values[n] for n in names}))[:300] + "); nothing was written. Put its values "
                          "on axes= or start from another recipe")
    start_index = first if start_index is None else start_index
    meta = {
        "axes": [[n, values[n]] for n in names], "count": len(entries), "maps": len(grids), "start": start_index,
        "grid_shape": shape, "image_shape": list(facts.image.shape[:2]), "num_layers": facts.max_layers,
        "quantize": quantize, "image_bytes": len(image), "ranges_bytes": len(ranges_bytes),
        "frames": facts.frames, "frame_bytes": len(image) // max(facts.frames, 1),
        "options": opts, "model": str(trace.attrs.get("model_name", "?")),
        "trace_id": str(trace.attrs.get("trace_id", "?")),
        "left_out": left_out_text([*left, *presets_left], labels),
    }
    texts = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    return Bundle(meta=meta, maps=_pack(image + ranges_bytes + codes), texts=_pack(texts))
