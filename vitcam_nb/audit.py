"""The audit as code: the ``vitcam-nb ambiguity`` job (trace a model on images, ask
:func:`vitcam_nb.ambiguity` how much a description leaves open, write its figure and a JSON summary),
and paper cards (``vc.audit.schema()``, ``template()``, ``validate(card)``, ``summarise(cards)``, ``figures()``: the
audit's published numbers with their source, Wall, Wang, Rizk & Santosh 2026).

Example:
    >>> parse_reported_args(["site=F1", "layer=-1", "aggregation=open"])
    {'site': 'F1', 'layer': -1, 'aggregation': 'open'}
    >>> figures()["no_justification"]["count"], validate(template())["card_version"]
    (101, '1.0.0')
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vitcam_nb.capture.trace import trace
from vitcam_nb.core.arguments import as_flag, as_path
from vitcam_nb.core.card_schema import PaperCardError, template
from vitcam_nb.core.card_schema import load_schema as schema
from vitcam_nb.core.card_schema import validate_card as validate
from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.core.outfiles import OutputFolder
from vitcam_nb.core.provenance import weights_origin
from vitcam_nb.core.version import __version__
from vitcam_nb.evaluate.ambiguity.analysis import ambiguity
from vitcam_nb.evaluate.audit.cards import audit_figures as figures
from vitcam_nb.evaluate.audit.cards import load_cards, summarise
from vitcam_nb.models import bundled_names, load_model, sample_image

__all__ = ["PaperCardError", "figures", "load_cards", "parse_reported_args", "run_ambiguity", "schema", "summarise",
           "template", "validate"]

#: What ``vitcam-nb ambiguity`` writes in its folder (and lists, with each file's SHA-256, in the folder's manifest).
_OUTPUTS = ("ambiguity.png", "ambiguity.json")


def parse_reported_args(items: Sequence[str]) -> dict[str, Any]:
    """``field=value`` words as a ``reported`` dict; values are read as JSON when they parse (numbers, lists),
    else kept as text.

    Example:
        >>> parse_reported_args(["layer=[0, 1]", "layer_fusion=mean"])
        {'layer': (0, 1), 'layer_fusion': 'mean'}
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ArgumentError(f"reported: expected field=value words, got {item!r}")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        out[key] = tuple(parsed) if isinstance(parsed, list) else parsed
    return out


def run_ambiguity(out: str | Path, model: str = "shapes-vit", reported: dict[str, Any] | None = None,
                  images: int = 1, image: str | None = None, *, pretrained: bool = False,
                  weights: str | Path | None = None, announce: Callable[[str], None] | None = None,
                  overwrite: bool = False) -> dict[str, Path]:
    """Trace ``model`` on ``images`` bundled sample images (or the file ``image``), run the ambiguity of
    ``reported`` and write ``ambiguity.png`` and ``ambiguity.json`` into ``out``; returns their paths. On a
    bundled model the images' object masks give the chance to localise. ``pretrained`` and ``weights`` go to
    :func:`vitcam_nb.load_model`; ``announce`` gets the weights' origin line before any result; the JSON
    (``weights_origin`` and the report paragraph) and the figure (footer and PNG Title) state it.

    Each file is written atomically and listed in the folder's manifest (``.vitcam_nb-outputs.json``); a file of
    those names that an earlier run did not write there, or that changed since, is refused before the model is
    built (:class:`~vitcam_nb.OutputExistsError`) unless ``overwrite=True``. A refused call creates nothing.

    Example:
        >>> import tempfile
        >>> paths = run_ambiguity(tempfile.mkdtemp(), reported={"site": "F1", "layer": -1})
        >>> sorted(paths)
        ['figure', 'summary']
    """
    import matplotlib

    matplotlib.use("Agg")
    folder = as_path("out", out)
    overwrite = as_flag("overwrite", overwrite)
    if isinstance(images, bool) or not isinstance(images, int) or images < 1:
        raise ArgumentError(f"images: expected a positive int, got {images!r}")
    if image is None and model not in bundled_names():  # refused before the model is built
        raise ArgumentError(f"image: a timm model ({model}) needs --image PATH; the bundled sample images are for "
                            f"the bundled models {bundled_names()}")
    if image is not None and not Path(image).is_file():
        raise ArgumentError(f"image: {Path(image)} is not a file")
    outputs = OutputFolder(folder, _OUTPUTS, f"vitcam_nb {__version__} run_ambiguity", overwrite=overwrite)
    net = load_model(model, pretrained=pretrained, weights=weights)
    origin = weights_origin(net)
    if announce is not None:
        announce(f"weights: {origin}")
    if image is not None:
        from PIL import Image

        with Image.open(image) as im:
            pixels, masks = [np.asarray(im.convert("RGB"))], None
    else:
        kind = "shortcut" if "shortcut" in model else "shapes"
        samples = [sample_image(kind, i, with_mask=True) for i in range(images)]
        pixels, masks = [s[0] for s in samples], [s[2] for s in samples]
    traces = [trace(net, p) for p in pixels]
    first = ambiguity(traces[0], reported, mask=None if masks is None else masks[0])
    said = f"Model {model}, weights {origin}. "
    summary = {"model": model, "weights_origin": origin, **first.to_dict(), "report": said + first.report()}
    if len(traces) > 1:
        many = ambiguity(traces, reported, mask=masks)
        summary["images"] = many.summary()
        summary["report_images"] = said + many.report()
    fig = first.plot()
    fig.text(0.005, 0.005, f"{model}; weights: {origin}", fontsize=6, color="0.3", ha="left", va="bottom")
    title = f"vitcam_nb ambiguity of {model}; weights: {origin}"
    text = json.dumps(summary, indent=2, default=str)
    folder.mkdir(parents=True, exist_ok=True)  # only now: a call refused above leaves no folder behind
    import matplotlib.pyplot as plt

    try:  # the temporary file has no .png suffix for matplotlib to read the format from
        figure = outputs.write("ambiguity.png",
                               lambda p: fig.savefig(p, dpi=110, format="png", metadata={"Title": title}))
    finally:  # written to a file, not shown: a notebook calling this twice keeps no figure open
        plt.close(fig)
    return {"figure": figure,
            "summary": outputs.write("ambiguity.json", lambda p: p.write_text(text, encoding="utf-8"))}
