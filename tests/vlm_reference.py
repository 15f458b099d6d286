"""Hand-written NumPy references for maps of generative-VLM answer traces placed on the original image (issue 55),
shared by the tests of ambiguity, masks and galleries: Grad-CAM from a trace's stored arrays, each crop's or tile's
cells placed in its box by nearest cell, looping over pixel centres (no kit code)."""

from __future__ import annotations

import json

import numpy as np

SIDES = ("top", "left", "bottom", "right")


def minmax(v):
    """Min-max; a constant map (a block the LM never reads: zero gradients) is the kit's degenerate zeros."""
    span = v.max() - v.min()
    return (v - v.min()) / span if span > 0 else np.zeros_like(v)


def gradcam(A, G):
    """Grad-CAM of activations A (tokens, channels) with gradients G (tokens, channels), min-max normalised."""
    return minmax(np.maximum(A @ G.mean(0), 0))


def place(cells, box, size, out):
    """Cells (gh, gw) written into ``out`` (of ``size``) at the pixels whose centre lies in ``box`` (top, left,
    bottom, right fractions), the nearest cell each; NaN cells leave ``out`` as it was. Returns ``out``."""
    gh, gw = cells.shape
    top, left, bottom, right = box
    for y in range(size[0]):
        for x in range(size[1]):
            cy, cx = (y + 0.5) / size[0], (x + 0.5) / size[1]
            if top <= cy < bottom and left <= cx < right:
                v = cells[int((cy - top) / (bottom - top) * gh), int((cx - left) / (right - left) * gw)]
                if not np.isnan(v):
                    out[y, x] = v
    return out


def tower_views(tr, layer, k, size):
    """Grad-CAM of F1 per crop (min-max per crop), each crop's cells in its box, one canvas per crop group."""
    views = {}
    for c in range(tr.sizes["crop"]):
        one = tr.isel(crop=c)
        patch = one["token_kind"].values == "patch"
        rows, cols = one["patch_row"].values[patch], one["patch_col"].values[patch]
        cells = np.zeros((rows.max() + 1, cols.max() + 1))
        cells[rows, cols] = gradcam(one["act"].sel(site="F1", layer=layer).values[patch],
                                    one["grad"].sel(site="F1", layer=layer).values[k][patch])
        box = tuple(float(one[f"crop_box_{s}"]) for s in SIDES)
        place(cells, box, size, views.setdefault(str(one["crop_group"].values), np.full(size, np.nan)))
    return views


def lm_views(tr, layer, k, size):
    """Grad-CAM of lm_resid over all image tokens as one set, each tile's cells in its box, one canvas per group."""
    v = gradcam(tr["lm_resid"].values[layer], tr["lm_resid_grad"].values[k, layer])
    views = {}
    for t, d in enumerate(json.loads(tr["lm_resid"].attrs["layout_tile_boxes"])):
        sel = tr["image_token_tile"].values == t
        cells = np.full(d["grid"], np.nan)
        cells[tr["image_token_row"].values[sel], tr["image_token_col"].values[sel]] = v[sel]
        place(cells, d["box"], size, views.setdefault(d["group"], np.full(size, np.nan)))
    return views
