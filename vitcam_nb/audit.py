"""The audit as code: the ``vitcam-nb ambiguity`` job (trace a model on images, ask
:func:`vitcam_nb.evaluate.ambiguity` how much a description leaves open, write its figure and a JSON summary), and
paper cards (``vc.audit.schema()``, ``template()``, ``validate(card)``, ``summarise(cards)``, ``figures()``: the
audit's published numbers with their source, Wall, Wang, Rizk & Santosh 2026).

Example:
    >>> parse_reported_args(["site=F1", "layer=-1", "aggregation=open"])
    {'site': 'F1', 'layer': -1, 'aggregation': 'open'}
    >>> figures()["no_justification"]["count"], validate(template())["card_version"]
    (101, '1.0.0')
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vitcam_nb.capture.trace import trace
from vitcam_nb.core.card_schema import PaperCardError, template
from vitcam_nb.core.card_schema import load_schema as schema
from vitcam_nb.core.card_schema import validate_card as validate
from vitcam_nb.evaluate.ambiguity import ambiguity
from vitcam_nb.evaluate.cards import audit_figures as figures
from vitcam_nb.evaluate.cards import load_cards, summarise
from vitcam_nb.models import bundled_names, load_model, sample_image

__all__ = ["PaperCardError", "figures", "load_cards", "parse_reported_args", "run_ambiguity", "schema", "summarise",
           "template", "validate"]


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
            raise ValueError(f"reported: expected field=value words, got {item!r}")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        out[key] = tuple(parsed) if isinstance(parsed, list) else parsed
    return out


def run_ambiguity(out: str | Path, model: str = "shapes-vit", reported: dict[str, Any] | None = None,
                  images: int = 1, image: str | None = None) -> dict[str, Path]:
    """Trace ``model`` on ``images`` bundled sample images (or the file ``image``), run the ambiguity of
    ``reported`` and write ``ambiguity.png`` and ``ambiguity.json`` into ``out``; returns their paths. On a
    bundled model the images' object masks give the chance to localise.

    Example:
        >>> paths = run_ambiguity("/tmp/vitcam-ambiguity", reported={"site": "F1", "layer": -1})
        >>> sorted(paths)
        ['figure', 'summary']
    """
    import matplotlib

    matplotlib.use("Agg")
    if isinstance(images, bool) or not isinstance(images, int) or images < 1:
        raise ValueError(f"images: expected a positive int, got {images!r}")
    net = load_model(model)
    if image is not None:
        from PIL import Image

        path = Path(image)
        if not path.is_file():
            raise ValueError(f"image: {path} is not a file")
        with Image.open(path) as im:
            pixels, masks = [np.asarray(im.convert("RGB"))], None
    elif model in bundled_names():
        kind = "shortcut" if "shortcut" in model else "shapes"
        samples = [sample_image(kind, i, with_mask=True) for i in range(images)]
        pixels, masks = [s[0] for s in samples], [s[2] for s in samples]
    else:
        raise ValueError(f"image: a timm model ({model}) needs --image PATH; the bundled sample images are for "
                         f"the bundled models {bundled_names()}")
    traces = [trace(net, p) for p in pixels]
    first = ambiguity(traces[0], reported, mask=None if masks is None else masks[0])
    summary = {"model": model, **first.to_dict(), "report": first.report()}
    if len(traces) > 1:
        many = ambiguity(traces, reported, mask=masks)
        summary["images"] = many.summary()
        summary["report_images"] = many.report()
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"figure": folder / "ambiguity.png", "summary": folder / "ambiguity.json"}
    fig = first.plot()
    fig.savefig(paths["figure"], dpi=110)
    paths["summary"].write_text(json.dumps(summary, indent=2, default=str))
    return paths
