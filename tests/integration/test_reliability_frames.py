"""Issue #37 item 3: a frame slider in vc.Explorer and in the one-file export for video traces.

Before, ``vc.Explorer(video_trace)`` and ``vc.export_html(video_trace, ...)`` were refused (a video trace has a clip,
not one image). Now the Explorer shows one frame of the clip under that frame of ``vc.cam(trace, recipe)`` (the
map upsampled in space and time and normalised over the whole clip, exactly as vc.cam gives it), with a frame
slider; the page's colours span the whole clip's range; a frame outside the clip is refused, in Python and in the
page, and the frame shown stays. The exported page holds every frame's map of every recipe, stored as the kernel
shows it. The reference here is ``vc.cam`` itself, sliced with NumPy, and the clip's min and max.
"""

from __future__ import annotations

import base64
import functools
import json
import zlib

import numpy as np
import pytest
import torch

import vitcam_nb as vc
from vitcam_nb.widgets.bundle import build_bundle
from vitcam_nb.widgets.standalone import page_html

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::vitcam_nb.core.errors.DegenerateMapWarning")

FRAMES, TUBELET = 4, 2
RECIPES = [vc.Recipe(), vc.Recipe(site="F4", weighting="layercam", upsample="nearest"),
           vc.Recipe(site="F6", normalize="none", upsample="bicubic"), vc.Recipe(site="F5", normalize="max")]


@functools.cache
def video_trace():
    """A tiny random VideoMAE (tubelets of 2 frames: the map is interpolated in time) on a random 4-frame clip."""
    torch.manual_seed(0)
    cfg = transformers.VideoMAEConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=32, image_size=16, patch_size=8, num_frames=FRAMES,
                                      tubelet_size=TUBELET, num_labels=3)
    model = transformers.VideoMAEForVideoClassification(cfg).eval()
    clip = torch.randn((FRAMES, 3, 16, 16), generator=torch.Generator().manual_seed(0))
    return vc.trace(model, clip, targets="top2")


def rgba(frame: np.ndarray) -> bytes:
    return np.concatenate([frame, np.full(frame.shape[:2] + (1,), 255, np.uint8)], axis=-1).tobytes()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.id)
def test_each_frame_shows_vc_cam_sliced_at_that_frame_on_the_clips_scale(recipe):
    tr = video_trace()
    full = vc.cam(tr, recipe).values  # (frame, y, x)
    ex = vc.Explorer(tr, recipe)
    assert ex.frames == FRAMES and ex.frame_index == 0
    lo, hi = float(full.min()), float(full.max())
    assert ex.value_range == ([0.0, hi] if recipe.normalize == "max" else [lo, hi])  # one scale for the clip
    for f in (0, 3, 1, 2):
        ex.frame_index = f
        assert ex.map.dtype == np.float32 and ex.map.shape == (16, 16)
        np.testing.assert_array_equal(ex.map, full[f])
        assert bytes(ex.image) == rgba(tr["clip"].values[f])
    assert not np.array_equal(full[0], full[-1])  # the frames differ: one is not shown for another
    np.testing.assert_array_equal(ex.cam().values, full)


def test_upsample_none_shows_the_token_grid_of_the_frames_tubelet():
    tr = video_trace()
    recipe = vc.Recipe(upsample="none")
    grid = vc.cam(tr, recipe).values  # (patch_frame, patch_row, patch_col)
    assert grid.shape == (FRAMES // TUBELET, 2, 2)
    ex = vc.Explorer(tr, recipe)
    for f in range(FRAMES):
        ex.frame_index = f
        np.testing.assert_array_equal(ex.map, grid[f // TUBELET])


def test_the_frame_is_kept_when_the_recipe_changes_from_python_or_the_page():
    tr = video_trace()
    ex = vc.Explorer(tr, RECIPES[0], frame_index=3)
    assert ex.frame_index == 3 and ex.frame_shown == 3
    ex.recipe = RECIPES[1]
    np.testing.assert_array_equal(ex.map, vc.cam(tr, RECIPES[1]).values[3])
    ex.request = {"id": 1, "recipe": {"site": "F6"}, "changed": ["site"]}
    assert ex.error == "" and ex.recipe.site == "F6" and ex.frame_index == 3
    np.testing.assert_array_equal(ex.map, vc.cam(tr, ex.recipe).values[3])
    ex.frame_request = {"id": 1, "index": 1}  # the page's slider
    assert ex.error == "" and ex.frame_index == 1
    np.testing.assert_array_equal(ex.map, vc.cam(tr, ex.recipe).values[1])


@pytest.mark.parametrize("bad", [4, -1, True, 1.0, "2"])
def test_a_frame_outside_the_clip_is_refused_and_the_frame_shown_stays(bad):
    tr = video_trace()
    with pytest.raises(IndexError, match=r"^frame: expected an int in \[0, 3\] \(the clip has 4 frames\)"):
        vc.Explorer(tr, frame_index=bad)
    ex = vc.Explorer(tr, frame_index=2)
    before = ex.map.copy()
    with pytest.raises(IndexError, match=r"^frame: expected an int in \[0, 3\]"):
        ex.frame_index = bad
    ex.frame_request = {"id": 1, "index": bad}  # the page's slider: a message, not a traceback
    assert ex.error.startswith("frame: expected an int in [0, 3]")
    assert ex.frame_index == 2
    np.testing.assert_array_equal(ex.map, before)


def test_an_image_trace_has_no_frames(model_factory, model_input):
    tr = vc.trace(model_factory("vit"), model_input("vit"))
    with pytest.raises(IndexError, match=r"frame: expected 0 \(an image trace\), got 1"):
        vc.Explorer(tr, frame_index=1)
    ex = vc.Explorer(tr)
    assert ex.frames == 0 and ex.value_range == []
    with pytest.raises(TypeError, match="^frame_index: this Explorer shows an image trace"):
        ex.frame_index = 0
    ex.frame_request = {"id": 1, "index": 0}
    assert ex.error.startswith("frame: this Explorer shows an image trace")


@pytest.mark.parametrize("view", ["Compare", "Gallery"])
def test_compare_and_gallery_refuse_a_video_trace_naming_the_explorer(view):
    tr = video_trace()
    args = (tr, vc.Recipe(), vc.Recipe(site="F4")) if view == "Compare" else (tr,)
    with pytest.raises(ValueError, match=rf"^trace: a video trace .*{view} shows one image's trace\. Show a "
                                         r"video trace with vc\.Explorer\(trace\) \(a frame slider\) "
                                         r".*vc\.plot\.frame_strip"):
        getattr(vc, view)(*args)


def test_the_export_holds_every_frames_map_of_every_recipe_exactly():
    tr = video_trace()
    bundle = build_bundle(tr, vc.Recipe(), axes={"site": ["F1", "F4"], "weighting": ["gradcam", "layercam"],
                                                 "target": ["logit"], "class_": ["top1"]},
                          quantize="float32", progress=False)
    meta = bundle.meta
    data = zlib.decompress(base64.b64decode(bundle.maps))
    entries = json.loads(zlib.decompress(base64.b64decode(bundle.texts)))
    n = 16 * 16 * 4
    assert meta["frames"] == FRAMES and meta["frame_bytes"] == n and meta["image_bytes"] == FRAMES * n
    for f in range(FRAMES):
        assert data[f * n:(f + 1) * n] == rgba(tr["clip"].values[f])
    grids = np.frombuffer(data[meta["image_bytes"]:], "<f4").reshape(-1, 16, 16)
    assert meta["count"] == len(entries) == 2 * 2 * 2  # sites x layers x weightings
    for entry in entries:
        full = vc.cam(tr, vc.Recipe.from_json(entry["r"])).values
        assert len(entry["g"]) == FRAMES
        for f, g in enumerate(entry["g"]):
            np.testing.assert_array_equal(grids[g], full[f])
        assert entry["v"] == [float(full.min()), float(full.max())]
    # The page says what it draws: vc.cam's maps as computed, not upsampled again.
    assert "a video trace of 4 frames: each frame&#x27;s map is the one vc.cam computed" in page_html(bundle, "t")


def test_static_view_of_a_video_trace_is_the_frame_strip():
    import matplotlib

    matplotlib.use("Agg")
    fig = vc.Explorer(video_trace()).static()
    assert [ax.get_title() for ax in fig.axes[:FRAMES]] == [f"frame {f}" for f in range(FRAMES)]


def test_an_export_mixing_the_token_grid_with_upsampled_frames_is_refused_by_name():
    with pytest.raises(vc.ExportError, match=r"grids of different shapes.*of a video trace, upsample 'none'"):
        build_bundle(video_trace(), vc.Recipe(), axes={"site": ["F1"], "layer": [1], "weighting": ["gradcam"],
                                                       "target": ["logit"], "class_": ["top1"],
                                                       "upsample": ["bilinear", "none"]}, progress=False)
