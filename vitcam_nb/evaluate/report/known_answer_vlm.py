"""The VLM known-answer report: which sites and methods of the bundled ``shapes-vlm`` point at the object a
question asks about.

Each question of :func:`vitcam_nb.data.shapes_vlm.shapes_vqa` asks about one of two objects ("what colour is the
cross", "where is red", "what shape is red") and comes with that object's pixel mask: the known answer of a map of
the answer. Per question, one trace of the true answer by teacher forcing (:func:`vitcam_nb.targets.answer`, every
site: the tower's F1..F6, the projector, ``lm_resid`` and ``lm_attn``), then each recipe of :data:`VLM_RECIPES` for
the answer's first token (``class_=0``), scored against the mask in NumPy:

* **pointing game** (:func:`vitcam_nb.evaluate.pointing_game`, default tolerance, 4.3 px at 64 px): does the map's
  highest pixel lie on (or near) the asked-about object? A map with its peak at a uniformly random pixel hits with
  probability equal to the share of pixels within the tolerance of the mask: the ``random peak`` row (per question,
  exact, then averaged).
* **AUROC** (:func:`vitcam_nb.evaluate.auroc`): the map as a detector of the mask's pixels; 0.5 is chance.
* **other object**: the pointing game on the OTHER object's mask: a map that finds "an object" but not the one
  asked about scores here as well as above, a map that binds the question scores lower.
* **token pointing** (:func:`token_pointing`): the same recipe with ``upsample="none"`` (the map on the 4x4 grid of
  image tokens): does its highest token's patch hold a pixel of the asked-about object? With 16 tokens the pixel
  pointing game also asks where bilinear upsampling puts the peak (a patch centre, which the object may miss even
  when its patch is the highest); this one asks only which token is highest. Its random baseline is the share of
  patches that hold a pixel of the object (``random peak`` row).

Example:
    >>> rows, settings = report_known_answer_vlm(n_questions=3, seed=0)  # doctest: +SKIP
    >>> rows[-1]["recipe"]  # doctest: +SKIP
    'random peak'
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping

import numpy as np

from vitcam_nb.capture.trace import trace
from vitcam_nb.core import presets
from vitcam_nb.core.errors import ArgumentError, DegenerateMapWarning
from vitcam_nb.core.kinds import kind_for
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.data.shapes_vlm import QUESTION_TYPES, answer_ids, prompt_ids, shapes_vqa
from vitcam_nb.data.train_vlm import greedy_answers, normalise
from vitcam_nb.evaluate.localisation.metrics import auroc, default_tolerance, pointing_game
from vitcam_nb.models import load_model
from vitcam_nb.targets.vlm_answer import answer

__all__ = ["VLM_RECIPES", "question_scores", "random_peak", "report_known_answer_vlm", "token_pointing", "vlm_recipes"]


def vlm_recipes(tower_layers: int = 4, lm_layers: int = 3) -> dict[str, Recipe]:
    """The recipes the report scores, each for answer token 0: Grad-CAM at every tower site F1..F6 of every block
    the projector reads (all but the last, which LLaVA's ``vision_feature_layer=-2`` leaves unread), the projector,
    ``lm_resid`` per LM layer, Grad-CAM on ``lm_attn`` per LM layer, and the VLM presets (tower Grad-CAM, Chefer et
    al.'s generic attention over all LM layers and at the last).

    Example:
        >>> len(vlm_recipes(4, 3))  # 3 x 6 tower, projector, 3 lm_resid, 3 lm_attn, 3 presets
        28
    """
    out: dict[str, Recipe] = {}
    for layer in range(tower_layers - 1):
        for site in ("F1", "F2", "F3", "F4", "F5", "F6"):
            out[f"gradcam tower {site} block {layer}"] = Recipe(site=site, layer=layer, class_=0)
    out["gradcam projector"] = Recipe(site="projector", layer=0, class_=0)
    for layer in range(lm_layers):
        out[f"gradcam lm_resid layer {layer}"] = Recipe(site="lm_resid", layer=layer, class_=0)
    for layer in range(lm_layers):
        out[f"gradcam lm_attn layer {layer}"] = Recipe(site="lm_attn", layer=layer, class_=0)
    out["preset vlm_tower_gradcam"] = presets.get("vlm_tower_gradcam")
    out["preset vlm_generic_attention (all layers)"] = presets.get("vlm_generic_attention")
    out["preset vlm_generic_attention (last layer)"] = presets.get("vlm_generic_attention", layer=-1)
    return out


#: The report's recipes for the bundled shapes-vlm (4 tower blocks, 3 LM layers).
VLM_RECIPES: dict[str, Recipe] = vlm_recipes()


def random_peak(mask: np.ndarray, tolerance: float | None = None) -> float:
    """The pointing game of a map whose peak is a uniformly random pixel: the share of pixels within ``tolerance``
    (default :func:`~vitcam_nb.evaluate.default_tolerance`) of ``mask``.

    Example:
        >>> m = np.zeros((4, 4), bool); m[0, 0] = True
        >>> random_peak(m, tolerance=0.0)
        0.0625
    """
    from scipy import ndimage

    mask = np.asarray(mask, dtype=bool)
    tol = default_tolerance(mask.shape) if tolerance is None else float(tolerance)
    return float(np.mean(ndimage.distance_transform_edt(~mask) <= tol))


def token_pointing(grid_map: object, mask: np.ndarray) -> float:
    """Pointing game on the token grid: the share of the highest cells of ``grid_map`` (h, w) whose patch of
    ``mask`` (H, W, a multiple of the grid) holds at least one True pixel; NaN for a constant map.

    Example:
        >>> mask = np.zeros((8, 8), bool); mask[0, 5] = True
        >>> token_pointing(np.array([[0.0, 1.0], [0.0, 0.0]]), mask)
        1.0
    """
    values = np.asarray(getattr(grid_map, "values", grid_map), dtype=np.float64)
    mask = np.asarray(mask, dtype=bool)
    (h, w), (ph, pw) = values.shape, (mask.shape[0] // values.shape[0], mask.shape[1] // values.shape[1])
    if ph * h != mask.shape[0] or pw * w != mask.shape[1]:
        raise ArgumentError(f"mask: expected a multiple of the map's grid {values.shape}, got {mask.shape}")
    if np.ptp(values) == 0:
        return float("nan")
    touched = mask.reshape(h, ph, w, pw).any(axis=(1, 3))
    peaks = values == values.max()
    return float(touched[peaks].mean())


def question_scores(cam_map: object, mask: np.ndarray, other: np.ndarray,
                    grid_map: object | None = None) -> dict[str, float]:
    """Pointing game and AUROC of ``cam_map`` on ``mask``, and the pointing game on the ``other`` object's mask
    (NaN where a map is constant: it points nowhere); with ``grid_map`` (the map on the token grid), also
    :func:`token_pointing` on both masks.

    Example:
        >>> m = np.zeros((8, 8), bool); m[:2, :2] = True
        >>> question_scores(m.astype(float), m, m[::-1, ::-1])["pointing_game"]
        1.0
    """
    values = np.asarray(getattr(cam_map, "values", cam_map), dtype=np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a constant map: NaN, counted as such in the report
        out = {"pointing_game": pointing_game(values, mask), "auroc": auroc(values, mask),
               "other_object": pointing_game(values, other)}
    if grid_map is not None:
        out.update(token_pointing=token_pointing(grid_map, mask), token_other=token_pointing(grid_map, other))
    return out


def report_known_answer_vlm(model: object = "shapes-vlm", n_questions: int = 300, seed: int = 7_000,
                            recipes: Mapping[str, Recipe] | None = None, progress: bool = False) -> tuple[list, dict]:
    """Score each recipe on ``n_questions`` questions of ``shapes_vqa(n_questions, seed)`` (a seed the training
    never used): mean pointing game, AUROC and other-object pointing game, overall, per question type, and on the
    questions the model answers right (greedy), with the ``random peak`` row last.

    Returns ``(rows, settings)``: one dict per recipe (``recipe``, ``recipe_id``, ``pointing_game``, ``auroc``,
    ``other_object``, ``pointing_game_<type>``, ``pointing_game_right``, ``n``, ``n_constant``) and the settings
    (model, accuracy, seed, generator, target, seconds). ``scripts/known_answer_report.py --model shapes-vlm``
    writes them.

    Example:
        >>> rows, settings = report_known_answer_vlm(n_questions=3)  # doctest: +SKIP
    """
    if isinstance(n_questions, bool) or not isinstance(n_questions, int) or n_questions < 1:
        raise ArgumentError(f"n_questions: expected a positive int, got {n_questions!r}")
    recipes = dict(VLM_RECIPES if recipes is None else recipes)
    t0 = time.time()
    net = load_model(model)
    images, questions, answers, masks, kinds, objects = shapes_vqa(n_questions, seed, objects=True)
    other = objects["masks"][np.arange(n_questions), 1 - objects["asked"]]
    right = np.array([g == a for g, a in zip(greedy_answers(net, images, questions), answers, strict=True)])
    scores = {name: [] for name in recipes}
    pixels = normalise(images)
    for i in range(n_questions):
        tr = trace(net, pixels[i:i + 1], targets=answer(input_ids=prompt_ids(questions[i]),
                                                        answer_ids=answer_ids(answers[i])))
        for name, recipe in recipes.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DegenerateMapWarning)
                m = kind_for(tr, recipe).cam(tr, recipe)  # the VLM trace's kind (vitcam_nb.compute registers it)
                grid = recipe.replace(upsample="none")
                g = kind_for(tr, grid).cam(tr, grid)
            scores[name].append(question_scores(m, masks[i], other[i], g))
        if progress and (i + 1) % 50 == 0:
            print(f"[known_answer_vlm] {i + 1}/{n_questions} questions ({time.time() - t0:.0f}s)", flush=True)
    vision = net.config.vision_config
    grid = int(vision.image_size) // int(vision.patch_size)
    rows = [_row(name, recipe.id, s, kinds, right) for (name, recipe), s in zip(recipes.items(), scores.values(),
                                                                                 strict=True)]
    base = [{"pointing_game": random_peak(masks[i]), "auroc": 0.5, "other_object": random_peak(other[i]),
             "token_pointing": _touched(masks[i], grid), "token_other": _touched(other[i], grid)}
            for i in range(n_questions)]
    rows.append(_row("random peak", "", base, kinds, right))
    settings = {"model": model if isinstance(model, str) else type(model).__name__,
                "accuracy": float(right.mean()),
                "accuracy_per_type": {t: _mean(right[kinds == k].astype(np.float64))
                                      for k, t in enumerate(QUESTION_TYPES)},
                "seed": seed, "n_questions": n_questions,
                "n_per_type": {t: int((kinds == k).sum()) for k, t in enumerate(QUESTION_TYPES)},
                "generator": f"vitcam_nb.data.shapes_vlm.shapes_vqa({n_questions}, {seed}, objects=True)",
                "target": "the logit of the true answer's first token (class_=0), teacher forcing",
                "tolerance_px": default_tolerance(masks.shape[1:]), "seconds": round(time.time() - t0, 1)}
    return rows, settings


def _row(name: str, recipe_id: str, s: list[dict], kinds: np.ndarray, right: np.ndarray) -> dict:
    pg = np.array([d["pointing_game"] for d in s])
    row = {"recipe": name, "recipe_id": recipe_id, "pointing_game": _mean(pg),
           "auroc": _mean(np.array([d["auroc"] for d in s])),
           "other_object": _mean(np.array([d["other_object"] for d in s])),
           "token_pointing": _mean(np.array([d["token_pointing"] for d in s])),
           "token_other": _mean(np.array([d["token_other"] for d in s]))}
    row.update({f"pointing_game_{t}": _mean(pg[kinds == k]) for k, t in enumerate(QUESTION_TYPES)})
    row.update({"pointing_game_right": _mean(pg[right]), "n": len(s), "n_constant": int(np.isnan(pg).sum())})
    return row


def _touched(mask: np.ndarray, grid: int) -> float:
    """The token pointing game of a uniformly random peak token: the share of the grid's patches holding a pixel of
    ``mask``."""
    h, w = mask.shape
    return float(mask.reshape(grid, h // grid, grid, w // grid).any(axis=(1, 3)).mean())


def _mean(values: np.ndarray) -> float:
    """The mean over the questions whose score is defined (a constant map has none); NaN if none is."""
    values = values[~np.isnan(values)]
    return float(values.mean()) if values.size else float("nan")
