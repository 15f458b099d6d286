"""Qwen2-VL and Qwen2.5-VL answers on tiny random models built in code (issue 55): every site's stored gradient
equals torch.autograd's from hooks on the family's own eager forward (the tower's packed tokens mapped to the image
by the tower's own rotary position ids and window index, not by the kit's cell map), Grad-CAM of an answer token
at a tower site and at ``lm_resid`` equals a hand-written reference, and the kit's explicit tower attention
computes what the model computes."""

from __future__ import annotations

import copy
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vitcam_testing import assert_rel_close  # noqa: E402
from vlm_marks import answer_gradients  # noqa: E402
from vlm_qwen_tiny import ANSWER, IMG, PROMPT, make_inputs, make_model  # noqa: E402

import vitcam_nb as vc  # noqa: E402

KINDS = ("qwen2", "qwen2_5")
TOWER = ("F1", "F2", "F3", "F4", "F5", "F6", "resid_pre", "attn_out", "resid_mid")
LM = ("projector", "lm_resid", "lm_attn")
GH, GW = 6, 10  # patches
POS = np.flatnonzero(np.asarray(PROMPT) == IMG)


@pytest.fixture(scope="module", params=KINDS)
def case(request):
    model = make_model(request.param)
    pv, thw, img = make_inputs()
    tr = vc.trace(model, pv, targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER,
                                                       model_kwargs={"image_grid_thw": thw}),
                  sites=list(TOWER + LM))
    return request.param, model, pv, thw, img, tr, reference(model, pv, thw)


# --------------------------------------------------------------------------------------------------
# the hand-written reference: hooks on an eager copy, the family's own eager attention recorded per chunk


def reference(model, pv, thw):
    """Activations and gradients (packed tower order; F2 per attention chunk), the entries, and each tower
    position's (row, col) patch from the tower's own position ids (Qwen2.5-VL: permuted by its window index)."""
    ref = copy.deepcopy(model)
    for cfg in (ref.config, ref.config.text_config, ref.config.vision_config):
        cfg._attn_implementation_internal = "eager"
    vis = ref.model.visual
    mod = sys.modules[type(vis).__module__]
    kept, handles, chunks, cells = {}, [], {}, {}
    attn_layer = {blk.attn: i for i, blk in enumerate(vis.blocks)}

    def batched(key):  # keep t[None] and let the model continue from it, so it is on the path to the output
        def hook(_m, _i, out):
            u = out[None]
            kept[key] = u
            return u[0]
        return hook

    def batched_in(key):
        def hook(_m, args):
            u = args[0][None]
            kept[key] = u
            return (u[0], *args[1:])
        return hook

    for i, blk in enumerate(vis.blocks):
        handles += [blk.norm1.register_forward_hook(batched((i, "F1"))),
                    blk.attn.proj.register_forward_pre_hook(batched_in((i, "F3"))),
                    blk.norm2.register_forward_hook(batched((i, "F4"))),
                    blk.mlp.register_forward_hook(batched((i, "F5"))),
                    blk.register_forward_hook(batched((i, "F6"))),
                    blk.register_forward_pre_hook(batched_in((i, "resid_pre"))),
                    blk.attn.register_forward_hook(batched((i, "attn_out"))),
                    # the stream itself (norm2 and the residual add both read it), no batch dimension
                    blk.norm2.register_forward_pre_hook(lambda _m, args, k=(i, "resid_mid"): kept.__setitem__(
                        k, args[0]))]
    handles.append(vis.merger.register_forward_hook(batched((0, "projector"))))
    handles.append(vis.rotary_pos_emb.register_forward_pre_hook(
        lambda _m, args: cells.__setitem__("pos", args[1].detach().clone())))
    for i, layer in enumerate(ref.model.language_model.layers):
        handles.append(layer.register_forward_pre_hook(
            lambda _m, args, kwargs, k=(i, "lm_resid"): kept.__setitem__(k, args[0] if args else
                                                                         kwargs["hidden_states"]), with_kwargs=True))
        handles.append(layer.self_attn.register_forward_hook(lambda _m, _i, o, k=(i, "lm_attn"): kept.__setitem__(
            k, o[1])))
    eager = mod.eager_attention_forward

    def recording(module, *args, **kwargs):  # the family's eager attention, its weights kept per tower chunk
        out, weights = eager(module, *args, **kwargs)
        if module in attn_layer:
            n = chunks.setdefault(attn_layer[module], 0)
            chunks[attn_layer[module]] = n + 1
            kept[(attn_layer[module], "F2", n)] = weights
        return out, weights

    seq = torch.tensor([PROMPT + ANSWER])
    mod.eager_attention_forward = recording
    try:
        logits = ref(input_ids=seq, pixel_values=pv.clone().requires_grad_(True), image_grid_thw=thw,
                     mm_token_type_ids=(seq == IMG).long(), attention_mask=torch.ones_like(seq),
                     use_cache=False).logits[0]
    finally:
        mod.eager_attention_forward = eager
        for h in handles:
            h.remove()
    acts, grads, z = answer_gradients(logits, len(PROMPT), ANSWER, kept,
                                      unbatched=tuple((i, "resid_mid") for i in range(len(vis.blocks))))
    pos = cells["pos"]
    if hasattr(vis, "permute_input_for_window_attn"):  # Qwen2.5-VL: the blocks see the window permutation
        from transformers.vision_utils import get_vision_window_index

        index, _ = get_vision_window_index(thw, vis.spatial_merge_size, vis.window_size, vis.patch_size)
        pos = vis.permute_input_for_window_attn(pos, index, pos.shape[0])
    raster = (pos[:, 0] * GW + pos[:, 1]).numpy()
    return acts, grads, z, raster, chunks


def to_raster(a, raster, axes=(-2,)):
    """A packed-order array put in raster order along ``axes`` (position p -> raster index raster[p])."""
    out = a
    for ax in axes:
        moved = np.zeros_like(out)
        idx = [slice(None)] * out.ndim
        idx[ax] = raster
        moved[tuple(idx)] = out
        out = moved
    return out


def f2_reference(acts, grads, chunks, layer, n):
    """The layer's block-diagonal attention (heads, N, N) and its gradients from the recorded chunks."""
    heads = acts[(layer, "F2", 0)].shape[0]
    a = np.zeros((heads, n, n), np.float32)
    g = np.zeros((grads[(layer, "F2", 0)].shape[0], heads, n, n), np.float32)
    s = 0
    for c in range(chunks[layer]):
        w = acts[(layer, "F2", c)]
        e = s + w.shape[-1]
        a[:, s:e, s:e], g[:, :, s:e, s:e] = w, grads[(layer, "F2", c)]
        s = e
    assert s == n
    return a, g


# --------------------------------------------------------------------------------------------------
# every stored gradient is torch.autograd's


def test_scores_are_the_family_forward_logits(case):
    kind, *_, tr, (acts, grads, z, raster, chunks) = case
    assert_rel_close(tr["logits"].values, z.numpy(), f"{kind} answer entries")
    assert tr.attrs["model_family"] == "hf_vlm_qwen"
    assert tr.attrs["vlm_family"] == {"qwen2": "qwen2_vl", "qwen2_5": "qwen2_5_vl"}[kind]
    assert (tr.sizes["token"], tr.attrs["grid_h"], tr.attrs["grid_w"]) == (GH * GW, GH, GW)
    # Qwen2.5-VL's windowed blocks attend in windows: more than one chunk; block 2 (full attention) one
    assert chunks[2] == 1 and chunks[0] == (1 if kind == "qwen2" else 6)


@pytest.mark.parametrize("site", TOWER)
def test_tower_site_gradients_equal_autograd(case, site):
    kind, *_, tr, (acts, grads, _, raster, chunks) = case
    for layer in range(3):
        if site == "F2":
            a, g = f2_reference(acts, grads, chunks, layer, GH * GW)
            a, g = to_raster(a, raster, (-2, -1)), to_raster(g, raster, (-2, -1))
            got_a, got_g = tr["attn"].values[layer], tr["attn_grad"].values[:, layer]
        else:
            a, g = to_raster(acts[(layer, site)], raster), to_raster(grads[(layer, site)], raster)
            si = list(tr["site"].values).index(site)
            got_a, got_g = tr["act"].values[layer, si], tr["grad"].values[:, layer, si]
        assert np.abs(g).max() > 0
        assert_rel_close(got_a, a, f"{kind} {site}@{layer}")
        assert_rel_close(got_g, g, f"{kind} {site}@{layer} grad")


def test_lm_site_gradients_equal_autograd_at_the_image_tokens(case):
    kind, *_, tr, (acts, grads, *_rest) = case
    np.testing.assert_array_equal(tr["image_token_pos"].values, POS)
    # the LM reads the merger's rows in raster order (Qwen2.5-VL: its window order undone); the reference's
    # merger output is in the tower's order, so its rows are matched to the LM's inputs by value
    lm_in = acts[(0, "lm_resid")][POS]
    proj = acts[(0, "projector")]
    rows = [int(np.argmin(np.abs(proj - v).sum(1))) for v in lm_in]
    assert sorted(rows) == list(range(len(POS))) and (kind == "qwen2") == (rows == sorted(rows))
    assert_rel_close(tr["projector"].values, proj[rows], f"{kind} projector")
    assert_rel_close(tr["projector_grad"].values, grads[(0, "projector")][:, rows], f"{kind} projector grad")
    answer_rows = np.arange(len(PROMPT), len(PROMPT) + len(ANSWER)) - 1
    for layer in range(2):
        assert_rel_close(tr["lm_resid"].values[layer], acts[(layer, "lm_resid")][POS], f"{kind} lm_resid@{layer}")
        g = grads[(layer, "lm_resid")][:, POS]
        assert np.abs(g).max() > 0
        assert_rel_close(tr["lm_resid_grad"].values[:, layer], g, f"{kind} lm_resid@{layer} grad")
        a = acts[(layer, "lm_attn")][:, answer_rows][:, :, POS]
        assert_rel_close(tr["lm_attn"].values[layer], a, f"{kind} lm_attn@{layer}")
        g = grads[(layer, "lm_attn")][:, :, answer_rows][:, :, :, POS]
        assert_rel_close(tr["lm_attn_grad"].values[:, layer], g, f"{kind} lm_attn@{layer} grad")
    assert tr.sizes["image_token"] == len(POS) == 15


# --------------------------------------------------------------------------------------------------
# Grad-CAM of an answer token equals a hand-written reference


def gradcam(A, G, shape):
    m = np.maximum(A @ G.mean(axis=0), 0).reshape(shape)
    return (m - m.min()) / (m.max() - m.min())


@pytest.mark.parametrize("token", [0, 2])
def test_gradcam_at_the_tower_equals_reference(case, token):
    kind, *_, tr, (acts, grads, _, raster, _c) = case
    expected = gradcam(to_raster(acts[(2, "F1")], raster), to_raster(grads[(2, "F1")][token], raster), (GH, GW))
    m = vc.cam(tr, vc.Recipe(site="F1", layer=-1, class_=token, upsample="none"))
    assert m.dims == ("patch_row", "patch_col") and m.attrs["degenerate"] == ""
    assert_rel_close(m.values, expected, f"{kind} tower Grad-CAM of answer token {token}")


@pytest.mark.parametrize("layer", [-1, 0])
def test_gradcam_at_lm_resid_equals_reference(case, layer):
    kind, *_, tr, (acts, grads, *_r) = case
    expected = gradcam(acts[(layer % 2, "lm_resid")][POS], grads[(layer % 2, "lm_resid")][0, POS], (3, 5))
    m = vc.cam(tr, vc.Recipe(site="lm_resid", layer=layer, class_=0, upsample="none"))
    assert m.dims == ("patch_row", "patch_col") and m.attrs["degenerate"] == ""
    assert_rel_close(m.values, expected, f"{kind} lm_resid Grad-CAM at LM layer {layer}")


def test_upsampled_maps_cover_the_rebuilt_image(case):
    kind, *_, img, tr, _ref = case
    np.testing.assert_array_equal(tr["image"].values, img)  # the patches put back, the normalisation undone
    for site in ("F1", "lm_resid"):
        m = vc.cam(tr, vc.Recipe(site=site, layer=-1, class_=0))
        assert m.shape == img.shape[:2]


# --------------------------------------------------------------------------------------------------
# the trace leaves the model as it was; the explicit attention is the model's


def test_trace_restores_the_model(case):
    kind, model, pv, thw, *_ = case
    assert model.config.vision_config._attn_implementation == "sdpa"
    assert tr_hooks(model) == 0
    assert not any(hasattr(blk.attn, "vitcam_probs") or "forward" in blk.attn.__dict__
                   for blk in model.model.visual.blocks)
    assert not hasattr(model.model.visual, "_vitcam_grid_probe")


def tr_hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_explicit_attention_computes_the_model_forward(case):
    from vitcam_nb.adapters.qwen_tower import explicit_tower_attention

    kind, model, pv, thw, *_ = case
    seq = torch.tensor([PROMPT + ANSWER])
    kw = dict(input_ids=seq, pixel_values=pv, image_grid_thw=thw, mm_token_type_ids=(seq == IMG).long(),
              use_cache=False)
    with torch.no_grad():
        plain = model(**kw).logits
        with explicit_tower_attention(model):
            explicit = model(**kw).logits
    assert_rel_close(explicit.numpy(), plain.numpy(), f"{kind} logits with the explicit tower attention")


# --------------------------------------------------------------------------------------------------
# the checklist states the layout and the tower's order; a saved trace gives the same maps


def test_checklist_states_the_layout_and_the_tower_order(case):
    kind, *_, tr, _ref = case
    import json

    for site in ("F1", "lm_resid", "projector"):
        text = json.loads(vc.cam(tr, vc.Recipe(site=site, layer=-1, class_=0)).attrs["checklist"])
        layout = text["gradient target"]["image-token layout"]
        assert "6x10 patches of 14 px" in layout and "merged 2x2 into 3x5 tokens in raster order" in layout
        windows = " and window" if kind == "qwen2_5" else ""
        assert f"the tower's merge-block{windows} order put in raster order" in layout


def test_saved_trace_gives_the_same_maps(case, tmp_path):
    kind, *_, tr, _ref = case
    back = vc.load(vc.save(tr, tmp_path / f"{kind}.nc"))
    for r in (vc.Recipe(site="F1", layer=-1, class_=0), vc.Recipe(site="lm_resid", layer=0, class_=1),
              vc.Recipe(site="lm_attn", layer=1, class_=2, relu="none"), vc.Recipe(site="projector", class_=3)):
        np.testing.assert_array_equal(vc.cam(back, r).values, vc.cam(tr, r).values, err_msg=f"{kind} {r.id}")
