"""The generative-VLM tables of ``docs/vlm.md``, from the registries (``scripts/generate.py`` writes them between
their markers): the family rows of :data:`vitcam_nb.adapters.hf_vlm.VLM_FAMILIES` with their image-token layout,
the classes still refused by name, the VLM presets' taxonomy rows, and the names an answer trace adds to the
schema (``docs/reference.md``). A family module that registers a row
(``register_vlm_family``) or a preset module that adds a row to ``VLM_TAXONOMY`` reaches the page with
``python scripts/generate.py``; nothing here is kept by hand.

Example:
    >>> "`LlavaForConditionalGeneration`" in vlm_families_table()
    True
"""

from __future__ import annotations

import inspect
import re

__all__ = ["shapes_vlm_summary", "vlm_families_table", "vlm_presets_table", "vlm_schema_table"]

_ROLE = re.compile(r":\w+:`~?([^`]+)`")  # a Sphinx role (:func:`~a.b.c`) -> its target, shortened below


def _cell(text: object) -> str:
    """One table cell: one line, pipes escaped (docstrings are free text)."""
    return " ".join(str(text).split()).replace("|", "&#124;")


def _doc_words(fn: object) -> str:
    """The first paragraph of ``fn``'s docstring as plain markdown: roles become code names, ``x`` becomes `x`."""
    doc = (inspect.getdoc(fn) or "").split("\n\n")[0]
    doc = _ROLE.sub(lambda m: f"`{m.group(1).split('.')[-1]}`", doc)
    return doc.replace("``", "`")


def vlm_families_table() -> str:
    """The registered generative-VLM families (one row each: classes, where the parts live, what the projector
    reads, the image-token layout, whether the tower runs on crops), then the classes refused by name and why.

    Example:
        >>> vlm_families_table().splitlines()[0].startswith("| family |")
        True
    """
    from vitcam_nb.adapters.hf_vlm import NOT_YET_SUPPORTED, NOT_YET_WHY, VLM_FAMILIES

    lines = ["| family | transformers classes | tower · projector · LM layers | what the projector reads | "
             "image-token layout | tower on crops |", "|---|---|---|---|---|---|"]
    for name, fam in VLM_FAMILIES.items():
        reads = fam.reads or ("the tower's hidden states of `vision_feature_layer` (LLaVA: -2 by default; the "
                              "tower layers above it are never read, so their maps are degenerate)")
        lines.append("| " + " | ".join(_cell(c) for c in (
            f"`{name}`", ", ".join(f"`{c}`" for c in fam.classes),
            f"`{fam.tower}` · `{fam.projector}` · `{fam.lm_layers}`", reads, _doc_words(fam.layout),
            "yes: one tower row per crop" if fam.crops else "no")) + " |")
    refused = sorted(NOT_YET_SUPPORTED.items(), key=lambda kv: kv[1])
    lines += ["", "Refused by name, with the reason (their layouts are written and tested in "
              "`vitcam_nb.adapters.vlm_layouts`)" + (": none." if not refused else ":")]
    lines += [f"- `{cls}` (`{fam}`): {_cell(NOT_YET_WHY.get(fam, 'not read yet'))}" for cls, fam in refused]
    return "\n".join(lines)


def vlm_presets_table() -> str:
    """The VLM presets' rows of the taxonomy (paper, site, target, tokens, aggregation, reconstruction).

    Example:
        >>> "`vlm_tower_gradcam`" in vlm_presets_table()
        True
    """
    from vitcam_nb.core.presets_vlm import VLM_TAXONOMY

    keys = ("paper", "site", "target", "tokens", "aggregation", "reconstruction")
    lines = ["| preset | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for name, row in VLM_TAXONOMY.items():
        lines.append(f"| `{name}` | " + " | ".join(_cell(row.get(k, "")) for k in keys) + " |")
    return "\n".join(lines)


# What each name of a generative-VLM answer trace holds, beyond the image trace's schema (docs/reference.md). The
# crop coordinates are checked against vitcam_nb.capture.crops.crop_coords, so a new one fails generation here
# until it is described.
_CROP_ROWS = {
    "crop": ("dimension", "crop", "one row per crop the tower ran on (LLaVA-NeXT/OneVision: base view then the "
             "tiles; Idefics3/SmolVLM: the tiles then the global view), in the model's order; it leads `act`, "
             "`grad`, `attn`, `attn_grad` and `image`, never the LM-side variables"),
    "crop_tile": ("coordinate", "crop", "the crop's tile name (`base`, `tile_r0_c1`, `global`, ...); empty for a "
                  "crop the LM never reads"),
    "crop_group": ("coordinate", "crop", "its tile group (`base` / `tiles`): crops of one group cover the image "
                   "without overlap and are stitched together, groups are kept apart"),
    "crop_box_top": ("coordinate", "crop", "the crop's box on the original image, a fraction of its height or "
                     "width (padding undone); NaN for a crop the LM never reads"),
    "crop_box_left": ("coordinate", "crop", "as `crop_box_top`"),
    "crop_box_bottom": ("coordinate", "crop", "as `crop_box_top`"),
    "crop_box_right": ("coordinate", "crop", "as `crop_box_top`"),
    "crops": ("attribute", "—", "how many crops the tower ran on"),
    "crop_tiles": ("attribute", "—", "the crops' tile names, comma-separated, in crop order"),
    "crop_layout": ("attribute", "—", "the crops in one sentence (the checklist's)"),
    "crop_source_size": ("attribute", "—", "the original image's `HxW` when the target's `image_sizes` gives it "
                         "(the default size of `stitch_crops`)"),
}
_ANSWER_ROWS = {
    "projector": ("variable", "image_token, lm_channel", "the projector's output at each image token (`_grad`: "
                  "d target / d it, with a leading target dim)"),
    "lm_resid": ("variable", "lm_layer, image_token, lm_channel", "each LM decoder layer's input residual stream "
                 "at the image-token positions"),
    "lm_attn": ("variable", "lm_layer, lm_head, answer_token, image_token", "the LM's attention probabilities "
                "from the rows predicting the answer tokens to the image-token keys"),
    "image_token_pos": ("coordinate", "image_token", "each image token's position in the sequence"),
    "image_token_tile": ("coordinate", "image_token", "its tile (an index into the variable attribute "
                         "`layout_tile_boxes`: name, grid, box and group of each tile)"),
    "image_token_row": ("coordinate", "image_token", "its row in its tile's grid"),
    "image_token_col": ("coordinate", "image_token", "its column in its tile's grid"),
    "answer_token_pos": ("coordinate", "answer_token", "the position predicting each answer token"),
    "answer_token_str": ("coordinate", "answer_token", "each answer token's decoded text"),
    "image_token_layout": ("attribute", "—", "the layout in one sentence (tiles, grid, unpadding, tokens dropped)"),
    "vlm_family": ("attribute", "—", "the family row that read the model (`llava`, `llava_next`, `qwen2_vl`, ...)"),
    "tower_layers_unused": ("attribute", "—", "the tower layers the LM never reads (their maps are degenerate)"),
    "answer_ids": ("attribute", "—", "the answer's token ids, comma-separated"),
}


def vlm_schema_table() -> str:
    """The names a generative-VLM answer trace adds to the schema: the ``crop`` dim with its coordinates and
    attributes (a tower run on several crops), then the LM-side variables and the image-token coordinates.

    Example:
        >>> vlm_schema_table().count("| `crop_box_")
        4
    """
    from vitcam_nb.capture.crops import crop_coords

    made = set(crop_coords(("base",), [None]))
    undescribed = sorted(made - set(_CROP_ROWS))
    if undescribed:
        raise SystemExit(f"scripts/vlm_tables.py: describe the crop coordinates {undescribed} in _CROP_ROWS")
    rows = ["| name | kind | dims | holds |", "| --- | --- | --- | --- |"]
    for name, (kind, dims, holds) in (_CROP_ROWS | _ANSWER_ROWS).items():
        rows.append(f"| `{name}` | {kind} | {dims} | {_cell(holds)} |")
    return "\n".join(rows)


def shapes_vlm_summary() -> str:
    """``shapes-vlm``'s card numbers (test accuracy per question type beside chance, its weights' hash) and the
    committed known-answer report's rows, best pointing first, down to the random peak, read from the files.

    Example:
        >>> "random peak" in shapes_vlm_summary()
        True
    """
    import json
    import math
    from pathlib import Path

    from vitcam_nb.models import model_card

    card = model_card("shapes-vlm")
    acc, chance = card["test_accuracy_per_type"], card["chance_accuracy_per_type"]
    root = Path(__file__).resolve().parents[1] / "reports" / "known_answer" / "vlm"
    report = json.loads((root / "known_answer_vlm.json").read_text(encoding="utf-8"))
    s = report["settings"]
    lines = [f"- **The model** (its card): {_cell(card['description'])}",
             f"- **Test accuracy** (greedy answers, card): {card['test_accuracy']:.2f} overall; per question type "
             + ", ".join(f"{k} {v:.2f} (chance {chance.get(k, float('nan')):.2f})" for k, v in acc.items())
             + f". Weights sha256 `{card['weights_sha256'][:12]}…`.",
             f"- **Known-answer report** (`reports/known_answer/vlm/known_answer_vlm.md`): {s['n_questions']} "
             f"questions (seed {s['seed']}), target {_cell(s['target'])}; regenerate with `{s['command']}`. "
             "Pointing game (the map's peak on the asked-about object), beside the same on the other object and "
             "the AUROC; the rows down to the random peak, best first:", "",
             "| recipe | pointing game | other object | AUROC | constant maps (left out of the means) |",
             "|---|---|---|---|---|"]
    rows = sorted((r for r in report["rows"] if math.isfinite(float(r.get("pointing_game") or "nan"))),
                  key=lambda r: -float(r["pointing_game"]))
    for r in rows:
        lines.append(f"| {_cell(r['recipe'])} | {r['pointing_game']:.3f} | {r['other_object']:.3f} | "
                     f"{r['auroc']:.3f} | {r['n_constant']} of {r['n']} |")
        if r["recipe"] == "random peak":
            break
    return "\n".join(lines)
