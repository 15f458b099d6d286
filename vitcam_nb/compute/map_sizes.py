"""How much a map store holds, checked before it is written: its maps per image, and its fixed part (the recipe
table with every recipe's checklist, the attributes, a disk block per file), against the memory budget and the
free space of the store's disk.

Example:
    >>> from vitcam_nb.compute.map_recipes import plan_entries
    >>> entries = plan_entries([Recipe(layer=0)], 2, ["F1"], "top1")[0]
    >>> recipe_row(entries[0])["layers"]
    [0]
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from vitcam_nb.capture.budget import available_bytes
from vitcam_nb.capture.budget_vlm import is_vlm, vlm_shape
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.compute.map_checksum import CHECKSUM_BYTES
from vitcam_nb.compute.map_recipes import Entry
from vitcam_nb.core.errors import TraceError, TraceFileError
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.recipe_canonical import canonical_form

__all__ = ["CHECKLIST_BYTES", "check_sizes", "check_table", "recipe_row", "table_bytes"]


def _cells(plan: TracePlan, hw: tuple[int, int]) -> int:
    """Token-grid cells of one map: (h, w) patches, times the tubelets in time of a video family's clip; a
    generative VLM's tower cells per crop (its LM-site maps lie on that grid or a coarser one)."""
    adapter, model = plan.adapter, plan.model
    if getattr(adapter, "video", False):
        tt, ph, pw = adapter.tubelet(model)
        return max(1, adapter.frames(model) // tt) * max(1, hw[0] // ph) * max(1, hw[1] // pw)
    if is_vlm(plan):  # the tower's own grid, whatever the image's size (its packed patches for Qwen2-VL)
        return max(1, vlm_shape(plan).tower_tokens - len(adapter.prefix_kinds(model)))
    # every family's description states its patch (an int, or "HxW"); ViT-B/16's where one does not
    patch = adapter.describe(model).get("patch_size", 16)
    ph, pw = (int(v) for v in patch.split("x")) if isinstance(patch, str) else (int(patch), int(patch))
    return max(1, hw[0] // ph) * max(1, hw[1] // pw)


#: Bytes of a recipe's checklist in the store's recipe table, counted before the pass has made it (the table is
#: checked exactly, with its checklists, before the store is created). A checklist with its methods paragraph runs to
#: about 5 kB (the input's crop and the canonical ids added to it in 0.3.0): 8 kB keeps the estimate an upper bound.
CHECKLIST_BYTES = 8192


def table_bytes(entries: list[Entry]) -> int:
    """Bytes of the store's recipe table and attributes known before any pass: each recipe's row (its checklist
    counted as :data:`CHECKLIST_BYTES`).

    Example:
        >>> from vitcam_nb.compute.map_recipes import plan_entries
        >>> entries = plan_entries([Recipe(layer=0)], 2, ["F1"], "top1")[0]
        >>> 16384 < table_bytes(entries) < 32768
        True
    """
    return sum(len(json.dumps(recipe_row(e))) + CHECKLIST_BYTES for e in entries) + CHECKLIST_BYTES


def _files_bytes(n: int, batch: int, parent: Path) -> int:
    """Disk blocks the store's files take beyond their bytes: every chunk and metadata file takes at least one block
    (a file per batch of maps and parts, a file per 64 images of each per-image array at most, a metadata file per
    array)."""
    block = os.statvfs(parent).f_frsize or 4096
    return block * (2 * -(-n // batch) + 14 * -(-n // 64) + 20)


def bytes_text(n: float) -> str:
    """``n`` bytes in the unit that shows them readably (a budget of 10 bytes is not "0.0 MB").

    Example:
        >>> bytes_text(10), bytes_text(2500), bytes_text(3.2e9)
        ('10 B', '2.5 kB', '3.2 GB')
    """
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def check_sizes(plan: TracePlan, entries: list[Entry], n_parts: int, n: int | None, hw: tuple[int, int],
                 batch: int, max_bytes: float | None, parent: Path, replaced: int, crops: int = 1) -> None:
    """Refuse, before the first pass, a space whose maps do not fit the memory budget or the store's disk: its
    maps, the recipe table and attributes, a disk block per file, against the free space and the ``replaced``
    bytes of the store this call replaces (removed once the new store exists). ``crops``: the crops each image's
    tower runs on (a store of crops holds a map per crop).

    Example:
        >>> check_sizes(plan, entries, 0, 10**9, (224, 224), 8, None, Path("."), 0)  # doctest: +SKIP
        Traceback (most recent call last):
        TraceFileError: recipes_or_space: 1 recipes over 1000000000 images make a store of about ...
    """
    per_image = (len(entries) + n_parts) * _cells(plan, hw) * 4 * max(1, int(crops)) + len(entries) * 64
    budget = max_bytes if max_bytes is not None else (available_bytes() or float("inf")) / 2
    if per_image * batch > budget:
        # The caller's max_bytes is what refuses, so it is named; without one, half the free memory refuses.
        name, what = (("max_bytes", f"max_bytes={max_bytes!r} ({bytes_text(budget)})") if max_bytes is not None
                      else ("recipes_or_space", f"the memory budget of {bytes_text(budget)} (half the free memory)"))
        raise TraceError(f"{name}: {len(entries)} recipes ({n_parts} fused parts) need about "
                         f"{bytes_text(per_image * batch)} of maps per batch of {batch}, above {what}; use fewer "
                         "recipes or a smaller batch_size" + (", or raise max_bytes" if max_bytes is not None else ""))
    free = shutil.disk_usage(parent).free + replaced
    fixed = table_bytes(entries) + _files_bytes(n or batch, batch, parent)
    per_image += CHECKSUM_BYTES  # on disk, each image's checksums too
    if n is not None and per_image * n + fixed > free:
        raise TraceFileError(f"recipes_or_space: {len(entries)} recipes over {n} images make a store of about "
                             f"{(per_image * n + fixed) / 1e6:.2f} MB ({per_image / 1e3:.1f} kB per image, "
                             f"{fixed / 1e3:.1f} kB of recipe table, attributes and file blocks); {parent} has "
                             f"{free / 1e6:.2f} MB free"
                             + (" (with the store this call replaces)" if replaced else ""))


def check_table(path: Path, store_attrs: dict, replaced: bool) -> None:
    """Refuse, before the store is created (and before a store it replaces is moved aside), attributes that do not
    fit the disk: the recipe table with every checklist, now made.

    Example:
        >>> import tempfile
        >>> check_table(Path(tempfile.mkdtemp()) / "m.zarr", {"recipes": "[]"}, False)
    """
    need = len(json.dumps(store_attrs, default=str)) + _files_bytes(1, 1, path.parent)
    free = shutil.disk_usage(path.parent).free
    if need > free:
        raise TraceFileError(f"path: the store's attributes (its recipe table with every checklist) need "
                             f"{need / 1e6:.2f} MB, and {path.parent} has {free / 1e6:.2f} MB free; nothing was "
                             "written" + (" and the store there is kept" if replaced else "") + ". Free space on "
                             "that disk, or use another path")


def recipe_row(e: Entry) -> dict:
    """A recipe's row of the store's table but its checklist (known before any pass).

    Example:
        >>> from vitcam_nb.compute.map_recipes import plan_entries
        >>> sorted(recipe_row(plan_entries([Recipe(layer=-1)], 3, ["F1"], "top1")[0][0]))[:3]
        ['canonical_id', 'id', 'json']
    """
    r = e.recipe
    return {"key": r.replace(upsample="none").id, "id": r.id, "json": r.to_json(), "text": r.to_string(),
            "canonical_id": _canonical(r, e.layers), "layers": list(e.layers), "rollout": e.rollout,
            "part": list(e.part) if e.part else None, "slot": list(e.slot),
            # which arrays hold its maps (map_recipes.Entry.grid): only in rows of a crops or LM-grid store
            **({"grid": e.grid} if e.grid else {})}


def _canonical(r: Recipe, layers: tuple[int, ...]) -> str:
    """The id of the recipe in its canonical form on a trace of this model (``Recipe.canonical_id``)."""
    return canonical_form(r.replace(layer=tuple(layers) if isinstance(r.layer, tuple) or r.layer == "all"
                                    else layers[0])).id
