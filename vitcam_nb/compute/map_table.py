"""A map store's recipe table (``attrs["recipes"]``, one row per stored map: its key, id, JSON, text, blocks and
layout), checked when the store is opened and looked up by what a recipe computes.

Checked: every row is what :func:`vitcam_nb.map_many` writes, and names the recipe its JSON holds (its id and key
are those of that JSON, its blocks those the recipe reads on the store's model): a table edited by hand, whose
JSON no longer matches its ids, would otherwise serve one recipe's map under another's name.

Looked up: a recipe as written (any upsampling: it is applied on read), else by its canonical form on the store's
model (:mod:`vitcam_nb.core.recipe_canonical`): ``layer=5`` of a 6-block model reads the stored ``layer=-1``,
``(0, 5)`` of a mean the stored ``(5, 0)``, ``(5,)`` of a mean or ``"all"`` spelled as every block the same map, as
``Recipe.canonical_id`` says they are on a trace. A recipe the store lacks is refused, naming it.

Example:
    >>> from vitcam_nb.core.recipe import Recipe
    >>> canonical_key(Recipe(layer=(5, 0), layer_fusion="mean"), 6) == canonical_key(
    ...     Recipe(layer=(-6, -1), layer_fusion="mean"), 6)
    True
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.core.errors import ArgumentTypeError, RecipeError, TraceFileError
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.recipe_canonical import canonical_form

__all__ = ["Found", "blocks", "canonical_key", "find", "read_table", "written_rows"]

_RECIPE_KEYS = ("key", "text", "layers", "rollout", "part", "slot")
_AGAIN = "compute it again with vc.map_many(..., overwrite=True)"


def blocks(recipe: Recipe, n_layers: int) -> tuple[int, ...]:
    """The absolute blocks ``recipe`` reads on a model of ``n_layers`` blocks (``"all"``: every block), in the
    order it names them; a layer that is no block of that model is refused, naming it.

    Example:
        >>> blocks(Recipe(layer=(-1, 0), layer_fusion="mean"), 6), blocks(Recipe(layer="all", layer_fusion="mean"), 3)
        ((5, 0), (0, 1, 2))
    """
    if recipe.layer == "all":
        return tuple(range(n_layers))
    out = []
    for v in recipe.layer if isinstance(recipe.layer, tuple) else (recipe.layer,):
        if isinstance(v, str) or not -n_layers <= v < n_layers:
            raise RecipeError(f"recipe {recipe.to_string()}: layer {v!r} is not a block of this model "
                              f"(allowed -{n_layers}..{n_layers - 1})")
        out.append(int(v) % n_layers)
    return tuple(out)


def canonical_key(recipe: Recipe, n: int) -> str | None:
    """What identifies a stored map by what it computes: the id of the recipe's canonical form on a model of ``n``
    blocks, but its upsampling (applied on read); None for a layer that is no block of that model.

    Example:
        >>> canonical_key(Recipe(layer=5), 6) == canonical_key(Recipe(layer=(-1,), layer_fusion="sum"), 6)
        True
    """
    try:
        read = blocks(recipe, n)
    except RecipeError:
        return None
    layer = tuple(read) if isinstance(recipe.layer, tuple) or recipe.layer == "all" else read[0]
    return canonical_form(recipe.replace(layer=layer, upsample="none")).id


@dataclass(frozen=True)
class _Table:
    rows: list[dict]
    recipes: list[Recipe]
    by_key: dict[str, int]
    by_canonical: dict[str, int]


def _count(recipe: Recipe, n: int, n_lm: int) -> int:
    """The layers ``recipe``'s site has: the model's ``n`` blocks, or a generative VLM's LM sites' own (``n_lm``
    decoder layers; the projector one), as the vlm kind counts them (an answer store: compute.map_vlm)."""
    if recipe.site == "projector" and n_lm:
        return 1
    return n_lm if recipe.site in ("lm_resid", "lm_attn") and n_lm else n


def _lm_layers(ds: xr.Dataset) -> int:
    """A generative VLM store's LM decoder layers (0 for any other store)."""
    try:
        return int(json.loads(str(ds.attrs.get("trace_attrs", "{}"))).get("lm_num_layers", 0) or 0)
    except (TypeError, ValueError):
        return 0


@functools.lru_cache(maxsize=16)
def _parse(text: str, n: int, n_lm: int = 0) -> _Table | str:
    """The table ``text`` of a store of ``n`` blocks (and ``n_lm`` LM layers), or what is wrong with it (cached: a
    table is checked once per process, however many images are read)."""
    try:
        rows = json.loads(text)
    except (TypeError, ValueError):
        return "its attribute 'recipes' is not the recipe table vc.map_many writes"
    if not isinstance(rows, list) or not all(isinstance(r, dict) and all(k in r for k in _RECIPE_KEYS)
                                             for r in rows):
        return "its attribute 'recipes' is not the recipe table vc.map_many writes"
    if not rows:
        return "its recipe table is empty (vc.map_many stores at least one recipe)"
    recipes: list[Recipe] = []
    for i, row in enumerate(rows):
        try:
            r = Recipe.from_json(row["json"])
        except Exception as exc:  # noqa: BLE001 - whatever a damaged JSON raises, the row is named
            return f"recipe table entry {i} ({str(row.get('text'))[:80]!r}) holds no readable recipe JSON ({exc})"
        try:
            layers = [int(v) for v in row["layers"]]
        except (TypeError, ValueError):
            layers = None
        # Ids are a contract (the same recipe has the same id in every version); the text and canonical id are
        # not compared, as a later version may write them otherwise for the same recipe.
        found = {"id": r.id, "key": r.replace(upsample="none").id}
        bad = [k for k, v in found.items() if row.get(k, v) != v]
        try:
            read = list(blocks(r, _count(r, n, n_lm)))
        except RecipeError:
            read = None
        if layers != read:
            bad.append("layers")
        if bad:
            return (f"recipe table entry {i} ({str(row.get('text'))[:80]!r}, id {row.get('id')!r}) does not match "
                    f"the recipe its JSON holds ({r.to_string()}, id {r.id}): its {', '.join(bad)} differ (the table "
                    "was edited)")
        recipes.append(r)
    by_key: dict[str, int] = {}
    by_canonical: dict[str, int] = {}
    for i, (row, r) in enumerate(zip(rows, recipes)):
        by_key.setdefault(row["key"], i)
        key = canonical_key(r, _count(r, n, n_lm))
        if key is not None:
            by_canonical.setdefault(key, i)
    return _Table(rows, recipes, by_key, by_canonical)


def _table(ds: xr.Dataset, where: str) -> _Table:
    problem = "its attribute 'num_layers' is not the block count vc.map_many writes"
    n = ds.attrs.get("num_layers")
    text = ds.attrs.get("recipes")
    if not isinstance(text, str):  # a list or dict edited in (unhashable for the cache): no table vc.map_many writes
        problem = "its attribute 'recipes' is not the recipe table vc.map_many writes"
    elif isinstance(n, int) and not isinstance(n, bool) and n > 0:
        problem = _parse(text, n, _lm_layers(ds))
        if isinstance(problem, _Table):
            return problem
    raise TraceFileError(f"path: {where} is a damaged map store: {problem}; {_AGAIN}")


def read_table(ds: xr.Dataset, where: str) -> list[dict]:
    """The rows of the store's recipe table, each checked against its JSON; a table that is no table, is empty,
    or has a row whose id, key or blocks are not those of its JSON is refused naming the store and the row.

    Example:
        >>> read_table(xr.Dataset(attrs={"recipes": "[]", "num_layers": 2}), "m.zarr")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        vitcam_nb.core.errors.TraceFileError: path: m.zarr is a damaged map store: its recipe table is empty ...
    """
    return _table(ds, where).rows


@dataclass(frozen=True)
class Found:
    """A recipe found in a store: its row's position and the row; ``recipe`` the stored recipe at the upsampling
    asked for (what the values are replayed with); ``layers`` the blocks the recipe asked for reads.

    Example:
        >>> Found(0, {"text": "F1@-1 ..."}, Recipe(), [5]).layers
        [5]
    """

    pos: int
    row: dict
    recipe: Recipe
    layers: list[int]


def find(ds: xr.Dataset, recipe: Any) -> Found:
    """The stored map ``recipe`` reads: as written, else the one of the same canonical form on the store's model; a
    recipe the store lacks is refused, naming it and some of the store's.

    Example:
        >>> find(image_maps(open_maps("maps.zarr"), 0), Recipe(layer=5)).row["text"]  # doctest: +SKIP
        'F1@-1 target=logit ...'
    """
    if not isinstance(recipe, Recipe):
        raise ArgumentTypeError(f"recipe: expected a vitcam_nb.Recipe, got {type(recipe).__name__}")
    table = _table(ds, ds.encoding.get("source", "the map store"))
    n = _count(recipe, int(ds.attrs["num_layers"]), _lm_layers(ds))
    pos = table.by_key.get(recipe.replace(upsample="none").id)
    if pos is None:
        pos = table.by_canonical.get(canonical_key(recipe, n) or "")
    if pos is None:
        rows = table.rows
        shown = ", ".join(r["text"] for r in rows[:3]) + (" ..." if len(rows) > 3 else "")
        raise RecipeError(f"recipe: {recipe.to_string()} (id {recipe.id}) is not in this map store ({len(rows)} "
                          f"recipes: {shown}); compute it with vc.map_many, or vc.cam on a trace")
    stored = table.recipes[pos]
    values = stored if stored.upsample == recipe.upsample else stored.replace(upsample=recipe.upsample)
    return Found(pos, table.rows[pos], values, list(blocks(recipe, n)))


def written_rows(attrs: dict, name: str, n: int) -> np.ndarray:
    """Which of the ``n`` rows of array ``name`` (``maps``/``lm_maps``: one per recipe; ``parts``/``lm_parts``:
    the recipes' parts) a store's pass writes. In a store whose recipes name their arrays (``grid``: an answer
    store with LM maps on the LM's own grid) the rows of the recipes the other arrays hold stay NaN; in any other
    store every row is written.

    Example:
        >>> written_rows({"recipes": json.dumps([{"part": None}, {"grid": "lm", "part": [0, 2]}])}, "maps", 2)
        array([ True, False])
        >>> written_rows({"recipes": json.dumps([{"part": None}, {"grid": "lm", "part": [0, 2]}])}, "lm_parts", 2)
        array([ True,  True])
    """
    rows = json.loads(attrs.get("recipes", "[]"))
    if not any(r.get("grid") for r in rows):
        return np.ones(n, bool)
    keep = np.zeros(n, bool)
    for i, r in enumerate(rows):
        if (r.get("grid", "") == "lm") != name.startswith("lm_"):
            continue
        if name.endswith("maps"):
            keep[i] = True
        elif r.get("part"):
            keep[r["part"][0]:r["part"][0] + r["part"][1]] = True
    return keep
