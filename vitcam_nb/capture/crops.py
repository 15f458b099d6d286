"""The trace of a model whose tower runs on several crops of one image (``Adapter.runs_crops``: LLaVA-NeXT and
LLaVA-OneVision's any-resolution tiles, Idefics3/SmolVLM's image splitting).

Every crop the tower ran on is kept, in the tower's order; none is ever dropped or averaged. The tower's variables
(``act``, ``grad``, ``attn``, ``attn_grad``, any other per-token variable, and ``image``: each crop's pixels exactly
as the tower's patch embedding received them, de-normalised) get a leading dim ``crop`` with the coordinates
``crop`` (0..n-1), ``crop_tile`` (the layout tile the crop becomes, from the family's ``crop_tiles``; "" for a crop
the LM never reads), ``crop_group`` (the tile group: ``base`` or ``tiles``) and ``crop_box_top/left/bottom/right``
(where the crop lies in the original image, fractions, padding undone; NaN for a crop the LM never reads). The
language-model variables (``projector``, ``lm_resid``, ``lm_attn``) and ``logits`` have no crop dim. So
``trace.isel(crop=k)`` is crop ``k``'s single-image trace, assembled exactly as one image's would be; the number of
crops comes from what the tower ran on (a family may skip crops the input held, e.g. all-padding ones).

Example:
    >>> TOWER_DIMS
    ('token', 'query', 'key')
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from vitcam_nb.adapters.vlm_crops import display_crops
from vitcam_nb.capture.assemble import assemble
from vitcam_nb.capture.crop_check import CROP_PIXELS
from vitcam_nb.capture.passes import ImagePass, PassResult
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.core.errors import TraceError
from vitcam_nb.preprocess import PreparedInput

__all__ = ["TOWER_DIMS", "assemble_crops", "crop_coords"]

#: a variable with one of these dims is the tower's (one row per crop); the others are the language model's
TOWER_DIMS = ("token", "query", "key")


def crop_coords(names: tuple[str, ...], tiles: list) -> dict[str, tuple[str, np.ndarray]]:
    """The ``crop`` coordinates of crops named ``names`` covering ``tiles`` (Tile or None each).

    Example:
        >>> from vitcam_nb.adapters.vlm_layout import Tile
        >>> c = crop_coords(("base", ""), [Tile("base", (2, 2), group="base"), None])
        >>> c["crop_group"][1].tolist(), c["crop_box_right"][1].tolist()
        (['base', ''], [1.0, nan])
    """
    boxes = np.array([t.box if t is not None else (np.nan,) * 4 for t in tiles], dtype=np.float64).reshape(-1, 4)
    out = {"crop": ("crop", np.arange(len(names), dtype=np.int64)),
           "crop_tile": ("crop", np.array(list(names), dtype=str)),
           "crop_group": ("crop", np.array([t.group_name if t is not None else "" for t in tiles], dtype=str))}
    for i, side in enumerate(("top", "left", "bottom", "right")):
        out[f"crop_box_{side}"] = ("crop", boxes[:, i])
    return out


def _source_size(target: object) -> tuple[int, int] | None:
    """The original image's (height, width) when the target's model_kwargs give it (``image_sizes``)."""
    sizes = (getattr(target, "model_kwargs", None) or {}).get("image_sizes")
    if sizes is None:
        return None
    arr = np.asarray(sizes.detach().cpu() if hasattr(sizes, "detach") else sizes).reshape(-1)
    return (int(arr[0]), int(arr[1])) if arr.size == 2 else None


def _crop_pass(whole: ImagePass, k: int, extra: dict, with_extra: bool) -> ImagePass:
    """Crop ``k``'s share of the pass: the tower's row ``k`` (views), the LM's tensors whole when asked."""
    def keep(key: tuple) -> bool:
        return key[1] not in extra or with_extra

    acts = {key: (t if key[1] in extra else t[k:k + 1]) for key, t in whole.acts.items() if keep(key)}
    grads = {key: (g if key[1] in extra else g[:, k:k + 1]) for key, g in whole.grads.items() if keep(key)}
    more = {name: {key: g[:, k:k + 1] for key, g in got.items() if key[1] not in extra}
            for name, got in whole.extra_grads.items()}
    return ImagePass(whole.logits, whole.classes, acts, grads, more)


def assemble_crops(plan: TracePlan, prepared: PreparedInput, run: PassResult) -> xr.Dataset:
    """The trace Dataset of a crops pass (module docstring): crop 0 assembled with the language-model sites (its
    attributes and trace id are the trace's), each crop's tower variables stacked along ``crop``.

    Example:
        >>> import torch
        >>> from vitcam_nb.adapters import TraceContext
        >>> run = PassResult(torch.zeros(1, 2), [[0]], {}, {}, (1, 1), TraceContext(torch.nn.Identity()), 0, "")
        >>> assemble_crops(None, None, run)  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        vitcam_nb.core.errors.TraceError: model: the tower's patch embedding never ran, so no crop was traced
    """
    pixels = run.ctx.facts.get(CROP_PIXELS)
    if pixels is None or not run.crops:
        raise TraceError("model: the tower's patch embedding never ran, so no crop was traced")
    model, adapter, target = plan.model, plan.adapter, plan.target
    n = int(pixels.shape[0])
    names = adapter.crop_tiles(model, target)
    if len(names) != n:
        raise TraceError(f"model: the tower ran on {n} crops but the family names {len(names)} ({list(names)}); "
                         "its crop_tiles does not fit this model")
    whole = run.whole()
    extra = plan.extra_layers
    for key, t in whole.acts.items():
        if key[1] not in extra and int(t.shape[0]) != n:
            raise TraceError(f"sites: {key[1]} at layer {key[0]} holds {int(t.shape[0])} rows, but the tower ran on "
                             f"{n} crops")
    display = display_crops(pixels, adapter.data_config(model) or {"mean": (0.0,) * 3, "std": (1.0,) * 3})
    tower_sites = [s for s in plan.site_ids if s not in extra]

    def prep(k: int) -> PreparedInput:
        return PreparedInput(prepared.tensor, display[k], prepared.preprocessing)

    first = assemble(plan, prep(0), _crop_pass(whole, 0, extra, True), run)
    tower = [v for v in first.data_vars if v != "image" and set(first[v].dims) & set(TOWER_DIMS)]
    # Each crop's arrays go into the stacked ones as it is assembled: one crop's copy more at a time, not all.
    stacked = {v: (("crop", *first[v].dims), np.empty((n, *first[v].shape), first[v].dtype)) for v in tower}
    for v in tower:
        stacked[v][1][0] = first[v].values
    out = first.drop_vars([*tower, "image"])
    del first
    for k in range(1, n if tower else 1):
        one = assemble(plan, prep(k), _crop_pass(whole, k, extra, False), run, site_ids=tower_sites)
        for v in tower:
            stacked[v][1][k] = one[v].values
        del one
    run.acts.clear()  # the stacked arrays hold their own copies now
    run.grads.clear()
    out = out.assign(stacked)
    out["image"] = (("crop", "y", "x", "rgb"), display)
    out = out.assign_coords(crop_coords(names, adapter.crop_geometry(model, target)))
    size = _source_size(target)
    groups = ", ".join(f"{k} {name or '(never read)'}" for k, name in enumerate(names))
    out.attrs.update({
        "crops": n, "crop_tiles": ",".join(names),
        "crop_layout": (f"the tower ran on {n} crops of one image, in this order: {groups}; each crop's tower sites "
                        "are one row of the crop dim, mapped on their own and stitched per tile group (never "
                        "averaged)"),
        **({"crop_source_size": f"{size[0]}x{size[1]}"} if size else {}),
    })
    return out
