"""The generative-VLM tables of ``docs/vlm.md``, from the registries (``scripts/generate.py`` writes them between
their markers): the family rows of :data:`vitcam_nb.adapters.hf_vlm.VLM_FAMILIES` with their image-token layout,
the classes still refused by name, and the VLM presets' taxonomy rows. A family module that registers a row
(``register_vlm_family``) or a preset module that adds a row to ``VLM_TAXONOMY`` reaches the page with
``python scripts/generate.py``; nothing here is kept by hand.

Example:
    >>> "`LlavaForConditionalGeneration`" in vlm_families_table()
    True
"""

from __future__ import annotations

import inspect
import re

__all__ = ["vlm_families_table", "vlm_presets_table"]

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
