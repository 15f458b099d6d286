"""A self-contained HTML report: each heatmap beside its checklist, and optionally the interactive
explorer (an exported page, :func:`vitcam_nb.export_html`) in a sandboxed frame above the static figures,
which stay as the fallback. The report itself runs no script and loads nothing (no CDN); every string from
users or models (labels, file names, recipe text) is escaped, never inserted as HTML. A trace whose weights are
random-init or of unknown origin gets a banner at the top of the page (:func:`weights_warning`)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from html import escape

import xarray as xr

# Cards flow in a grid that fits the window; long unbroken strings (hashes, JSON) wrap instead of widening it.
_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1200px;padding:0 1em;color:#222}
*{box-sizing:border-box}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(100%,560px),1fr));gap:.8em;align-items:start}
.card{display:flex;gap:1em;border:1px solid #ccc;border-radius:6px;padding:.7em;min-width:0}
.card>div{min-width:0}.card>div:last-child{flex:1}
.card.degenerate{border-color:#c00;background:#fff4f4}
.card img{width:270px;max-width:100%;height:auto;image-rendering:auto}
.card h3{margin:.1em 0 .4em;font-size:1em}
img.figure{max-width:100%;height:auto;display:block}
table{border-collapse:collapse;font-size:.82em;width:100%}
td,th{border:1px solid #ddd;padding:2px 6px;vertical-align:top;text-align:left;overflow-wrap:anywhere}
th{background:#eef2f6}td:first-child{width:32%}
details{margin:.3em 0}summary{cursor:pointer;color:#035;font-size:.9em}
.provenance{border:1px solid #bbb;border-radius:6px;padding:.6em .9em;background:#f7f9fb}
.badge{display:inline-block;background:#c00;color:#fff;border-radius:3px;padding:0 6px;font-size:.8em}
.scores{font-size:.85em;padding-left:1.2em;margin:.3em 0}.muted{color:#666;font-size:.85em;overflow-wrap:anywhere}
.reproduce code{font-size:.8em;overflow-wrap:anywhere;white-space:normal}
iframe.explorer{width:100%;height:1150px;border:1px solid #ccc;border-radius:6px}
.weights-banner{background:#b00020;color:#fff;font-size:1.15em;padding:.8em 1em;border-radius:6px;margin:.6em 0 1em}
.weights-banner strong{font-size:1.2em;letter-spacing:.02em}
"""
_SHARED = "model and input"

#: The title line of a figure, and the banner of a report, whose model holds random (untrained) weights.
RANDOM_WEIGHTS = "RANDOM WEIGHTS — maps show an untrained model"
#: The same for weights whose origin the kit cannot tell (not loaded by it, norm layers moved off their init).
UNKNOWN_WEIGHTS = "WEIGHTS OF UNKNOWN ORIGIN — maps may show an untrained model"


def weights_warning(origin: str | None) -> str | None:
    """The warning line for a weights' origin (``weights_origin`` of a trace, with or without a ``"weights: "``
    prefix): :data:`RANDOM_WEIGHTS` for random-init, :data:`UNKNOWN_WEIGHTS` for unknown or missing, None for weights
    the kit loaded (bundled, pretrained, a file).

    Example:
        >>> weights_warning("weights: random-init")
        'RANDOM WEIGHTS — maps show an untrained model'
        >>> weights_warning("bundled shapes-vit (file sha256 54d5...)") is None
        True
    """
    text = str(origin or "").strip().removeprefix("weights:").strip()
    if text.startswith(("random", "untrained")):
        return RANDOM_WEIGHTS
    if text.startswith(("bundled ", "pretrained ", "file ")):
        return None
    return UNKNOWN_WEIGHTS


def _weights_banner(trace: xr.Dataset) -> str:
    origin = trace.attrs.get("weights_origin")
    warning = weights_warning(origin)
    if warning is None:
        return ""
    model = str(trace.attrs.get("model_name", "?"))
    what = ("its weights are random-init: the network was never trained" if warning == RANDOM_WEIGHTS else
            "where its weights come from is not known (the kit did not load them)")
    return (f"<div class='weights-banner' role='alert'><strong>{escape(warning)}</strong><br>Model "
            f"{escape(model)}: {escape(what)}, so every map below explains that network, not a learned model. For "
            "maps of a trained model load its weights: vc.load_model(name, pretrained=True) or weights=PATH "
            f"(command line: --pretrained or --weights PATH). Weights' origin: {escape(str(origin or 'not recorded'))}."
            "</div>")  # the checklist category every card of one trace shares: shown once, at the top


@dataclass
class ReportEntry:
    """One heatmap in the report: a label, the map (DataArray from ``vc.cam``) and optional scores (numbers, or
    words such as the audit label).

    Example:
        >>> ReportEntry("F1 last block", m, {"pointing game": 1.0})  # doctest: +SKIP
    """

    label: str
    cam_map: xr.DataArray
    scores: Mapping[str, float | str] = field(default_factory=dict)


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _table(checklist: Mapping[str, Mapping[str, object]], css: str) -> str:
    """Two columns, each category a heading row above its items: readable in a narrow card."""
    rows = []
    for category, items in checklist.items():
        rows.append(f"<tr><th colspan='2'>{escape(category)}</th></tr>")
        rows += [f"<tr><td>{escape(str(item))}</td><td>{escape(str(value))}</td></tr>" for item, value in items.items()]
    return f"<table class='{css}'>" + "".join(rows) + "</table>"


def _shared(entries: Sequence[ReportEntry]) -> dict | None:
    """The provenance category of the cards' checklists when it is the same in every card, else None."""
    found = [json.loads(e.cam_map.attrs["checklist"]).get(_SHARED) for e in entries]
    return found[0] if found and found[0] is not None and all(f == found[0] for f in found) else None


def _provenance(trace: xr.Dataset, shared: dict | None) -> str:
    a = trace.attrs
    line = (f"<p class='muted'>model {escape(str(a.get('model_name', '?')))} · weights sha256 "
            f"{escape(str(a.get('weights_sha256', '?'))[:16])}… · input {escape(str(a.get('img_size', '?')))} · "
            f"trace {escape(str(a.get('trace_id', '?')))} · vitcam_nb {escape(str(a.get('vitcam_nb_version', '?')))}"
            "</p>")
    table = ""
    if shared is not None:
        table = (f"<details><summary>{escape(_SHARED)}: shared by every map below</summary>"
                 f"{_table({_SHARED: shared}, 'provenance-table')}</details>")
    return f"<section class='provenance'><h2>Provenance</h2>{line}{table}</section>"


def _reproduce(trace: xr.Dataset, m: xr.DataArray) -> str:
    """The recipe as a line a reader can paste (``vitcam-nb cam``), its id as written, its canonical id and the trace's
    id: enough to regenerate the map from the trace file."""
    from vitcam_nb.core.recipe import Recipe

    recipe = Recipe.from_json(m.attrs["recipe"])
    resolved = recipe.resolve(trace)
    return (f"<p class='reproduce'><code>{escape(resolved.to_string())}</code><br><span class='muted'>recipe id "
            f"{escape(recipe.id)} · canonical id {escape(resolved.id)} · trace "
            f"{escape(str(trace.attrs.get('trace_id', '?')))}</span></p>")


def _score(value: float | str) -> str:
    """A number to three decimals; a word (the audit label) as escaped text."""
    return escape(value) if isinstance(value, str) else f"{value:.3f}"


def _card(trace: xr.Dataset, entry: ReportEntry, shared: dict | None, mask: object) -> str:
    from vitcam_nb.plot import class_name, overlay

    m = entry.cam_map
    reason = str(m.attrs.get("degenerate", ""))
    name = class_name(trace, m.attrs["recipe"]) if "recipe" in m.attrs else None
    img = _png(overlay(trace, m, title="", mask=mask))  # the card's heading names the map, in page-sized text
    scores = "".join(f"<li>{escape(k)}: {_score(v)}</li>" for k, v in entry.scores.items())
    badge = f"<p><span class='badge'>degenerate</span> {escape(reason)}</p>" if reason else ""
    checklist = json.loads(m.attrs["checklist"])
    if shared is not None and checklist.get(_SHARED) == shared:
        checklist.pop(_SHARED)  # shown once, in the provenance block
    return (
        f"<div class='card{' degenerate' if reason else ''}' data-recipe-id='{escape(m.attrs['recipe_id'])}'>"
        f"<div><img alt='{escape(entry.label)}' src='data:image/png;base64,{img}'>"
        f"<ul class='scores'>{scores}</ul></div>"
        f"<div><h3>{escape(entry.label)}{escape(f' · class {name}' if name else '')} "
        f"<span class='muted'>recipe {escape(m.attrs['recipe_id'])}</span></h3>"
        f"{badge}{_reproduce(trace, m)}<details><summary>methods paragraph</summary>"
        f"<p class='muted'>{escape(str(m.attrs.get('methods', '')))}</p></details>"
        f"<details><summary>checklist ({len(checklist)} categories)</summary>"
        f"{_table(checklist, 'checklist')}</details></div></div>"
    )


def render(trace: xr.Dataset, entries: Sequence[ReportEntry], *, title: str = "vitcam_nb report",
           figures: Mapping[str, object] | None = None, notes: Sequence[str] = (),
           interactive: str | None = None, mask: object = None) -> str:
    """Render the report as one HTML string (images embedded as data URIs). ``interactive``: the HTML of an
    exported explorer, shown in a frame (``srcdoc``, scripts allowed, nothing else) before the figures.
    ``mask``: the object's pixels, outlined on every map when known.

    The provenance (model, weights, input, versions) is shown once at the top; each card keeps its own
    checklist, folded in a ``<details>``. Random-init weights, or weights of unknown origin (the trace's
    ``weights_origin``), put a banner above everything (:func:`weights_warning`).

    Example:
        >>> html = render(tr, [ReportEntry("default", vc.cam(tr, vc.Recipe()))])  # doctest: +SKIP
    """
    shared = _shared(entries)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>",
        _weights_banner(trace),
        f"<h1>{escape(title)}</h1>",
        _provenance(trace, shared),
    ]
    parts += [f"<p>{escape(n)}</p>" for n in notes]
    if interactive is not None:
        parts.append("<h2>Interactive explorer</h2><p class='muted'>Runs in this file with no kernel or network; "
                     "if it does not start, the static figures below show the same maps.</p>"
                     f"<iframe class='explorer' title='vitcam_nb explorer' sandbox='allow-scripts' "
                     f"srcdoc='{escape(interactive, quote=True)}'></iframe>")
    for name, fig in (figures or {}).items():
        parts.append(f"<h2>{escape(name)}</h2>"
                     f"<img class='figure' alt='{escape(name)}' src='data:image/png;base64,{_png(fig)}'>")
    parts.append(f"<h2>Variants ({len(entries)})</h2><div class='cards'>")
    parts += [_card(trace, entry, shared, mask) for entry in entries]
    parts.append("</div></body></html>")
    return "\n".join(parts)
