"""What the Explorer offers on a map store (:func:`vitcam_nb.open_maps`): only the recipes the store holds. A map
store keeps maps, not activations, so each control lists only the values its stored recipes take (every
upsampling, which is applied on read), the preset menu only the presets it holds, and the first recipe shown is
one it holds; a combination of offered values the store lacks is refused by name in the page, as any refusal is.
A map store holds no pixels: the map is drawn over a uniform grey image of the traced size.

Example:
    >>> import timm, numpy as np, tempfile, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    >>> imgs = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    >>> ds = vc.open_maps(vc.map_many(m, imgs, ["F4@1 layercam"], tempfile.mkdtemp() + "/m.zarr", progress=False))
    >>> facts = store_facts(vc.image_maps(ds, 0))
    >>> facts.sites, facts.layers, facts.image.shape
    (('F4',), (1,), (32, 32, 3))
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.capture.reader import image_trace
from vitcam_nb.compute.map_store import image_maps, is_map_store
from vitcam_nb.core.recipe import SITES, Recipe
from vitcam_nb.widgets.controls import controls
from vitcam_nb.widgets.facts import TraceFacts, default_recipe

__all__ = ["GREY", "display_trace", "explorer_view", "read_image", "store_controls", "store_facts", "stored_recipes"]

#: The grey the map is drawn over: a map store holds no pixels.
GREY = 128


def stored_recipes(one: xr.Dataset) -> list[Recipe]:
    """The recipes a map store holds, in its order.

    Example:
        >>> [r.site for r in stored_recipes(vc.image_maps(ds, 0))]  # doctest: +SKIP
        ['F4']
    """
    return [Recipe.from_json(row["json"]) for row in json.loads(one.attrs["recipes"])]


def store_facts(one: xr.Dataset) -> TraceFacts:
    """The control facts of one image of a map store: the sites and blocks its recipes read, its traced classes
    and their labels, the model's ranking of the classes, and a grey image of the traced size.

    Example:
        >>> store_facts(vc.image_maps(ds, 0)).classes  # doctest: +SKIP
        (3, 7)
    """
    rows = json.loads(one.attrs["recipes"])
    stored = {Recipe.from_json(row["json"]).site for row in rows}
    layers = sorted({int(v) for row in rows for v in row["layers"]})
    trace_attrs = json.loads(one.attrs["trace_attrs"])
    classes = tuple(int(c) for c in one["target_class"].values if int(c) >= 0)
    names = [str(v) for v in one["target_label"].values] if "target_label" in one.variables else []
    labels = {c: (names[k] if k < len(names) and names[k] else str(c))
              for k, c in enumerate(int(v) for v in one["target_class"].values) if c >= 0}
    logits = np.asarray(one["logits"].values, dtype=np.float64)
    image = np.full((int(one.attrs["img_height"]), int(one.attrs["img_width"]), 3), GREY, np.uint8)
    return TraceFacts(sites=tuple(s for s in SITES if s in stored), layers=tuple(layers),
                      num_layers=int(one.attrs["num_layers"]), num_heads=int(trace_attrs.get("num_heads", 1)),
                      classes=classes, labels=labels,
                      ranked=tuple(int(c) for c in np.argsort(-logits, kind="stable")), image=image)


def store_controls(one: xr.Dataset, facts: TraceFacts) -> dict[str, Any]:
    """The Explorer's control table cut to what the store holds: each field's values those its recipes take
    (every upsampling), the layer control its recipes' blocks, the presets those it holds.

    Example:
        >>> [f["values"] for f in store_controls(one, store_facts(one))["fields"] if f["name"] == "weighting"]
        ... # doctest: +SKIP
        [[['layercam', 'layercam']]]
    """
    recipes = stored_recipes(one)
    table = controls(facts)
    for field in table["fields"]:
        name = field["name"]
        if "values" not in field or name == "upsample":  # any upsampling is applied on read
            continue
        taken = {json.dumps(getattr(r, name)) for r in recipes}
        field["values"] = [pair for pair in field["values"] if json.dumps(pair[0]) in taken]
    held = {r.replace(upsample="none").id for r in recipes}
    table["presets"] = [row for row in table["presets"]
                        if Recipe.from_dict(row[2]).replace(upsample="none").id in held]
    return table


def display_trace(one: xr.Dataset, facts: TraceFacts) -> xr.Dataset:
    """What a map is overlaid on (``vc.plot.overlay``): the grey image, with the image's trace id.

    Example:
        >>> display_trace(one, store_facts(one))["image"].shape  # doctest: +SKIP
        (32, 32, 3)
    """
    return xr.Dataset({"image": (("y", "x", "rgb"), facts.image)}, attrs={"trace_id": str(one["trace_id"].values)})



def read_image(store: xr.Dataset, i: int) -> xr.Dataset:
    """Image ``i`` of a trace store (its trace) or of a map store (its maps).

    Example:
        >>> read_image(vc.open_maps("maps.zarr"), 0)["maps"].dims  # doctest: +SKIP
        ('recipe', 'gy', 'gx')
    """
    return image_maps(store, i) if is_map_store(store) else image_trace(store, i)


def explorer_view(trace: xr.Dataset) -> tuple[TraceFacts, dict[str, Any], Recipe]:
    """The Explorer's facts, control table and first recipe for a trace, or for one image of a map store (its
    controls offer only what it holds; it starts at its first recipe).

    Example:
        >>> facts, table, start = explorer_view(vc.image_maps(ds, 0))  # doctest: +SKIP
        >>> start.site  # doctest: +SKIP
        'F4'
    """
    if is_map_store(trace):
        facts = store_facts(trace)
        return facts, store_controls(trace, facts), stored_recipes(trace)[0]
    facts = TraceFacts.of(trace)
    return facts, controls(facts), default_recipe(facts)
