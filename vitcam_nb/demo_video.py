"""The video demo (``vitcam-nb demo --model shapes-video``): trace the bundled video model on a generated clip whose
evidence frames and masks are known, and write the trace, a frame strip per recipe, the scores and a report.

Example:
    >>> clip, label, masks, evidence = sample_clip()
    >>> clip.shape, evidence.tolist()
    ((4, 32, 32, 3), [False, False, True, True])
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from vitcam_nb import plot
from vitcam_nb.api import cam
from vitcam_nb.capture.io import save
from vitcam_nb.capture.trace import trace
from vitcam_nb.core.arguments import as_flag
from vitcam_nb.core.errors import ArgumentError, DegenerateMapWarning, VitcamError
from vitcam_nb.core.escape import escape_markdown
from vitcam_nb.core.outfiles import OutputFolder
from vitcam_nb.core.provenance import weights_origin
from vitcam_nb.core.version import __version__
from vitcam_nb.data.shapes_video import shape_clips
from vitcam_nb.data.train_video import NAME, normalise_clips
from vitcam_nb.evaluate.report.known_answer_video import VIDEO_RECIPES, frame_pointing, right_frames
from vitcam_nb.htmlreport import weights_warning
from vitcam_nb.models import load_model

__all__ = ["VIDEO_DEMO_MODELS", "VIDEO_OUTPUTS", "png_metadata", "recipes_listing", "run_video_demo", "sample_clip",
           "save_figure"]

#: Bundled models the demo shows with a clip.
VIDEO_DEMO_MODELS = (NAME,)
#: What the video demo writes (and lists, with each file's SHA-256, in the folder's manifest).
VIDEO_OUTPUTS = ("trace.nc", "frame_strips.png", "scores.json", "report.md", "recipes.json")
_SAMPLE_SEED = 5_100
_STRIP_SCALE = 1.6


def sample_clip(index: int = 0) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """A fixed generated clip for the video demo: ``(clip uint8 (4, 32, 32, 3), label, masks (4, 32, 32),
    evidence (4,))``, clip ``index`` of ``shape_clips(8, seed=5100)``.

    Example:
        >>> sample_clip(1)[1] in range(5)
        True
    """
    clips, labels, masks, evidence = shape_clips(8, seed=_SAMPLE_SEED)
    return clips[index], int(labels[index]), masks[index], evidence[index]


def run_video_demo(out: str | Path = "vitcam-demo", model: str = NAME, progress: bool = True,
                   overwrite: bool = False, *, announce: Callable[[str], None] | None = None) -> dict[str, Path]:
    """Trace the bundled video model on :func:`sample_clip` and write ``trace.nc``, ``frame_strips.png`` (one strip
    per recipe of :data:`~vitcam_nb.evaluate.report.known_answer_video.VIDEO_RECIPES`, the top-1 class),
    ``scores.json`` and ``report.md`` (right-frames share and pointing per evidence frame of each map; a uniform map
    scores the evidence frames' share) and ``recipes.json``; returns their paths. Files are written atomically and
    listed in the folder's manifest; a file of those names the kit did not write there is refused before any work
    unless ``overwrite=True``; a refused call creates nothing.

    Example:
        >>> paths = run_video_demo("/tmp/vitcam-video-demo", progress=False)  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    overwrite = as_flag("overwrite", overwrite)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ArgumentError(f"out: {out} is a file; the demo writes a folder of files, give a folder path")
    folder = OutputFolder(out, VIDEO_OUTPUTS, f"vitcam_nb {__version__} run_demo (video)", overwrite=overwrite)
    net = load_model(model)
    origin = f"weights: {weights_origin(net)}"
    if announce is not None:
        announce(origin)
    clip, label, masks, evidence = sample_clip()
    tr = trace(net, normalise_clips(clip[None])[0], targets="top1")
    out.mkdir(parents=True, exist_ok=True)  # only now: a call refused above leaves no folder
    save(tr, out / "trace.nc", overwrite=True)
    paths = {"trace": folder.record("trace.nc")}
    pred = int(np.argmax(tr["logits"].values))
    names = [str(v) for v in tr["class_label"].values]
    frames = np.flatnonzero(evidence).tolist()

    rows, maps = [], {}
    for label_text, recipe in VIDEO_RECIPES.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DegenerateMapWarning)
            m = cam(tr, recipe)
        maps[label_text] = m
        rows.append({"recipe": label_text, "recipe_id": recipe.id, "right_frames": right_frames(m, evidence),
                     "frame_pointing": frame_pointing(m, masks, evidence, tolerance=4.0)})
    rows.append({"recipe": "uniform map", "recipe_id": "", "right_frames": right_frames(np.ones(masks.shape), evidence),
                 "frame_pointing": float("nan")})

    fig, axes = plt.subplots(len(maps), len(clip), figsize=(_STRIP_SCALE * len(clip), _STRIP_SCALE * len(maps) + 0.6),
                             squeeze=False)
    for row, (label_text, m) in zip(axes, maps.items(), strict=True):
        for f, ax in enumerate(row):
            ax.imshow(tr["clip"].values[f])
            ax.imshow(m.values[f], cmap=plot.DEFAULT_CMAP, alpha=0.5, vmin=0, vmax=1)
            if masks[f].any():
                plot.draw_mask(ax, masks[f])
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"frame {f}" + (" (evidence)" if evidence[f] else ""), fontsize=7)
        row[0].set_ylabel(label_text, fontsize=6)
    fig.suptitle(f"{model}: class {names[pred]} (top-1); true {names[label]}; evidence frames {frames} outlined",
                 fontsize=8)
    fig.tight_layout()
    meta = png_metadata("vitcam_nb video demo", model, origin, [r.id for r in VIDEO_RECIPES.values()])
    paths["strips"] = folder.write("frame_strips.png", lambda p: save_figure(fig, p, meta, origin))

    scores = {"model": model, "weights_origin": origin, "clip": f"vitcam_nb.demo_video.sample_clip(0) (shape_clips(8, "
              f"seed={_SAMPLE_SEED})[0])", "true_class": names[label], "predicted_class": names[pred],
              "evidence_frames": frames, "rows": rows}
    paths["scores"] = folder.write("scores.json", lambda p: p.write_text(json.dumps(scores, indent=1)))
    md = _report(model, origin, names[pred], names[label], frames, rows)
    paths["report"] = folder.write("report.md", lambda p: p.write_text(md, encoding="utf-8"))
    listed = json.dumps(recipes_listing(tr, model, origin, VIDEO_RECIPES), indent=1)
    paths["recipes"] = folder.write("recipes.json", lambda p: p.write_text(listed, encoding="utf-8"))
    return paths


def _report(model: str, origin: str, pred: str, true: str, frames: list[int], rows: list[dict]) -> str:
    """The markdown report; every text from the model or the user is escaped."""
    def num(v: float) -> str:
        return "—" if np.isnan(v) else f"{v:.3f}"

    lines = [f"# vitcam_nb video demo: {escape_markdown(model, inline=True)}", "",
             f"{escape_markdown(origin, inline=True)}. Clip: a generated moving-shape clip whose class object is "
             f"drawn in frames {frames} only. True class: {escape_markdown(true, inline=True)}; predicted (top-1, "
             f"the class every map explains): {escape_markdown(pred, inline=True)}.", "",
             "Right frames: the share of the map's mass (sum of its values over all frames and pixels) on the "
             "evidence frames; a uniform map scores the evidence frames' share of the frames. Frame pointing: "
             "whether each evidence frame's highest pixel lies within 4 px of the object's mask, averaged over those "
             "frames.", "", "| recipe | recipe id | right frames | frame pointing |", "| --- | --- | --- | --- |"]
    lines += [f"| {escape_markdown(r['recipe'], inline=True)} | {r['recipe_id']} | {num(r['right_frames'])} | "
              f"{num(r['frame_pointing'])} |" for r in rows]
    lines += ["", "The frame strips are in `frame_strips.png`; the trace in `trace.nc`.", ""]
    return "\n".join(lines)


#: The colour of the random-weights title line (the report's banner uses the same).
_WARNING_RED = "#b00020"


def png_metadata(title: str, model: object, origin: str, recipe_ids: list[str]) -> dict[str, str]:
    """A demo PNG's metadata: its Title (led by the weights warning where there is one), the model, the weights'
    origin and the ids of the recipes its maps show.

    Example:
        >>> png_metadata("gallery", "m", "weights: random-init", ["abc"])["Title"]
        'RANDOM WEIGHTS — maps show an untrained model; gallery; weights: random-init'
    """
    warning = weights_warning(origin)
    meta = {"Title": f"{warning + '; ' if warning else ''}{title}; {origin}", "Model": str(model),
            "Weights": origin.removeprefix("weights: "), "Recipes": " ".join(recipe_ids)}
    if warning:
        meta["Warning"] = warning
    return meta


def save_figure(fig: object, path: Path, metadata: dict[str, str], origin: str) -> None:
    """Save a demo figure with the weights' origin in a footer and ``metadata`` in the PNG, then close it; random or
    unknown weights add a title line above the figure, white on red at 14 pt (the picture grows to hold it).

    Example:
        >>> meta = png_metadata("g", "m", "weights: random-init", [])
        >>> save_figure(fig, Path("g.png"), meta, "weights: random-init")  # doctest: +SKIP
    """
    import matplotlib.pyplot as plt

    fig.text(0.005, 0.995, origin, fontsize=6, color="0.3", ha="left", va="top")
    warning, extra = weights_warning(origin), {}
    if warning:
        fig.text(0.5, 1.0, warning, ha="center", va="bottom", fontsize=14, fontweight="bold", color="white",
                 bbox={"boxstyle": "square,pad=0.5", "facecolor": _WARNING_RED, "edgecolor": "none"},
                 gid="vitcam-weights-warning")
        extra = {"bbox_inches": "tight", "pad_inches": 0.15}  # the line sits above the axes: the saved area grows
    fig.savefig(path, dpi=80, format="png", metadata=metadata, **extra)
    plt.close(fig)


def recipes_listing(tr: object, model: object, origin: str, recipes: dict) -> dict:
    """What a demo's ``recipes.json`` holds: the model, the weights' origin (and warning), the trace id, and per label
    the recipe, its id as written and its canonical id on the trace (None where the trace's kind cannot resolve it).

    Example:
        >>> listing = recipes_listing(tr, "shapes-vit", "weights: random-init", {"default": Recipe()})  # doctest: +SKIP
        >>> listing["weights_warning"]  # doctest: +SKIP
        'RANDOM WEIGHTS — maps show an untrained model'
    """
    listed = {}
    for label, recipe in recipes.items():
        try:
            canonical = recipe.resolve(tr).id
        except VitcamError:
            canonical = None
        listed[label] = {"recipe": json.loads(recipe.to_json()), "recipe_id": recipe.id, "canonical_id": canonical}
    return {"model": str(model), "weights_origin": origin.removeprefix("weights: "),
            "weights_warning": weights_warning(origin), "trace_id": tr.attrs.get("trace_id"),
            "vitcam_nb_version": __version__, "recipes": listed}
