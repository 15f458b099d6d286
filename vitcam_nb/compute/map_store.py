"""The map store that :func:`vitcam_nb.map_many` writes, read back: every recipe's map of every image on the token
grid, turned into exactly the map :func:`vitcam_nb.cam` gives on the trace of that image.

What a recipe's map is made of is kept on the token grid: for a recipe of one block (or a rollout) its map after
the ReLU, the degeneracy check and the per-layer normalisation (``maps``, (image, recipe, gy, gx)); for a fused
recipe of several blocks its fused token-grid map in ``maps`` and each block's map in ``parts`` (image, part,
gy, gx), because a fused map upsamples each block before fusing. With each block's degeneracy reason
(``part_reason``), reading a map replays the rest of :func:`vitcam_nb.cam` (upsampling, fusion, normalisation,
as the recipe names them) on the same arrays, so a map read from the store is bitwise the map ``vc.cam`` computes
on the trace the store's pass made of that image. ``degenerate`` and ``scale`` (image, recipe) hold each map's
reason on the token grid and the largest magnitude its degeneracy check compared with. A generative VLM's answer
store may add a ``crop`` dim to ``maps``, ``parts`` and ``part_reason`` (a tower on crops: one map per crop) and
hold LM-site maps off the tower's grid in ``lm_maps``, ``lm_parts`` and ``lm_part_reason`` (one map per tile group),
each recipe row naming its arrays (:mod:`vitcam_nb.compute.map_vlm`); stores without them read as before.

Example:
    >>> import timm, numpy as np, tempfile, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    >>> imgs = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    >>> ds = vc.open_maps(vc.map_many(m, imgs, ["F1@1"], tempfile.mkdtemp() + "/m.zarr", progress=False))
    >>> vc.cam(image_maps(ds, 1), Recipe.parse("F1@1")).dims, vc.cam(ds, Recipe.parse("F1@1")).dims
    (('y', 'x'), ('image', 'y', 'x'))
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.adapters.hf_vlm import LM_SITES
from vitcam_nb.capture.reader import load_image
from vitcam_nb.compute.fusion import fuse_layers
from vitcam_nb.compute.map_checksum import CHECKSUM_VAR, CHECKSUMS_ATTR, UNVERIFIED, VERIFIED, verify_image
from vitcam_nb.compute.map_table import Found, find, read_table, written_rows
from vitcam_nb.compute.map_vlm_maps import CROP_COORDS, lm_report, lm_values, stored_report
from vitcam_nb.compute.maps import map_array, warn_degenerate
from vitcam_nb.compute.report import build_checklist, describe
from vitcam_nb.compute.report_cache import cached_report
from vitcam_nb.compute.spatial import normalise, upsample
from vitcam_nb.compute.video import VIDEO, upsample_clip
from vitcam_nb.compute.vlm_crops import CROPS
from vitcam_nb.compute.vlm_tiles import placed_map
from vitcam_nb.core.arguments import as_flag, as_path
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.errors import (
    ArgumentError,
    ArgumentIndexError,
    ArgumentTypeError,
    DegenerateMapWarning,
    TraceError,
    TraceFileError,
)
from vitcam_nb.core.kinds import TRACE_KINDS, MapValues, TraceKind
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.schema import MAPS_STORE_KIND

__all__ = ["MAPS", "MAPS_STORE_KIND", "MAPS_STORE_VERSION", "MapsKind", "image_maps", "is_map_store", "open_maps",
           "replay", "report_of", "report_trace"]

MAPS_STORE_VERSION = 1
#: What every map store's reader needs: its attributes, and the arrays (each with its ``image`` dimension but
#: ``token_kind``) a map is read from.
_NEEDED_ATTRS = ("recipes", "num_layers", "img_height", "img_width", "pad", "trace_attrs")
_NEEDED_VARS = ("maps", "part_reason", "degenerate", "scale", "trace_id", "provenance", "token_kind", "done")


def is_map_store(ds: object) -> bool:
    """Whether ``ds`` is a map store (or one image of it) opened with :func:`open_maps`.

    Example:
        >>> is_map_store(xr.Dataset(attrs={"store_kind": MAPS_STORE_KIND})), is_map_store(xr.Dataset())
        (True, False)
    """
    return isinstance(ds, xr.Dataset) and ds.attrs.get("store_kind") == MAPS_STORE_KIND


def replay(parts: np.ndarray, reasons: Sequence[str], layer_ids: list[int], recipe: Recipe, size: tuple[int, int],
           pad: tuple[int, int], rollout: bool) -> MapValues:
    """The rest of :func:`vitcam_nb.cam` after the per-layer token-grid maps ``parts`` (layer, gy, gx): the same
    upsampling, fusion and normalisation calls on the same arrays, so the values are bitwise those of ``vc.cam``.

    Example:
        >>> parts = np.array([[[0.0, 1.0], [0.5, 0.25]]], np.float32)
        >>> values, notes, partial = replay(parts, [""], [0], Recipe(upsample="none"), (4, 4), (0, 0), False)
        >>> values.tolist(), notes
        ([[0.0, 1.0], [0.5, 0.25]], [])
    """
    if rollout:
        out = upsample(parts[0], size, recipe.upsample, pad)
        return normalise(out, recipe.normalize), [r for r in reasons if r], []
    # an LM site's layers are named as the vlm kind names them ("lm_resid layer 1: ...")
    return fuse_layers(upsample(parts, size, recipe.upsample, pad), np.asarray(reasons, dtype=object), layer_ids,
                       recipe, label=f"{recipe.site} layer" if recipe.site in LM_SITES else "layer")


def report_trace(one: xr.Dataset, layers: Sequence[int] | None = None) -> xr.Dataset:
    """What a recipe's checklist and methods are written from: the trace's attributes (those of the image's pass)
    and its token kinds, as on the image's trace, and the blocks the recipe's map is of (``layers``).

    Example:
        >>> report_trace(image_maps(open_maps("maps.zarr"), 0)).attrs["model_family"]  # doctest: +SKIP
        'vit'
    """
    report = report_of(json.loads(one.attrs["trace_attrs"]), str(one["provenance"].values),
                       one["token_kind"].values, layers)
    # The image's logits: the methods line resolves class_="topK" to this image's class, as on its trace.
    return report.assign(logits=one["logits"].load()) if "logits" in one.variables else report


def report_of(trace_attrs: dict, provenance: str, token_kind: Any, layers: Sequence[int] | None = None) -> xr.Dataset:
    """The attributes and token kinds of an image's trace, as a Dataset the report functions read; with ``layers``,
    also the blocks a recipe's map is of as its ``layer`` coordinate (a map of ``layer="all"`` is of every block its
    pass traced, and the report names them as it does on a trace).

    Example:
        >>> report_of({"model_family": "vit"}, '{"trace_id": "abc"}', ["cls", "patch"]).attrs
        {'model_family': 'vit', 'trace_id': 'abc'}
    """
    kinds = np.array([str(k) for k in np.asarray(token_kind)])
    coords = {"token_kind": ("token", kinds)}
    if layers is not None:
        coords["layer"] = ("layer", [int(v) for v in layers])
    return xr.Dataset(coords=coords, attrs={**trace_attrs, **json.loads(provenance)})


def _grid(one: xr.Dataset, found: Found) -> str:
    """Which arrays hold the map of ``found`` (its row's ``grid``: "" ``maps``, "crop" ``maps`` with a crop dim,
    "lm" ``lm_maps``; "" for one crop of an image); a row naming arrays the store lacks is refused, naming it."""
    grid = str(found.row.get("grid", ""))
    need = {"": "maps", "crop": "maps", "lm": "lm_maps"}.get(grid)
    crop_dim = need is not None and need in one.variables and "crop" in one["maps"].dims
    if grid == "crop" and not crop_dim and one.attrs.get("crop_dim"):
        return ""  # one crop of an image (ds.isel(crop=k), as the crops form reads it): a single-image store's
    if need is None or need not in one.variables or (grid != "lm" and (grid == "crop") != crop_dim):
        where = one.encoding.get("source", "the map store")
        raise TraceFileError(f"path: {where} is a damaged map store: recipe {found.row.get('text')!r} names grid "
                             f"{grid!r}, which its arrays do not hold; compute it again with vc.map_many(..., "
                             "overwrite=True)")
    return grid


def _crops_view(one: xr.Dataset) -> xr.Dataset:
    """An image of a store of crops as the crops form reads a trace: each crop's coordinates and the crops' words
    (its facts, written per image), so ``CROPS`` maps each crop (``one.isel(crop=k)``, a single-image store's
    image) with the reader below and stacks them as on the trace."""
    facts = json.loads(str(one["provenance"].values))
    coords = json.loads(facts.get(CROP_COORDS, "{}"))
    one = one.assign_coords({"crop": np.arange(one.sizes["crop"], dtype=np.int64),
                             **{c: ("crop", np.asarray(v)) for c, v in coords.items()}})
    one.attrs.update({k: facts[k] for k in ("crop_layout", "image_token_layout", "crop_source_size") if k in facts})
    return one


def _lm(one: xr.Dataset, found: Found) -> tuple[np.ndarray, tuple[str, ...], dict, list[str], list[str]]:
    """An LM-site map stored on the LM's own grid, placed as the ``vlm`` kind places it (map_vlm_maps.lm_values)."""
    info = found.row
    if info["part"] is None:
        parts = np.asarray(one["lm_maps"].values[found.pos])[None]
    else:
        start, count = info["part"]
        parts = np.asarray(one["lm_parts"].values[start:start + count])
    start, count = info["slot"]
    reasons = [str(r) for r in one["lm_part_reason"].values[start:start + count]]
    return lm_values(parts, reasons, list(info["layers"]), found.recipe, str(one["provenance"].values))


def _lm_report(one: xr.Dataset, report: xr.Dataset, found: Found) -> tuple[str, str] | None:
    """An LM-site map's checklist and methods: those written with the image's maps at the stored upsampling, or
    at another those the ``vlm`` kind writes, made again from the image's stored layout (map_vlm_maps.lm_report;
    a store written before it kept one has its stored report only)."""
    stored = stored_report(report, found.row["id"])
    if found.recipe.id == found.row["id"]:
        return stored
    return lm_report(report, one["logits"].values, one["target_class"].values, found.recipe) or stored


def _values(one: xr.Dataset, found: Found) -> MapValues:
    """The map of the stored recipe ``found`` names (at the upsampling asked for), replayed from its stored parts:
    the values ``vc.cam`` gives on the trace for that recipe and for every spelling of the same map."""
    pos, info, recipe = found.pos, found.row, found.recipe
    grid = _grid(one, found)
    if grid == "lm":
        values, _, _, notes, partial = _lm(one, found)
        return values, notes, partial
    if grid == "crop":
        return CROPS.compute(_crops_view(one), recipe)
    if info["part"] is None:
        parts = np.asarray(one["maps"].values[pos])[None]
    else:
        start, count = info["part"]
        parts = np.asarray(one["parts"].values[start:start + count])
    start, count = info["slot"]
    reasons = [str(r) for r in one["part_reason"].values[start:start + count]]
    size = (int(one.attrs["img_height"]), int(one.attrs["img_width"]))
    pad = tuple(int(v) for v in json.loads(one.attrs["pad"]))
    if "grid_t" not in one.attrs:
        return replay(parts, reasons, list(info["layers"]), recipe, size, pad, bool(info["rollout"]))
    # A clip's map, as the video kind computes it: the recipe on the frames stacked into one (t x h, w) grid,
    # then upsampled in space and time and normalised over the whole clip.
    gt, gh, gw = parts.shape[-3:]
    grid, notes, partial = replay(parts.reshape(len(parts), gt * gh, gw), reasons, list(info["layers"]),
                                  recipe.replace(upsample="none"), size, pad, bool(info["rollout"]))
    grid = grid.reshape(gt, gh, gw)
    if recipe.upsample == "none":
        return grid, notes, partial
    clip_size = (int(one.attrs["clip_frames"]), *size)
    clip = upsample_clip(grid, clip_size, recipe.upsample)
    return normalise(clip.reshape(1, -1, size[1]), recipe.normalize).reshape(clip_size), notes, partial


def _one_cam(one: xr.Dataset, recipe: Recipe, warn: bool = True) -> xr.DataArray:
    found = find(one, recipe)
    grid = _grid(one, found)
    if grid == "crop":  # one map per crop (crop, y, x), each read as a single-image store's, as on the trace
        with warnings.catch_warnings():
            if not warn:
                warnings.simplefilter("ignore", DegenerateMapWarning)
            return CROPS.cam(_crops_view(one), recipe)
    blocks = {"blocks": ",".join(str(v) for v in found.layers), "blocks_of": str(one.attrs["num_layers"])}
    if grid == "lm":  # an LM-site map off the store's grid: (y, x), or (view, y, x) over several tiles
        values, dim, coords, notes, partial = _lm(one, found)
        reason = (warn_degenerate(recipe, notes) if warn else "; ".join(notes)) if notes else ""
        checklist, methods = _lm_report(one, report_trace(one), found)
        out = placed_map(values, dim, coords, recipe, xr.Dataset(attrs={"trace_id": str(one["trace_id"].values)}),
                         checklist, methods, reason, partial)
        out.attrs.update(blocks)
        return out
    values, notes, partial = _values(one, found)
    reason = (warn_degenerate(recipe, notes) if warn else "; ".join(notes)) if notes else ""
    report = report_trace(one, found.layers)
    if "grid_t" not in one.attrs:
        # an answer store's LM-site recipe: the checklist written with the image's maps (compute.map_vlm)
        checklist, methods = (_lm_report(one, report, found) if recipe.site in LM_SITES else None) or \
            cached_report(recipe, report)
        return map_array(values, recipe, str(one["trace_id"].values), checklist, methods, reason, partial, **blocks)
    # a clip's map: the video kind's dims and report, as vc.cam gives them on the clip's trace
    flat = map_array(values[0], recipe, str(one["trace_id"].values), VIDEO.checklist(recipe, report).to_json(),
                     VIDEO.describe(recipe, report), reason, partial, **blocks,
                     time_interpolation=VIDEO.time_text(recipe, report),
                     tubelet_size=str(report.attrs.get("tubelet_size", "")))
    dims = ("patch_frame", "patch_row", "patch_col") if recipe.upsample == "none" else ("frame", "y", "x")
    return xr.DataArray(values.astype(np.float32, copy=False), dims=dims, name="cam", attrs=flat.attrs)


def open_maps(path: str | os.PathLike, *, incomplete: bool = False) -> xr.Dataset:
    """Open a :func:`vitcam_nb.map_many` store: a lazy Dataset of the finished images (``image`` dimension).

    ``vc.cam(ds, recipe)`` gives every image's map (read now, image by image: (image, y, x)),
    ``vc.cam(vc.image_maps(ds, i), recipe)`` one image's, both exactly as ``vc.cam`` gives them on the image's
    trace. A store still being written (or interrupted) is refused
    unless ``incomplete=True`` (then only the images marked done are opened). A recipe is read under any spelling
    of a stored one (its canonical form on the store's model: ``layer=5`` of a 6-block model reads the stored
    ``layer=-1``). Every image read is checked against the checksums written with it: a chunk changed on disk is
    refused naming the store, the image and the array. A store written before checksums (0.3.0 or earlier) opens
    with a warning, and ``attrs["checksums"]`` says its maps are unverified.

    Example:
        >>> ds = open_maps("maps.zarr")  # doctest: +SKIP
        >>> ds["maps"].dims  # doctest: +SKIP
        ('image', 'recipe', 'gy', 'gx')
    """
    path = as_path("path", path)  # None or a list: refused by name, not by pathlib's TypeError
    incomplete = as_flag("incomplete", incomplete)
    if not path.is_dir():
        raise TraceFileError(f"path: {path} is not a map store folder (vc.map_many writes one)")
    try:
        ds = xr.open_zarr(str(path), consolidated=False, zarr_format=3)
    except Exception as exc:  # zarr raises several types for a folder that is no group
        raise TraceFileError(f"path: {path} is not a zarr map store ({exc})") from exc
    if ds.attrs.get("store_kind") != MAPS_STORE_KIND:
        raise TraceFileError(f"path: {path} is not a vitcam_nb map store (store_kind "
                             f"{ds.attrs.get('store_kind')!r}); open a trace store with vc.open_traces")
    if ds.attrs.get("store_version") != MAPS_STORE_VERSION:
        raise TraceFileError(f"path: {path} has map store version {ds.attrs.get('store_version')}; this vitcam_nb "
                             f"reads {MAPS_STORE_VERSION}")
    _check_layout(path, ds)
    if CHECKSUM_VAR not in ds.variables:  # a store written before checksums: read as before, said unverified
        warnings.warn(f"path: {path} has no checksums ({UNVERIFIED})", UserWarning, stacklevel=2)
        ds.attrs[CHECKSUMS_ATTR] = UNVERIFIED
    done = np.asarray(ds["done"].values, bool)
    if not incomplete and not (int(ds.attrs.get("complete", 0)) and done.all()):
        raise TraceFileError(f"path: {path} is incomplete ({int(done.sum())} of {done.size} images done); rerun "
                             "vc.map_many with the same arguments to finish it, or pass incomplete=True")
    return ds.isel(image=np.flatnonzero(done))


def _check_layout(path: Path, ds: xr.Dataset) -> None:
    """Refuse a damaged map store before any map is read: an attribute or array its reader needs that is missing,
    or a recipe table that is not one, named with the store."""
    missing = [f"attribute {a!r}" for a in _NEEDED_ATTRS if a not in ds.attrs]
    missing += [f"array {v!r}" for v in _NEEDED_VARS if v not in ds.variables]
    if missing:
        raise TraceFileError(f"path: {path} is a damaged map store: it lacks the {', '.join(missing)} that "
                             "vc.map_many writes; compute it again with vc.map_many(..., overwrite=True)")
    for name in ("img_height", "img_width"):  # the size every map is resized to: 0 would reach torch's resize
        value = ds.attrs[name]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise TraceFileError(f"path: {path} is a damaged map store: its attribute {name!r} is {value!r}, not the "
                                 "positive image size vc.map_many writes; compute it again with "
                                 "vc.map_many(..., overwrite=True)")
    read_table(ds, str(path))  # a table that is none, empty, or whose rows' ids are not their JSON's
    if CHECKSUM_VAR not in ds.variables and ds.attrs.get(CHECKSUMS_ATTR) == VERIFIED:
        raise TraceFileError(f"path: {path} is a damaged map store: it lacks the array {CHECKSUM_VAR!r} its "
                             "attributes say it has; compute it again with vc.map_many(..., overwrite=True)")


def _as_array(var: xr.Variable) -> xr.Variable | None:
    """A text array's single value held as a 0-d numpy array, or None where ``var`` needs no change: zarr's string
    arrays, indexed at one image, load as a Python ``str``, which xarray's repr (and anything asking the variable's
    dtype) cannot display."""
    try:
        var.dtype  # noqa: B018 - what repr asks first
    except AttributeError:
        return xr.Variable(var.dims, np.asarray(str(var.values)), var.attrs, var.encoding)
    return None


def _written(ds: xr.Dataset, name: str, var: xr.Variable) -> np.ndarray:
    """The values of one image's array the store's pass wrote (the other arrays' recipes' rows are NaN)."""
    axis = None if name == "scale" else next((a for a, d in enumerate(var.dims) if d in ("recipe", "part")), None)
    return var.values if axis is None else np.compress(written_rows(ds.attrs, name, var.shape[axis]), var.values, axis)


def _load_image(ds: xr.Dataset, i: int) -> xr.Dataset:
    """Image ``i`` read from disk, each array by name: a chunk that cannot be decoded (truncated, corrupted) or is
    gone (a map store's float arrays are filled with NaN where nothing was written) is refused naming the store, the
    array and the image."""
    where = ds.encoding.get("source", "the map store")
    one = ds.isel(image=i)
    texts: dict[str, xr.Variable] = {}
    load_image(one, where, i, "compute it again with vc.map_many")
    for name, var in one.variables.items():
        fixed = _as_array(var)
        if name in ("maps", "parts", "scale", "lm_maps", "lm_parts") and np.isnan(_written(ds, name, var)).any():
            raise TraceFileError(f"path: {where} is damaged: array {name!r} of image {i} is missing values (a chunk "
                                 "of the store was deleted or never written); compute it again with vc.map_many")
        if fixed is not None:
            texts[name] = fixed
    verify_image(one, where, i)  # before any text is rewritten: the values exactly as read
    one = one.assign_coords({k: v for k, v in texts.items() if k in one.coords})
    one = one.assign({k: v for k, v in texts.items() if k not in one.coords})
    if not str(one["trace_id"].values):
        raise TraceFileError(f"path: {where} is damaged: image {i} is marked done but its trace_id is missing; "
                             "compute it again with vc.map_many")
    return one


def image_maps(ds: xr.Dataset, i: int) -> xr.Dataset:
    """Image ``i`` of an :func:`open_maps` store, loaded: what ``vc.cam`` reads that image's maps from (``i`` from 0,
    as ``Explorer.index``; a damaged chunk is refused naming the store and the array).

    Example:
        >>> one = image_maps(open_maps("maps.zarr"), 0)  # doctest: +SKIP
        >>> one["maps"].dims  # doctest: +SKIP
        ('recipe', 'gy', 'gx')
    """
    if not is_map_store(ds) or "image" not in ds.dims:
        raise ArgumentTypeError("ds: expected a map store from vc.open_maps")
    n = ds.sizes["image"]
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < n:
        raise ArgumentIndexError(f"i: expected an image position in [0, {n - 1}], got {i!r}")
    if ds.attrs.get("crop_dim") and "crop" not in ds["maps"].dims:  # a checksum covers every crop of an image
        raise ArgumentError("ds: this store of crops was sliced along 'crop' before its image was read; read the "
                            "image first, then its crop: vc.image_maps(ds, i).isel(crop=k)")
    return _load_image(ds, int(i))


def _first(ds: xr.Dataset) -> xr.Dataset:
    return image_maps(ds, 0) if "image" in ds.dims else ds


class MapsKind(TraceKind):
    """Map stores (:func:`open_maps`) and their images (:func:`image_maps`): maps are read, not computed.

    Example:
        >>> MAPS.accepts(xr.Dataset(attrs={"store_kind": MAPS_STORE_KIND}), None), MAPS.accepts(xr.Dataset(), None)
        (True, False)
    """

    name = "maps"

    def accepts(self, trace: Any, recipe: Any) -> bool:
        return is_map_store(trace)

    def compute(self, trace: xr.Dataset, recipe: Recipe) -> MapValues:
        if "image" in trace.dims:
            raise TraceError("trace: a map store has one map per image; use vc.cam(ds, recipe) for all of them, or "
                             "vc.image_maps(ds, i) for one")
        return _values(trace, find(trace, recipe))

    def cam(self, trace: xr.Dataset, recipe: Recipe) -> xr.DataArray:
        if "image" not in trace.dims:
            return _one_cam(trace, recipe)
        find(trace, recipe)  # a recipe the store lacks is refused before any image is read
        per = [_one_cam(image_maps(trace, i), recipe, warn=False) for i in range(trace.sizes["image"])]
        if not per:
            raise TraceError("trace: the map store holds no finished images")
        out = xr.concat([p.drop_attrs() for p in per], dim="image")
        out = out.assign_coords(image=trace["image"].values, degenerate=("image", [p.attrs["degenerate"] for p in per]),
                                trace_id=("image", [str(v) for v in trace["trace_id"].values]))
        out.attrs = {k: per[0].attrs[k] for k in ("recipe", "recipe_id", "checklist", "methods")}
        return out.rename("cam")

    def resolve(self, trace: xr.Dataset, recipe: Recipe) -> Recipe:
        # A store holds the maps it was asked for: a recipe vc.cam refuses here (not in the recipes' table) has no
        # id on it either (Recipe.canonical_id), whether the store is whole or one image of it.
        find(trace, recipe)
        return super().resolve(trace, recipe)

    def gallery(self, trace: xr.Dataset, recipe: Recipe, vary: Mapping[str, Any] | Sequence[str]) -> xr.DataArray:
        raise TraceError("trace: a map store holds the maps it was asked for; read each with vc.cam")

    def checklist(self, recipe: Recipe, trace: xr.Dataset) -> Checklist:
        first = _first(trace)
        found = find(first, recipe)
        report = report_trace(first, found.layers)
        stored = _lm_report(first, report, found) if recipe.site in LM_SITES else None  # the image's own
        if stored:
            return Checklist(json.loads(stored[0]))
        if _grid(first, found) == "crop":
            return CROPS.checklist(recipe, _crops_view(first))
        return VIDEO.checklist(recipe, report) if "grid_t" in first.attrs else build_checklist(recipe, report)

    def describe(self, recipe: Recipe, trace: xr.Dataset) -> str:
        first = _first(trace)
        found = find(first, recipe)
        report = report_trace(first, found.layers)
        stored = _lm_report(first, report, found) if recipe.site in LM_SITES else None
        if stored:
            return stored[1]
        if _grid(first, found) == "crop":
            return CROPS.describe(recipe, _crops_view(first))
        return VIDEO.describe(recipe, report) if "grid_t" in first.attrs else describe(recipe, report)


MAPS = MapsKind()
# First: a map store is an xarray Dataset the flat kind would otherwise take for a trace.
# Lookup priority: first of all: a map store's image is a Dataset other forms would take for a trace.
TRACE_KINDS.register(MAPS.name, MAPS, replace=True, priority=10)
