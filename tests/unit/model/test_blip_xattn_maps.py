"""BLIP cross-attention maps in use (issue #9): the checklist names the site, module, text tokens and heads; a text
row without gradient gives a degenerate map; a saved trace, a float16 trace and other head counts give the same
maps; the gallery and the Explorer vary the ``xattn`` layer and the text tokens. The model and its text are
``test_blip.py``'s."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from test_blip import hand_map, itm_target, make_blip, make_x
from vitcam_testing import assert_rel_close

import vitcam_nb as vc

transformers = pytest.importorskip("transformers")


# --------------------------------------------------------------------------------------------------
# the checklist, and a text row without gradient


def test_xattn_checklist_names_site_module_tokens_and_heads(blip_trace):
    import json

    r = vc.Recipe(site="xattn", layer=0, class_=1, text_tokens="dog", weighting="layercam",
                  heads="mean_then_relu")
    m = vc.cam(blip_trace, r)
    assert set(m.attrs) == {"recipe", "recipe_id", "trace_id", "checklist", "methods", "degenerate",
                            "degenerate_cause", "degenerate_layers"}
    assert m.attrs["recipe_id"] == r.id and m.attrs["trace_id"] == blip_trace.attrs["trace_id"]
    c = json.loads(m.attrs["checklist"])
    fr = c["feature representation"]
    assert fr["site"].startswith("xattn")
    assert fr["module"] == "text_encoder.encoder.layer.0.crossattention.self.dropout"
    assert fr["input or output"] == "output" and "cross-attention layer 0 of 0..1" in fr["layer"]
    assert "'dog'" in c["token handling"]["text tokens"] and "position(s) 2" in c["token handling"]["text tokens"]
    assert c["aggregation"]["heads"].startswith("2 cross-attention heads; mean_then_relu")
    assert "crossattention" in m.attrs["methods"] and "'dog'" in m.attrs["methods"]


def test_xattn_degenerate_row_is_zeros_with_warning(blip_trace):
    """At the last text layer only the first row reaches the ITM head: another row has no gradient."""
    r = vc.Recipe(site="xattn", layer=-1, class_=1, text_tokens="dog", weighting="layercam")
    with pytest.warns(vc.DegenerateMapWarning, match="cross-attention rows"):
        m = vc.cam(blip_trace, r)
    assert np.all(m.values == 0) and "only the first text token" in m.attrs["degenerate"]
    # fused over both layers, the good layer is kept and the degenerate one reported
    with warnings.catch_warnings():
        warnings.simplefilter("error", vc.DegenerateMapWarning)
        fused = vc.cam(blip_trace, r.replace(layer="all", layer_fusion="max"))
    assert fused.values.max() == 1.0 and fused.attrs["degenerate_layers"].startswith("cross-attention layer 1")


# --------------------------------------------------------------------------------------------------
# storage and other layouts


def test_saved_trace_gives_the_same_xattn_map(blip, blip_trace, tmp_path):
    r = vc.Recipe(site="xattn", layer=0, class_=1, text_tokens="a", weighting="layercam", heads="mean_then_relu")
    back = vc.load(vc.save(blip_trace, tmp_path / "blip.nc"))
    assert list(back["text_token_str"].values) == list(blip_trace["text_token_str"].values)
    np.testing.assert_array_equal(vc.cam(back, r).values, vc.cam(blip_trace, r).values)
    half = vc.trace(blip, make_x(), targets=itm_target(), sites=["xattn"], dtype="float16")
    assert half["xattn"].dtype == np.float16
    np.testing.assert_allclose(vc.cam(half, r).values, vc.cam(blip_trace, r).values, atol=2e-2)


def test_different_head_counts_get_their_own_xattn_head_dimension():
    """BLIP-large has 16 vision heads but 12 text heads: F2's "head" and the cross-attention's must not clash."""
    model = make_blip()
    cfg = model.config
    cfg.vision_config.num_attention_heads = 4
    wide = transformers.BlipForImageTextRetrieval(cfg).eval()
    tr = vc.trace(wide, make_x(), targets=itm_target(), sites=["F2", "xattn"])
    assert tr.sizes["head"] == 4 and tr.sizes["xattn_head"] == 2
    assert tr["xattn"].dims == ("xattn_layer", "xattn_head", "text_token", "key")
    A, G = tr["xattn"].values[0, :, 2], tr["xattn_grad"].sel(target="logit_1").values[0, :, 2]
    m = vc.cam(tr, vc.Recipe(site="xattn", layer=0, class_=1, text_tokens=2, weighting="layercam",
                             upsample="none", normalize="none", relu="none"))
    assert_rel_close(m.values, hand_map(A, G, "layercam", "channels", "none"), "xattn_head map")


def test_gallery_varies_xattn_layers_and_text_tokens(blip_trace):
    base = vc.Recipe(site="xattn", layer=0, class_=1, weighting="layercam")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        g = vc.gallery(blip_trace, base, vary={"layer": "all", "text_tokens": ["cls", 2]})
        one = vc.cam(blip_trace, base.replace(layer=1, text_tokens=2))
    assert g.dims == ("layer", "text_tokens", "y", "x") and g.shape[:2] == (2, 2)
    np.testing.assert_array_equal(g.sel(layer=1).values[1], one.values)
    assert g.recipe_id.values[1, 1] == one.attrs["recipe_id"]


def test_explorer_offers_xattn_and_text_tokens(blip_trace):
    import json

    from vitcam_nb.widgets.encoding import grid_bytes

    ex = vc.Explorer(blip_trace, vc.Recipe(site="F1", layer=0, class_=1))
    spec = {f["name"]: f for f in ex.options["fields"]}
    assert "xattn" in [v for v, _ in spec["site"]["values"]]
    words = [str(v) for v in blip_trace["text_token_str"].values]
    assert [v for v, _ in spec["text_tokens"]["values"]] == ["all", "cls", *range(len(words))]
    assert spec["text_tokens"]["values"][3][1] == f"1 · {words[1]}"  # labels are inserted as text
    assert spec["text_tokens"]["when"] == [{"field": "site", "in": ["xattn"]}]
    draft = {**ex.recipe.to_dict(), "site": "xattn", "text_tokens": 2, "weighting": "layercam"}
    ex.set_state(json.loads(json.dumps({"request": {"id": 1, "recipe": draft,
                                                    "changed": ["site", "text_tokens", "weighting"]}})))
    want = vc.Recipe(site="xattn", layer=0, class_=1, text_tokens=2, weighting="layercam")
    assert ex.error == "" and ex.recipe == want
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        assert ex.grid == grid_bytes(vc.cam(blip_trace, want, grid=True).values)
    draft = {**ex.recipe.to_dict(), "site": "F1", "text_tokens": 2}  # hidden control goes back to its default
    ex.set_state({"request": {"id": 2, "recipe": draft, "changed": ["site"]}})
    assert ex.recipe == vc.Recipe(site="F1", layer=0, class_=1, weighting="layercam")
