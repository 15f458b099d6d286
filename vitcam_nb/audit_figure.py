"""The audit's experiment in one command (``vitcam-nb figure``): a grid of variants (site x target x weighting x
token handling x heads) on ViT-B/16 when its pretrained weights are on this machine, on the bundled known-answer
model otherwise; every map labelled localises / context / inverted / empty against the object's mask
(:func:`vitcam_nb.evaluate.audit.labels.label_map`), and a figure and a JSON record of the counts.

Example:
    >>> recipes, skipped = audit_recipes({"site": ["F1", "F2"], "target": ["logit"], "weighting": ["gradcam"],
    ...                                   "weight_tokens": ["patch"], "heads": ["channels", "max"]})
    >>> [(r.site, r.heads) for r in recipes], list(skipped.values())
    ([('F1', 'channels'), ('F2', 'channels'), ('F2', 'max')], [1])
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import warnings
from collections import Counter
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitcam_nb.api import gallery
from vitcam_nb.audit_plot import plot_audit
from vitcam_nb.capture.trace import trace
from vitcam_nb.core.arguments import as_flag, as_path
from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError, DegenerateMapWarning, RecipeError
from vitcam_nb.core.outfiles import MANIFEST, OutputFolder
from vitcam_nb.core.recipe import HEAD_RULES, TARGETS, WEIGHT_TOKENS, Recipe
from vitcam_nb.core.recipe_space import check_space
from vitcam_nb.core.schema import CORE_SITES
from vitcam_nb.core.version import __version__
from vitcam_nb.data.segmenter import LinearSegmenter
from vitcam_nb.evaluate.audit.labels import LABELS, label_map, rule_text, thresholds
from vitcam_nb.models import bundled_names, load_model, model_card, sample_image
from vitcam_nb.preprocess import InputCropWarning, prepare_input

__all__ = ["AUDIT_AXES", "AUDIT_MODEL", "FALLBACK_MODEL", "FILES", "audit_recipes", "cached_weights",
           "photo_with_mask", "run_figure"]

AUDIT_MODEL = "vit_base_patch16_224"
FALLBACK_MODEL = "shapes-vit"
#: The audit's axes and the values the experiment crosses (the last block, the top-1 class throughout).
AUDIT_AXES: dict[str, list] = {"site": list(CORE_SITES), "target": list(TARGETS),
                               "weighting": ["gradcam", "hirescam", "gradcampp", "xgradcam", "layercam", "eigencam"],
                               "weight_tokens": list(WEIGHT_TOKENS), "heads": list(HEAD_RULES)}
FILES = ("audit_figure.png", "audit_figure.json")
WRITTEN_BY = "vitcam-nb figure"
_PHOTO, _PHOTO_MASK = "grace_hopper.jpg", "grace_hopper_mask.json"


def photo_with_mask() -> tuple[np.ndarray, np.ndarray] | None:
    """The natural photograph that matplotlib ships (``grace_hopper.jpg``, 600 x 512) and the hand-drawn mask of
    the person (hat, head, upper body; a polygon in ``vitcam_nb/data/samples/grace_hopper_mask.json``), or None
    when this matplotlib has no sample data.

    Example:
        >>> image, mask = photo_with_mask()
        >>> image.shape, mask.shape, round(float(mask.mean()), 2)
        ((600, 512, 3), (600, 512), 0.56)
    """
    import matplotlib.cbook
    from PIL import Image, ImageDraw

    try:
        path = matplotlib.cbook.get_sample_data(_PHOTO, asfileobj=False)
    except (OSError, ValueError):
        return None
    if not Path(path).is_file():
        return None
    with Image.open(path) as im:
        image = np.asarray(im.convert("RGB"))
    spec = json.loads(resources.files("vitcam_nb.data").joinpath("samples", _PHOTO_MASK).read_text())
    canvas = Image.new("L", tuple(spec["image_size_wh"]), 0)
    ImageDraw.Draw(canvas).polygon([tuple(p) for p in spec["polygon_xy"]], fill=1)
    return image, np.asarray(canvas).astype(bool)


def cached_weights(name: str) -> str | None:
    """The path of ``name``'s default pretrained weights (``model.safetensors``) if they are already in the Hugging
    Face cache timm downloads into, else None. Nothing is downloaded; pickled checkpoints (``.bin``, ``.pth``) are
    not read.

    Example:
        >>> cached_weights("vit_base_patch16_224")  # doctest: +SKIP
        '/home/me/.cache/huggingface/hub/models--timm--vit_base_patch16_224.augreg2_in21k_ft_in1k/.../model.safetensors'
    """
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(name)
    if cfg is None:
        return None
    if not cfg.hf_hub_id:
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(cfg.hf_hub_id, "model.safetensors")
    return found if isinstance(found, str) and Path(found).is_file() else None


def _load_file(name: str, path: str) -> torch.nn.Module:
    """``name`` with the weights of a local safetensors file (never a pickle)."""
    try:
        return load_model(name, weights=path)  # a safetensors state dict, loaded strictly; the origin names the file
    except (RuntimeError, OSError, ValueError) as exc:  # a file that does not fit the model
        raise ArgumentError(f"weights: {Path(path).name} could not be loaded into {name} ({str(exc)[:200]})") from exc


def _choose_model(model: str, weights: str | None) -> tuple[torch.nn.Module, str, str]:
    """(model, its name, the line saying which model ran and why)."""
    if weights is not None:
        path = Path(weights)
        if not path.is_file():
            raise ArgumentError(f"weights: {path} is not a file")
        if path.suffix != ".safetensors":
            raise ArgumentError(f"weights: {path.name} is not a .safetensors file; the kit reads no pickled checkpoint")
        name = AUDIT_MODEL if model == "auto" else model
        if name in bundled_names():
            raise ArgumentError(f"weights: the bundled model {name} carries its own weights; leave out weights")
        net = _load_file(name, str(path))
        return net, name, f"ran on {name} with the weights of the local file {path.name}, as asked"
    if model in bundled_names():
        return load_model(model), model, f"ran on the bundled known-answer model {model}, as asked"
    name = AUDIT_MODEL if model == "auto" else model
    import timm

    if not timm.is_model(name):
        raise ArgumentError(f"model: {name!r} is neither 'auto', a bundled model {bundled_names()} nor a timm model "
                            f"name")
    found = cached_weights(name)
    if found is None:
        why = f"{name}'s pretrained weights are not on this machine (not in the Hugging Face cache timm reads)"
        if model != "auto":
            raise ArgumentError(f"model: {why}; put them there (timm downloads them on first use when online), give "
                                "weights=FILE, or use model='auto' to fall back to the bundled model")
        line = f"ran on the bundled known-answer model {FALLBACK_MODEL}: {why}"
        return load_model(FALLBACK_MODEL), FALLBACK_MODEL, line
    net = _load_file(name, found)
    return net, name, f"ran on {name} with its pretrained weights from this machine's timm / Hugging Face cache"


def audit_recipes(axes: dict[str, list] | None = None) -> tuple[list[Recipe], dict[str, int]]:
    """Every valid recipe of the axes' product (last block, top-1 class), and the invalid combinations skipped,
    counted by the reason :class:`~vitcam_nb.RecipeError` gives.

    Example:
        >>> recipes, skipped = audit_recipes()
        >>> len(recipes), sum(skipped.values())
        (414, 882)
    """
    axes = _axes(axes)
    recipes, skipped = [], Counter()
    for combo in itertools.product(*axes.values()):
        try:
            recipes.append(Recipe(layer=-1, **dict(zip(axes, combo))))
        except RecipeError as exc:
            skipped[str(exc).split(";")[0]] += 1
    return recipes, dict(skipped)


def _axes(axes: dict[str, list] | None) -> dict[str, list]:
    if axes is None:
        return {k: list(v) for k, v in AUDIT_AXES.items()}
    if not isinstance(axes, dict):
        raise ArgumentTypeError(f"axes: expected a dict field -> list of values, got {type(axes).__name__}")
    unknown = sorted(set(axes) - set(AUDIT_AXES))
    if unknown:
        raise ArgumentError(f"axes: {unknown[0]!r} is not an axis of the audit; axes are {list(AUDIT_AXES)}")
    out = {}
    for field, default in AUDIT_AXES.items():
        values = axes.get(field, default)
        if isinstance(values, str) or not isinstance(values, (list, tuple)) or not values:
            raise ArgumentError(f"axes: {field} needs a non-empty list of values, got {values!r}")
        out[field] = list(values)
    check_space(out, "axes")  # a typo ("f4") is refused, not listed among the skipped combinations
    return out


def _check_out(folder: Path, overwrite: bool) -> OutputFolder:
    """Refuse a folder holding anything but this command's outputs, and either output unless the kit wrote it there
    unchanged (unless ``overwrite``), before any expensive work; the folder whose writes are atomic and recorded."""
    if folder.exists() and not folder.is_dir():
        raise ArgumentError(f"out: {folder} is a file; give a folder path")
    others = sorted(p.name for p in folder.iterdir() if p.name not in (*FILES, MANIFEST)) if folder.is_dir() else []
    if others and not overwrite:
        raise ArgumentError(f"out: {folder} holds files this command did not write ({', '.join(others[:5])}); the kit "
                            "never overwrites them. Use an empty or new folder, or overwrite=True (--overwrite) to "
                            f"write {' and '.join(FILES)} there (other files are left alone)")
    _probe(folder)
    return OutputFolder(folder, FILES, WRITTEN_BY, overwrite=overwrite)


def _probe(folder: Path) -> None:
    """Refuse a folder that cannot be made or written (under /proc, a read-only mount, a file's path) before any
    work: permission bits do not say it (root ignores them), so a probe folder is made and removed in the folder,
    or in its nearest existing ancestor when it does not exist yet (which the run would create)."""
    base = folder
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise ArgumentError(f"out: {folder} cannot be made: {base} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(dir=base, prefix=".vitcam-figure-probe-"))
    except OSError as exc:
        raise ArgumentError(f"out: {folder} cannot be written ({base}: {exc.strerror}); nothing was computed. Give a "
                            "folder this process can write to") from exc


def _images(model: str, net: torch.nn.Module, images: int, photo: bool) -> list[dict[str, Any]]:
    """The images with their object masks at the model input (the mask goes through the image's preprocessing)."""
    out = []
    kind = "shortcut" if "shortcut" in model else "shapes"
    classes = model_card(FALLBACK_MODEL)["classes"]
    for i in range(images):
        pixels, label, mask = sample_image(kind, i, with_mask=True)
        out.append({"name": f"{classes[label]} (bundled {kind} #{i})", "pixels": pixels, "mask": mask,
                    "kind": "bundled shape"})
    found = photo_with_mask() if photo else None
    if found is not None:
        out.append({"name": "grace_hopper.jpg (photograph)", "pixels": found[0], "mask": found[1],
                    "kind": "photograph"})
    for item in out:
        drawn = np.repeat(item["mask"].astype(np.uint8)[..., None] * 255, 3, axis=2)
        with warnings.catch_warnings():  # the mask goes through the image's own crop, stated by its trace
            warnings.simplefilter("ignore", InputCropWarning)
            item["input_mask"] = prepare_input(net, drawn).display[..., 0] >= 128
    return out


def run_figure(out: str | Path = "vitcam-figure", model: str = "auto", images: int = 5, photo: bool = True,
               axes: dict[str, list] | None = None, weights: str | None = None, overwrite: bool = False,
               progress: bool = True, examples: int = 5) -> dict[str, Any]:
    """Run the audit's experiment and write ``audit_figure.png`` and ``audit_figure.json`` into ``out``.

    ``model``: "auto" (ViT-B/16 if its pretrained weights are on this machine, else the bundled ``shapes-vit``),
    a bundled name, or a timm name whose weights are cached (or given as the local file ``weights``). Images:
    the first ``images`` bundled shapes (exact masks) and, with ``photo``, matplotlib's ``grace_hopper.jpg``
    with its hand-drawn mask. ``axes`` narrows :data:`AUDIT_AXES`. Returns the paths, the summary dict and the
    line saying which model ran and why. Both files are written atomically and listed in the folder's manifest
    (``.vitcam_nb-outputs.json``); a rerun replaces them. Before any work, a folder holding other files, or either
    file when an earlier run did not write it there or it changed since, is refused
    (:class:`~vitcam_nb.OutputExistsError` for the two files) unless ``overwrite=True``, which replaces the two
    files and leaves the others alone. A refused call creates nothing.

    Example:
        >>> result = run_figure("/tmp/vitcam-figure", model="shapes-vit", images=1, photo=False,
        ...                     axes={"site": ["F1"], "weighting": ["gradcam"]}, progress=False)  # doctest: +SKIP
        >>> sum(result["summary"]["counts"].values())  # doctest: +SKIP
        9
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vitcam_nb.core.progress import progress_bar as tqdm

    if weights is not None:
        as_path("weights", weights)  # a number or a list is refused by name here, not by pathlib after the passes
    overwrite, photo, progress = (as_flag(k, v) for k, v in
                                  (("overwrite", overwrite), ("photo", photo), ("progress", progress)))
    if isinstance(images, bool) or not isinstance(images, int) or images < 0:
        raise ArgumentError(f"images: expected a count >= 0 of bundled shape images, got {images!r}")
    if not isinstance(model, str) or not model:
        raise ArgumentError(f"model: expected 'auto', a bundled name or a timm name, got {model!r}")
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
        raise ArgumentError(f"examples: expected a count >= 1 of example maps per label, got {examples!r:.80}")
    if images == 0 and not photo:
        raise ArgumentError("images: 0 bundled images and no photograph leave nothing to run")
    try:
        sample_image("shapes", images - 1)
    except IndexError as exc:
        raise ArgumentError(f"images: at most the bundled sample images can be used ({exc})") from exc
    recipes, skipped = audit_recipes(axes)
    if not recipes:
        raise ArgumentError(f"axes: no valid recipe in the product of the axes ({skipped})")
    folder = as_path("out", out)
    outputs = _check_out(folder, overwrite)
    net, name, line = _choose_model(model, weights)
    if isinstance(net, LinearSegmenter):
        raise ArgumentError(f"model: {name} is a segmentation model; the audit labels classifier maps")
    items = _images(name, net, images, photo)
    groups: dict[tuple, list[Recipe]] = {}
    for r in recipes:  # one gallery per choice of the other fields, over the sites valid for it
        groups.setdefault(tuple(getattr(r, f) for f in AUDIT_AXES if f != "site"), []).append(r)
    rows, traces = [], []
    bar = tqdm(total=len(items) * len(groups), desc="vitcam-nb figure", disable=not progress)
    for index, item in enumerate(items):
        with warnings.catch_warnings():
            # The figure crops the photograph on purpose and maps its mask through the same crop (input_mask); the
            # trace records the box and its checklist states it, so the warning would only repeat it.
            warnings.simplefilter("ignore", InputCropWarning)
            tr = trace(net, item["pixels"], targets="top1", layers=[-1])
        traces.append(tr)
        item["predicted"] = str(tr["class_label"].values[int(np.argmax(tr["logits"].values))])
        for members in groups.values():
            sites = [r.site for r in members]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DegenerateMapWarning)
                g = gallery(tr, members[0], vary={"site": sites})
            for i, r in enumerate(members):
                label, numbers = label_map(g.values[i], item["input_mask"])
                rows.append({"image": index, "recipe_id": str(g["recipe_id"].values[i]),
                             **{f: getattr(r, f) for f in AUDIT_AXES}, "label": label, **numbers,
                             "degenerate": str(g["degenerate"].values[i])})
            bar.update()
    bar.close()
    summary = _summary(name, line, traces[0].attrs, items, rows, recipes, skipped, _axes(axes))
    folder.mkdir(parents=True, exist_ok=True)
    fig = plot_audit(summary, rows, items, traces, examples=examples)
    text = json.dumps(summary, indent=1, default=str)
    # the temporary file has no .png suffix for matplotlib to read the format from
    paths = {"figure": outputs.write(FILES[0], lambda p: fig.savefig(p, dpi=72, format="png")),
             "summary": outputs.write(FILES[1], lambda p: p.write_text(text, encoding="utf-8"))}
    plt.close(fig)
    return {"paths": paths, "summary": summary, "line": line}


def _counts(rows: list[dict]) -> dict[str, int]:
    found = Counter(r["label"] for r in rows)
    return {label: found.get(label, 0) for label in LABELS}


def _summary(name: str, line: str, attrs: dict, items: list[dict], rows: list[dict], recipes: list[Recipe],
             skipped: dict[str, int], axes: dict[str, list]) -> dict[str, Any]:
    bundled = name in bundled_names()
    caveat = (f"{name} was trained on 64x64 synthetic shapes: on the photograph its labels say nothing about "
              "correct localisation (the person is no class it knows); only the bundled shapes have a known answer."
              if bundled else "The bundled shapes are no ImageNet images: their labels on this model are a stress "
                              "test, the photograph is the natural image.")
    return {
        "written_by": WRITTEN_BY, "vitcam_nb_version": __version__, "model": name, "ran": line,
        "weights_origin": str(attrs.get("weights_origin", "")), "weights_sha256": str(attrs.get("weights_sha256", "")),
        "caveat": caveat, "rule": rule_text(), "thresholds": thresholds(), "labels": list(LABELS),
        "axes": axes, "fixed": {"layer": -1, "class_": "top1", "other fields": "Recipe defaults"},
        "maps": len(rows), "recipes_per_image": len(recipes), "skipped_combinations": sum(skipped.values()),
        "skipped_reasons": skipped,
        "images": [{"name": it["name"], "kind": it["kind"], "predicted": it["predicted"],
                    "mask_share": float(it["input_mask"].mean())} for it in items],
        "counts": _counts(rows),
        "counts_per_axis": {f: {str(v): _counts([r for r in rows if r[f] == v]) for v in values}
                            for f, values in axes.items()},
        "counts_per_image": {it["name"]: _counts([r for r in rows if r["image"] == i]) for i, it in enumerate(items)},
        "per_map": rows,
    }
