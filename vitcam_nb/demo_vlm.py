"""The VLM demo (``vitcam-nb demo --model shapes-vlm``): ask the bundled tiny LLaVA a question about a generated
image whose asked-about object is known, and explain the answer it generates.

The demo generates a greedy answer (:func:`vitcam_nb.data.train_vlm.greedy_answers`), traces that answer by teacher
forcing (:func:`vitcam_nb.targets.answer`) and writes the trace, the answer-token maps of :data:`DEMO_RECIPES` (a
tower Grad-CAM and LM-side maps) over the image with the asked-about object outlined, their scores against its mask,
the image-token layout and each map's checklist.

Example:
    >>> image, question, answer, mask = sample_question()
    >>> image.shape, mask.shape, question.split()[0] in ("what", "where")
    ((64, 64, 3), (64, 64), True)
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
from vitcam_nb.core import presets
from vitcam_nb.core.arguments import as_flag
from vitcam_nb.core.errors import ArgumentError, DegenerateMapWarning
from vitcam_nb.core.escape import escape_markdown
from vitcam_nb.core.outfiles import OutputFolder
from vitcam_nb.core.provenance import weights_origin
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.version import __version__
from vitcam_nb.data.shapes_vlm import answer_ids, encode, prompt_ids, shapes_vqa
from vitcam_nb.data.train_vlm import NAME, greedy_answers, normalise
from vitcam_nb.demo_video import png_metadata, recipes_listing, save_figure
from vitcam_nb.evaluate.report.known_answer_vlm import question_scores
from vitcam_nb.models import load_model
from vitcam_nb.targets.vlm_answer import answer

__all__ = ["DEMO_RECIPES", "VLM_DEMO_MODELS", "VLM_OUTPUTS", "run_vlm_demo", "sample_question"]

#: Bundled generative VLMs the demo shows with a generated question.
VLM_DEMO_MODELS = (NAME,)
#: What the VLM demo writes (and lists, with each file's SHA-256, in the folder's manifest).
VLM_OUTPUTS = ("trace.nc", "answer_maps.png", "scores.json", "checklists.json", "report.md", "recipes.json")
#: The answer-token maps the demo shows (answer token 0: the first word the model generated).
DEMO_RECIPES: dict[str, Recipe] = {
    "tower Grad-CAM (vlm_tower_gradcam: F6 of the block the projector reads)": presets.get("vlm_tower_gradcam"),
    "projector Grad-CAM": Recipe(site="projector", layer=0, class_=0),
    "lm_resid Grad-CAM, LM layer 0": Recipe(site="lm_resid", layer=0, class_=0),
    "lm_resid Grad-CAM, last LM layer": Recipe(site="lm_resid", layer=-1, class_=0),
    "generic attention over the LM layers (vlm_generic_attention)": presets.get("vlm_generic_attention"),
}
_SAMPLE_SEED = 5_200


def sample_question(index: int = 0) -> tuple[np.ndarray, str, str, np.ndarray]:
    """A fixed generated question for the demo: ``(image uint8 (64, 64, 3), question, true answer, mask (64, 64) of
    the asked-about object)``, item ``index`` of ``shapes_vqa(8, seed=5200)``.

    Example:
        >>> sample_question(1)[2] != ""
        True
    """
    images, questions, answers, masks, _kinds = shapes_vqa(8, seed=_SAMPLE_SEED)
    return images[index], questions[index], answers[index], masks[index]


def run_vlm_demo(out: str | Path = "vitcam-demo", model: str = NAME, progress: bool = True, overwrite: bool = False,
                 *, announce: Callable[[str], None] | None = None) -> dict[str, Path]:
    """Ask the bundled VLM :func:`sample_question`, explain its greedy answer, and write ``trace.nc`` (the answer by
    teacher forcing, every site), ``answer_maps.png`` (the image and each map of :data:`DEMO_RECIPES`, the
    asked-about object outlined), ``scores.json`` (the question, true and generated answers, and per map the
    pointing game and AUROC on the asked-about object and the pointing game on the other one), ``checklists.json``
    (each map's checklist), ``report.md`` and ``recipes.json``; returns their paths. Files are written atomically and
    listed in the folder's manifest; a file of those names the kit did not write there is refused before any work
    unless ``overwrite=True``; a refused call creates nothing. ``progress`` is accepted for the demo's common
    signature (the VLM demo is a few seconds).

    Example:
        >>> paths = run_vlm_demo("/tmp/vitcam-vlm-demo", progress=False)  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    overwrite = as_flag("overwrite", overwrite)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ArgumentError(f"out: {out} is a file; the demo writes a folder of files, give a folder path")
    folder = OutputFolder(out, VLM_OUTPUTS, f"vitcam_nb {__version__} run_demo (vlm)", overwrite=overwrite)
    net = load_model(model)
    origin = f"weights: {weights_origin(net)}"
    if announce is not None:
        announce(origin)
    image, question, true_answer, mask = sample_question()
    other = _other_object()
    generated = greedy_answers(net, image[None], [question])[0]
    # the generated words are traced; an answer the vocabulary cannot hold (no <eos> in the budget) is traced
    # without its marker, and an empty one (an immediate <eos>) is explained as the true answer instead
    words = generated.replace(" <no eos>", "").strip()
    traced = words if words else true_answer
    encode(traced)
    tr = trace(net, normalise(image[None]), targets=answer(input_ids=prompt_ids(question),
                                                           answer_ids=answer_ids(traced)))
    out.mkdir(parents=True, exist_ok=True)  # only now: a call refused above leaves no folder
    save(tr, out / "trace.nc", overwrite=True)
    paths = {"trace": folder.record("trace.nc")}

    maps, rows, checklists = {}, [], {}
    for label, recipe in DEMO_RECIPES.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DegenerateMapWarning)
            m = cam(tr, recipe)
        maps[label] = m
        checklists[label] = json.loads(m.attrs["checklist"])
        rows.append({"recipe": label, "recipe_id": recipe.id, "degenerate": bool(m.attrs.get("degenerate", False)),
                     **question_scores(m, mask, other)})

    fig, axes = plt.subplots(1, len(maps) + 1, figsize=(2.0 * (len(maps) + 1), 3.0), squeeze=False)
    axes[0, 0].imshow(image)
    plot.draw_mask(axes[0, 0], mask)
    axes[0, 0].set_title("image, asked-about\nobject outlined", fontsize=7)
    for ax, (label, m) in zip(axes[0, 1:], maps.items(), strict=True):
        ax.imshow(image)
        ax.imshow(np.asarray(m.values, dtype=np.float64), cmap=plot.DEFAULT_CMAP, alpha=0.55)
        plot.draw_mask(ax, mask)
        ax.set_title("\n".join(_wrap(label, 26)), fontsize=6)
    for ax in axes[0]:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"{model}: Q: {question}?  generated: {generated or '(empty)'}  (true: {true_answer}); maps of the "
                 f"answer's first token", fontsize=8, y=0.92)
    fig.tight_layout(rect=(0, 0, 1, 0.86))  # room above for the title and the weights' origin line
    meta = png_metadata("vitcam_nb VLM demo", model, origin, [r.id for r in DEMO_RECIPES.values()])
    paths["maps"] = folder.write("answer_maps.png", lambda p: save_figure(fig, p, meta, origin))

    layout = str(tr.attrs.get("image_token_layout", ""))
    scores = {"model": model, "weights_origin": origin,
              "question_source": f"vitcam_nb.demo_vlm.sample_question(0) (shapes_vqa(8, seed={_SAMPLE_SEED})[0])",
              "question": question, "true_answer": true_answer, "generated_answer": generated,
              "traced_answer": traced, "traced_token": "answer token 0 (class_=0)",
              "image_token_layout": layout, "rows": rows}
    paths["scores"] = folder.write("scores.json", lambda p: p.write_text(json.dumps(scores, indent=1)))
    paths["checklists"] = folder.write("checklists.json", lambda p: p.write_text(json.dumps(checklists, indent=1)))
    md = _report(model, origin, question, generated, true_answer, traced, layout, rows)
    paths["report"] = folder.write("report.md", lambda p: p.write_text(md, encoding="utf-8"))
    listed = json.dumps(recipes_listing(tr, model, origin, DEMO_RECIPES), indent=1)
    paths["recipes"] = folder.write("recipes.json", lambda p: p.write_text(listed, encoding="utf-8"))
    return paths


def _other_object(index: int = 0) -> np.ndarray:
    """The mask of the object question ``index`` of :func:`sample_question` does not ask about (the generator draws
    exactly two; the same seeded draw)."""
    objects = shapes_vqa(8, seed=_SAMPLE_SEED, objects=True)[5]
    return objects["masks"][index, 1 - int(objects["asked"][index])]


def _wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return [*lines, line]


def _report(model: str, origin: str, question: str, generated: str, true: str, traced: str, layout: str,
            rows: list[dict]) -> str:
    """The markdown report; every text from the model or the user is escaped."""
    def num(v: float) -> str:
        return "—" if np.isnan(v) else f"{v:.3f}"

    def esc(text: str) -> str:
        return escape_markdown(text, inline=True)

    lines = [f"# vitcam_nb VLM demo: {esc(model)}", "", f"{esc(origin)}.", "",
             f"Question (a generated image, `shapes_vqa(8, seed={_SAMPLE_SEED})[0]`): {esc(question)}", "",
             f"Generated answer (greedy): {esc(generated or '(empty)')}. True answer: {esc(true)}. Traced answer "
             f"(teacher forcing; the maps explain its first token): {esc(traced)}.", "",
             f"Image-token layout: {esc(layout)}.", "",
             "Pointing game: whether the map's highest pixel lies within the default tolerance (4.3 px at 64 px) of "
             "the asked-about object's mask; AUROC: the map as a detector of that mask's pixels (0.5 is chance); "
             "other object: the pointing game on the object the question does not ask about.", "",
             "| map | recipe id | pointing game | AUROC | other object |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {esc(r['recipe'])} | {r['recipe_id']} | {num(r['pointing_game'])} | {num(r['auroc'])} | "
              f"{num(r['other_object'])} |" for r in rows]
    lines += ["", "The maps are in `answer_maps.png`, each map's checklist in `checklists.json`, the trace in "
              "`trace.nc`.", ""]
    return "\n".join(lines)
