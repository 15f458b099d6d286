"""Synthetic known-answer images: one class-determining shape among distractors.

Each image holds exactly one *class object* (circle, square, triangle, cross or ring) at a random
position, scale, rotation and colour, drawn over a textured background (colour gradient, low-frequency
blotches and pixel noise) together with distractor objects that are none of the class shapes (thin line
segments, small dots, elongated ellipses). The colour of every object is random, so only the object's
*shape* decides the class, and the pixel mask of the class object is the ground-truth evidence a
heatmap should point at.

Everything is vectorised over the batch with numpy and driven by one ``numpy.random.Generator``, so a
seed fixes the images exactly.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from vitcam_nb.core.errors import ArgumentError

__all__ = ["CLASS_NAMES", "NUM_CLASSES", "MEAN", "STD", "generator_settings", "shapes", "shortcut_marks"]

CLASS_NAMES: tuple[str, ...] = ("circle", "square", "triangle", "cross", "ring")
NUM_CLASSES = len(CLASS_NAMES)

# Normalisation used to train the bundled models (pixel / 255, then (x - MEAN) / STD).
MEAN: tuple[float, float, float] = (0.5, 0.5, 0.5)
STD: tuple[float, float, float] = (0.25, 0.25, 0.25)

# Shortcut marks: class c puts a 6x6 patch of colour _MARK_COLOURS[c] in corner _MARK_CORNERS[c]
# (0 top-left, 1 top-right, 2 bottom-left, 3 bottom-right).
_MARK_SIZE = 6
_MARK_MARGIN = 2
_MARK_CORNERS = np.array([0, 1, 2, 3, 0])
_MARK_COLOURS = np.array(
    [[255, 255, 255], [255, 40, 40], [40, 255, 40], [40, 90, 255], [255, 255, 40]], dtype=np.float32
)

_RADIUS = (10.0, 16.0)  # class object size (circle radius) in pixels at size 64
_MAX_ROTATION_DEG = 15.0  # class objects are rotated uniformly in [-max, max] degrees
_BG_LEVEL = (50.0, 200.0)  # background grey level ...
_BG_TINT = 25.0  # ... plus a per-channel tint in [-tint, tint]
_BLOT_AMP = (6.0, 16.0)  # amplitude of the low-frequency background blotches
_NOISE_SD = (3.0, 8.0)  # per-pixel noise standard deviation
_N_DISTRACTORS = (2, 5)  # inclusive range of distractor objects per image
_MIN_COLOUR_DIST = 90.0  # objects and distractors differ from the mean background colour by this much
_MIN_LUMA_DIST = 50.0  # ... and by this much in brightness (so shapes show in greyscale too)
_CHUNK = 512  # images rendered together; bounds memory to a few tens of MB


def shapes(
    n: int,
    seed: int,
    size: int = 64,
    shortcut: bool | Literal["random"] = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Generate ``n`` synthetic images with one class object each.

    Parameters
    ----------
    n : number of images.
    seed : seed of the ``numpy.random.Generator``; the same ``(n, seed, size, shortcut)`` always gives
        the same arrays.
    size : image height and width in pixels (shapes scale with it; 64 for the bundled models).
    shortcut : ``False`` for honest images; ``True`` adds a small bright mark whose corner and colour
        are determined by the class (a spurious cue); ``"random"`` adds the same kind of mark with a
        corner and colour that are independent of the class.

    Returns
    -------
    images : uint8 array ``(n, size, size, 3)`` (RGB).
    labels : int64 array ``(n,)`` indexing :data:`CLASS_NAMES`.
    masks : bool array ``(n, size, size)``, True on the pixels of the class object (never on the
        shortcut mark or on distractors).

    Example
    -------
    >>> images, labels, masks = shapes(8, seed=0)
    >>> images.shape, images.dtype, labels.shape, masks.shape
    ((8, 64, 64, 3), dtype('uint8'), (8,), (8, 64, 64))
    >>> [CLASS_NAMES[i] for i in labels[:3]]  # doctest: +SKIP
    ['ring', 'cross', 'circle']
    """
    if shortcut not in (False, True, "random"):
        raise ArgumentError(f"shortcut must be False, True or 'random', got {shortcut!r}")
    if n < 0:
        raise ArgumentError(f"n must be >= 0, got {n}")
    if size < 16:
        raise ArgumentError(f"size must be >= 16, got {size}")
    rng = np.random.default_rng(seed)
    images = np.empty((n, size, size, 3), dtype=np.uint8)
    labels = np.empty((n,), dtype=np.int64)
    masks = np.empty((n, size, size), dtype=bool)
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        images[start:stop], labels[start:stop], masks[start:stop] = _render(rng, stop - start, size, shortcut)
    return images, labels, masks


def generator_settings() -> dict:
    """The constants that define the image distribution (sizes in pixels at 64x64), for model cards.

    Example:
        >>> generator_settings()["n_distractors"]
        [2, 5]
    """
    return {
        "object_radius": list(_RADIUS),
        "max_rotation_deg": _MAX_ROTATION_DEG,
        "background_level": list(_BG_LEVEL),
        "background_tint": _BG_TINT,
        "blotch_amplitude": list(_BLOT_AMP),
        "noise_sd": list(_NOISE_SD),
        "n_distractors": list(_N_DISTRACTORS),
        "min_colour_distance": _MIN_COLOUR_DIST,
        "min_brightness_distance": _MIN_LUMA_DIST,
        "mark_size": _MARK_SIZE,
        "mark_margin": _MARK_MARGIN,
        "mark_corners": _MARK_CORNERS.tolist(),
        "mark_colours": _MARK_COLOURS.astype(int).tolist(),
    }


# --------------------------------------------------------------------------------------------------
# rendering


def _render(
    rng: np.random.Generator, b: int, size: int, shortcut: bool | str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    s = size / 64.0  # every length below is given for 64-pixel images
    coords = np.arange(size, dtype=np.float32) + 0.5
    yy = coords[None, :, None]  # (1, H, 1)
    xx = coords[None, None, :]  # (1, 1, W)

    img = background(rng, b, size)

    # class object parameters (drawn first so they do not depend on the distractor count)
    labels = rng.integers(0, NUM_CLASSES, size=b)
    radius = rng.uniform(*_RADIUS, size=b).astype(np.float32) * s
    margin = 1.2 * radius + 2.0 * s  # the farthest vertex of any class shape is 1.2 r from its centre
    cx = rng.uniform(0.0, 1.0, size=b).astype(np.float32) * (size - 2 * margin) + margin
    cy = rng.uniform(0.0, 1.0, size=b).astype(np.float32) * (size - 2 * margin) + margin
    angle = np.deg2rad(rng.uniform(-_MAX_ROTATION_DEG, _MAX_ROTATION_DEG, size=b)).astype(np.float32)
    ring_frac = rng.uniform(0.45, 0.6, size=b).astype(np.float32)  # inner/outer radius of rings
    cross_frac = rng.uniform(0.25, 0.35, size=b).astype(np.float32)  # arm half-width / arm length
    bg_mean = img.mean(axis=(1, 2))
    obj_colour = contrasting_colour(rng, bg_mean)

    # distractors, painted under the class object
    n_dis = rng.integers(_N_DISTRACTORS[0], _N_DISTRACTORS[1] + 1, size=b)
    max_dis = _N_DISTRACTORS[1]
    win = min(size, int(np.ceil(24 * s)))
    local = np.arange(win, dtype=np.float32) + 0.5
    for k in range(max_dis):
        kind = rng.integers(0, 3, size=b)
        dx = rng.uniform(2.0, size - 2.0, size=b).astype(np.float32)
        dy = rng.uniform(2.0, size - 2.0, size=b).astype(np.float32)
        dang = rng.uniform(0.0, 2.0 * np.pi, size=b).astype(np.float32)
        length = rng.uniform(6.0, 16.0, size=b).astype(np.float32) * s  # segment half-length is /2
        width = rng.uniform(1.0, 2.2, size=b).astype(np.float32) * s
        dot_r = rng.uniform(1.5, 3.0, size=b).astype(np.float32) * s
        ell_a = rng.uniform(5.0, 9.0, size=b).astype(np.float32) * s
        ell_b = rng.uniform(1.2, 2.2, size=b).astype(np.float32) * s
        dcol = contrasting_colour(rng, bg_mean)
        # distractors are at most ~10 px from their centre: evaluate them on a local window only
        oy = np.clip(np.floor(dy).astype(int) - win // 2, 0, size - win)
        ox = np.clip(np.floor(dx).astype(int) - win // 2, 0, size - win)
        yl = (oy[:, None] + local)[:, :, None] - dy[:, None, None]
        xl = (ox[:, None] + local)[:, None, :] - dx[:, None, None]
        u, v = rotate(xl, yl, dang)
        seg = sd_box(u, v, length[:, None, None] / 2, width[:, None, None] / 2)
        dot = np.sqrt(u * u + v * v) - dot_r[:, None, None]
        ell = _sd_ellipse(u, v, ell_a[:, None, None], ell_b[:, None, None])
        sd = np.where((kind == 0)[:, None, None], seg, np.where((kind == 1)[:, None, None], dot, ell))
        sd[k >= n_dis] = np.inf
        alpha = coverage(sd)
        bi, wy, wx = np.nonzero(alpha)
        a = alpha[bi, wy, wx][:, None]
        py, px = oy[bi] + wy, ox[bi] + wx
        img[bi, py, px] = img[bi, py, px] * (1.0 - a) + dcol[bi] * a

    # the class object
    u, v = rotate(xx - cx[:, None, None], yy - cy[:, None, None], angle)
    r = radius[:, None, None]
    dist = np.sqrt(u * u + v * v)
    sd = np.empty((b, size, size), dtype=np.float32)
    for c in range(NUM_CLASSES):
        sel = labels == c
        if not sel.any():
            continue
        uc, vc, rc, dc = u[sel], v[sel], r[sel], dist[sel]
        if c == 0:  # circle
            sd[sel] = dc - rc
        elif c == 1:  # square, half-side chosen so its area is close to the circle's
            h = 0.85 * rc
            sd[sel] = sd_box(uc, vc, h, h)
        elif c == 2:  # equilateral triangle, circumradius 1.2 r
            sd[sel] = _sd_triangle(uc, vc, 1.2 * rc)
        elif c == 3:  # plus-shaped cross
            w = cross_frac[sel][:, None, None] * rc
            sd[sel] = np.minimum(sd_box(uc, vc, rc, w), sd_box(uc, vc, w, rc))
        else:  # ring
            inner = ring_frac[sel][:, None, None] * rc
            sd[sel] = np.abs(dc - (rc + inner) / 2) - (rc - inner) / 2
    paint(img, coverage(sd), obj_colour)
    masks = sd < 0.0

    if shortcut:
        img, mark = shortcut_marks(rng, img, labels, size, s, randomise=shortcut == "random")
        masks &= ~mark  # the mark is painted over the object where they overlap

    return np.clip(np.rint(img), 0, 255).astype(np.uint8), labels.astype(np.int64), masks


def background(rng: np.random.Generator, b: int, size: int) -> np.ndarray:
    """Colour gradient + bilinear low-frequency blotches + pixel noise, float32 (b, H, W, 3).

    Example:
        >>> background(np.random.default_rng(0), 2, 16).shape
        (2, 16, 16, 3)
    """
    t = np.linspace(0.0, 1.0, size, dtype=np.float32)
    theta = rng.uniform(0.0, 2.0 * np.pi, size=b).astype(np.float32)
    ramp = np.cos(theta)[:, None, None] * t[None, None, :] + np.sin(theta)[:, None, None] * t[None, :, None]
    ramp = (ramp - ramp.min(axis=(1, 2), keepdims=True)) / (np.ptp(ramp, axis=(1, 2), keepdims=True) + 1e-6)
    level = rng.uniform(*_BG_LEVEL, size=(b, 1, 1, 1)).astype(np.float32)
    c0 = level + rng.uniform(-_BG_TINT, _BG_TINT, size=(b, 1, 1, 3)).astype(np.float32)
    c1 = c0 + rng.uniform(-60.0, 60.0, size=(b, 1, 1, 3)).astype(np.float32)
    img = c0 + (c1 - c0) * ramp[..., None]

    # low-frequency texture: a coarse random grid upsampled bilinearly
    g = int(rng.integers(3, 7))
    coarse = rng.normal(0.0, 1.0, size=(b, g, g, 3)).astype(np.float32)
    pos = np.linspace(0.0, g - 1.0, size, dtype=np.float32)
    i0 = np.minimum(np.floor(pos).astype(int), g - 2)
    f = pos - i0
    interp = np.zeros((size, g), dtype=np.float32)  # bilinear interpolation as a matrix
    interp[np.arange(size), i0] = 1.0 - f
    interp[np.arange(size), i0 + 1] = f
    # blot[b, y, x, c] = sum_ij interp[y, i] coarse[b, i, j, c] interp[x, j], as two plain 2-D matmuls
    tmp = coarse.transpose(0, 3, 1, 2).reshape(-1, g) @ interp.T  # (b*3*g_i, x)
    tmp = tmp.reshape(b * 3, g, size).transpose(1, 0, 2).reshape(g, -1)  # (g_i, b*3*x)
    blot = (interp @ tmp).reshape(size, b, 3, size).transpose(1, 0, 3, 2)  # (b, y, x, c)
    amp = rng.uniform(*_BLOT_AMP, size=(b, 1, 1, 1)).astype(np.float32)
    img = img + amp * blot

    noise_sd = rng.uniform(*_NOISE_SD, size=(b, 1, 1, 1)).astype(np.float32)
    img = img + noise_sd * rng.standard_normal(size=(b, size, size, 3), dtype=np.float32)
    return img


def contrasting_colour(rng: np.random.Generator, ref: np.ndarray) -> np.ndarray:
    """Random RGB colours (b, 3) that stand out from ``ref`` (b, 3): at least ``_MIN_COLOUR_DIST`` apart
    in RGB and ``_MIN_LUMA_DIST`` apart in brightness (channel mean). The first of 32 uniform
    candidates that qualifies, else the candidate with the largest brightness difference.

    Example:
        >>> contrasting_colour(np.random.default_rng(0), np.zeros((1, 3), np.float32)).shape
        (1, 3)
    """
    cand = rng.uniform(0.0, 255.0, size=(ref.shape[0], 32, 3)).astype(np.float32)
    dist = np.linalg.norm(cand - ref[:, None, :], axis=2)
    luma = np.abs(cand.mean(axis=2) - ref.mean(axis=1, keepdims=True))
    ok = (dist >= _MIN_COLOUR_DIST) & (luma >= _MIN_LUMA_DIST)
    idx = np.where(ok.any(axis=1), ok.argmax(axis=1), luma.argmax(axis=1))
    return cand[np.arange(ref.shape[0]), idx]


def shortcut_marks(
    rng: np.random.Generator, img: np.ndarray, labels: np.ndarray, size: int, s: float, randomise: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Paint each image's class-coded corner mark (or, with ``randomise``, a random one) into a copy of the
    float images (B, size, size, 3); returns the marked images and the marks' pixel masks.

    Example:
        >>> out, mark = shortcut_marks(np.random.default_rng(0), np.zeros((1, 64, 64, 3), np.float32),
        ...                            np.array([0]), 64, 1.0, randomise=False)
        >>> int(mark.sum()), out[0, 2, 2].tolist()
        (36, [255.0, 255.0, 255.0])
    """
    b = len(labels)
    if randomise:
        corner = rng.integers(0, 4, size=b)
        colour = _MARK_COLOURS[rng.integers(0, NUM_CLASSES, size=b)]
    else:
        corner = _MARK_CORNERS[labels]
        colour = _MARK_COLOURS[labels]
    m = max(1, int(round(_MARK_SIZE * s)))
    g = max(0, int(round(_MARK_MARGIN * s)))
    out = img.copy()
    mark = np.zeros(img.shape[:3], dtype=bool)
    for c in range(4):
        sel = np.nonzero(corner == c)[0]
        y0 = g if c in (0, 1) else size - g - m
        x0 = g if c in (0, 2) else size - g - m
        out[sel, y0 : y0 + m, x0 : x0 + m, :] = colour[sel][:, None, None, :]
        mark[sel, y0 : y0 + m, x0 : x0 + m] = True
    return out, mark


# --------------------------------------------------------------------------------------------------
# geometry helpers (signed distances in pixels, negative inside)


def rotate(x: np.ndarray, y: np.ndarray, angle: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Coordinates (x, y) turned by ``angle`` (one per image, radians) into the shape's own frame (u, v).

    Example:
        >>> u, v = rotate(np.ones((1, 1, 1), np.float32), np.zeros((1, 1, 1), np.float32), np.array([np.pi / 2]))
        >>> round(float(u[0, 0, 0]), 6), round(float(v[0, 0, 0]), 6)
        (0.0, -1.0)
    """
    c = np.cos(angle)[:, None, None].astype(np.float32)
    s = np.sin(angle)[:, None, None].astype(np.float32)
    return c * x + s * y, -s * x + c * y


def sd_box(u: np.ndarray, v: np.ndarray, hu: np.ndarray, hv: np.ndarray) -> np.ndarray:
    """Signed distance (pixels, negative inside) to an axis-aligned box of half-sizes ``hu``, ``hv``.

    Example:
        >>> float(sd_box(np.array(3.0), np.array(0.0), 1.0, 1.0)), float(sd_box(np.array(0.0), np.array(0.0), 1.0, 2.0))
        (2.0, -1.0)
    """
    qu = np.abs(u) - hu
    qv = np.abs(v) - hv
    outside = np.sqrt(np.maximum(qu, 0.0) ** 2 + np.maximum(qv, 0.0) ** 2)
    return outside + np.minimum(np.maximum(qu, qv), 0.0)


def _sd_triangle(u: np.ndarray, v: np.ndarray, circum: np.ndarray) -> np.ndarray:
    inradius = circum / 2.0
    sd = None
    for k in range(3):
        a = np.float32(np.pi / 2 + k * 2 * np.pi / 3)
        d = u * np.cos(a) + v * np.sin(a) - inradius
        sd = d if sd is None else np.maximum(sd, d)
    return sd


def _sd_ellipse(u: np.ndarray, v: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # first-order approximation, exact on the boundary, good enough for anti-aliasing
    k0 = np.sqrt((u / a) ** 2 + (v / b) ** 2)
    k1 = np.sqrt((u / (a * a)) ** 2 + (v / (b * b)) ** 2)
    return k0 * (k0 - 1.0) / np.maximum(k1, 1e-6)


def coverage(sd: np.ndarray) -> np.ndarray:
    """Anti-aliased pixel coverage from a signed distance.

    Example:
        >>> coverage(np.array([-1.0, 0.0, 1.0])).tolist()
        [1.0, 0.5, 0.0]
    """
    return np.clip(0.5 - sd, 0.0, 1.0).astype(np.float32)


def paint(img: np.ndarray, alpha: np.ndarray, colour: np.ndarray) -> None:
    """Alpha-blend ``colour`` (b, 3) into ``img`` (b, H, W, 3) in place, touching only covered pixels.

    Example:
        >>> img = np.zeros((1, 1, 2, 3), np.float32)
        >>> paint(img, np.array([[[0.5, 0.0]]], np.float32), np.array([[200.0, 0.0, 0.0]], np.float32))
        >>> img[0, 0, :, 0].tolist()
        [100.0, 0.0]
    """
    bi, yi, xi = np.nonzero(alpha)
    a = alpha[bi, yi, xi][:, None]
    img[bi, yi, xi] = img[bi, yi, xi] * (1.0 - a) + colour[bi] * a
