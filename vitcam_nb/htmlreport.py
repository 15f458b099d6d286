"""A self-contained HTML report: each heatmap beside its checklist, and optionally the interactive
explorer (an exported page, :func:`vitcam_nb.export_html`) in a sandboxed frame above the static figures,
which stay as the fallback. The report itself runs no script and loads nothing (no CDN); every string from
users or models (labels, file names, recipe text) is escaped, never inserted as HTML."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from html import escape

import xarray as xr

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
.card{display:flex;gap:1.2em;border:1px solid #ccc;border-radius:6px;padding:.8em;margin:.8em 0}
.card.degenerate{border-color:#c00;background:#fff4f4}
.card img{width:220px;height:220px;image-rendering:auto}
table{border-collapse:collapse;font-size:.82em}td,th{border:1px solid #ddd;padding:2px 6px;vertical-align:top}
.badge{display:inline-block;background:#c00;color:#fff;border-radius:3px;padding:0 6px;font-size:.8em}
.scores{font-size:.85em}.muted{color:#666;font-size:.85em}
iframe.explorer{width:100%;height:1150px;border:1px solid #ccc;border-radius:6px}
"""


@dataclass
class ReportEntry:
    """One heatmap in the report: a label, the map (DataArray from ``vc.cam``) and optional scores.

    Example:
        >>> ReportEntry("F1 last block", m, {"pointing game": 1.0})  # doctest: +SKIP
    """

    label: str
    cam_map: xr.DataArray
    scores: Mapping[str, float] = field(default_factory=dict)


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _checklist_table(checklist_json: str) -> str:
    rows = []
    for category, items in json.loads(checklist_json).items():
        for i, (item, value) in enumerate(items.items()):
            head = f"<th rowspan='{len(items)}'>{escape(category)}</th>" if i == 0 else ""
            rows.append(f"<tr>{head}<td>{escape(str(item))}</td><td>{escape(str(value))}</td></tr>")
    return "<table class='checklist'>" + "".join(rows) + "</table>"


def render(trace: xr.Dataset, entries: Sequence[ReportEntry], *, title: str = "vitcam_nb report",
           figures: Mapping[str, object] | None = None, notes: Sequence[str] = (),
           interactive: str | None = None) -> str:
    """Render the report as one HTML string (images embedded as data URIs). ``interactive``: the HTML of an
    exported explorer, shown in a frame (``srcdoc``, scripts allowed, nothing else) before the figures.

    Example:
        >>> html = render(tr, [ReportEntry("default", vc.cam(tr, vc.Recipe()))])  # doctest: +SKIP
    """
    from vitcam_nb.plot import overlay

    a = trace.attrs
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f"<p class='muted'>model {escape(str(a.get('model_name', '?')))} · weights sha256 "
        f"{escape(str(a.get('weights_sha256', '?'))[:16])}… · input {escape(str(a.get('img_size', '?')))} · "
        f"trace {escape(str(a.get('trace_id', '?')))} · vitcam_nb {escape(str(a.get('vitcam_nb_version', '?')))}"
        "</p>",
    ]
    parts += [f"<p>{escape(n)}</p>" for n in notes]
    if interactive is not None:
        parts.append("<h2>Interactive explorer</h2><p class='muted'>Runs in this file with no kernel or network; "
                     "if it does not start, the static figures below show the same maps.</p>"
                     f"<iframe class='explorer' title='vitcam_nb explorer' sandbox='allow-scripts' "
                     f"srcdoc='{escape(interactive, quote=True)}'></iframe>")
    for name, fig in (figures or {}).items():
        parts.append(f"<h2>{escape(name)}</h2><img alt='{escape(name)}' src='data:image/png;base64,{_png(fig)}'>")
    parts.append(f"<h2>Variants ({len(entries)})</h2>")
    for entry in entries:
        m = entry.cam_map
        reason = str(m.attrs.get("degenerate", ""))
        img = _png(overlay(trace, m, title=entry.label))
        scores = "".join(f"<li>{escape(k)}: {v:.3f}</li>" for k, v in entry.scores.items())
        badge = f"<p><span class='badge'>degenerate</span> {escape(reason)}</p>" if reason else ""
        parts.append(
            f"<div class='card{' degenerate' if reason else ''}' data-recipe-id='{escape(m.attrs['recipe_id'])}'>"
            f"<div><img alt='{escape(entry.label)}' src='data:image/png;base64,{img}'>"
            f"<ul class='scores'>{scores}</ul></div>"
            f"<div><h3>{escape(entry.label)} <span class='muted'>recipe {escape(m.attrs['recipe_id'])}</span></h3>"
            f"{badge}<p class='muted'>{escape(str(m.attrs.get('methods', '')))}</p>"
            f"{_checklist_table(m.attrs['checklist'])}</div></div>"
        )
    parts.append("</body></html>")
    return "\n".join(parts)
