"""Issue #37 item 3, the face of a video trace: the one-image views refused clearly, not by accident.

Before, ``vc.Explorer(video_trace)`` failed with "trace: has no 'image'" (true, but no way forward) and
``vc.plot.overlay`` on a video map raised a bare ``KeyError: 'image'``. Now each refuses with a ``ValueError``
that names the argument, says it is a video trace or map, and points at ``vc.plot.frame_strip``; before any
widget or figure is made. The new schema entries of a video trace are documented, and a ``patch_frame`` outside
the (t, y, x) grid is a schema problem like a ``patch_row`` outside it.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import vitcam_nb as vc
from vitcam_nb.core import schema

transformers = pytest.importorskip("transformers")


@functools.cache
def video_trace():
    torch.manual_seed(0)
    cfg = transformers.VideoMAEConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32, image_size=16, patch_size=8, num_frames=4,
                                      tubelet_size=2, num_labels=2)
    model = transformers.VideoMAEForVideoClassification(cfg).eval()
    clip = torch.randn((4, 3, 16, 16), generator=torch.Generator().manual_seed(0))
    return vc.trace(model, clip, targets="top1")


@pytest.mark.parametrize("view", ["Explorer", "Compare"])
def test_widgets_refuse_a_video_trace_and_point_at_frame_strip(view):
    tr = video_trace()
    args = (tr,) if view == "Explorer" else (tr, vc.Recipe(), vc.Recipe(site="F4"))
    with pytest.raises(ValueError, match=r"^trace: a video trace .*vc\.plot\.frame_strip"):
        getattr(vc, view)(*args)


def test_export_html_refuses_a_video_trace_before_writing(tmp_path):
    with pytest.raises(ValueError, match=r"trace: a video trace .*frame_strip"):
        vc.export_html(video_trace(), tmp_path / "page.html")
    assert list(tmp_path.iterdir()) == []


def test_overlay_refuses_a_video_trace_and_a_video_map():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = video_trace()
    m = vc.cam(tr, vc.Recipe())
    assert m.dims == ("frame", "y", "x")
    before = plt.get_fignums()
    with pytest.raises(ValueError, match=r"^trace: a video trace .*vc\.plot\.frame_strip\(trace, cam_map\)"):
        vc.plot.overlay(tr, m)
    # a video map over an image trace: the map is what does not fit
    image_tr = tr.drop_vars("clip").assign(image=(("y", "x", "rgb"), np.zeros((16, 16, 3), np.uint8)))
    with pytest.raises(ValueError, match=r"^cam_map: overlay\(\) draws a 2-D map \(y, x\), got dims "
                                         r"\('frame', 'y', 'x'\); a video map: draw it with vc\.plot\.frame_strip"):
        vc.plot.overlay(image_tr, m)
    assert plt.get_fignums() == before  # refused before a figure was made


def test_the_video_entries_are_in_the_schema_and_checked():
    tr = video_trace()
    for name in ("clip",):
        assert tr[name].dims == schema.VARIABLES[name].dims
    assert tr["patch_frame"].dims == schema.COORDINATES["patch_frame"].dims
    for name in ("grid_t", "clip_frames", "tubelet_size", "token_order"):
        assert name in tr.attrs and name in schema.ATTRIBUTES
    assert schema.problems(tr) == []
    frames = tr["patch_frame"].values.copy()
    frames[-1] = 2  # grid_t is 2: tubelets 0 and 1
    bad = tr.assign_coords(patch_frame=("token", frames))
    assert schema.problems(bad) == ["coordinate 'patch_frame' holds values outside -1..1 (grid_t 2)"]
