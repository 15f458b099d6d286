"""The video known-answer report: how well video maps of the bundled ``shapes-video`` point at the right frames.

Each clip of :func:`vitcam_nb.data.shapes_video.shape_clips` shows its class object in a known range of frames
(the *evidence frames*) and nowhere else, with its pixel mask in each of them. Two scores, in NumPy:

* **right frames**: the share of the map's mass (the sum of its values, over every frame and pixel) that lies in
  the evidence frames. A map that spreads evenly over the clip scores the evidence frames' share of the frames
  (2 of 4 for ``shapes-video``: 0.5); a map entirely in the evidence frames scores 1. NaN for an all-zero map. A
  map with negative values (no ReLU) is scored on its values as they are, so its share can leave [0, 1].
* **frame pointing**: the pointing game per evidence frame, averaged over those frames: whether the frame's
  highest pixel lies on the class object (its mask, widened by ``tolerance`` pixels), ties counted fractionally;
  NaN for a frame whose map is constant.

Example:
    >>> m = np.zeros((4, 2, 2)); m[2:, 0, 0] = 1.0
    >>> right_frames(m, np.array([False, False, True, True]))
    1.0
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import torch

from vitcam_nb.capture.trace import trace
from vitcam_nb.core import presets
from vitcam_nb.core.errors import ArgumentError, DegenerateMapWarning, RecipeError
from vitcam_nb.core.kinds import kind_for
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.data.shapes_video import shape_clips
from vitcam_nb.data.train_video import normalise_clips
from vitcam_nb.models import load_model

__all__ = ["VIDEO_RECIPES", "frame_pointing", "report_known_answer_video", "right_frames"]

#: The recipes the report scores by default: Grad-CAM at three sites and depths, HiResCAM and LayerCAM, attention
#: rollout (rows averaged over the tokens: VideoMAE has no class token), and nearest time upsampling.
VIDEO_RECIPES: dict[str, Recipe] = {
    "gradcam F1 last block": Recipe(site="F1", layer=-1),
    "gradcam F4 last block": Recipe(site="F4", layer=-1),
    "gradcam F6 first block": Recipe(site="F6", layer=0),
    "hirescam F1 last block": presets.hirescam(),
    "layercam F1 last block": presets.layercam(),
    "attention rollout, mean rows": presets.attention_rollout().replace(attn_rows="mean"),
    "gradcam F1 last block, nearest in time": Recipe(site="F1", layer=-1, upsample="nearest"),
}


def _frames(cam_map: object, what: str) -> np.ndarray:
    values = np.asarray(getattr(cam_map, "values", cam_map), dtype=np.float64)
    if values.ndim != 3:
        raise ArgumentError(f"cam_map: expected a video map (frame, y, x), got {values.ndim} dimensions "
                            f"{values.shape}; {what}")
    return values


def right_frames(cam_map: object, evidence: np.ndarray) -> float:
    """The share of ``cam_map``'s mass in the evidence frames: the sum of its values on the frames where
    ``evidence`` is True over the sum of all its values (NaN when the map sums to 0).

    ``cam_map``: a (frame, y, x) map (DataArray or array); ``evidence``: bool (frame,).

    Example:
        >>> right_frames(np.ones((4, 2, 2)), np.array([True, True, False, False]))
        0.5
    """
    values = _frames(cam_map, "compute it with upsampling on (not upsample='none')")
    evidence = np.asarray(evidence, dtype=bool)
    if evidence.shape != values.shape[:1]:
        raise ArgumentError(f"evidence: expected one bool per frame ({values.shape[0]}), got shape {evidence.shape}")
    total = values.sum()
    return float(values[evidence].sum() / total) if total != 0 else float("nan")


def frame_pointing(cam_map: object, masks: np.ndarray, evidence: np.ndarray, tolerance: float = 0.0) -> float:
    """Pointing game per evidence frame, averaged: the share of each frame's peak pixels (ties) that lie within
    ``tolerance`` pixels of that frame's mask; NaN for a frame with a constant map (left out of the mean).

    ``masks``: bool (frame, y, x) of the class object; ``evidence``: bool (frame,).

    Example:
        >>> m = np.zeros((2, 3, 3)); m[1, 1, 1] = 1.0; m[0, 0, 0] = 1.0
        >>> masks = np.zeros((2, 3, 3), bool); masks[:, 1, 1] = True
        >>> frame_pointing(m, masks, np.array([True, True]))
        0.5
    """
    from scipy import ndimage

    values = _frames(cam_map, "the pointing game is per frame")
    masks, evidence = np.asarray(masks, dtype=bool), np.asarray(evidence, dtype=bool)
    if masks.shape != values.shape:
        raise ArgumentError(f"masks: expected the map's shape {values.shape}, got {masks.shape}")
    hits = []
    for f in np.flatnonzero(evidence):
        frame = values[f]
        if np.ptp(frame) == 0:
            continue
        near = ndimage.distance_transform_edt(~masks[f]) <= tolerance
        peaks = frame == frame.max()
        hits.append((peaks & near).sum() / peaks.sum())
    return float(np.mean(hits)) if hits else float("nan")


def _for_class(recipe: Recipe, class_: int) -> Recipe:
    """``recipe`` for the clip's true class; a recipe that uses no gradient (attention rollout) has no class."""
    try:
        return recipe.replace(class_=class_)
    except RecipeError:
        return recipe


def report_known_answer_video(model: torch.nn.Module | str = "shapes-video", n_clips: int = 50, seed: int = 0,
                              recipes: Mapping[str, Recipe] | None = None,
                              tolerance: float = 4.0) -> tuple[list[dict], dict]:
    """Score each recipe on ``n_clips`` fresh clips of the moving-shape generator: mean right-frames share and
    mean frame pointing, for the true class, with a uniform map's right-frames share beside them.

    Returns ``(rows, settings)``: one dict per recipe (``recipe``, ``recipe_id``, ``right_frames``,
    ``frame_pointing``, ``n``) plus a ``uniform map`` row, and the settings (model, its accuracy on the clips, seed,
    clips, tolerance). ``scripts/known_answer_report.py --model shapes-video`` writes them as JSON.

    Example:
        >>> rows, settings = report_known_answer_video(n_clips=4)  # doctest: +SKIP
        >>> rows[-1]["recipe"], rows[-1]["right_frames"]  # doctest: +SKIP
        ('uniform map', 0.5)
    """
    if not isinstance(n_clips, int) or n_clips < 1:
        raise ArgumentError(f"n_clips: expected a positive int, got {n_clips!r}")
    recipes = dict(VIDEO_RECIPES if recipes is None else recipes)
    net = load_model(model)
    cfg = net.config
    clips, labels, masks, evidence = shape_clips(n_clips, seed, frames=int(cfg.num_frames), size=int(cfg.image_size),
                                                 span=int(cfg.tubelet_size))
    x = normalise_clips(clips)
    scores = {name: ([], []) for name in recipes}
    correct = 0
    for i in range(n_clips):
        tr = trace(net, x[i], targets=[int(labels[i])])
        correct += int(np.argmax(tr["logits"].values) == labels[i])
        for name, recipe in recipes.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DegenerateMapWarning)
                r = _for_class(recipe, int(labels[i]))
                m = kind_for(tr, r).cam(tr, r)  # the video trace kind (vitcam_nb.compute registers it)
            scores[name][0].append(right_frames(m, evidence[i]))
            scores[name][1].append(frame_pointing(m, masks[i], evidence[i], tolerance))
    rows = [{"recipe": name, "recipe_id": recipe.id, "right_frames": float(np.nanmean(rf)),
             "frame_pointing": float(np.nanmean(fp)), "n": n_clips}
            for (name, recipe), (rf, fp) in zip(recipes.items(), scores.values(), strict=True)]
    uniform = float(np.mean([right_frames(np.ones(masks[i].shape), evidence[i]) for i in range(n_clips)]))
    rows.append({"recipe": "uniform map", "recipe_id": "", "right_frames": uniform, "frame_pointing": float("nan"),
                 "n": n_clips})
    settings = {"model": model if isinstance(model, str) else type(model).__name__, "accuracy": correct / n_clips,
                "seed": seed, "n_clips": n_clips, "tolerance_px": tolerance, "target": "the true class's logit",
                "generator": f"vitcam_nb.data.shapes_video.shape_clips({n_clips}, {seed}, frames={cfg.num_frames}, "
                             f"size={cfg.image_size}, span={cfg.tubelet_size})"}
    return rows, settings
