"""Traces of the flat-layout families in use (issue #8): every plain preset gives a finite map and the trace
leaves the model unchanged, the adapters' facts (``describe``), the EVA and BEiT sites rebuilt from the weights,
and CLIP image towers traced for similarity targets, against the independent reference."""

from __future__ import annotations

import copy
import json
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flat_families import FAMILIES, PRE_NORM, SIM_VECTORS, Family, make_input
from flat_reference import family_run, reference, scalar_for
from torch import nn
from vitcam_testing import assert_rel_close, assert_unchanged, plain_presets, snapshot, traced

import vitcam_nb as vc
from vitcam_nb import presets

# --------------------------------------------------------------------------------------------------
# 3. Presets, model state, adapter facts


@pytest.mark.parametrize("label", list(FAMILIES))
def test_presets_finite_and_model_unchanged(label):
    fam = FAMILIES[label]
    _, _, tr, _, _, before, after = family_run(label)
    for key in before:
        assert after[key] == before[key], f"{label}: model state {key!r} changed by the trace"
    first_token_site = next(s for s in fam.core_sites if s != "F2")
    h, w = fam.input_hw
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        for name in plain_presets():
            recipe = presets.get(name)
            if recipe.layer_fusion != "rollout":  # top1 may not be traced; rollout has no class at all
                recipe = recipe.replace(class_=int(tr["target_class"].values[0]))
            if recipe.site not in fam.sites:  # e.g. F1 of a post-norm model: refused, then another site
                with pytest.raises(vc.RecipeError, match="^site"):
                    vc.cam(tr, recipe)
                recipe = recipe.replace(site=first_token_site)
            if recipe.site == "F2" and recipe.attn_rows == "cls" and "cls" not in fam.prefix:
                with pytest.raises(vc.RecipeError, match="^attn_rows='cls'"):
                    vc.cam(tr, recipe)
                recipe = recipe.replace(attn_rows="mean")
            m = vc.cam(tr, recipe)
            assert m.shape == (h, w), f"{label} {name}: shape {m.shape}"
            assert np.isfinite(m.values).all(), f"{label} {name}: non-finite map"


@pytest.mark.parametrize(("label", "family", "encoding"), [
    ("beit", "beit", "relative position bias"),
    ("beit_shared_bias", "beit", "absolute + shared relative position bias"),
    ("eva02", "eva", "absolute + rope"),
    ("eva_postnorm", "eva", "absolute"),
    ("eva_rope_registers", "eva", "rope"),
    ("dinov2", "vit", "absolute"),
])
def test_describe_facts(label, family, encoding):
    fam = FAMILIES[label]
    model, _, tr, _, _, _, _ = family_run(label)
    blk = getattr(model, fam.block_list)[0]
    assert tr.attrs["model_family"] == family
    assert tr.attrs["position_encoding"] == encoding
    assert tr.attrs["num_heads"] == 4 and tr.attrs["head_dim"] == 8 and tr.attrs["embed_dim"] == 32
    assert tr.attrs["patch_size"] == fam.patch
    assert tr.attrs["num_heads"] == tr["attn"].sizes["head"] == blk.attn.num_heads
    assert tr.attrs["global_pool"] == (model.global_pool or "none")
    if family == "eva":
        assert tr.attrs["block_norm"] == ("post-norm" if label == "eva_postnorm" else "pre-norm")
    for k, v in tr.attrs.items():
        assert isinstance(v, (str, int, float)) and not isinstance(v, bool), f"attr {k} is {type(v)}"


@torch.no_grad()  # rebuilt from the weights: no autograd wanted
def test_eva_sub_layernorm_and_f3_meaning():
    """EVA-02 CLIP blocks have a sub-LayerNorm (attn.norm) between the heads and attn.proj: F3 is the raw head
    concatenation, rebuilt here from F2 and the value projection, and attn_out = proj(norm(F3))."""
    model, _, tr, _, _, _, _ = family_run("eva02_clip")
    for layer, blk in enumerate(model.blocks):
        attn = blk.attn
        assert not isinstance(attn.norm, nn.Identity) and tr.attrs["attn_sub_norm"] == 1
        f1 = torch.from_numpy(traced(tr, "F1", layer)).double()
        a = torch.from_numpy(traced(tr, "F2", layer)).double()
        v = F.linear(f1, attn.v_proj.weight.double(), attn.v_proj.bias.double())
        n, h = f1.shape[0], attn.num_heads
        f3 = (a @ v.reshape(n, h, -1).transpose(0, 1)).transpose(0, 1).reshape(n, -1)
        assert_rel_close(traced(tr, "F3", layer), f3, f"F3@{layer}")
        normed = F.layer_norm(f3, (f3.shape[-1],), attn.norm.weight.double(), attn.norm.bias.double(),
                              attn.norm.eps)
        out = F.linear(normed, attn.proj.weight.double(), attn.proj.bias.double())
        assert_rel_close(traced(tr, "attn_out", layer), out, f"attn_out@{layer}")
        np.testing.assert_allclose(traced(tr, "F2", layer).sum(-1), 1.0, atol=1e-5)


@torch.no_grad()  # rebuilt from the weights: no autograd wanted
def test_eva_postnorm_residuals():
    """Post-norm: F6 = resid_mid + norm2(F5) and resid_mid = resid_pre + norm1(attn_out)."""
    model, _, tr, _, _, _, _ = family_run("eva_postnorm")
    for layer, blk in enumerate(model.blocks):
        def t(site, layer=layer):
            return torch.from_numpy(traced(tr, site, layer)).double()

        def ln(norm, v):
            return F.layer_norm(v, (v.shape[-1],), norm.weight.double(), norm.bias.double(), norm.eps)

        assert_rel_close(t("resid_mid"), t("resid_pre") + ln(blk.norm1, t("attn_out")), f"resid_mid@{layer}")
        assert_rel_close(t("F6"), t("resid_mid") + ln(blk.norm2, t("F5")), f"F6@{layer}")


@torch.no_grad()  # rebuilt from the weights: no autograd wanted
def test_beit_attention_includes_the_relative_bias():
    """F2 of BEiT is softmax(q k^T / sqrt(d) + relative position bias), rebuilt from F1 and the weights."""
    model, _, tr, _, _, _, _ = family_run("beit")
    for layer, blk in enumerate(model.blocks):
        attn = blk.attn
        f1 = torch.from_numpy(traced(tr, "F1", layer)).double()
        bias = torch.cat([attn.q_bias, attn.k_bias, attn.v_bias]).double()
        n, h = f1.shape[0], attn.num_heads
        q, k, _ = F.linear(f1, attn.qkv.weight.double(), bias).reshape(n, 3, h, -1).permute(1, 2, 0, 3)
        table, index = attn.relative_position_bias_table.double(), attn.relative_position_index
        rel = table[index.reshape(-1)].reshape(n, n, h).permute(2, 0, 1)
        expected = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + rel, dim=-1)
        assert_rel_close(traced(tr, "F2", layer), expected, f"F2@{layer}")


# --------------------------------------------------------------------------------------------------
# 5. CLIP image towers: similarity targets


@pytest.mark.parametrize(("metric", "scale"), [("cosine", 10.0), ("dot", 0.5)])
def test_clip_similarity_logits_and_gradients(metric, scale):
    fam = FAMILIES["clip_timm"]
    model, x = fam.build(), make_input(fam, seed=1)
    target = vc.targets.similarity(SIM_VECTORS.numpy(), ["a", "b", "c"], metric=metric, scale=scale)
    tr = vc.trace(model, x, targets=target, sites=["F1", "F2", "F6"])

    def scores(out):
        e = out[0].double()
        v = SIM_VECTORS.double()
        return scale * (v @ e / (v.norm(dim=1) * e.norm()) if metric == "cosine" else v @ e)

    with torch.no_grad():
        expected = scores(copy.deepcopy(model)(x)).numpy()
    assert_rel_close(tr["logits"].values, expected, "similarities")
    assert list(tr["class_label"].values) == ["a", "b", "c"]
    assert tr.attrs["target_kind"] == "similarity" and tr.attrs["similarity_metric"] == metric
    fam = Family("clip", lambda: model, fam.input_hw, 8, (4, 4), ("cls",),
                 {s: PRE_NORM[s] for s in ("F1", "F2", "F6")}, scores=lambda out: scores(out).float())
    for target_name, c in zip(tr["target"].values, tr["target_class"].values, strict=True):
        ref, _ = reference(fam, model, x, scalar_for(int(c)))
        for layer in (0, 1):
            for site in ("F1", "F2", "F6"):
                assert_rel_close(traced(tr, site, layer, str(target_name)), ref[(layer, site)][1],
                                 f"{metric} grad {site}@{layer} {target_name}")


def test_clip_class_targets_refused_and_checklist_names_similarity():
    fam = FAMILIES["clip_timm"]
    model, x = fam.build(), make_input(fam)
    before = snapshot(model)
    with pytest.raises(vc.TraceError, match="num_classes=0.*similarity"):
        vc.trace(model, x, targets="top5")
    assert_unchanged(before, model)
    _, _, tr, _, _, _, _ = family_run("clip_timm")
    checklist = json.loads(vc.cam(tr, vc.Recipe()).attrs["checklist"])
    scores = checklist["gradient target"]["scores"]
    assert "cosine similarity" in scores and "3 given vectors" in scores and "times 10" in scores
