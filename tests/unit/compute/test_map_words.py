"""The checklist and methods paragraph say in words what the map shows, carry the raster caveat, and quote the
position probe (vc.evaluate.position_probe) when the trace holds one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr
from timm.models.vision_transformer import VisionTransformer

import vitcam_nb as vc
from vitcam_nb.compute.report import RASTER_CAVEAT, map_words
from vitcam_nb.core.schema import SITE_MEANINGS

pytestmark = pytest.mark.filterwarnings("ignore::vitcam_nb.DegenerateMapWarning")
CAVEAT = ("Tokens are placed on the grid in raster order (patch_row, patch_col): this assumes each token still stands "
          "for its own patch, which may not hold in deep layers where attention mixes tokens")
SITES = ["F1", "F2", "F3", "F4", "F5", "F6", "resid_pre", "attn_out", "resid_mid"]
V0_1 = Path(__file__).resolve().parents[2] / "data" / "v0_1" / "flat.nc"


@pytest.fixture(scope="module")
def tr() -> xr.Dataset:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=4).eval()
    return vc.trace(model, np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8), targets="top1",
                    sites=SITES)


def _report(tr, recipe) -> tuple[dict, str]:
    m = vc.cam(tr, recipe)
    return json.loads(m.attrs["checklist"]), m.attrs["methods"]


def test_each_site_says_in_words_what_its_map_is_and_carries_the_raster_caveat(tr):
    assert RASTER_CAVEAT == CAVEAT
    for site in SITES:
        checklist, methods = _report(tr, vc.Recipe(site=site, layer=-1))
        words = checklist["feature representation"]["what the map shows"]
        assert f"the {SITE_MEANINGS[site]} ({site})" in words, site
        assert words.startswith("attention weights x gradients: " if site == "F2" else "token activations x "
                                "gradients: "), site
        assert checklist["spatial reconstruction"]["raster order"] == CAVEAT, site
        assert f" What the map shows: {words}. {CAVEAT}." in methods, site
        assert "position probe" not in checklist["spatial reconstruction"] and "Position probe" not in methods


def test_the_words_of_a_few_sites_written_out():
    assert map_words(vc.Recipe(site="F1")) == (
        "token activations x gradients: the LayerNorm output before attention (F1) of each patch token, combined "
        "over channels with weights from the target's gradients")
    assert map_words(vc.Recipe(site="F2", attn_rows="mean")) == (
        "attention weights x gradients: the softmax attention per head (F2); a patch's value comes from the "
        "attention its token receives as a key from the mean over all query rows, combined over heads with weights "
        "from the target's gradients")
    assert map_words(vc.Recipe(site="xattn")).startswith(
        "cross-modal interaction x gradients: the cross-attention of text queries over image keys (xattn), per head")
    assert map_words(vc.Recipe(site="F1", weighting="eigencam")).endswith("combined over channels without gradients")
    assert map_words(vc.Recipe(site="F4", weighting="scorecam")).endswith(
        "with weights from the model's scores of perturbed inputs (vc.score)")
    assert map_words(vc.Recipe(site="F2", layer="all", layer_fusion="rollout")).startswith(
        "attention weights: the softmax attention per head (F2) of each listed block, chained over the blocks by the "
        "rollout")


def test_a_recipe_without_a_trace_is_described_too():
    checklist = vc.Recipe(site="F6").checklist()
    assert checklist["feature representation"]["what the map shows"].startswith(
        "token activations x gradients: the residual stream after the block (F6)")
    assert _before_recipe_line(vc.Recipe().describe()).endswith(f"{CAVEAT}.")


def test_a_0_1_file_keeps_its_0_1_report_and_a_newer_trace_gets_the_words():
    old = vc.load(V0_1)
    checklist, methods = _report(old, vc.Recipe())
    assert "what the map shows" not in checklist["feature representation"] and CAVEAT not in methods
    newer = old.copy()
    newer.attrs = {**old.attrs, "vitcam_nb_version": "0.2.0"}
    checklist, methods = _report(newer, vc.Recipe())
    assert checklist["spatial reconstruction"]["raster order"] == CAVEAT
    assert _before_recipe_line(methods).endswith(f"{CAVEAT}.")


def _with_probe(tr, values: dict, *, trace_id: str | None = None) -> xr.Dataset:
    sites, layers = sorted({s for s, _ in values}), sorted({v for _, v in values})
    data = np.full((len(sites), len(layers)), np.nan)
    for (s, v), r in values.items():
        data[sites.index(s), layers.index(v)] = r
    probe = xr.DataArray(data, dims=("site", "layer"), coords={"site": sites, "layer": layers}, name="position_r2",
                         attrs={"folds": 5, "seed": 0, "trace_id": tr.attrs["trace_id"] if trace_id is None
                                else trace_id})
    out = tr.copy()
    out["position_r2"] = probe
    return out


def _before_recipe_line(methods: str) -> str:
    """The paragraph without its last sentence, the recipe as text (tests/unit/face/test_report_reproduce.py)."""
    head, sep, _ = methods.rpartition(" Recipe as text: ")
    assert sep, methods
    return head


def test_the_probe_is_quoted_for_the_maps_site_and_block(tr):
    probed = _with_probe(tr, {("F1", 0): 0.93, ("F1", 1): 0.12, ("F4", 1): 0.6})
    head = "a ridge probe (vc.evaluate.position_probe, 5-fold CV over patch tokens) predicts each token's grid position"
    checklist, methods = _report(probed, vc.Recipe(site="F1", layer=0))
    assert checklist["spatial reconstruction"]["position probe"] == (
        f"{head} from its F1 activations with R^2 = 0.93 (block 0): the positions are linearly recoverable from "
        "these features, as raster order needs")
    assert _before_recipe_line(methods).endswith(
        f"{CAVEAT}. Position probe: {checklist['spatial reconstruction']['position probe']}.")
    low = _report(probed, vc.Recipe(site="F1", layer=-1))[0]["spatial reconstruction"]["position probe"]
    assert low.endswith("R^2 = 0.12 (block 1): the positions are not linearly recoverable from these features; the "
                        "raster reshape is an assumption here")
    middle = _report(probed, vc.Recipe(site="F4", layer=1))[0]["spatial reconstruction"]["position probe"]
    assert middle.endswith("R^2 = 0.60 (block 1): the positions are only partly recoverable from these features; "
                           "read the raster reshape with care")
    both = _report(probed, vc.Recipe(site="F1", layer="all", layer_fusion="mean"))[0]
    assert "R^2 = 0.93 (block 0), 0.12 (block 1): the positions are not linearly" in \
        both["spatial reconstruction"]["position probe"]  # the verdict follows the weakest block
    for recipe in (vc.Recipe(site="F2", layer=0), vc.Recipe(site="F4", layer=0), vc.Recipe(site="F6", layer=0)):
        assert "position probe" not in _report(probed, recipe)[0]["spatial reconstruction"]  # not probed: silent


def test_a_probe_of_another_trace_is_not_quoted(tr):
    foreign = _with_probe(tr, {("F1", 1): 0.99}, trace_id="0123456789abcdef")
    text = _report(foreign, vc.Recipe(site="F1"))[0]["spatial reconstruction"]["position probe"]
    assert text == "not quoted: the trace's position_r2 was computed on another trace (0123456789abcdef)"


def test_the_report_cache_sees_a_new_probe(tr):
    plain = vc.cam(tr, vc.Recipe()).attrs["methods"]
    high = vc.cam(_with_probe(tr, {("F1", 1): 0.95}), vc.Recipe()).attrs["methods"]
    low = vc.cam(_with_probe(tr, {("F1", 1): 0.05}), vc.Recipe()).attrs["methods"]
    assert "Position probe" not in plain and "R^2 = 0.95" in high and "R^2 = 0.05" in low


def test_a_measured_probe_survives_save_and_load_and_is_quoted(tr, tmp_path):
    probe = vc.evaluate.position_probe(tr, sites=["F1"])
    stored = tr.copy()
    stored["position_r2"] = probe
    back = vc.load(vc.save(stored, tmp_path / "t.nc"))
    np.testing.assert_array_equal(back["position_r2"].sel(site="F1").values, probe.sel(site="F1").values)
    quoted = _report(back, vc.Recipe(site="F1", layer=-1))[0]["spatial reconstruction"]["position probe"]
    assert f"R^2 = {float(probe.sel(site='F1', layer=1)):.2f} (block 1)" in quoted
    np.testing.assert_array_equal(vc.cam(back, vc.Recipe()).values, vc.cam(tr, vc.Recipe()).values)
