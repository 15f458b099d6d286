"""Write the map-store fixtures the reader contract test reads (tests/unit/compute/test_map_store_old_vlm.py): two
``vc.map_many`` stores written by vitcam_nb at commit 64cc51f, before map stores held crop or LM-grid arrays, and
what that version's reader gave on them.

Run once, with that commit's code first on the path (its tree exported, e.g. ``git archive 64cc51f vitcam_nb tests
| tar -x -C /tmp/old``), from the repository root::

    PYTHONPATH=/tmp/old python tests/data/maps_v1/make_fixtures.py

It writes, next to this file:

* ``vit.zarr``: a store of a seeded tiny timm ViT (2 images, 3 recipes: one block, a fused mean, a rollout);
* ``llava.zarr``: an answer store of the tiny LLaVA of tests/unit/model/test_vlm_llava.py (2 images, one answer
  target each; a tower recipe and two LM-site recipes on the tower's grid, one of them fused);
* ``expected.npz`` + ``expected.json``: each stored map as that version's ``vc.cam`` read it (per image and for the
  whole store), with its checklist, methods, degeneracy and ids.

The script is kept for provenance only: rerunning it with a later version would test that version against itself.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import timm
import torch

import vitcam_nb as vc

HERE = Path(__file__).parent
VIT_RECIPES = [vc.Recipe(site="F1", layer=1), vc.Recipe(site="F4", layer=(0, 1), layer_fusion="mean"),
               vc.Recipe(site="F2", layer="all", layer_fusion="rollout")]
LLAVA_RECIPES = [vc.Recipe(site="F1", layer=1, class_=0), vc.Recipe(site="lm_resid", layer=-1, class_=1),
                 vc.Recipe(site="lm_resid", layer="all", layer_fusion="max", class_=2, relu="none")]


def vit_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2).eval()


def vit_images() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)


def llava_case() -> tuple:
    sys.path.insert(0, str(HERE.parents[1] / "unit" / "model"))
    sys.path.insert(0, str(HERE.parents[1]))
    from test_vlm_llava import PROMPT, make_llava, make_x

    targets = [vc.targets.answer(input_ids=PROMPT, answer_ids=a) for a in ([9, 10, 11], [12, 13, 14])]
    return make_llava(), [make_x(1), make_x(2)], targets


def _read(path: Path, recipes: list, out: dict, arrays: dict, name: str) -> None:
    ds = vc.open_maps(path)
    for r in recipes:
        r = vc.Recipe.parse(r) if isinstance(r, str) else r
        for i in range(ds.sizes["image"]):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m = vc.cam(vc.image_maps(ds, i), r)
            key = f"{name}/{r.id}/{i}"
            arrays[key] = m.values
            out[key] = {k: str(m.attrs[k]) for k in ("checklist", "methods", "degenerate", "recipe_id", "trace_id")}
            out[key]["dims"] = list(m.dims)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            whole = vc.cam(ds, r)
        arrays[f"{name}/{r.id}/all"] = whole.values
        out[f"{name}/{r.id}/all"] = {"dims": list(whole.dims)}


def main() -> None:
    out: dict = {"version": vc.__version__, "vit_recipes": [r.to_json() for r in VIT_RECIPES],
                 "llava_recipes": [r.to_json() for r in LLAVA_RECIPES]}
    arrays: dict = {}
    vc.map_many(vit_model(), vit_images(), VIT_RECIPES, HERE / "vit.zarr", batch_size=2, progress=False)
    _read(HERE / "vit.zarr", VIT_RECIPES, out, arrays, "vit")
    model, images, targets = llava_case()
    vc.map_many(model, images, LLAVA_RECIPES, HERE / "llava.zarr", targets=targets, batch_size=2, progress=False)
    _read(HERE / "llava.zarr", LLAVA_RECIPES, out, arrays, "llava")
    np.savez_compressed(HERE / "expected.npz", **arrays)
    (HERE / "expected.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
