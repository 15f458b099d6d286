"""The figure of the audit's experiment (``vitcam-nb figure``): a row of example maps per label, titled in words,
with the object's outline and one colour bar; below, the counts per label and per value of each axis.

Example:
    >>> example_title({"site": "F4", "target": "logit", "weighting": "gradcam", "weight_tokens": "patch",
    ...                "heads": "channels"}, "circle")
    'circle\\nF4, logit target, gradcam\\npatch tokens, heads channels'
"""

from __future__ import annotations

import textwrap
import warnings
from typing import Any

import numpy as np

from vitcam_nb.api import cam
from vitcam_nb.core.errors import DegenerateMapWarning
from vitcam_nb.core.escape import escape_mathtext
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.evaluate.audit.labels import LABELS

__all__ = ["LABEL_COLOURS", "example_title", "pick_examples", "plot_audit"]

#: One colour per label (colour-blind-safe Dark2 hues; grey for empty).
LABEL_COLOURS = {"localises": "#1b9e77", "context": "#7570b3", "inverted": "#d95f02", "empty": "#999999"}
_AXES = ("site", "target", "weighting", "weight_tokens", "heads")


def example_title(row: dict[str, Any], image: str) -> str:
    """A map's title in words: the image, then the recipe's values on the audit's axes.

    Example:
        >>> example_title({"site": "F2", "target": "prob", "weighting": "layercam", "weight_tokens": "patch",
        ...                "heads": "max"}, "photo").splitlines()[1]
        'F2, prob target, layercam'
    """
    return (f"{image}\n{row['site']}, {row['target']} target, {row['weighting']}\n"
            f"{row['weight_tokens']} tokens, heads {row['heads']}")


def _typical(label: str, row: dict[str, Any]) -> float:
    """Sort key: the clearest cases first (highest AUROC localises, lowest inverted, chance-like context)."""
    if label == "empty":
        return 0.0
    a = float(row["auroc"])
    return {"localises": -a, "inverted": a, "context": abs(a - 0.5)}[label]


def pick_examples(rows: list[dict[str, Any]], label: str, n: int) -> list[dict[str, Any]]:
    """Up to ``n`` maps with ``label``, the clearest first, one image at a time before any image repeats.

    Example:
        >>> rows = [{"image": i % 2, "label": "inverted", "auroc": a} for i, a in enumerate([0.1, 0.2, 0.0])]
        >>> [r["auroc"] for r in pick_examples(rows, "inverted", 2)]
        [0.0, 0.2]
    """
    ranked = sorted((r for r in rows if r["label"] == label), key=lambda r: _typical(label, r))
    picked, seen = [], set()
    for r in ranked:  # first pass: one per image
        if len(picked) < n and r["image"] not in seen:
            picked.append(r)
            seen.add(r["image"])
    for r in ranked:
        if len(picked) < n and all(r is not p for p in picked):
            picked.append(r)
    return picked


def _bars(ax, counts: dict[str, dict[str, int]], title: str) -> None:
    """Stacked horizontal bars: one per axis value, one segment per label."""
    values = list(counts)
    left = np.zeros(len(values))
    for label in LABELS:
        widths = np.array([counts[v][label] for v in values], float)
        ax.barh(values, widths, left=left, color=LABEL_COLOURS[label], label=label)
        left += widths
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("maps", fontsize=7)


def plot_audit(summary: dict[str, Any], rows: list[dict[str, Any]], items: list[dict[str, Any]], traces: list,
               examples: int = 5):
    """The experiment's figure from its summary, per-map rows, images (with ``input_mask``) and traces.

    Example maps are recomputed from their trace (``vc.cam``, the recipe of the row); each shows its values on
    [0, 1] (every map is min-max normalised) with a perceptually uniform colour map and the mask's outline.

    Example:
        >>> fig = plot_audit(result["summary"], result["summary"]["per_map"], items, traces)  # doctest: +SKIP
    """
    import matplotlib.pyplot as plt

    cols = max(1, examples)
    fig = plt.figure(figsize=(2.2 * cols + 1.0, 2.2 * len(LABELS) + 3.4))
    grid = fig.add_gridspec(len(LABELS) + 1, cols + 1, height_ratios=[1] * len(LABELS) + [1.05],
                            width_ratios=[1] * cols + [0.06], hspace=0.6, wspace=0.25, top=0.9, bottom=0.14)
    shown = None
    for r_i, label in enumerate(LABELS):
        picked = pick_examples(rows, label, cols)
        for c_i in range(cols):
            ax = fig.add_subplot(grid[r_i, c_i])
            ax.set_xticks([])
            ax.set_yticks([])
            if c_i == 0:
                ax.set_ylabel(f"{label}\n{summary['counts'][label]} maps", fontsize=10, color=LABEL_COLOURS[label],
                              fontweight="bold")
            if c_i >= len(picked):
                ax.text(0.5, 0.5, "no map got this label" if not picked else "", ha="center", va="center", fontsize=8,
                        transform=ax.transAxes)
                ax.set_frame_on(c_i == 0)
                continue
            row = picked[c_i]
            item = items[row["image"]]
            with warnings.catch_warnings():  # an empty map's reason is already in the record (``degenerate``)
                warnings.simplefilter("ignore", DegenerateMapWarning)
                m = cam(traces[row["image"]], Recipe(layer=-1, **{f: row[f] for f in _AXES}))
            shown = ax.imshow(np.asarray(m.values), cmap="viridis", vmin=0.0, vmax=1.0)
            ax.contour(item["input_mask"], levels=[0.5], colors="white", linewidths=0.8)
            auroc = "" if row["auroc"] is None else f"\nAUROC {row['auroc']:.2f}, pointing {row['pointing_game']:.2f}"
            ax.set_title(escape_mathtext(example_title(row, item["name"].split(" (")[0]) + auroc), fontsize=6.5)
    if shown is not None:
        bar = fig.colorbar(shown, cax=fig.add_subplot(grid[: len(LABELS), cols]))
        bar.set_label("map value (each map min-max normalised); white line: object mask", fontsize=8)
        bar.ax.tick_params(labelsize=7)
    bottom = grid[len(LABELS), :].subgridspec(1, len(_AXES) + 1, wspace=0.55)
    ax = fig.add_subplot(bottom[0, 0])
    totals = summary["counts"]
    ax.bar(list(totals), list(totals.values()), color=[LABEL_COLOURS[k] for k in totals])
    for x, v in enumerate(totals.values()):
        ax.text(x, v, str(v), ha="center", va="bottom", fontsize=7)
    ax.set_title(f"all {summary['maps']} maps", fontsize=9)
    ax.tick_params(axis="x", labelsize=7, rotation=45)
    ax.tick_params(axis="y", labelsize=7)
    for i, field in enumerate(_AXES):
        _bars(fig.add_subplot(bottom[0, i + 1]), summary["counts_per_axis"][field], f"per {field}")
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=LABEL_COLOURS[k]) for k in LABELS], labels=list(LABELS),
               loc="lower center", ncol=len(LABELS), fontsize=8, frameon=False, bbox_to_anchor=(0.5, 0.0))
    ran = summary["ran"][:1].upper() + summary["ran"][1:]
    head = (f"The audit's experiment: {summary['maps']} maps ({summary['recipes_per_image']} variants x "
            f"{len(items)} images; {summary['skipped_combinations']} invalid combinations skipped). "
            f"{ran}. Weights origin (trace): {summary['weights_origin']}.")
    fig.suptitle(escape_mathtext("\n".join(textwrap.wrap(head, 150))), fontsize=9, y=0.99)
    rule = "\n".join(textwrap.wrap("Rule: " + summary["rule"] + " " + summary["caveat"], 200))
    fig.text(0.01, 0.03, escape_mathtext(rule), fontsize=6.5, va="bottom")
    return fig
