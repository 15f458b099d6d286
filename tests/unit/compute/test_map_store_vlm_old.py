"""Map stores written before stores held crop or LM-grid arrays still read exactly as they did (the store's schema is
a contract: arrays were added, none renamed). The fixtures in tests/data/maps_v1 were written by vitcam_nb at commit
64cc51f (make_fixtures.py there): a plain ViT store (one block, a fused mean, a rollout) and a tiny LLaVA answer
store (a tower recipe and LM-site recipes on the tower's grid), with each map as that version's ``vc.cam`` read it.
Reading them now gives the same dims, checklists, methods, degeneracy and ids, and the same values within 1e-6: the
stored token-grid maps are read as they are, but their bilinear upsampling on reading is a matrix product, which
another CPU's BLAS kernel may round differently from the one that wrote expected.npz."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

import vitcam_nb as vc

HERE = Path(__file__).resolve().parents[2] / "data" / "maps_v1"
EXPECTED = json.loads((HERE / "expected.json").read_text())


def _recipes(name: str) -> list[vc.Recipe]:
    return [vc.Recipe.from_json(j) for j in EXPECTED[f"{name}_recipes"]]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Copies of the fixtures (reading writes nothing, but a test never risks the committed files)."""
    out = {}
    for name in ("vit", "llava"):
        out[name] = tmp_path_factory.mktemp(name) / f"{name}.zarr"
        shutil.copytree(HERE / f"{name}.zarr", out[name])
    return out


@pytest.mark.parametrize("name", ["vit", "llava"])
def test_an_old_store_reads_as_it_did(stores, name):
    if name == "llava":
        pytest.importorskip("transformers")
    expected = np.load(HERE / "expected.npz")
    ds = vc.open_maps(stores[name])
    # the old layout: none of the arrays or table keys a crops or LM-grid store adds
    assert not {"lm_maps", "lm_parts", "lm_part_reason"} & set(ds.variables)
    assert "crop" not in ds.dims and "crop_dim" not in ds.attrs
    assert all("grid" not in row for row in json.loads(ds.attrs["recipes"]))
    for r in _recipes(name):
        for i in range(ds.sizes["image"]):
            key = f"{name}/{r.id}/{i}"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", vc.DegenerateMapWarning)
                m = vc.cam(vc.image_maps(ds, i), r)
            np.testing.assert_allclose(m.values, expected[key], rtol=0, atol=1e-6)  # NaN where it was NaN
            assert list(m.dims) == EXPECTED[key]["dims"]
            for k in ("checklist", "methods", "degenerate", "recipe_id", "trace_id"):
                assert str(m.attrs[k]) == EXPECTED[key][k], (key, k)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", vc.DegenerateMapWarning)
            whole = vc.cam(ds, r)
        np.testing.assert_allclose(whole.values, expected[f"{name}/{r.id}/all"], rtol=0, atol=1e-6)
        assert list(whole.dims) == EXPECTED[f"{name}/{r.id}/all"]["dims"]
