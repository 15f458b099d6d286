"""Synthetic known-answer detection images: two or three shapes per image, each with its exact box and mask.

Each image holds two or three non-overlapping objects (circle, square or cross, the classes of
:data:`DET_CLASS_NAMES`) at random sizes, rotations and colours over the textured background of
:func:`vitcam_nb.data.shapes.shapes`. The image is cut into three vertical bands of equal width; each object's
centre lies in a band of its own (two of the three bands, or all three, chosen at random), anywhere in it, so
slot ``k`` of the returned arrays is band ``k`` from the left and the objects are listed left to right, an empty
band holding no object. That is the order the bundled detector ``shapes-yolos`` reports them in: its detection
token ``k`` predicts the object of band ``k`` or "no object". A box is the tight pixel box of the object's mask
``(x0, y0, x1, y1)``, ``x1``/``y1`` exclusive, so the boxes are known exactly, and the mask of object ``k`` is
where a map of detection ``k`` should point.

Example:
    >>> images, labels, boxes, masks = shapes_detection(4, seed=0)
    >>> images.shape, labels.shape, boxes.shape, masks.shape
    ((4, 64, 64, 3), (4, 3), (4, 3, 4), (4, 3, 64, 64))
"""

from __future__ import annotations

import numpy as np

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.data.shapes import background, contrasting_colour, coverage, paint, rotate, sd_box

__all__ = ["DET_CLASS_NAMES", "MAX_OBJECTS", "NO_OBJECT", "detection_generator_settings", "shapes_detection"]

DET_CLASS_NAMES: tuple[str, ...] = ("circle", "square", "cross")
MAX_OBJECTS = 3
#: The label of an empty band (an image with two objects has label -1, a zero box and an all-False mask there).
NO_OBJECT = -1

_RADIUS = (6.0, 9.0)  # object size (circle radius) in pixels at size 64
_MAX_ROTATION_DEG = 15.0
_GAP = 3.0  # pixels between the discs that bound two objects
_EXTENT = 1.25  # every object lies within 1.25 r of its centre (square corners: 0.85 r * sqrt(2) = 1.2 r)
_TRIES = 64  # placements tried per object before the image is redrawn


def shapes_detection(n: int, seed: int, size: int = 64) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Generate ``n`` images with two or three objects each.

    Returns
    -------
    images : uint8 ``(n, size, size, 3)`` RGB.
    labels : int64 ``(n, 3)`` indices into :data:`DET_CLASS_NAMES` per band (left to right), ``-1``
        (:data:`NO_OBJECT`) for the empty band of a two-object image.
    boxes : float32 ``(n, 3, 4)`` ``(x0, y0, x1, y1)`` in pixels, the tight box of each mask (``x1``, ``y1``
        exclusive); zeros for an empty band.
    masks : bool ``(n, 3, size, size)``: the pixels of each object.

    Example:
        >>> _, labels, boxes, masks = shapes_detection(2, seed=1)
        >>> bool(((labels >= 0) == masks.any(axis=(2, 3))).all())
        True
    """
    if n < 0:
        raise ArgumentError(f"n must be >= 0, got {n}")
    if size < 32:
        raise ArgumentError(f"size must be >= 32, got {size}")
    rng = np.random.default_rng(seed)
    s = size / 64.0
    img = background(rng, n, size) if n else np.zeros((0, size, size, 3), np.float32)
    bg_mean = img.mean(axis=(1, 2))
    count = rng.integers(2, MAX_OBJECTS + 1, size=n)
    # a two-object image leaves one band empty, chosen uniformly
    empty = np.where(count < MAX_OBJECTS, rng.integers(0, MAX_OBJECTS, size=n), -1)
    present = np.arange(MAX_OBJECTS)[None] != empty[:, None]
    cls = rng.integers(0, len(DET_CLASS_NAMES), size=(n, MAX_OBJECTS))
    radius = rng.uniform(*_RADIUS, size=(n, MAX_OBJECTS)).astype(np.float32) * s
    angle = np.deg2rad(rng.uniform(-_MAX_ROTATION_DEG, _MAX_ROTATION_DEG, size=(n, MAX_OBJECTS))).astype(np.float32)
    cross_frac = rng.uniform(0.28, 0.38, size=(n, MAX_OBJECTS)).astype(np.float32)
    colour = np.stack([contrasting_colour(rng, bg_mean) for _ in range(MAX_OBJECTS)], axis=1) if n else \
        np.zeros((0, MAX_OBJECTS, 3), np.float32)
    centres = np.stack([_place(rng, radius[i] * _EXTENT, present[i], size, _GAP * s) for i in range(n)]) if n else \
        np.zeros((0, MAX_OBJECTS, 2), np.float32)

    coords = np.arange(size, dtype=np.float32) + 0.5
    masks = np.zeros((n, MAX_OBJECTS, size, size), dtype=bool)
    for k in range(MAX_OBJECTS):
        u, v = rotate(coords[None, None, :] - centres[:, k, 0, None, None],
                       coords[None, :, None] - centres[:, k, 1, None, None], angle[:, k])
        r = radius[:, k, None, None]
        w = cross_frac[:, k, None, None] * r
        sd = np.where((cls[:, k] == 0)[:, None, None], np.sqrt(u * u + v * v) - r,
                      np.where((cls[:, k] == 1)[:, None, None], sd_box(u, v, 0.85 * r, 0.85 * r),
                               np.minimum(sd_box(u, v, r, w), sd_box(u, v, w, r))))
        sd[~present[:, k]] = np.inf
        paint(img, coverage(sd), colour[:, k])
        masks[:, k] = sd < 0.0

    labels = np.where(present, cls, NO_OBJECT).astype(np.int64)
    images = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    return images, labels, _mask_boxes(masks), masks


def detection_generator_settings() -> dict:
    """The constants that define the detection images (sizes in pixels at 64x64), for the model card.

    Example:
        >>> detection_generator_settings()["objects_per_image"]
        [2, 3]
    """
    return {"classes": list(DET_CLASS_NAMES), "objects_per_image": [2, MAX_OBJECTS], "object_radius": list(_RADIUS),
            "max_rotation_deg": _MAX_ROTATION_DEG, "min_gap": _GAP, "background": "as vitcam_nb.data.shapes",
            "bands": "three vertical bands of equal width; each object's centre in its own band; slot k = band k",
            "order": "left to right by band; an empty band has label -1",
            "box": "tight pixel box of the mask, (x0, y0, x1, y1), x1 and y1 exclusive"}


def _place(rng: np.random.Generator, extent: np.ndarray, present: np.ndarray, size: int, gap: float) -> np.ndarray:
    """Centres (3, 2): object k's centre in band k, the object inside the image and ``gap`` from the others
    (bounding discs of radius ``extent``); rows of empty bands are 0."""
    out = np.zeros((MAX_OBJECTS, 2), np.float32)
    band = size / MAX_OBJECTS
    for _ in range(_TRIES):
        ok = True
        for k in np.nonzero(present)[0]:
            e = float(extent[k])
            x = rng.uniform(max(k * band, e + 1.0), min((k + 1) * band, size - e - 1.0), size=_TRIES)
            y = rng.uniform(e + 1.0, size - e - 1.0, size=_TRIES)
            xy = np.stack([x, y], 1).astype(np.float32)
            far = np.ones(_TRIES, bool)
            for j in np.nonzero(present[:k])[0]:
                far &= np.linalg.norm(xy - out[j], axis=1) >= e + extent[j] + gap
            if not far.any():
                ok = False
                break
            out[k] = xy[int(np.argmax(far))]
        if ok:
            return out
    raise RuntimeError("could not place the objects apart; the image is too small for them")


def _mask_boxes(masks: np.ndarray) -> np.ndarray:
    """(n, K, 4) tight boxes (x0, y0, x1, y1) of (n, K, H, W) masks, exclusive ends; zeros for an empty mask."""
    cols, rows = masks.any(axis=2), masks.any(axis=3)
    w, h = cols.shape[-1], rows.shape[-1]
    x0 = np.where(cols.any(-1), cols.argmax(-1), 0)
    x1 = np.where(cols.any(-1), w - cols[..., ::-1].argmax(-1), 0)
    y0 = np.where(rows.any(-1), rows.argmax(-1), 0)
    y1 = np.where(rows.any(-1), h - rows[..., ::-1].argmax(-1), 0)
    return np.stack([x0, y0, x1, y1], -1).astype(np.float32)
