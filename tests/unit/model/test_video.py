"""Video transformers (issue #37, item 3): VideoMAE, ViViT and TimeSformer on a (t, y, x) token grid.

Every family is a tiny random config (hidden 32, 2 layers, 2 heads, 32 px frames, 8 px patches, 4 frames) with
redrawn O(1) weights. The reference never calls vitcam_nb: it deep-copies the model, sets the eager attention,
hooks the modules named below (read from transformers' ``VideoMAELayer``, ``VivitLayer`` and ``TimesformerLayer``
forwards) with ``retain_grad()``, runs one fresh forward + ``backward()`` per target scalar, and brings each
tensor to the trace's (t, y, x) token order itself (TimeSformer orders its tokens (y, x, t); its spatial attention
runs on one sequence per frame with a copy of the class token: the trace's class token is the copies' mean, its
gradient their sum).

Naming convention (scripts/support_matrix.py): ``test_site_reference`` ids are ``"<family>-<site>"``.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn
from vitcam_testing import assert_rel_close, assert_unchanged, hooked_eager_copy, snapshot, target_scalar, traced

import vitcam_nb as vc
from vitcam_nb.core.errors import TraceError

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

T, HW, P, G = 4, 32, 8, 4  # frames, frame size, patch size, patch grid side
BASE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=HW,
            num_frames=T, num_labels=3)


def redraw(model: nn.Module, seed: int = 0) -> nn.Module:
    """O(1) weights: the default init would hide a wrong hook behind near-zero gradients."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("cls_token", "position_embeddings", "time_embeddings"):
                p.copy_(0.5 * noise)
            elif leaf == "weight" and p.ndim == 1:
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim >= 2:
                p.copy_(noise / math.sqrt(p[0].numel()))
            else:
                p.copy_(0.1 * noise)
    return model.eval()


def videomae() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.VideoMAEConfig(**BASE, patch_size=P, tubelet_size=2)
    return redraw(transformers.VideoMAEForVideoClassification(cfg))


def vivit() -> nn.Module:
    torch.manual_seed(0)
    return redraw(transformers.VivitForVideoClassification(transformers.VivitConfig(**BASE, tubelet_size=[2, P, P])))


def timesformer() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.TimesformerConfig(**BASE, patch_size=P)
    return redraw(transformers.TimesformerForVideoClassification(cfg))


def ident(a: np.ndarray, grad: bool) -> np.ndarray:
    return a


def yxt_to_tyx(a: np.ndarray, grad: bool) -> np.ndarray:
    """TimeSformer's stream (1 + G*G*T, C), patches (y, x, t), to (class token, then (t, y, x))."""
    patches = a[1:].reshape(G, G, T, -1).transpose(2, 0, 1, 3).reshape(T * G * G, -1)
    return np.concatenate([a[:1], patches])


def per_frame(a: np.ndarray, grad: bool) -> np.ndarray:
    """TimeSformer's spatial sequences (T, 1 + G*G, C): the class-token copies merged (mean; gradient summed),
    the frames' patches concatenated in (t, y, x) order."""
    cls = a[:, 0].sum(0) if grad else a[:, 0].mean(0)
    return np.concatenate([cls[None], a[:, 1:].reshape(T * G * G, -1)])


# site -> (module path relative to the layer, "input" / "output" / "weights" = element 1 of the output,
#          conversion to the trace's layout, whether the batch holds one row per frame)
MAE = {"F1": ("layernorm_before", "output"), "F2": ("attention.attention", "weights"),
       "F3": ("attention.output.dense", "input"), "F4": ("layernorm_after", "output"),
       "F5": ("output.dense", "output"), "F6": ("", "output"), "resid_pre": ("", "input"),
       "attn_out": ("attention", "output"), "resid_mid": ("layernorm_after", "input")}
VIVIT = {"F1": ("layernorm_before", "output"), "F2": ("attention", "weights"), "F3": ("attention.o_proj", "input"),
         "F4": ("layernorm_after", "output"), "F5": ("mlp", "output"), "F6": ("", "output"),
         "resid_pre": ("", "input"), "attn_out": ("attention", "output"), "resid_mid": ("layernorm_after", "input")}
TSF = {"F1": ("layernorm_before", "output"), "F3": ("attention.output.dense", "input"),
       "F4": ("layernorm_after", "output"), "F5": ("output", "output"), "F6": ("", "output"),
       "resid_pre": ("", "input"), "attn_out": ("attention", "output"), "resid_mid": ("layernorm_after", "input")}


@dataclass(frozen=True)
class Family:
    label: str
    build: Callable[[], nn.Module]
    layers: str
    sites: dict
    grid: tuple[int, int, int]
    prefix: tuple[str, ...]
    convert: Callable[[str], Callable[[np.ndarray, bool], np.ndarray]]


FAMILIES = {f.label: f for f in [
    Family("hf_videomae", videomae, "videomae.encoder.layer", MAE, (2, G, G), (), lambda s: ident),
    Family("hf_vivit", vivit, "vivit.layers", VIVIT, (2, G, G), ("cls",), lambda s: ident),
    Family("hf_timesformer", timesformer, "timesformer.encoder.layer", TSF, (T, G, G), ("cls",),
           lambda s: per_frame if s in ("F1", "F3", "attn_out") else yxt_to_tyx),
]}


def make_clip(seed: int = 0, frames: int = T) -> torch.Tensor:
    return torch.randn((frames, 3, HW, HW), generator=torch.Generator().manual_seed(1000 + seed))


def reference(fam: Family, model: nn.Module, x: torch.Tensor, scalar: Callable[[torch.Tensor], torch.Tensor]):
    """({(layer, site): (act, grad)} float64 in the trace's layout, logits), from my own hooks."""
    def attention_kinds(layer, blk, keep):  # TimeSformer's two attention kinds, at attn_drop (identity in eval)
        for site, attn in (("attn_time", blk.temporal_attention), ("attn_space", blk.attention)):
            attn.attention.attn_drop.register_forward_hook(lambda _m, _i, out, key=(layer, site): keep(key, out))

    m, store = hooked_eager_copy(model, fam.layers, fam.sites,
                                 attention_kinds if fam.label == "hf_timesformer" else None)
    with torch.enable_grad():
        logits = m(pixel_values=x[None].clone().requires_grad_(True)).logits[0]
        scalar(logits).backward()
    out = {}
    for (layer, site), t in store.items():
        a, g = t.detach().double().numpy(), t.grad.double().numpy()
        if site in ("attn_time", "attn_space"):
            out[(layer, site)] = (a, g)
            continue
        if site not in ("F1", "F3", "attn_out") or fam.label != "hf_timesformer":
            a, g = a[0], g[0]  # batch of one clip
        conv = fam.convert(site)
        out[(layer, site)] = (conv(a, False), conv(g, True)) if site != "F2" else (a, g)
    return out, logits.detach().double().numpy()


@functools.cache
def family_run(label: str):
    fam = FAMILIES[label]
    model, x = fam.build(), make_clip()
    before = snapshot(model)
    extra = ["attn_time", "attn_space"] if label == "hf_timesformer" else []
    tr = vc.trace(model, x, targets=[0, 1, 2], sites=[*fam.sites, *extra])  # every class: the top one too
    assert_unchanged(before, model)
    refs, logits = {}, None
    for target, c in zip(tr["target"].values, tr["target_class"].values, strict=True):
        refs[str(target)], logits = reference(fam, model, x, target_scalar(int(c)))
    return model, x, tr, refs, logits


@pytest.mark.parametrize(("label", "site"), [pytest.param(f, s, id=f"{f}-{s}") for f in FAMILIES
                                             for s in FAMILIES[f].sites])
def test_site_reference(label, site):
    model, _, tr, refs, logits = family_run(label)
    assert tr.attrs["model_family"] == label
    assert_rel_close(tr["logits"].values, logits, f"{label} logits")
    for target, ref in refs.items():
        for layer in tr["layer"].values:
            act, grad = ref[(int(layer), site)]
            assert_rel_close(traced(tr, site, int(layer)), act, f"{label} act {site}@{layer}")
            assert_rel_close(traced(tr, site, int(layer), target), grad, f"{label} grad {site}@{layer} {target}")
    assert any(np.abs(ref[(0, site)][1]).max() > 0 for ref in refs.values())


@pytest.mark.parametrize(("family", "site"), [pytest.param("hf_timesformer", "F2", id="hf_timesformer-F2")])
def test_site_not_applicable(family, site):
    """Divided space-time attention has no single (query, key) matrix over all tokens: F2 is refused, the two
    attention kinds are the extra sites."""
    with pytest.raises(TraceError, match=rf"sites: a site this model does not have '{site}'; this {family} model has "
                                         r"\['F1', 'F3', 'F4', 'F5', 'F6', .*'attn_time', 'attn_space'\]"):
        vc.trace(timesformer(), make_clip(), targets="top1", sites=[site])


@pytest.mark.parametrize("site", ["attn_time", "attn_space"])
def test_timesformer_attention_kinds_reference(site):
    """Divided space-time attention: temporal matrices per patch position (query and key: frames), spatial ones
    per frame (query and key: the class-token copy, then the frame's patches), each with its gradients."""
    _, _, tr, refs, _ = family_run("hf_timesformer")
    for target, ref in refs.items():
        for layer in range(2):
            act, grad = ref[(layer, site)]
            if site == "attn_time":  # the model's rows are the patch positions (y, x)
                act, grad = act.reshape(G, G, *act.shape[1:]), grad.reshape(G, G, *grad.shape[1:])
            stored = tr[site].isel({f"{site}_layer": layer}).values
            assert_rel_close(stored, act, f"{site}@{layer}")
            assert_rel_close(tr[f"{site}_grad"].sel(target=target).isel({f"{site}_layer": layer}).values, grad,
                             f"{site} grad@{layer} {target}")
    np.testing.assert_allclose(tr[site].values.sum(-1), 1.0, rtol=1e-5)  # softmax rows


@pytest.mark.parametrize("label", list(FAMILIES))
def test_token_grid_is_t_y_x(label):
    fam = FAMILIES[label]
    _, _, tr, _, _ = family_run(label)
    n = len(fam.prefix)
    assert (tr.attrs["grid_t"], tr.attrs["grid_h"], tr.attrs["grid_w"]) == fam.grid
    assert tuple(tr["token_kind"].values[:n]) == fam.prefix
    got = list(zip(tr["patch_frame"].values[n:], tr["patch_row"].values[n:], tr["patch_col"].values[n:]))
    gt, gh, gw = fam.grid
    assert got == [(t, r, c) for t in range(gt) for r in range(gh) for c in range(gw)]
    assert tr["clip"].dims == ("frame", "y", "x", "rgb") and tr.sizes["frame"] == T and "image" not in tr


@pytest.mark.parametrize("label", list(FAMILIES))
def test_gradcam_f1_last_block_on_the_t_y_x_grid(label):
    """Grad-CAM at F1 of the last block for the top class, written out in NumPy from the reference tensors:
    channel weights = mean gradient over the patch tokens, map = ReLU(activations . weights) on the (t, y, x)
    grid, min-max over the whole clip; upsampled, torch's trilinear interpolation (half-pixel centres) to
    (frames, H, W), min-max again."""
    fam = FAMILIES[label]
    _, _, tr, refs, logits = family_run(label)
    top = int(np.argmax(logits))
    act, grad = refs[f"logit_{top}"][(1, "F1")]
    n = len(fam.prefix)
    w = grad[n:].mean(axis=0)
    cam = np.maximum(act[n:] @ w, 0.0).reshape(fam.grid)
    cam = (cam - cam.min()) / (cam.max() - cam.min())
    got = vc.cam(tr, vc.Recipe(site="F1", layer=-1, upsample="none"))
    assert got.dims == ("patch_frame", "patch_row", "patch_col")
    assert_rel_close(got.values, cam, f"{label} grad-cam grid")
    up = torch.nn.functional.interpolate(torch.from_numpy(cam)[None, None], size=(T, HW, HW), mode="trilinear",
                                         align_corners=False)[0, 0].numpy()
    up = (up - up.min()) / (up.max() - up.min())
    full = vc.cam(tr, vc.Recipe(site="F1", layer=-1))
    assert full.dims == ("frame", "y", "x")
    assert_rel_close(full.values, up, f"{label} grad-cam upsampled")
    # nearest: every frame takes its tubelet's value, every pixel its patch's (integer scale factors)
    near = vc.cam(tr, vc.Recipe(site="F1", layer=-1, upsample="nearest")).values
    blocks = cam.repeat(T // fam.grid[0], 0).repeat(P, 1).repeat(P, 2)
    assert_rel_close(near, blocks, f"{label} grad-cam nearest")
    space = json.loads(full.attrs["checklist"])["spatial reconstruction"]
    tubelet = 2 if label != "hf_timesformer" else 1
    assert space["tubelet size"].startswith(f"{tubelet}x{P}x{P}")
    assert space["time interpolation"].startswith("linear") and f"{fam.grid[0]} -> {T} frames" in \
        space["time interpolation"]


@pytest.mark.parametrize("label", list(FAMILIES))
def test_clip_with_another_frame_count_is_refused_before_the_model_runs(label):
    model = FAMILIES[label].build()
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(TraceError, match=r"image: the model was built for clips of 4 frames.*got 6 frames"):
            vc.trace(model, make_clip(frames=6), targets="top1")
        with pytest.raises(TraceError, match=r"image: a batch of 2 clips"):
            vc.trace(model, torch.stack([make_clip(), make_clip()]), targets="top1")
        with pytest.raises(TypeError, match=r"image: a video model takes one clip as a normalised float tensor"):
            vc.trace(model, np.zeros((T, HW, HW, 3), np.uint8), targets="top1")
    finally:
        handle.remove()
    assert calls == []


@pytest.mark.parametrize("upsample", ["bilinear", "none"])
def test_frame_strip_has_one_panel_per_frame(upsample):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, _, tr, _, _ = family_run("hf_videomae")
    m = vc.cam(tr, vc.Recipe(site="F1", layer=-1, upsample=upsample))
    fig = vc.plot.frame_strip(tr, m)
    try:
        panels = [ax for ax in fig.axes if ax.get_title()]
        want = [f"frame {i}" for i in range(T)] if upsample != "none" else \
            ["tubelet 0 (frames 0-1)", "tubelet 1 (frames 2-3)"]
        assert [ax.get_title() for ax in panels] == want
        # each panel: its own frame of the clip under the map, at the clip's size
        for i, ax in enumerate(panels):
            shown = ax.get_images()
            step = T // len(panels)
            np.testing.assert_array_equal(shown[0].get_array(), tr["clip"].values[i * step])
            np.testing.assert_array_equal(np.asarray(shown[1].get_array()), m.values[i])
        assert fig._suptitle.get_text().startswith("gradcam · F1 · last block · logit")
        assert [ax.get_ylabel() for ax in fig.axes if ax not in panels] == ["map value"]  # one colour bar
        with pytest.raises(ValueError, match=r"cam_map: expected a video map"):
            vc.plot.frame_strip(tr, m.isel({m.dims[0]: 0}))
    finally:
        plt.close(fig)


def test_video_maps_report_what_they_are_and_refuse_what_is_not_there(tmp_path):
    model, x, tr, _, _ = family_run("hf_timesformer")
    recipe = vc.Recipe(site="F4", layer=0)
    m = vc.cam(tr, recipe)
    assert recipe.checklist(tr).to_json() == m.attrs["checklist"] and recipe.describe(tr) == m.attrs["methods"]
    assert "time interpolation linear between tubelet centres" in m.attrs["methods"]
    assert m.attrs["tubelet_size"].startswith("1x8x8") and "4 -> 4 frames" in m.attrs["time_interpolation"]
    with pytest.raises(vc.RecipeError, match=r"site: this hf_timesformer model has no 'F2'"):
        vc.cam(tr, vc.Recipe(site="F2"))
    with pytest.raises(vc.RecipeError, match=r"weighting: 'vitcx' is computed by the vitcx trace kind"):
        vc.cam(tr, vc.Recipe(weighting="vitcx", target="prob"))
    with pytest.raises(vc.RecipeError, match=r"vary: galleries of video maps are not available yet"):
        vc.gallery(tr, recipe, vary=("layer",))
    with pytest.raises(TraceError, match=r"model: trace_many stores images; the hf_videomae family takes video"):
        vc.trace_many(videomae(), [make_clip()], tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_a_video_trace_saves_and_loads(tmp_path):
    _, _, tr, _, _ = family_run("hf_vivit")
    back = vc.load(vc.save(tr, tmp_path / "clip.nc"))
    recipe = vc.Recipe(site="F2", layer="all", layer_fusion="rollout")
    np.testing.assert_array_equal(vc.cam(back, recipe).values, vc.cam(tr, recipe).values)
    np.testing.assert_array_equal(back["patch_frame"].values, tr["patch_frame"].values)
