"""Idefics3 and SmolVLM as generative VLM families (``vitcam_nb[hf]``): one :class:`~vitcam_nb.adapters.hf_vlm.
VlmFamily` row each, registered with :func:`~vitcam_nb.adapters.hf_vlm.register_vlm_family`.

Both split the image into ``rows x cols`` tiles plus a global view (the image squashed to one tile); the SigLIP-like
tower (``model.vision_model``, no class token) runs on every crop, the connector pixel-shuffles each ``s x s`` block
of patches into one token and projects it (``model.connector``), the Llama-like LM (``model.text_model``) reads
the tokens of every crop, tiles row-major then the global view
(:mod:`~vitcam_nb.adapters.vlm_layouts.idefics`). The model's forward does not take ``rows``/``cols``: they are read
off the prompt's ids, whose template the processors write (``_prompt_split_image``): per tile
``<fake_token_around_image><row_r_col_c>`` then its image tokens, a newline after each row of tiles, and
``<fake_token_around_image><global-img>`` before the global view's tokens, which are followed by
``<fake_token_around_image>``. So the token after a tile's run is ``<fake_token_around_image>`` within a row of
tiles and a newline at its end, and the token before the global view's run is ``<global-img>``, the same id in
every image (the last run of the prompt is always a global view).

Example:
    >>> from vitcam_nb.adapters.hf_vlm import VLM_FAMILIES
    >>> VLM_FAMILIES["idefics3"].crops, VLM_FAMILIES["smolvlm"].projector
    (True, 'model.connector')
    >>> prompt_tiles([0, 5, 20, 9, 9, 5, 21, 9, 9, 7, 7, 5, 8, 9, 9, 5], image_id=9, per_crop=2)  # 1x2 tiles
    ([1], [2])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from vitcam_nb.adapters.hf_vlm import VlmFamily, image_token_id, register_vlm_family
from vitcam_nb.adapters.vlm_layout import ImageTokenLayout
from vitcam_nb.adapters.vlm_layouts.idefics import IDEFICS3_ANATOMY, SMOLVLM_ANATOMY, idefics3_layout, smolvlm_layout
from vitcam_nb.core.errors import ArgumentError, TraceError

__all__ = ["IDEFICS3", "SMOLVLM", "idefics_crop_tiles", "idefics_layout_of", "prompt_tiles"]


def _runs(ids: np.ndarray, image_id: int) -> list[tuple[int, int]]:
    """(start, stop) of each run of consecutive image tokens."""
    pos = np.flatnonzero(ids == image_id)
    if not pos.size:
        return []
    cut = np.flatnonzero(np.diff(pos) > 1) + 1
    return [(int(p[0]), int(p[-1]) + 1) for p in np.split(pos, cut)]


def prompt_tiles(ids: Any, *, image_id: int, per_crop: int) -> tuple[list[int], list[int]]:
    """Each image's tile grid (``rows``, ``cols``; 0, 0 for an image not split), read off a prompt's ids as the
    Idefics3/SmolVLM processors write it (``per_crop`` image tokens per crop). Raises :class:`ArgumentError` when
    the ids do not follow that template.

    Example:
        >>> prompt_tiles([0, 5, 8, 9, 9, 5, 1], image_id=9, per_crop=2)  # <fake><global-img> 2 tokens <fake>
        ([0], [0])
    """
    ids = np.asarray(ids).reshape(-1)
    runs = _runs(ids, image_id)
    if not runs:
        raise ArgumentError(f"input_ids: no image tokens (id {image_id})")
    lengths = [b - a for a, b in runs]
    if any(n != per_crop for n in lengths) or runs[0][0] == 0 or runs[-1][1] >= ids.size:
        raise ArgumentError(f"input_ids: image-token runs of lengths {lengths}; the Idefics3/SmolVLM template gives "
                            f"runs of {per_crop} tokens (one per crop), each after <row_r_col_c> or <global-img> "
                            "and before a <fake_token_around_image> or newline; give the processor's prompt")
    before = [int(ids[a - 1]) for a, _ in runs]
    after = [int(ids[b]) for _, b in runs]
    glob, fake = before[-1], after[-1]  # the last run is a global view: <global-img> before, <fake...> after
    rows, cols, start = [], [], 0
    for k in [k for k, b in enumerate(before) if b == glob]:
        n = k - start  # the tiles of this image, then its global view at run k
        if after[k] != fake:
            raise ArgumentError(f"input_ids: the global view's tokens at {runs[k][0]} are not closed by the token "
                                "that closes the last one (<fake_token_around_image>)")
        ends = [j - start for j in range(start, k) if after[j] != fake]  # the last tile of each row
        c = ends[0] + 1 if n else 0
        if n and (n % c or ends != list(range(c - 1, n, c))):
            raise ArgumentError(f"input_ids: the {n} tiles of image {len(rows) + 1} do not form rows of equal "
                                "length (a newline after each row of tiles)")
        rows.append(n // c if n else 0)
        cols.append(c)
        start = k + 1
    if start != len(runs):
        raise ArgumentError("input_ids: image tokens after the last global view")
    return rows, cols


def _grid_tokens(model: torch.nn.Module) -> int:
    vc, s = model.config.vision_config, int(model.config.scale_factor)
    return (int(vc.image_size) // int(vc.patch_size) // s) ** 2


def _tiles(model: torch.nn.Module, ids: np.ndarray) -> tuple[list[int], list[int]]:
    try:
        return prompt_tiles(ids, image_id=image_token_id(model), per_crop=_grid_tokens(model))
    except ArgumentError as exc:
        raise TraceError(str(exc)) from exc


def idefics_layout_of(model: torch.nn.Module, ids: np.ndarray, grid: tuple[int, int],
                      extra: Mapping[str, Any] | None = None) -> ImageTokenLayout:
    """The layout of the prompt's last image (:func:`~vitcam_nb.adapters.vlm_layouts.idefics3_layout`), its tile
    grid read off the ids (:func:`prompt_tiles`): the image whose global view is the last crop; a one-image prompt's
    only image.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> class M: config = NS(image_token_id=9, scale_factor=1, vision_config=NS(image_size=16, patch_size=8))
        >>> [t.name for t in idefics_layout_of(M(), np.array([0, 5, 8, 9, 9, 9, 9, 5]), (2, 2)).tiles]
        ['global']
    """
    rows, cols = _tiles(model, np.asarray(ids))
    fn = smolvlm_layout if type(model).__name__.startswith("SmolVLM") else idefics3_layout
    try:
        return fn(model.config, ids, rows, cols, image_index=len(rows) - 1)
    except ArgumentError as exc:
        raise TraceError(f"input_ids: {exc}") from exc


def idefics_crop_tiles(model: torch.nn.Module, ids: np.ndarray, extra: Mapping[str, Any] | None = None
                       ) -> tuple[str, ...]:
    """The layout tile each crop the tower runs becomes, in its order: the crops of earlier images of the prompt are
    read by the LM but not mapped (""), then the last image's tiles row-major and its global view. The model drops
    all-zero (padding) crops before the tower, so the tower runs exactly the crops the prompt has tokens for.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> class M: config = NS(image_token_id=9, scale_factor=2, vision_config=NS(image_size=16, patch_size=8))
        >>> idefics_crop_tiles(M(), np.array([0, 5, 20, 9, 5, 21, 9, 7, 7, 5, 8, 9, 5]))  # 1x2 tiles
        ('tile_r0_c0', 'tile_r0_c1', 'global')
    """
    rows, cols = _tiles(model, np.asarray(ids))
    names = [f"tile_r{r}_c{c}" for r in range(rows[-1]) for c in range(cols[-1])] + ["global"]
    return (*[""] * sum(r * c + 1 for r, c in zip(rows[:-1], cols[:-1])), *names)


_READS = ("the tower's last hidden state (after its post_layernorm) of every crop, every tower layer read; the "
          "connector pixel-shuffles each scale_factor x scale_factor block of patches into one token and projects "
          "it (modality_projection)")
#: Idefics3's and SmolVLM's processors normalise with mean = std = 0.5 (IMAGENET_STANDARD_MEAN/STD)
_MEAN_STD = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
IDEFICS3 = register_vlm_family(VlmFamily(
    "idefics3", (IDEFICS3_ANATOMY.model_class,), tower="model.vision_model", projector=IDEFICS3_ANATOMY.projector,
    lm_layers=IDEFICS3_ANATOMY.lm_layers, layout=idefics_layout_of, tower_prefix=(), reads=_READS, crops=True,
    crop_tiles=idefics_crop_tiles, mean_std=_MEAN_STD), replace=True)
SMOLVLM = register_vlm_family(VlmFamily(
    "smolvlm", (SMOLVLM_ANATOMY.model_class,), tower="model.vision_model", projector=SMOLVLM_ANATOMY.projector,
    lm_layers=SMOLVLM_ANATOMY.lm_layers, layout=idefics_layout_of, tower_prefix=(), reads=_READS, crops=True,
    crop_tiles=idefics_crop_tiles, mean_std=_MEAN_STD), replace=True)
