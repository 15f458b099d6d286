"""The main job: trace a model on an image and write the trace, a gallery, an agreement atlas and an
HTML report with the interactive explorer of the trace and many variants with their checklists and
localisation scores."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from vitcam_nb import evaluate, htmlreport, plot
from vitcam_nb.adapters.hf import is_transformers_model
from vitcam_nb.api import cam, gallery
from vitcam_nb.capture.io import save
from vitcam_nb.capture.trace import trace
from vitcam_nb.core import presets
from vitcam_nb.core.arguments import as_flag
from vitcam_nb.core.errors import ArgumentError, DegenerateMapWarning
from vitcam_nb.core.model_names import check_model
from vitcam_nb.core.outfiles import OutputFolder
from vitcam_nb.core.progress import progress_bar
from vitcam_nb.core.provenance import weights_origin
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.version import __version__
from vitcam_nb.data.segmenter import LinearSegmenter
from vitcam_nb.data.shapes_detection import shapes_detection
from vitcam_nb.data.train_vlm import NAME as _VLM_NAME
from vitcam_nb.demo_video import VIDEO_DEMO_MODELS, png_metadata, recipes_listing, run_video_demo, save_figure
from vitcam_nb.evaluate.audit.labels import rule_text
from vitcam_nb.evaluate.report.card import card_scores
from vitcam_nb.models import bundled_names, load_model, sample_image
from vitcam_nb.targets.dense import region
from vitcam_nb.targets.detection import detection
from vitcam_nb.widgets.standalone import explorer_html


def demo_recipes(num_layers: int) -> dict[str, object]:
    """The variants the demo report shows: presets plus every site at three depths.

    Example:
        >>> len(demo_recipes(6)) > 10
        True
    """

    out: dict[str, object] = {}
    for layer in sorted({-1, num_layers // 2, 0}, reverse=True):
        for site in ("F1", "F2", "F3", "F4", "F5", "F6"):
            out[f"gradcam {site} block {layer % num_layers}"] = Recipe(site=site, layer=layer)
    out["hirescam F1 last"] = presets.hirescam()
    out["layercam F1 last"] = presets.layercam()
    out["gradcam++ F1 last"] = presets.gradcampp()
    out["eigencam F1 last"] = presets.eigencam()
    out["gradcam F1 last, prob target"] = Recipe(target="prob")
    out["gradcam F1 last, CLS weights"] = Recipe(weight_tokens="cls")
    out["Chefer attention Grad-CAM"] = presets.chefer_attention_gradcam()
    out["attention rollout"] = presets.attention_rollout()
    out["gradient rollout"] = presets.gradient_rollout()
    out["LeGrad-style"] = presets.legrad_style()
    out["gradcam F1, mean over layers"] = Recipe(layer="all", layer_fusion="mean")
    return out


def _load_image(image: str | None, model_name: str) -> tuple[object, np.ndarray | None, str]:

    if image is not None:
        from PIL import Image

        path = Path(image)
        if not path.is_file():
            raise ArgumentError(f"image: {path} is not a file")
        try:
            with Image.open(path) as im:
                return im.convert("RGB"), None, path.name
        except (OSError, SyntaxError) as exc:  # PIL's errors for a file that is not an image it reads
            raise ArgumentError(f"image: {path} could not be read as an image ({exc})") from exc
    if model_name not in bundled_names():
        raise ArgumentError(f"image: a timm model ({model_name}) needs --image PATH; the bundled sample images "
                            f"are for the bundled models {bundled_names()}")
    if model_name == DETECTOR:
        images, _labels, _boxes, masks = shapes_detection(1, seed=DETECTION_SEED)
        return images[0], masks[0], f"generated detection image (shapes_detection(1, seed={DETECTION_SEED}))"
    kind = "shortcut" if "shortcut" in model_name else "shapes"
    img, _label, mask = sample_image(kind, 0, with_mask=True)
    return img, mask, f"bundled sample {kind} #0"


def _dense_target(net: object, model_name: str, mask: np.ndarray | None) -> object:
    """A segmentation model's default target: the region of the bundled image's object, for its true class
    (``1 + label``: class 0 is the background); a detector's: every detection token (on the generated image, the
    tokens whose band holds an object), each scored by its top class; a classifier keeps the top-k classes."""
    if is_transformers_model(net, ("YolosForObjectDetection",)):
        n = int(net.config.num_detection_tokens)
        return detection(query=[k for k in range(n) if mask is None or (k < len(mask) and mask[k].any())])
    if not isinstance(net, LinearSegmenter):
        return "top5"
    if mask is None:
        raise ArgumentError(f"image: the segmentation model {model_name} is shown with a region target on the bundled "
                            "sample image (its object mask is the region); leave out --image")
    _img, label, _mask = sample_image("shapes", 0, with_mask=True)
    return region(mask, int(label) + 1)


#: The bundled detector, shown on a generated image with two or three objects (seed below).
DETECTOR, DETECTION_SEED = "shapes-yolos", 4_321

#: Bundled generative VLMs: the VLM demo (:func:`vitcam_nb.demo_vlm.run_vlm_demo`).
VLM_DEMO_MODELS = (_VLM_NAME,)

#: What the demo writes in its folder (and lists, with each file's SHA-256, in the folder's manifest).
OUTPUTS = ("trace.nc", "gallery.png", "atlas.png", "report.html", "recipes.json")


def run_demo(out: str | Path = "vitcam-demo", model: str = "shapes-vit", image: str | None = None,
             progress: bool = True, overwrite: bool = False, *, pretrained: bool = False,
             weights: str | Path | None = None, announce: Callable[[str], None] | None = None) -> dict[str, Path]:
    """Trace ``model`` on ``image`` (default: a bundled model on a bundled image) and write the outputs.

    Writes ``trace.nc``, ``gallery.png`` (every layer x site), ``atlas.png`` (agreement of the report's
    variants), ``report.html`` and ``recipes.json``; returns their paths. Each is written atomically and listed
    in the folder's manifest (``.vitcam_nb-outputs.json``); a file of those names that an earlier demo did not
    write there, or that changed since, is refused before any work (:class:`~vitcam_nb.OutputExistsError`)
    unless ``overwrite=True``; a refused call (an output, an argument, the model) creates nothing. A bundled video
    model (``shapes-video``) writes the video demo's outputs instead (:func:`vitcam_nb.demo_video.run_video_demo`), the
    bundled VLM (``shapes-vlm``) the VLM demo's (:func:`vitcam_nb.demo_vlm.run_vlm_demo`).
    ``pretrained`` and ``weights`` go to :func:`vitcam_nb.load_model`; ``announce`` is called with the weights'
    origin line once the model is loaded, before any result. The trace, both PNGs (a footer and their Title) and
    the report state that origin; random-init weights (or weights of unknown origin) put a red title line on both PNGs
    and a banner at the top of the report (:func:`vitcam_nb.htmlreport.weights_warning`). Each PNG's metadata and
    ``recipes.json`` name the model, the weights' origin and the recipe ids (as written and canonical on the trace).

    Example:
        >>> paths = run_demo("/tmp/vitcam-demo", progress=False)  # doctest: +SKIP
        >>> sorted(paths)  # doctest: +SKIP
        ['atlas', 'gallery', 'recipes', 'report', 'trace']
    """
    overwrite = as_flag("overwrite", overwrite)
    if model in VIDEO_DEMO_MODELS:  # a bundled video model: a generated clip with known evidence frames
        if image is not None or pretrained or weights is not None:
            raise ArgumentError(f"image, pretrained, weights: the video demo of {model} traces its bundled weights on "
                                f"a generated clip with known evidence frames; leave them out")
        return run_video_demo(out, model, progress=progress, overwrite=overwrite, announce=announce)
    if model in VLM_DEMO_MODELS:  # the bundled VLM: a generated question whose asked-about object is known
        if image is not None or pretrained or weights is not None:
            raise ArgumentError(f"image, pretrained, weights: the VLM demo of {model} asks its bundled weights a "
                                f"generated question whose asked-about object is known; leave them out")
        from vitcam_nb.demo_vlm import run_vlm_demo

        return run_vlm_demo(out, model, progress=progress, overwrite=overwrite, announce=announce)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if isinstance(model, str):  # a misspelt bundled name: "did you mean", before any file or progress bar
        check_model(model, image)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ArgumentError(f"out: {out} is a file; the demo writes a folder of files, give a folder path")
    folder = OutputFolder(out, OUTPUTS, f"vitcam_nb {__version__} run_demo", overwrite=overwrite)
    img, mask, image_name = _load_image(image, model)  # a missing image is refused before the model is built
    net = load_model(model, pretrained=pretrained, weights=weights)
    origin = f"weights: {weights_origin(net)}"
    if announce is not None:
        announce(origin)
    # Only now: the origin line and a random-weights warning are printed above the bar, not onto its line.
    steps = progress_bar(total=5, desc="vitcam-nb demo", disable=not progress)
    steps.set_postfix_str("trace")
    tr = trace(net, img, targets=_dense_target(net, model, mask))
    if mask is not None and mask.ndim == 3:  # the detector's image: score maps of the top detection (top1)
        top = json.loads(tr.attrs["target_detections"])[int(np.argmax(tr["logits"].values))]
        mask, image_name = mask[top["detection"]], f"{image_name}; the mask of object {top['detection']}"
    out.mkdir(parents=True, exist_ok=True)  # only now: a call refused above (an argument, the model) leaves no folder
    # vc.save writes atomically itself; the folder check above already decided that trace.nc may be replaced.
    save(tr, out / "trace.nc", overwrite=True)
    paths = {"trace": folder.record("trace.nc")}
    steps.update()

    steps.set_postfix_str("gallery")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateMapWarning)
        g = gallery(tr, Recipe(), vary={"layer": "all", "site": "all"})
    fig = plot.grid(tr, g, mask=mask)
    meta = png_metadata(f"vitcam_nb gallery of {model}", model, origin, [str(i) for i in g["recipe_id"].values.ravel()])
    paths["gallery"] = folder.write("gallery.png", lambda p: save_figure(fig, p, meta, origin))
    steps.update()

    recipes = demo_recipes(int(tr.attrs["num_layers"]))
    steps.set_postfix_str("atlas")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        at = evaluate.atlas(tr, recipes)
    fig = evaluate.plot_atlas(at)
    canonical = [r.resolve(tr).id for r in recipes.values()]
    meta = png_metadata(f"vitcam_nb agreement atlas of {model}", model, origin, canonical)
    paths["atlas"] = folder.write("atlas.png", lambda p: save_figure(fig, p, meta, origin))
    steps.update()

    entries = []
    for label, recipe in progress_bar(recipes.items(), desc="variants", disable=not progress, leave=False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DegenerateMapWarning)
            m = cam(tr, recipe)
        scores = {}
        if mask is not None and mask.shape == m.shape and not m.attrs["degenerate"]:
            scores = _scores(m, mask)
        entries.append(htmlreport.ReportEntry(label, m, scores))
    steps.update()

    steps.set_postfix_str("report")
    pred = int(np.argmax(tr["logits"].values))
    notes = [f"Model: {model}; {origin}.",
             f"Image: {image_name}. Predicted class: {tr['class_label'].values[pred]} ({pred}).",
             "Which variant to use is your choice; this report makes each choice visible. Cite a map by its "
             "recipe id and paste its methods paragraph."]
    if mask is not None:
        notes.append("Scores compare each map with the known evidence mask of the bundled image (outlined in cyan). "
                     "For a non-negative map with minimum 0, as min-max normalised maps are, the energy pointing "
                     "game and the relevance mass are the same formula (the share of the map's sum inside the "
                     "mask): a card shows one 'relevance mass' where the two are equal, both where they differ. "
                     "The pointing game alone can hit with a map whose mass lies off the object: each card shows "
                     "beside it the "
                     "AUROC (the map as a detector of the mask's pixels; 0.5 is chance) and the audit label "
                     f"(evaluate.audit.labels). {rule_text()}")
    figures = {"Gallery: every block x site (gradcam, logit, top-1)": plt.imread(paths["gallery"]),
               "Agreement atlas (Spearman on the token grid)": plt.imread(paths["atlas"])}
    steps.set_postfix_str("explorer")
    explorer = explorer_html(tr, progress=progress)
    html = htmlreport.render(tr, entries, title=f"vitcam_nb demo: {model}", notes=notes,
                             figures={k: _image_figure(v) for k, v in figures.items()}, interactive=explorer,
                             mask=mask)
    paths["report"] = folder.write("report.html", lambda p: p.write_text(html, encoding="utf-8"))
    listed = json.dumps(recipes_listing(tr, model, origin, recipes), indent=1)
    paths["recipes"] = folder.write("recipes.json", lambda p: p.write_text(listed, encoding="utf-8"))
    steps.update()
    steps.close()
    return paths


def _scores(m: object, mask: np.ndarray) -> dict[str, float | str]:
    """Pointing game, AUROC and audit label, then the relevance mass (and the energy pointing game where it differs
    from it): :func:`vitcam_nb.evaluate.report.card.card_scores`."""
    return card_scores(m, mask)


def _image_figure(pixels: np.ndarray):
    import matplotlib.pyplot as plt

    h, w = pixels.shape[:2]
    fig = plt.figure(figsize=(w / 80, h / 80), dpi=80)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.imshow(pixels)
    ax.set_axis_off()
    return fig
