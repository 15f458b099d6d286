"""The kit's own metrics in the score-card registry (:mod:`~vitcam_nb.evaluate.metric_registry`): localisation
against the mask, complexity of the map, faithfulness curves (token mode, the model called), robustness (one
trace per perturbed copy for all recipes of an image) and the randomised-logit check.

Example:
    >>> from vitcam_nb.evaluate.metric_registry import metric_names
    >>> metric_names("localisation")
    ['pointing_game', 'energy_pointing_game', 'relevance_mass_accuracy', 'relevance_rank_accuracy', 'auroc']
"""

from __future__ import annotations

import numpy as np

from vitcam_nb.evaluate.complexity.metrics import COMPLEXITY_METRICS
from vitcam_nb.evaluate.faithfulness.correlation import MODEL_FAITHFULNESS_METRICS
from vitcam_nb.evaluate.faithfulness.curves import deletion, insertion
from vitcam_nb.evaluate.localisation.metrics import LOCALISATION_METRICS
from vitcam_nb.evaluate.metric_registry import (
    METRICS,
    MODEL_LOCK,
    MetricInputs,
    on_maps,
    on_model_maps,
    register_metric,
)
from vitcam_nb.evaluate.metrics import discover
from vitcam_nb.evaluate.randomisation.mprt import efficient_mprt
from vitcam_nb.evaluate.randomisation.parameters import randomised_logit
from vitcam_nb.evaluate.robustness.stability import robustness
from vitcam_nb.evaluate.shapley.agreement import shapley_agreement
from vitcam_nb.evaluate.shapley.values import shapley_patches

__all__ = ["SHAPLEY_DEFAULTS", "robustness_metric"]

#: The registered ``shapley_agreement``'s settings unless ``settings["shapley"]`` says otherwise: 4x4 groups
#: (65,536 model calls per image and class), mean baseline (as deletion_auc's substrate), logit of the class.
SHAPLEY_DEFAULTS = {"grid": (4, 4), "baseline": "mean", "score": "logit", "batch_size": 512}


def robustness_metric(name: str):
    """The registry function of robustness metric ``name``: one :func:`~vitcam_nb.evaluate.robustness.stability` run per
    image and class for all recipes and all robustness metrics (cached on the image), settings from
    ``inputs.settings["robustness"]`` (``n``, ``radius``; the seed is the score card's).

    Example:
        >>> callable(robustness_metric("max_sensitivity"))
        True
    """
    def run(inputs: MetricInputs) -> list[float]:
        opts = dict(inputs.settings.get("robustness", {}))

        def compute() -> dict:
            out: dict = {}
            fallback = inputs.target if inputs.target is not None else int(np.argmax(inputs.trace["logits"].values))
            per = [r.class_ if isinstance(r.class_, int) else fallback for r in inputs.recipes]  # rollout: no class
            for cls in dict.fromkeys(per):
                idx = [i for i, c in enumerate(per) if c == cls]
                with MODEL_LOCK:
                    arr = robustness(inputs.model, inputs.trace, [inputs.recipes[i] for i in idx], target=cls,
                                     seed=inputs.seed, **opts)
                for row, i in enumerate(idx):
                    out[i] = dict(zip(arr["metric"].values.tolist(), arr.values[row].tolist(), strict=True))
            return out

        scores = inputs.cached("robustness", compute)
        return [scores[i][name] if inputs.maps[i] is not None else np.nan for i in range(len(inputs.recipes))]

    return run


def _randomised_logit(inputs: MetricInputs) -> list[float]:
    out = []
    for recipe, m in zip(inputs.recipes, inputs.maps, strict=True):
        if m is None or recipe.layer_fusion == "rollout":  # rollout does not depend on the class
            out.append(np.nan)
            continue
        out.append(float(randomised_logit(inputs.trace, recipe, seed=inputs.seed, metrics=("spearman",)).values[0]))
    return out


def _efficient_mprt(inputs: MetricInputs) -> list[float]:
    opts = dict(inputs.settings.get("efficient_mprt", {}))
    out = []
    for recipe, m in zip(inputs.recipes, inputs.maps, strict=True):
        if m is None or recipe.layer_fusion == "rollout":  # rollout uses no gradient and no class
            out.append(np.nan)
            continue
        fixed = recipe if isinstance(recipe.class_, int) else recipe.replace(class_=inputs.target)
        with MODEL_LOCK:
            out.append(float(efficient_mprt(inputs.model, inputs.trace, fixed, seed=inputs.seed, **opts).values))
    return out


def _shapley_agreement(inputs: MetricInputs) -> list[float]:
    """Each recipe's token-grid map against the image's exact Shapley values, computed once per image and class."""
    opts = {**SHAPLEY_DEFAULTS, **inputs.settings.get("shapley", {}), "progress": False}
    out = []
    for recipe, m in zip(inputs.recipes, inputs.grids, strict=True):
        if m is None:
            out.append(np.nan)
            continue
        cls = recipe.class_ if isinstance(recipe.class_, int) else inputs.target
        if cls is None:  # rollout with no fixed class: the predicted class of the intact image
            cls = int(np.argmax(inputs.trace["logits"].values))

        def compute(cls: int = int(cls)):
            with MODEL_LOCK:
                return shapley_patches(inputs.model, inputs.trace, target=cls, **opts)

        values = inputs.cached(f"shapley:{cls}", compute)
        out.append(float(shapley_agreement(m, values).attrs["value"]))
    return out


def _register() -> None:
    if "pointing_game" in METRICS:
        return
    for name, fn in LOCALISATION_METRICS.items():
        register_metric(name, "localisation", on_maps(fn, mask=True), needs=("mask",),
                        description=f"{name} of the upsampled map against the mask")
    for name, fn in COMPLEXITY_METRICS.items():
        register_metric(name, "complexity", on_maps(fn), higher_is_better=name == "sparseness",
                        description=f"{name} of the upsampled map")
    register_metric("deletion_auc", "faithfulness", on_model_maps(deletion, progress=False), needs=("model",),
                    higher_is_better=False, description="deletion AUC, token mode, mean substrate, probability")
    register_metric("insertion_auc", "faithfulness", on_model_maps(insertion, progress=False), needs=("model",),
                    description="insertion AUC, token mode, blur substrate, probability")
    for name, fn in MODEL_FAITHFULNESS_METRICS.items():  # settings under their own name: each takes others
        register_metric(name, "faithfulness", on_model_maps(fn, attr="value", key=name, progress=False),
                        needs=("model",), description=f"{name} (vc.evaluate.{name}), token mode, probability")
    for name in ("max_sensitivity", "avg_sensitivity"):
        register_metric(name, "robustness", robustness_metric(name), needs=("model",), higher_is_better=False,
                        description=f"{name}, uniform noise perturbations (vc.evaluate.robustness)")
    register_metric("randomised_logit", "randomisation", _randomised_logit, higher_is_better=False,
                    description="Spearman of the predicted class's map and another traced class's map")
    register_metric("efficient_mprt", "randomisation", _efficient_mprt, needs=("model",),
                    description="relative rise of the map's entropy when every part of the model is randomised")
    register_metric("shapley_agreement", "faithfulness", _shapley_agreement, needs=("model",), by_default=False,
                    description="Spearman of the token-grid map pooled per group and the exact Shapley values of "
                                "4x4 patch groups (vc.evaluate.shapley_patches: 2^16 model calls per image; "
                                "settings['shapley'] sets grid, baseline, score, batch_size); run only when named")


_register()
# The metrics that are one module each register themselves; found by walking their package, listed nowhere.
discover("vitcam_nb.evaluate.metrics")
