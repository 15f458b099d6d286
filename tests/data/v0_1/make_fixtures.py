"""Write the 0.1 fixtures the contract tests read: files and ids written by vitcam_nb 0.1 and its public API.

Run once, at the last 0.1 commit (e4ec999), from the repository root::

    python tests/data/v0_1/make_fixtures.py [--api-only]

It writes, next to this file:

* ``api.json``: every public name of the 0.1 API (``vitcam_nb.__all__`` and the namespaces users import
  from) with its ``inspect.signature`` text, and the public methods of the public classes;
* ``flat.nc``: a trace of the bundled ``shapes-vit`` (sites F1, F2, F4, two layers, top-2, float16);
* ``swin.nc``: a hierarchical (DataTree) trace of a tiny seeded Swin;
* ``store.zarr``: a ``trace_many`` store of two shapes images;
* ``expected.json`` + ``expected.npz``: trace ids, recipe ids and maps that 0.1 computed from those files.

The files are small on purpose (about 1 MB together); the script is kept for provenance only: rerunning
it with a later version would test that version against itself.
"""

from __future__ import annotations

import inspect
import json
import sys
import warnings
from pathlib import Path

import numpy as np
import timm
import torch

import vitcam_nb as vc

HERE = Path(__file__).parent
NAMESPACES = {
    "vitcam_nb": None,
    "vitcam_nb.adapters": None,
    "vitcam_nb.data": None,
    "vitcam_nb.evaluate": None,
    "vitcam_nb.widgets": None,
    "vitcam_nb.plot": ["overlay", "grid"],
    "vitcam_nb.presets": ["CITATIONS", "PRESETS", "citation", "get", "names", "pytorch_grad_cam_vit", "gradcam",
                          "hirescam", "gradcam_elementwise", "gradcampp", "xgradcam", "layercam", "eigencam",
                          "eigengradcam", "chefer_attention_gradcam", "attention_rollout", "gradient_rollout",
                          "legrad_style"],
    "vitcam_nb.stages": ["stage_dataset", "global_layer", "window_to_dense"],
    "vitcam_nb.targets": ["Target", "ClassTargets", "Similarity", "similarity", "similarity_scores", "as_target",
                          "prompts", "itm"],
    "vitcam_nb.preprocess": ["PreparedInput", "data_config", "prepare_input", "preprocessing_json"],
}
CLASSES = ["Recipe", "Checklist", "Explorer", "Gallery", "Compare", "Adapter", "SiteSpec", "Target",
           "ClassTargets", "Similarity"]


def parameters(obj: object) -> list | None:
    """[name, kind, default] of every parameter (annotations left out: they document, they do not bind)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return [[p.name, p.kind.name, None if p.default is inspect.Parameter.empty else repr(p.default)]
            for p in sig.parameters.values()]


def _kind(obj: object) -> str:
    if inspect.isclass(obj):
        return "class"
    if inspect.ismodule(obj):
        return "module"
    if callable(obj):
        return "function"
    return "value"


def api_snapshot() -> dict:
    import importlib

    out: dict = {"names": {}, "classes": {}}
    for path, names in NAMESPACES.items():
        module = importlib.import_module(path)
        names = names or list(module.__all__)
        for name in names:
            obj = getattr(module, name)
            out["names"][f"{path}:{name}"] = {"kind": _kind(obj), "signature": parameters(obj)
                                              if _kind(obj) in ("class", "function") else None}
    for name in CLASSES:
        cls = getattr(vc, name, None) or getattr(vc.adapters, name, None) or getattr(vc.targets, name)
        members = {}
        for attr, value in vars(cls).items():
            if attr.startswith("_") and attr != "__init__":
                continue
            if isinstance(value, property):
                members[attr] = "property"
            elif isinstance(value, (classmethod, staticmethod)):
                members[attr] = parameters(value.__func__)
            elif inspect.isfunction(value):
                members[attr] = parameters(value)
        out["classes"][name] = members
    return out


def flat_trace():
    model = vc.load_model("shapes-vit")
    image = vc.sample_image("shapes", 0)
    return vc.trace(model, image, targets="top2", sites=["F1", "F2", "F4"], layers=[-2, -1], dtype="float16")


def swin_trace():
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1), num_heads=(2, 4),
                              embed_dim=16, img_size=28, window_size=7, num_classes=4).eval()
    image = np.random.default_rng(0).integers(0, 256, (28, 28, 3), dtype=np.uint8)
    return vc.trace(model, image, targets="top1", sites=["F1", "F2", "F3"])


RECIPES = {
    "default_last": vc.Recipe(site="F1", layer=-1),
    "f4_prob": vc.Recipe(site="F4", layer=-2, target="prob", class_="top2", weighting="layercam"),
    "f2_chefer": vc.presets.chefer_attention_gradcam(),
    "rollout": vc.Recipe(site="F2", layer="all", layer_fusion="rollout"),
    "f1_mean": vc.Recipe(site="F1", layer="all", layer_fusion="mean", weighting="hirescam"),
}
SWIN_RECIPES = {
    "stage_last": vc.Recipe(site="F3", layer="1.-1", upsample="none"),
    "across": vc.Recipe(site="F1", layer=(0, 1), layer_fusion="mean"),
    "window_f2": vc.Recipe(site="F2", layer=0, attn_rows="mean", upsample="none"),
}


def main() -> None:
    (HERE / "api.json").write_text(json.dumps(api_snapshot(), indent=1, sort_keys=True) + "\n")
    if "--api-only" in sys.argv:
        return
    warnings.simplefilter("ignore")
    flat, swin = flat_trace(), swin_trace()
    for path in ("flat.nc", "swin.nc"):
        (HERE / path).unlink(missing_ok=True)
    vc.save(flat, HERE / "flat.nc")
    vc.save(swin, HERE / "swin.nc")
    store = HERE / "store.zarr"
    images = [vc.sample_image("shapes", i) for i in range(2)]
    vc.trace_many(vc.load_model("shapes-vit"), images, store, targets="top1", sites=["F1"], layers=[-1],
                  dtype="float16", overwrite=True, progress=False)
    ds = vc.open_traces(store)
    maps, expected = {}, {"flat": {}, "swin": {}, "store": {}}
    expected["flat_trace_id"] = flat.attrs["trace_id"]
    expected["swin_trace_id"] = swin.attrs["trace_id"]
    expected["store_trace_ids"] = [str(v) for v in ds["trace_id"].values]
    for name, recipe in RECIPES.items():
        m = vc.cam(flat, recipe)
        maps[f"flat/{name}"] = m.values
        expected["flat"][name] = {"recipe": recipe.to_json(), "recipe_id": recipe.id, "methods": m.attrs["methods"],
                                  "checklist": m.attrs["checklist"], "degenerate": m.attrs["degenerate"]}
    for name, recipe in SWIN_RECIPES.items():
        m = vc.cam(swin, recipe)
        maps[f"swin/{name}"] = m.values
        expected["swin"][name] = {"recipe": recipe.to_json(), "recipe_id": recipe.id,
                                  "checklist": m.attrs["checklist"]}
    store_recipe = vc.Recipe(site="F1", layer=-1, upsample="none")
    maps["store/default"] = vc.cam(ds, store_recipe).values
    expected["store"]["default"] = {"recipe": store_recipe.to_json(), "recipe_id": store_recipe.id}
    g = vc.gallery(flat, vc.Recipe(), vary={"layer": "all", "site": ["F1", "F4"]})
    maps["flat/gallery"] = g.values
    expected["flat"]["gallery_ids"] = g["recipe_id"].values.tolist()
    np.savez_compressed(HERE / "expected.npz", **maps)
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
