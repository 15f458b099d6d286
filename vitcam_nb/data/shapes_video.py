"""Synthetic known-answer clips: one class-determining moving shape, present in one frame range only.

Each clip has ``frames`` frames. The *class object* (circle, square, triangle, cross or ring, the classes of
:mod:`vitcam_nb.data.shapes`) is drawn in ``span`` consecutive frames only, the *evidence frames*, starting at a
multiple of ``span`` (so with ``span`` equal to a model's tubelet size the evidence fills whole tubelets), and it
moves in a straight line across them. Every frame also holds moving distractors that are none of the class shapes
(small dots and thin ellipses), so motion alone and the presence of an object do not give the class away. Colours
are random and contrast with the background; only the shape decides the class. The pixel masks of the class object
in each frame (empty outside the evidence frames) are the known answer a heatmap should point at, in space and in
time.

Everything is vectorised over the batch with NumPy and driven by one ``numpy.random.Generator``: a seed fixes the
clips exactly.

Example:
    >>> clips, labels, masks, evidence = shape_clips(2, seed=0)
    >>> clips.shape, masks.shape, evidence.sum(axis=1).tolist()
    ((2, 4, 32, 32, 3), (2, 4, 32, 32), [2, 2])
"""

from __future__ import annotations

import numpy as np

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.data.shapes import CLASS_NAMES, NUM_CLASSES

__all__ = ["CLASS_NAMES", "NUM_CLASSES", "shape_clips", "video_generator_settings"]

_RADIUS = (6.0, 9.0)  # class object size (circle radius) in pixels at size 32
_MAX_ROTATION_DEG = 15.0
_SPEED = 2.0  # class objects and distractors move up to this many pixels per frame along each axis (at size 32)
_BG_LEVEL = (40.0, 215.0)
_BG_TINT = 20.0
_NOISE_SD = 4.0
_N_DISTRACTORS = 3
_DOT_RADIUS = (1.2, 2.2)
_ELLIPSE_AXES = ((3.5, 5.0), (0.9, 1.4))  # half-axes of the thin ellipses


def shape_clips(n: int, seed: int, frames: int = 4, size: int = 32,
                span: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Generate ``n`` clips with one moving class object in ``span`` consecutive frames each.

    Parameters
    ----------
    n : number of clips.
    seed : seed of the ``numpy.random.Generator``; the same arguments always give the same arrays.
    frames : frames per clip (4 for the bundled ``shapes-video``).
    size : frame height and width in pixels (lengths scale with it; 32 for the bundled model).
    span : evidence frames per clip; ``frames`` must be a multiple of it. The first evidence frame is a multiple
        of ``span`` drawn uniformly.

    Returns
    -------
    clips : uint8 ``(n, frames, size, size, 3)`` (RGB).
    labels : int64 ``(n,)`` indexing :data:`CLASS_NAMES`.
    masks : bool ``(n, frames, size, size)``, True on the class object's pixels (none outside the evidence frames).
    evidence : bool ``(n, frames)``, True on the evidence frames.

    Example
    -------
    >>> clips, labels, masks, evidence = shape_clips(3, seed=1)
    >>> bool((masks.any(axis=(2, 3)) == evidence).all())
    True
    """
    if n < 0:
        raise ArgumentError(f"n: expected >= 0, got {n}")
    if size < 16:
        raise ArgumentError(f"size: expected >= 16, got {size}")
    if span < 1 or frames < span or frames % span:
        raise ArgumentError(f"span: expected a divisor of frames ({frames}) between 1 and frames, got {span}")
    rng = np.random.default_rng(seed)
    s = size / 32.0
    t = np.arange(frames)
    coords = np.arange(size, dtype=np.float32) + 0.5
    yy, xx = coords[None, None, :, None], coords[None, None, None, :]  # (1, 1, H, 1), (1, 1, 1, W)

    labels = rng.integers(0, NUM_CLASSES, size=n)
    start = rng.integers(0, frames // span, size=n) * span
    evidence = (t[None] >= start[:, None]) & (t[None] < start[:, None] + span)
    bg = rng.uniform(*_BG_LEVEL, size=(n, 1, 1, 1, 1)) + rng.uniform(-_BG_TINT, _BG_TINT, size=(n, 1, 1, 1, 3))
    img = np.broadcast_to(bg, (n, frames, size, size, 3)).astype(np.float32)
    img = img + _NOISE_SD * rng.standard_normal(img.shape, dtype=np.float32)
    dark = bg.mean(axis=-1)[:, 0, 0, 0] >= 128.0  # objects are dark on a light background and vice versa

    # distractors, in every frame, under the class object
    for _ in range(_N_DISTRACTORS):
        kind = rng.integers(0, 2, size=n)
        c0, v = _path(rng, n, frames, size, 3.0 * s)
        angle = rng.uniform(0.0, np.pi, size=n)
        dot_r = rng.uniform(*_DOT_RADIUS, size=n) * s
        ea, eb = (rng.uniform(*a, size=n) * s for a in _ELLIPSE_AXES)
        u, w = _local(xx, yy, c0, v, t, angle)
        # a dot is an ellipse with equal half-axes
        ea, eb = np.where(kind == 0, dot_r, ea), np.where(kind == 0, dot_r, eb)
        _paint(img, _sd_ellipse(u, w, ea[:, None, None, None], eb[:, None, None, None]), _colour(rng, dark))

    # the class object, in the evidence frames only
    radius = rng.uniform(*_RADIUS, size=n) * s
    c0, v = _path(rng, n, span, size, 1.2 * radius + 1.0 * s)
    angle = np.deg2rad(rng.uniform(-_MAX_ROTATION_DEG, _MAX_ROTATION_DEG, size=n))
    u, w = _local(xx, yy, c0, v, t - start[:, None], angle)
    sd = _sd_class(u, w, radius[:, None, None, None], labels)
    sd[~evidence] = np.inf
    _paint(img, sd, _colour(rng, dark))
    masks = sd < 0.0
    return np.clip(np.rint(img), 0, 255).astype(np.uint8), labels.astype(np.int64), masks, evidence


def video_generator_settings() -> dict:
    """The constants that define the clip distribution (lengths in pixels at 32x32), for the model card.

    Example:
        >>> video_generator_settings()["n_distractors"]
        3
    """
    return {"object_radius": list(_RADIUS), "max_rotation_deg": _MAX_ROTATION_DEG, "max_speed_px_per_frame": _SPEED,
            "background_level": list(_BG_LEVEL), "background_tint": _BG_TINT, "noise_sd": _NOISE_SD,
            "n_distractors": _N_DISTRACTORS, "dot_radius": list(_DOT_RADIUS),
            "ellipse_half_axes": [list(a) for a in _ELLIPSE_AXES],
            "colours": "per channel uniform in [0, 85] on a light background (mean >= 128), [170, 255] otherwise"}


def _path(rng: np.random.Generator, n: int, steps: int, size: int, margin: np.ndarray | float):
    """Start (n, 2) and velocity (n, 2) of straight paths that stay ``margin`` inside the frame for ``steps``."""
    margin = np.broadcast_to(np.asarray(margin, dtype=np.float64), (n,))[:, None]
    v = rng.uniform(-_SPEED, _SPEED, size=(n, 2)) * size / 32.0
    travel = v * (steps - 1)
    lo = margin + np.maximum(0.0, -travel)
    hi = size - margin - np.maximum(0.0, travel)
    return lo + rng.uniform(0.0, 1.0, size=(n, 2)) * np.maximum(hi - lo, 0.0), v


def _local(xx: np.ndarray, yy: np.ndarray, c0: np.ndarray, v: np.ndarray, steps: np.ndarray, angle: np.ndarray):
    """Rotated coordinates (n, T, H, W) around the centre ``c0 + v * steps`` of each frame."""
    steps = np.broadcast_to(steps, (c0.shape[0], steps.shape[-1])).astype(np.float32)
    cx = (c0[:, 0:1] + v[:, 0:1] * steps)[:, :, None, None]
    cy = (c0[:, 1:2] + v[:, 1:2] * steps)[:, :, None, None]
    c, s = np.cos(angle)[:, None, None, None], np.sin(angle)[:, None, None, None]
    x, y = (xx - cx).astype(np.float32), (yy - cy).astype(np.float32)
    return c * x + s * y, -s * x + c * y


def _sd_box(u: np.ndarray, v: np.ndarray, hu: np.ndarray, hv: np.ndarray) -> np.ndarray:
    qu, qv = np.abs(u) - hu, np.abs(v) - hv
    return np.sqrt(np.maximum(qu, 0.0) ** 2 + np.maximum(qv, 0.0) ** 2) + np.minimum(np.maximum(qu, qv), 0.0)


def _sd_ellipse(u: np.ndarray, v: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # a first-order distance (exact on the axes), enough for small distractors
    k = np.sqrt((u / a) ** 2 + (v / b) ** 2)
    return (k - 1.0) * np.minimum(a, b)


def _sd_class(u: np.ndarray, v: np.ndarray, r: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Signed distance (negative inside) to each clip's class shape, the shapes of vitcam_nb.data.shapes."""
    out = np.empty(u.shape, dtype=np.float32)
    for c in range(NUM_CLASSES):
        sel = labels == c
        uc, vc, rc = u[sel], v[sel], r[sel]
        if c in (0, 4):
            d = np.sqrt(uc * uc + vc * vc)
            out[sel] = d - rc if c == 0 else np.abs(d - 0.775 * rc) - 0.225 * rc  # circle; ring, inner radius 0.55 r
        elif c == 1:
            out[sel] = _sd_box(uc, vc, 0.85 * rc, 0.85 * rc)  # square of about the circle's area
        elif c == 2:  # equilateral triangle, circumradius 1.2 r (inradius 0.6 r)
            sides = [uc * np.cos(a) + vc * np.sin(a) - 0.6 * rc for a in np.pi / 2 + np.arange(3) * 2 * np.pi / 3]
            out[sel] = np.maximum.reduce(sides)
        else:  # plus-shaped cross, arm half-width 0.3 r
            out[sel] = np.minimum(_sd_box(uc, vc, rc, 0.3 * rc), _sd_box(uc, vc, 0.3 * rc, rc))
    return out


def _colour(rng: np.random.Generator, dark: np.ndarray) -> np.ndarray:
    col = rng.uniform(0.0, 85.0, size=(dark.shape[0], 3))
    return np.where(dark[:, None], col, col + 170.0).astype(np.float32)


def _paint(img: np.ndarray, sd: np.ndarray, colour: np.ndarray) -> None:
    alpha = np.clip(0.5 - sd, 0.0, 1.0)[..., None]  # one pixel of anti-aliasing
    img *= 1.0 - alpha
    img += alpha * colour[:, None, None, None, :]
