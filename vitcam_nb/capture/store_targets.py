"""Detection targets in a :func:`vitcam_nb.trace_many` store: one :func:`vitcam_nb.targets.detection` for every
image, or a list of them, one per image (e.g. each image's own ground-truth box). A box is matched and a top class
chosen per image, so each image is traced in a pass of its own, exactly as :func:`vitcam_nb.trace` traces it with
that target; the target attributes that describe the image's own detections (:data:`IMAGE_TARGET_ATTRS`) are
stored per image and given back by :func:`vitcam_nb.image_trace`.

Example:
    >>> from vitcam_nb.targets.detection import detection
    >>> len(detection_targets([detection(query=0), detection(query=1)], 2))
    2
    >>> detection_targets("top5", 2) is None
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.provenance import settings_id
from vitcam_nb.targets.detection import Detection

__all__ = ["IMAGE_TARGET_ATTRS", "detection_plan", "detection_settings", "detection_targets",
           "image_target", "split_target_attrs"]

#: The target attributes of a detection trace that describe that image's detections (box, class, score).
IMAGE_TARGET_ATTRS = ("target_scores", "target_detections", "target_checklist")


def detection_targets(targets: Any, n: int | None) -> list[Detection] | None:
    """The detection targets of a store (one for all images, or one per image), None for class targets; a
    list whose length is not the number of images is refused, naming both.

    Example:
        >>> from vitcam_nb.targets.detection import detection
        >>> len(detection_targets(detection(query=[0, 1]), None))
        1
    """
    if isinstance(targets, Detection):
        return [targets]
    if not isinstance(targets, Sequence) or isinstance(targets, str) or not targets:
        return None
    if not any(isinstance(t, Detection) for t in targets):
        return None
    if not all(isinstance(t, Detection) for t in targets):
        raise TraceError("targets: a list of detection targets holds one vitcam_nb.targets.detection per image; "
                         f"this one also holds {sorted({type(t).__name__ for t in targets} - {'Detection'})}")
    if n is None or len(targets) != n:
        raise TraceError(f"targets: {len(targets)} detection targets (one per image) for "
                         f"{'an iterator of images' if n is None else f'{n} images'}; give a list of images and one "
                         "target per image, or one target for every image")
    return list(targets)


def detection_plan(model: Any, targets: list[Detection], **plan_args: Any) -> TracePlan:
    """The plan of a detection store: every target checked against the model before any pass; a family whose
    layout a store does not hold (per-stage grids, extra sites) refused as class stores refuse it.

    Example:
        >>> plan = detection_plan(yolos, [vc.targets.detection(query=0)], sites=["F1"])  # doctest: +SKIP
    """
    plan = TracePlan.for_trace(model, targets[0], **plan_args)
    if getattr(plan.adapter, "hierarchical", False) or plan.extra_layers:
        raise TraceError(f"model: trace_many stores flat token layouts; the {plan.adapter.family} family has "
                         "per-stage grids or extra sites. Trace its images one by one with vitcam_nb.trace()")
    for t in targets[1:]:
        t.check(plan.model)
    return plan


def image_target(plan: TracePlan, targets: list[Detection], index: int) -> TracePlan:
    """The plan of image ``index``: its own target (or the one for every image).

    Example:
        >>> image_target(plan, targets, 3).target is targets[3]  # doctest: +SKIP
        True
    """
    target = targets[index] if len(targets) > 1 else targets[0]
    return TracePlan(**{**plan.__dict__, "target": target})


def detection_settings(targets: list[Detection]) -> dict:
    """The ``targets`` entry of a detection store's settings: the one target's settings, or a digest of every
    image's (a resumed call with other boxes is another store).

    Example:
        >>> from vitcam_nb.targets.detection import detection
        >>> detection_settings([detection(query=0)])["queries"]
        [0]
    """
    if len(targets) == 1:
        return targets[0].settings()
    return {"kind": "detection", "per_image": len(targets),
            "settings_id": settings_id({"targets": [t.settings() for t in targets]})}


def split_target_attrs(per: list[xr.Dataset]) -> tuple[list[xr.Dataset], dict[str, np.ndarray]]:
    """Each image's trace without its per-image target attributes, and those attributes as (image,) values.

    Example:
        >>> one = xr.Dataset(attrs={"target_scores": "box 1", "model_name": "m"})
        >>> traces, values = split_target_attrs([one])
        >>> traces[0].attrs, values["target_scores"].tolist()
        ({'model_name': 'm'}, ['box 1'])
    """
    keys = [k for k in IMAGE_TARGET_ATTRS if k in per[0].attrs]
    values = {k: np.array([str(ds.attrs.get(k, "")) for ds in per], dtype=object) for k in keys}
    out = []
    for ds in per:
        ds = ds.copy()
        ds.attrs = {k: v for k, v in ds.attrs.items() if k not in keys}
        out.append(ds)
    return out, values

