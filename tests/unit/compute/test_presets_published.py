"""The published presets of issue #20 (part B) against references written from their official code, on tiny
random models: Transition Attention Maps, Beyond Intuition head-wise and token-wise, ViT-CX and the ALBEF ITM
Grad-CAM. Each reference runs the model itself, the way the official code does (``register_hook`` on the
attention, one forward and ``backward()`` per integration step, AgglomerativeClustering, a noise tensor drawn
at once); only the preset's map comes from vitcam_nb. Maps are compared before ReLU and normalisation.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from vitcam_testing import assert_rel_close, make_input, make_model

import vitcam_nb as vc

STEPS = 5


def close(ours, want, what: str) -> None:
    """The reference is a real map (not constant) and vitcam_nb's equals it within 1e-5 relative."""
    assert np.ptp(want) > 1e-6 * np.abs(want).max() > 0, f"{what}: the reference map is constant"
    assert_rel_close(ours, want, what)


def raw(recipe: vc.Recipe, **changes) -> vc.Recipe:
    return recipe.replace(relu="none", normalize="none", **changes)


class Hooked:
    """The official code's model patch: each block keeps its attention and, on backward, its gradient."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.store, self.handles = model, {}, []
        for i, blk in enumerate(model.blocks):
            blk.attn.fused_attn = False
            self.handles.append(blk.attn.attn_drop.register_forward_hook(self._keep(i)))
            self.handles.append(blk.register_forward_pre_hook(
                lambda _m, args, i=i: self.store.__setitem__(("z", i), args[0].detach())))
            self.handles.append(blk.attn.qkv.register_forward_hook(
                lambda _m, _a, out, i=i: self.store.__setitem__(("qkv", i), out.detach())))

    def _keep(self, i):
        def hook(_m, _i, out):
            self.store[("attn", i)] = out.detach()
            out.register_hook(lambda g: self.store.__setitem__(("grad", i), g.detach()))
        return hook

    def backward(self, x: torch.Tensor, index: int) -> None:
        out = self.model(x)
        self.model.zero_grad()
        out[0, index].backward()

    def integrated(self, x: torch.Tensor, index: int, steps: int) -> torch.Tensor:
        last = len(self.model.blocks) - 1
        total = 0
        for alpha in np.linspace(0, 1, steps):
            self.backward(x * alpha, index)
            total = total + self.store[("grad", last)]
        return total / steps

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _setup(depth: int = 4, seed: int = 0):
    model = make_model("vit", seed=seed, depth=depth)
    x = make_input("vit", seed=seed)
    index = int(model(x).argmax())
    return model, x, index


def _vc_map(model, x, recipe, **score):
    tr = vc.trace(model, x, targets="top1")
    tr = vc.score(tr, model, recipe, x, **score)
    return vc.cam(tr, raw(recipe, upsample="none")).values


def tam_maps() -> tuple[np.ndarray, np.ndarray]:
    """The preset's raw map and the official code's (TAM), on the same model and input."""
    model, x, index = _setup()
    ours = _vc_map(model, x, vc.presets.transition_attention_maps(start_layer=-3), steps=STEPS)
    ref = Hooked(model)
    try:  # official: start_layer=1 of 4 blocks
        ref.backward(x, index)
        L = len(model.blocks)
        states = ref.store[("attn", L - 1)].mean(1)[:, 0, :][:, None, :]
        for i in range(1, L - 1)[::-1]:
            states = states.bmm(ref.store[("attn", i)].mean(1)) + states
        W = ref.integrated(x, index, STEPS).clamp(min=0).mean(1)[:, 0, :][:, None, :]
        want = (states * W)[0, 0, 1:].reshape(4, 4).numpy()
    finally:
        ref.close()
    return ours, want


def test_transition_attention_maps_equal_the_official_code():
    close(*tam_maps(), "TAM")


def bt_head_maps() -> tuple[np.ndarray, np.ndarray]:
    """The preset's raw map and the official code's (BT-H)."""
    model, x, index = _setup()
    ours = _vc_map(model, x, vc.presets.beyond_intuition_head(start_layer=-3), steps=STEPS)
    ref = Hooked(model)
    try:  # official: start_layer=2, the loop starts at block start_layer - 1 = 1
        ref.backward(x, index)
        s = ref.store[("attn", 0)].shape[-1]
        R = torch.eye(s)[None]
        for nb in range(len(model.blocks)):
            if nb < 2 - 1:
                continue
            grad = ref.store[("grad", nb)].reshape(-1, s, s)
            cam = ref.store[("attn", nb)].reshape(-1, s, s)
            importance = torch.mean(torch.matmul(cam.transpose(-1, -2), grad).abs(), dim=(-1, -2))
            importance = importance / importance.sum()
            cam = torch.matmul(importance, cam.reshape(cam.shape[0], -1)).reshape(s, s)
            R = R + torch.matmul(cam, R)
        W = ref.integrated(x, index, STEPS).clamp(min=0).mean(1)
        want = (W * R)[0, 0, 1:].reshape(4, 4).numpy()
    finally:
        ref.close()
    return ours, want


def test_beyond_intuition_head_equals_the_official_code():
    close(*bt_head_maps(), "BT-H")


def bt_token_maps() -> tuple[np.ndarray, np.ndarray]:
    """The preset's raw map and the official code's (BT-T, with the kit's reading of vproj)."""
    model, x, index = _setup()
    ours = _vc_map(model, x, vc.presets.beyond_intuition_token(start_layer=-2), steps=STEPS)
    ref = Hooked(model)
    try:  # official: start_layer=3, the loop starts at block 2
        ref.backward(x, index)
        s = ref.store[("attn", 0)].shape[-1]
        R = torch.eye(s)[None]
        for nb, blk in enumerate(model.blocks):
            if nb < 3 - 1:
                continue
            z = ref.store[("z", nb)]
            v = ref.store[("qkv", nb)][..., 2 * z.shape[-1]:]
            vproj = v @ blk.attn.proj.weight.detach().T
            m = torch.diag_embed(torch.linalg.norm(vproj, dim=-1).squeeze() / torch.linalg.norm(z, dim=-1).squeeze())
            cam = ref.store[("attn", nb)]
            mean_cam = cam.reshape(-1, s, s).mean(0)
            R = R + torch.matmul(torch.matmul(mean_cam, m), R)
        W = ref.integrated(x, index, STEPS).clamp(min=0).mean(1)
        want = (W * R.abs())[0, 0, 1:].reshape(4, 4).numpy()
    finally:
        ref.close()
    return ours, want


def test_beyond_intuition_token_equals_the_official_code_with_our_reading_of_vproj():
    close(*bt_token_maps(), "BT-T")


def _vitcx_reference(model, x, index, noise, seed):
    """ViT-CX as the official code: norm1 of the last block, torchvision Resize, AgglomerativeClustering,
    the causal score with one noise tensor for all masks (the clusters put in order of their first channel,
    as vitcam_nb numbers them, so both draw the same noise for the same mask)."""
    sklearn_cluster = pytest.importorskip("sklearn.cluster")
    transforms = pytest.importorskip("torchvision.transforms")
    keep = {}
    handle = model.blocks[-1].norm1.register_forward_hook(lambda _m, _i, out: keep.__setitem__("f", out.detach()))
    try:
        with torch.no_grad():
            p = torch.softmax(model(x), dim=1)[0]
    finally:
        handle.remove()
    f = keep["f"][:, 1:, :]
    gh = int(np.sqrt(f.shape[1]))
    fmap = f.reshape(1, gh, gh, f.shape[2]).transpose(2, 3).transpose(1, 2)[0]
    H, W = x.shape[-2:]
    fmap = transforms.Resize((H, W))(fmap)
    act = fmap.reshape(fmap.shape[0], H * W)
    mask = (act - act.min(1).values[:, None]) / (act.max(1).values[:, None] - act.min(1).values[:, None])
    sim = torch.mm(mask, mask.T) / (torch.linalg.norm(mask, dim=1).reshape(-1, 1) * torch.linalg.norm(mask, dim=1))
    sim[torch.isnan(sim)] = 0
    cluster = sklearn_cluster.AgglomerativeClustering(n_clusters=None, distance_threshold=0.1, metric="precomputed",
                                                      linkage="complete").fit((1 - sim).numpy())
    order = {c: i for i, c in enumerate(dict.fromkeys(cluster.labels_.tolist()))}
    labels = [order[c] for c in cluster.labels_.tolist()]
    n = len(order)
    summed = torch.zeros((n, H * W))
    for i in range(len(mask)):
        summed[labels[i]] += mask[i]
    masks = ((summed - summed.min(1).values[:, None]) / (summed.max(1).values[:, None] - summed.min(1).values[:, None])
             ).reshape(n, 1, H, W)
    random_whole = torch.randn([n, 3, H, W], generator=torch.Generator().manual_seed(seed)) * noise
    with torch.no_grad():
        masked = torch.cat([x[0] * masks[i] + random_whole[i] * (1 - masks[i]) for i in range(n)])
        masked = masked.reshape(n, 3, H, W)
        original = torch.stack([x[0] + random_whole[i] * (1 - masks[i]) for i in range(n)])
        p_mask, p_orig = torch.softmax(model(masked), 1), torch.softmax(model(original), 1)
    p_final = p_mask.T - p_orig.T + p[index]
    sal = torch.matmul(p_final, (masks / masks.sum(0)).reshape(n, H * W)).reshape(-1, H, W) / n
    return sal[index].numpy(), n


def vit_cx_maps(noise: float) -> tuple[np.ndarray, np.ndarray]:
    """The preset's raw map and the official code's (ViT-CX), after checking both made the same masks."""
    model, x, index = _setup(depth=2)
    want, n = _vitcx_reference(model, x, index, noise, seed=3)
    tr = vc.score(vc.trace(model, x, targets="top1"), model, vc.presets.vit_cx(), x, noise=noise, seed=3,
                  batch_size=1000)
    assert tr.sizes["vitcx_mask"] == n
    return vc.cam(tr, raw(vc.presets.vit_cx())).values, want


@pytest.mark.parametrize("noise", [0.0, 0.1])
def test_vit_cx_equals_the_official_code(noise):
    close(*vit_cx_maps(noise), f"ViT-CX noise {noise}")


def albef_maps() -> tuple[np.ndarray, np.ndarray]:
    """The preset's raw map and ALBEF's visualization.ipynb Grad-CAM on a tiny random BLIP ITM model."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BlipConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                         vocab_size=100, max_position_embeddings=16, pad_token_id=0, bos_token_id=1, sep_token_id=2,
                         is_decoder=True),
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                           image_size=32, patch_size=8),
        image_text_hidden_size=16)
    torch.manual_seed(0)
    blip = transformers.BlipForImageTextRetrieval(cfg).eval()
    with torch.no_grad():
        for p in blip.parameters():
            p.mul_(20.0 if p.ndim >= 2 else 1.0)  # the Hugging Face init gives near-zero attention gradients
    ids = torch.tensor([[1, 5, 6, 7, 2]])
    tr = vc.trace(blip, torch.randn((1, 3, 32, 32), generator=torch.Generator().manual_seed(1)),
                  targets=vc.targets.itm(ids), sites=["xattn"])
    recipe = vc.presets.albef_itm_gradcam(layer=0)
    ours = vc.cam(tr, raw(recipe, upsample="none")).values
    # ALBEF visualization.ipynb: cams[:, :, :, 1:] * grads[:, :, :, 1:].clamp(min=0), mean over heads, row 0
    cams = tr["xattn"].isel(xattn_layer=0).values
    grads = tr["xattn_grad"].sel(target="logit_1").isel(xattn_layer=0).values
    gradcam = (cams[:, :, 1:] * np.clip(grads[:, :, 1:], 0, None)).mean(0)
    return ours, gradcam[0].reshape(4, 4)


def test_albef_itm_gradcam_is_the_mean_over_heads_of_attention_times_relu_gradient_at_the_cls_row():
    close(*albef_maps(), "ALBEF ITM Grad-CAM")


def test_every_new_preset_is_named_in_its_checklist():
    model, x, _ = _setup(depth=2)
    tr = vc.trace(model, x, targets="top1")
    recipe = vc.presets.transition_attention_maps()
    assert vc.presets.preset_name(recipe) == "transition_attention_maps"
    tr = vc.score(tr, model, vc.presets.vit_cx(), x)
    checklist = json.loads(vc.cam(tr, vc.presets.vit_cx()).attrs["checklist"])
    assert checklist["recipe"]["preset"] == f"this is vit_cx ({vc.presets.CITATIONS['vit_cx']})"
    assert "ViT-CX" in checklist["aggregation"]["weighting"]
    # A preset added after 0.1 is named on any blocks, and the checklist says which.
    tam = vc.presets.transition_attention_maps(start_layer=-2)
    assert vc.presets.preset_text(tam).endswith("on blocks (-2, -1)")
    assert vc.presets.preset_text(vc.presets.vit_cx(layer=0)).startswith("this is vit_cx (")
    assert vc.presets.preset_text(vc.Recipe(layer=3)) == ""  # a 0.1 preset only at its defaults, as in 0.1
    # A 0.1 preset keeps the citation alone (the 0.1 contract fixes its checklist text).
    assert vc.presets.preset_text(vc.presets.attention_rollout()) == vc.presets.CITATIONS["attention_rollout"]


def test_integrated_rollouts_without_scores_are_refused_with_the_call_that_adds_them():
    model, x, _ = _setup(depth=2)
    tr = vc.trace(model, x, targets="top1", sites="F2")
    with pytest.raises(vc.RecipeError, match=r"vc\.score\(tr, model, vc\.Recipe\("):
        vc.cam(tr, vc.presets.transition_attention_maps(start_layer=-2))
    with pytest.raises(vc.RecipeError, match="target='logit'"):
        vc.presets.transition_attention_maps().replace(target="prob")
    with pytest.raises(vc.RecipeError, match="start_layer"):
        vc.presets.beyond_intuition_head(start_layer=4)
    scored = vc.score(tr, model, vc.presets.transition_attention_maps(start_layer=-2), x, steps=2)
    with pytest.raises(vc.RecipeError, match="last block"):
        vc.cam(scored, vc.Recipe(site="F2", layer=(0,), layer_fusion="transition"))
    with pytest.raises(vc.RecipeError, match="vitcx"):
        vc.cam(scored, vc.presets.vit_cx())


def test_the_transition_map_follows_the_recipe_query_rows():
    model, x, _ = _setup(depth=2)
    recipe = vc.presets.transition_attention_maps(start_layer=0)
    tr = vc.score(vc.trace(model, x, targets="top1", sites="F2"), model, recipe, x, steps=3)
    ig = np.clip(tr["attn_grad_ig"].isel(target=0).values.astype(np.float64), 0, None).mean(0)
    A = tr["attn"].values.astype(np.float64).mean(1)
    state = A[1] @ (A[0] + np.eye(A.shape[-1]))
    want = (ig * state).mean(0)[1:].reshape(4, 4)  # the mean over all query rows, patch keys
    close(vc.cam(tr, raw(recipe, upsample="none", attn_rows="mean")).values, want, "rows")
