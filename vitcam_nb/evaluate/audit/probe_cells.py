"""Where each image token of a generative VLM's answer trace is, for :func:`~vitcam_nb.evaluate.audit.
position_probe.position_probe`: the position its LM-side features (``projector``, ``lm_resid``) are probed for.

On a one-tile layout the token's cell ``(image_token_row, image_token_col)``, as before. On a multi-tile layout
(LLaVA-NeXT/OneVision's base view and crops, Idefics3/SmolVLM's tiles and global view) a multi-tile map draws each
token in its tile's box on the image (:mod:`vitcam_nb.compute.vlm_tiles`), so that is the raster assumption to
measure. ``frame``:

* ``"image"`` (default): the centre of the token's cell on the image, through its tile's box (the layout's
  ``layout_tile_boxes``): ``(top + (row + 0.5) (bottom - top) / rows, left + (col + 0.5) (right - left) / cols)``,
  fractions of the image's height and width. Tokens of every tile are probed together; two groups that overlap (a
  base or global view and the crops) put two tokens at one place, as the maps do. A high R^2 says the features
  carry where on the image the token is drawn; a tower that saw each crop alone may carry only the position in
  its crop, which ``"tile"`` measures.
* ``"tile"``: the centre of the cell within its tile, ``((row + 0.5) / rows, (col + 0.5) / cols)`` of the tile's
  grid: what each tile's own raster reshape assumes, whichever box it is drawn in.

R^2 is unchanged by an affine rescaling of a coordinate, so on a one-tile layout both frames give the R^2 of the
cell indices themselves.

Example:
    >>> import xarray as xr
    >>> tr = xr.Dataset(coords={"image_token_tile": ("image_token", [0, 0]),
    ...                         "image_token_row": ("image_token", [0, 1]), "image_token_col": ("image_token", [0, 0])})
    >>> lm_positions(tr, "projector", "image")[0].tolist()
    [[0.0, 0.0], [1.0, 0.0]]
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from vitcam_nb.compute.vlm_tiles import is_tiled, trace_layout
from vitcam_nb.core.errors import ArgumentError

__all__ = ["FRAMES", "lm_positions"]

#: The positions the LM-side sites of a multi-tile trace are probed for (the module docstring).
FRAMES = ("image", "tile")


def lm_positions(trace: xr.Dataset, site: str, frame: str) -> tuple[np.ndarray, str]:
    """(image tokens, 2) float64 positions of the trace's image tokens in ``frame`` and the words that say so.

    Example:
        >>> import json, xarray as xr
        >>> boxes = json.dumps([{"name": "a", "grid": [1, 2], "box": [0, 0, 1, 0.5], "group": "t"},
        ...                     {"name": "b", "grid": [1, 2], "box": [0, 0.5, 1, 1], "group": "t"}])
        >>> tr = xr.Dataset({"projector": ("image_token", np.zeros(4), {"layout_tile_boxes": boxes})},
        ...                 coords={"image_token_pos": ("image_token", np.arange(4)),
        ...                         "image_token_tile": ("image_token", [0, 0, 1, 1]),
        ...                         "image_token_row": ("image_token", [0, 0, 0, 0]),
        ...                         "image_token_col": ("image_token", [0, 1, 0, 1])})
        >>> lm_positions(tr, "projector", "image")[0][:, 1].tolist()
        [0.125, 0.375, 0.625, 0.875]
    """
    if frame not in FRAMES:
        raise ArgumentError(f"frame: expected one of {list(FRAMES)}, got {frame!r:.80}")
    rows = trace["image_token_row"].values.astype(np.float64)
    cols = trace["image_token_col"].values.astype(np.float64)
    if not is_tiled(trace):
        return np.stack([rows, cols], -1), "image tokens at their layout cells (image_token_row, image_token_col)"
    lay = trace_layout(trace, site)
    grid = np.array([t.grid for t in lay.tiles], np.float64)[lay.tile_of]  # (n, 2): each token's tile grid
    inside = np.stack([(rows + 0.5) / grid[:, 0], (cols + 0.5) / grid[:, 1]], -1)
    names = ", ".join(t.name for t in lay.tiles)
    if frame == "tile":
        return inside, (f"image tokens of the {len(lay.tiles)} tiles ({names}) at their cell centres within their "
                        "tile ((row + 0.5) / rows, (col + 0.5) / cols of the tile's grid), probed together")
    box = np.array([t.box for t in lay.tiles], np.float64)[lay.tile_of]  # (n, 4): top, left, bottom, right
    out = np.stack([box[:, 0] + inside[:, 0] * (box[:, 2] - box[:, 0]),
                    box[:, 1] + inside[:, 1] * (box[:, 3] - box[:, 1])], -1)
    return out, (f"image tokens of the {len(lay.tiles)} tiles ({names}) at their cell centres on the image through "
                 "each tile's box (layout_tile_boxes; fractions of height and width), probed together")
