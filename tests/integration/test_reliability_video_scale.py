"""Issue #37 item 5 (and #35's memory estimate): video and detection families at dataset scale. ``trace_many``
stores clips (VideoMAE, TimeSformer with its two attentions), each read back as ``vc.trace`` gives it on that clip,
and a clip of another frame count is refused naming both counts, before any pass; ``map_many`` stores a clip's maps
on its (t, y, x) token grid, read back bitwise as ``vc.cam`` gives them on the clip's full trace; the memory estimate
of a clip equals hand-computed sizes and the Dataset's nbytes, so the budget checks a video trace; ``trace_many``
with a detection target per image (a box matched on each image) equals ``vc.trace`` bitwise. Tiny random configs
(hidden 32, 2 layers, 2 heads, 32 px frames, 8 px patches, 4 frames), as in tests/unit/model/test_video.py."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import zarr

import vitcam_nb as vc
from vitcam_nb.core.errors import TraceError

transformers = pytest.importorskip("transformers")

T, HW, P, G = 4, 32, 8, 4
BASE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=HW,
            num_frames=T, num_labels=3)
EXTRA_ATTRS = {"image_index", "image_label", "image_source"}


def _redraw(model: torch.nn.Module) -> torch.nn.Module:
    """O(1) weights, so that gradients are far from zero and a wrong slice shows."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise / math.sqrt(p[0].numel()) if p.ndim >= 2 else 0.1 * noise)
    return model.eval()


def videomae() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.VideoMAEConfig(**BASE, patch_size=P, tubelet_size=2)
    return _redraw(transformers.VideoMAEForVideoClassification(cfg))


def timesformer() -> torch.nn.Module:
    torch.manual_seed(0)
    return _redraw(transformers.TimesformerForVideoClassification(transformers.TimesformerConfig(**BASE, patch_size=P)))


def clips(n: int, frames: int = T) -> torch.Tensor:
    return torch.randn((n, frames, 3, HW, HW), generator=torch.Generator().manual_seed(7))


def _assert_same_trace(got, want) -> None:
    """A store's clip equals vc.trace on it: schema, attrs; values to the rounding of batched kernels."""
    assert {k: v for k, v in got.attrs.items() if k not in EXTRA_ATTRS} == want.attrs
    assert set(got.variables) == set(want.variables)
    for name, var in want.variables.items():
        other = got.variables[name]
        assert other.dims == var.dims and other.dtype == var.dtype, name
        if var.dtype.kind == "f":
            scale = float(np.abs(var.values.astype(np.float64)).max()) or 1.0
            np.testing.assert_allclose(other.values, var.values, rtol=1e-5, atol=1e-5 * scale, err_msg=name)
        else:
            np.testing.assert_array_equal(other.values, var.values, err_msg=name)


@pytest.mark.parametrize("family", ["hf_videomae", "hf_timesformer"])
def test_trace_many_stores_clips_each_equal_to_its_single_trace(tmp_path, family):
    model = videomae() if family == "hf_videomae" else timesformer()
    x = clips(3)
    given = x if family == "hf_videomae" else list(x)  # one (N, T, C, H, W) array, or a list of clips
    path = vc.trace_many(model, given, tmp_path / "clips.zarr", targets="top2", batch_size=2, progress=False)
    ds = vc.open_traces(path)
    assert ds["clip"].dims == ("image", "frame", "y", "x", "rgb") and ds.sizes["image"] == 3
    assert ds["patch_frame"].values.tolist() == ([-1] if family == "hf_timesformer" else []) + \
        np.repeat(np.arange(T if family == "hf_timesformer" else T // 2), G * G).tolist()
    group = zarr.open_group(str(path), mode="r")
    assert group["clip"].chunks == (1, T, HW, HW, 3)  # one clip per chunk, as one image per chunk
    if family == "hf_timesformer":
        assert group["attn_time_grad"].chunks[:3] == (1, 3, 1)  # one clip, every target, one layer
    for i in range(3):
        _assert_same_trace(vc.image_trace(ds, i), vc.trace(model, x[i], targets="top2"))


def test_a_clip_of_another_frame_count_is_refused_naming_both_before_a_pass(tmp_path):
    model = videomae()
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    mixed = [clips(1)[0], clips(1, frames=6)[0]]
    with pytest.raises(TraceError, match=r"^images: clip 1: the model was built for clips of 4 frames .*got 6 "
                                         r"frames"):
        vc.trace_many(model, mixed, tmp_path / "mixed.zarr", targets="top1", batch_size=2, progress=False)
    assert calls == [] and not (tmp_path / "mixed.zarr").exists()
    with pytest.raises(TraceError, match=r"^masks: the hf_videomae family takes clips"):
        vc.trace_many(model, clips(1), tmp_path / "m.zarr", masks=[np.ones((HW, HW), bool)], progress=False)
    handle.remove()


RECIPES = [
    vc.Recipe(site="F1", layer=-1),
    vc.Recipe(site="F4", layer=0, weighting="hirescam", upsample="bicubic"),
    vc.Recipe(site="F4", layer=(0, 1), layer_fusion="mean"),  # fused on the (t x h, w) grid, then upsampled
    vc.Recipe(site="F3", layer=1, heads="max", weighting="layercam", upsample="nearest"),
    vc.Recipe(site="F1", layer=0, target="prob", class_="top2", normalize="max", relu="none"),
]
F2_RECIPES = [  # VideoMAE has no class token: the attention rows are averaged
    vc.presets.attention_rollout().replace(attn_rows="mean"),
    vc.Recipe(site="F2", layer=1, heads="mean_then_relu", attn_rows="mean"),
]


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        return fn(*args, **kwargs)


@pytest.mark.parametrize("family", ["hf_videomae", "hf_timesformer"])
def test_map_many_on_clips_reads_back_bitwise_vc_cam_on_a_full_trace(tmp_path, family):
    # A batch of one is the pass vc.trace makes: each stored map read back equals vc.cam on a full trace of the clip,
    # on the (t, y, x) token grid and upsampled to (frame, y, x), bit for bit.
    model = videomae() if family == "hf_videomae" else timesformer()
    recipes = RECIPES + (F2_RECIPES if family == "hf_videomae" else [])  # TimeSformer has no F2
    x = clips(2)
    ds = vc.open_maps(vc.map_many(model, x, recipes, tmp_path / "maps.zarr", batch_size=1, progress=False))
    gt = T // 2 if family == "hf_videomae" else T
    assert ds["maps"].dims == ("image", "recipe", "gt", "gy", "gx")
    assert ds["maps"].shape == (2, len(recipes), gt, G, G) and ds["parts"].shape == (2, 2, gt, G, G)
    for i in range(2):
        tr = vc.trace(model, x[i], targets="top2")
        one = vc.image_maps(ds, i)
        for r in recipes:
            for grid in (False, True):
                got, want = _quiet(vc.cam, one, r, grid=grid), _quiet(vc.cam, tr, r, grid=grid)
                assert got.dims == want.dims == (("patch_frame", "patch_row", "patch_col") if grid
                                                 else ("frame", "y", "x"))
                np.testing.assert_array_equal(got.values, want.values, err_msg=f"{r.to_string()} grid={grid}")
                differ = {k for k in want.attrs if got.attrs[k] != want.attrs[k]}
                assert differ <= {"trace_id", "checklist", "methods"}, (r.to_string(), differ)
                assert got.attrs["methods"].replace(got.attrs["trace_id"], want.attrs["trace_id"]) == \
                    want.attrs["methods"]
                assert got.attrs["checklist"].replace(got.attrs["trace_id"], want.attrs["trace_id"]) == \
                    want.attrs["checklist"]
    every = _quiet(vc.cam, ds, recipes[1])
    assert every.dims == ("image", "frame", "y", "x")
    np.testing.assert_array_equal(every.values[1], _quiet(vc.cam, vc.image_maps(ds, 1), recipes[1]).values)


def test_map_many_on_clips_refuses_the_torch_backend_before_a_pass(tmp_path):
    model = videomae()
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(TraceError, match=r"^backend: the torch kernels .* hf_videomae family's clips"):
        vc.map_many(model, clips(1), RECIPES[:1], tmp_path / "t.zarr", backend="torch", progress=False)
    with pytest.raises(TraceError, match=r"^images: clip 0: the model was built for clips of 4 frames .*got 6"):
        vc.map_many(model, clips(1, frames=6), RECIPES[:1], tmp_path / "f.zarr", progress=False)
    assert calls == [] and not (tmp_path / "t.zarr").exists() and not (tmp_path / "f.zarr").exists()
    handle.remove()


# -- the memory estimate covers clips ----------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["hf_videomae", "hf_timesformer"])
def test_the_estimate_of_a_clip_equals_hand_computed_sizes_and_the_dataset(tmp_path, family):
    model = videomae() if family == "hf_videomae" else timesformer()
    x = clips(1)[0]
    c, heads, k = 32, 2, 2 + 1  # channels, heads, two targets and the expected score
    if family == "hf_videomae":  # no class token; tubelets of 2 frames: 2 x 4 x 4 tokens
        tokens, sites = 2 * G * G, ["F1", "F2", "F4"]
        want = {"act": 2 * 2 * tokens * c * 4, "attn": 2 * heads * tokens * tokens * 4}
    else:  # a class token, then 4 x 4 x 4 tokens; attn_time (layer, y, x, head, t, t) and attn_space (layer, frame,
        # head, 1 + 16, 1 + 16) are captured in both blocks
        tokens, sites = 1 + T * G * G, ["F1", "F4", "attn_time", "attn_space"]
        want = {"act": 2 * 2 * tokens * c * 4, "attn": 0, "attn_time": 2 * G * G * heads * T * T * 4,
                "attn_space": 2 * T * heads * (1 + G * G) ** 2 * 4}
    want = {**want, **{f"{n}_grad": k * v for n, v in want.items() if n != "act"}, "grad": k * want["act"]}
    est = vc.estimate(model, x, "top2", sites=sites)
    tr = vc.trace(model, x, "top2", sites=sites)
    assert est["tokens"] == tokens and tr.sizes["token"] == tokens
    for name, size in want.items():
        assert est["parts"][name] == size == (tr[name].nbytes if name in tr else 0), name
    assert est["dataset_bytes"] == pytest.approx(tr.nbytes, rel=0.01), (est, tr.nbytes)
    # the Dataset's clip (4 frames) is in it, so a budget below the estimate is refused before the model runs
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(TraceError, match=r"^max_bytes: this trace needs about .* over the budget"):
        vc.trace(model, x, "top2", sites=sites, max_bytes=est["peak_bytes"] - 1)
    with pytest.raises(TraceError, match=r"^max_bytes: this trace needs about .*batch_size=1"):
        vc.trace_many(model, clips(2), tmp_path / "b.zarr", targets="top2", sites=sites, batch_size=2,
                      max_bytes=est["peak_bytes"] + est["dataset_bytes"] + 1, progress=False)
    assert calls == [] and not (tmp_path / "b.zarr").exists()
    handle.remove()


# -- detection targets in trace_many ------------------------------------------------------------------------------
def yolos() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.YolosConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                   image_size=[32, 32], patch_size=8, num_detection_tokens=3, num_labels=4)
    return _redraw(transformers.YolosForObjectDetection(cfg))


BOXES = [(0, 0, 16, 16), (8, 8, 30, 30), (0, 10, 20, 32)]


def test_trace_many_with_a_detection_target_per_image_equals_vc_trace_bitwise(tmp_path):
    # Each image's box is matched on that image: each image is traced in its own pass, exactly as vc.trace does.
    model, x = yolos(), torch.randn((3, 3, HW, HW), generator=torch.Generator().manual_seed(3))
    targets = [vc.targets.detection(box=b) for b in BOXES]
    path = vc.trace_many(model, x, tmp_path / "det.zarr", targets=targets, batch_size=2, progress=False)
    ds = vc.open_traces(path)
    for i, box in enumerate(BOXES):
        got, want = vc.image_trace(ds, i), vc.trace(model, x[i], targets=vc.targets.detection(box=box))
        assert {k: v for k, v in got.attrs.items() if k not in EXTRA_ATTRS} == want.attrs
        assert f"box ({', '.join(f'{v:g}' for v in box)}) matched by IoU" in got.attrs["target_scores"]
        assert set(got.variables) == set(want.variables)
        for name, var in want.variables.items():
            np.testing.assert_array_equal(got[name].values, var.values, err_msg=name)
    # resumed with the same targets: nothing is traced again; with other boxes it is another store
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    vc.trace_many(model, x, path, targets=targets, batch_size=2, progress=False)
    with pytest.raises(vc.TraceFileError, match=r"another model or settings.*targets"):
        vc.trace_many(model, x, path, targets=[vc.targets.detection(box=(0, 0, 8, 8))] * 3, batch_size=2,
                      progress=False)
    assert calls == []
    handle.remove()


def test_detection_targets_that_do_not_fit_the_images_are_refused(tmp_path):
    model, x = yolos(), torch.randn((3, 3, HW, HW), generator=torch.Generator().manual_seed(3))
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(TraceError, match=r"^targets: 2 detection targets \(one per image\) for 3 images"):
        vc.trace_many(model, x, tmp_path / "a.zarr", targets=[vc.targets.detection(query=0)] * 2, progress=False)
    with pytest.raises(TraceError, match=r"^targets: a list of detection targets .*int"):
        vc.trace_many(model, x, tmp_path / "a.zarr", targets=[vc.targets.detection(query=0), 1, 2], progress=False)
    assert calls == [] and not (tmp_path / "a.zarr").exists()
    uneven = [vc.targets.detection(box=b) for b in (BOXES[0], BOXES[:2], BOXES[2])]
    with pytest.raises(TraceError, match=r"^targets: image 1 has 2 detection scores, the store 1"):
        vc.trace_many(model, x, tmp_path / "b.zarr", targets=uneven, batch_size=3, progress=False)
    handle.remove()


def test_map_many_with_a_detection_target_per_image_reads_back_bitwise_vc_cam(tmp_path):
    model, x = yolos(), torch.randn((3, 3, HW, HW), generator=torch.Generator().manual_seed(3))
    recipes = [vc.Recipe(site="F4", layer=0), vc.presets.attention_rollout(),
               vc.Recipe(site="F1", layer=(0, 1), layer_fusion="mean", upsample="bicubic", target="prob")]
    targets = [vc.targets.detection(box=b) for b in BOXES]
    ds = vc.open_maps(vc.map_many(model, x, recipes, tmp_path / "det.zarr", targets=targets, batch_size=2,
                                  progress=False))
    for i, box in enumerate(BOXES):
        tr = vc.trace(model, x[i], targets=vc.targets.detection(box=box))
        one = vc.image_maps(ds, i)
        for r in recipes:
            got, want = _quiet(vc.cam, one, r), _quiet(vc.cam, tr, r)
            np.testing.assert_array_equal(got.values, want.values, err_msg=f"{i} {r.to_string()}")
            assert {k for k in want.attrs if got.attrs[k] != want.attrs[k]} <= {"trace_id", "checklist", "methods"}
            # the checklist states this image's own matched box
            assert got.attrs["checklist"].replace(got.attrs["trace_id"], want.attrs["trace_id"]) == \
                want.attrs["checklist"]
    with pytest.raises(TraceError, match=r"^backend: detection targets are matched per image"):
        vc.map_many(model, x, recipes[:1], tmp_path / "t.zarr", targets=targets, backend="torch", progress=False)
