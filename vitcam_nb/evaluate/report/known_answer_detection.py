"""The known-answer report of the bundled detector ``shapes-yolos``: pointing game per detection.

On fresh images of :func:`vitcam_nb.data.shapes_detection.shapes_detection` the detector is traced with one
detection target per detection token (``vc.targets.detection(query=[0, 1, 2])``, each scored by the logit of its
own top class); the map of detection ``k`` should peak inside the mask of object ``k`` (the object of band
``k``). Each row states whether it does (pointing game, tolerance 0 px by default: the peak inside the mask), the
chance level of that hit (the share of the image the mask covers: what a peak placed uniformly at random hits),
whether the peak fell on another object instead, and how well the detection found its object (IoU, class).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from vitcam_nb.capture.trace import trace
from vitcam_nb.core.arguments import as_flag, as_path
from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError, DegenerateMapWarning
from vitcam_nb.core.kinds import kind_for
from vitcam_nb.core.outfiles import OutputFolder
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.data.shapes_detection import MAX_OBJECTS, shapes_detection
from vitcam_nb.evaluate.localisation.metrics import pointing_game
from vitcam_nb.models import load_model
from vitcam_nb.targets.detection import box_iou, detection

__all__ = ["report_known_answer_detection"]

_DEFAULT = {"gradcam F1 last": Recipe()}
_OUTPUTS = ("known_answer_detection.csv", "known_answer_detection.json")


def report_known_answer_detection(
    model: torch.nn.Module | str = "shapes-yolos",
    n_images: int = 100,
    seed: int = 0,
    *,
    recipes: Mapping[str, Recipe] | None = None,
    tolerance: float = 0.0,
    out_dir: str | Path | None = None,
    overwrite: bool = False,
):
    """Pointing game per detection of the known-answer detector over ``n_images`` generated images.

    Args:
        model: the detector or a bundled name (default ``"shapes-yolos"``); detection token ``k`` must report
            the object of band ``k`` as the bundled model does.
        n_images, seed: images from ``shapes_detection(n_images, seed)`` (seeds the training used are stated in
            the model card; use another).
        recipes: label -> Recipe (default Grad-CAM at F1 of the last block); ``class_=k`` is set per detection.
        tolerance: pointing-game tolerance in pixels (0: the map's peak inside the object's mask).
        out_dir: if given, writes ``known_answer_detection.csv`` and ``known_answer_detection.json`` (settings
            and summary) there; a file of those names there that the kit did not write (or that changed since) is
            refused (:class:`~vitcam_nb.OutputExistsError`) before any work unless ``overwrite=True``.
        overwrite: replace such files (True or False).

    Returns:
        ``(table, summary)``: a pandas DataFrame with one row per recipe x image x present object (``pointing``,
        ``chance``, ``other_object``, ``iou``, ``class_ok``, ...) and a dict per recipe of the means (``pointing``
        over the rows with a non-constant map, ``pointing_all`` counting constant maps as misses, ``chance``).

    Example:
        >>> table, summary = report_known_answer_detection(n_images=4)  # doctest: +SKIP
        >>> summary["gradcam F1 last"]["pointing"] > summary["gradcam F1 last"]["chance"]  # doctest: +SKIP
        True
    """
    import pandas as pd

    if isinstance(n_images, bool) or not isinstance(n_images, int) or n_images < 1:
        raise ArgumentError(f"n_images: expected a positive int, got {n_images!r}")
    recipes = dict(_DEFAULT if recipes is None else recipes)
    if not recipes or not all(isinstance(r, Recipe) for r in recipes.values()):
        raise ArgumentTypeError(f"recipes: expected a non-empty mapping of labels to vitcam_nb.Recipe, got "
                                f"{recipes!r:.80}")
    overwrite = as_flag("overwrite", overwrite)
    # a file of these names that the kit did not write there is refused before any image is traced
    folder = None if out_dir is None else OutputFolder(as_path("out_dir", out_dir), _OUTPUTS,
                                                       "report_known_answer_detection", overwrite=overwrite)
    name = model if isinstance(model, str) else type(model).__name__
    model = load_model(model) if isinstance(model, str) else model
    images, labels, boxes, masks = shapes_detection(n_images, seed)
    rows = []
    for i in range(n_images):
        target = detection(query=list(range(MAX_OBJECTS)))
        tr = trace(model, images[i], targets=target)
        found = json.loads(tr.attrs["target_detections"])
        for label, recipe in recipes.items():
            for k in np.nonzero(labels[i] >= 0)[0]:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DegenerateMapWarning)
                    r = recipe.replace(class_=int(k))
                    m = kind_for(tr, r).cam(tr, r)
                values = m.values
                constant = bool(np.ptp(values) == 0)
                peak = values == values.max()
                others = masks[i][[j for j in range(MAX_OBJECTS) if j != k]].any(axis=0)
                rows.append({
                    "recipe": label, "image": i, "detection": int(k), "label": int(labels[i, k]),
                    "predicted_class": int(found[k]["class"]), "class_ok": int(found[k]["class"]) == labels[i, k],
                    "iou": float(box_iou(boxes[i, k], np.array([found[k]["box"]]))[0]),
                    "pointing": np.nan if constant else _pointing(values, masks[i, k], tolerance),
                    "chance": float(masks[i, k].mean()),
                    "other_object": np.nan if constant else float(peak[others].sum() / peak.sum())})
    table = pd.DataFrame(rows)
    summary = {label: {"pointing": float(g["pointing"].mean()),
                       "pointing_all": float(g["pointing"].fillna(0.0).mean()),
                       "chance": float(g["chance"].mean()), "other_object": float(g["other_object"].mean()),
                       "mean_iou": float(g["iou"].mean()), "class_accuracy": float(g["class_ok"].mean()),
                       "detections": len(g)}
               for label, g in table.groupby("recipe", sort=False)}
    settings = {"model": name, "n_images": n_images, "seed": seed, "tolerance_px": tolerance,
                "targets": "detection(query=[0, 1, 2]): each detection's top-class logit",
                "recipes": {k: json.loads(r.to_json()) for k, r in recipes.items()},
                "chance": "share of the image inside the object's mask (a uniformly random peak's hit rate)"}
    table.attrs.update(settings)
    if folder is not None:
        folder.root.mkdir(parents=True, exist_ok=True)
        text = json.dumps({**settings, "summary": summary}, indent=1)
        folder.write("known_answer_detection.csv", lambda p: table.to_csv(p, index=False))
        folder.write("known_answer_detection.json", lambda p: p.write_text(text, encoding="utf-8"))
    return table, summary


def _pointing(values: np.ndarray, mask: np.ndarray, tolerance: float) -> float:
    return float(pointing_game(values, mask, tolerance=tolerance))
