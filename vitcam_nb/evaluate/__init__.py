"""Measure heatmaps: agreement between variants, localisation against a mask, faithfulness to the model,
and sanity checks.

One job per module:

* :mod:`~vitcam_nb.evaluate.agreement.metrics`: two maps on one grid -> a number (Spearman, Pearson, cosine,
  SSIM, top-k IoU, Krishna et al.'s feature / rank / sign agreement).
* :mod:`~vitcam_nb.evaluate.agreement.atlas`: the pairwise agreement of many recipes, and its clustered plot.
* :mod:`~vitcam_nb.evaluate.localisation.metrics`: a map against a ground-truth mask (pointing game,
  energy-based pointing game, relevance mass and rank accuracy, top-k intersection, AUROC).
* :mod:`~vitcam_nb.evaluate.complexity.metrics`: one map -> how concentrated it is (sparseness, entropy, effective
  complexity).
* :mod:`~vitcam_nb.evaluate.faithfulness.curves`: deletion, insertion, LeRF - MoRF area, ROAD (call the model),
  on the engine of :mod:`~vitcam_nb.evaluate.faithfulness.perturbation` with the substrates of
  :mod:`~vitcam_nb.evaluate.faithfulness.substrates`.
* :mod:`~vitcam_nb.evaluate.faithfulness.correlation`: faithfulness correlation, monotonicity correlation, SaCo (and
  :mod:`~vitcam_nb.evaluate.faithfulness.irof`), on the removal engine of
  :mod:`~vitcam_nb.evaluate.faithfulness.removal`;
  :mod:`~vitcam_nb.evaluate.faithfulness.sufficiency` over a set of images (no model call).
* :mod:`~vitcam_nb.evaluate.ambiguity.analysis`: every recipe a description allows, their spread and the share of map
  variance each open choice explains (:mod:`~vitcam_nb.evaluate.ambiguity.space`,
  :mod:`~vitcam_nb.evaluate.ambiguity.sensitivity`;
  over many images :mod:`~vitcam_nb.evaluate.ambiguity.many`).
* :mod:`~vitcam_nb.evaluate.robustness.stability`: max/average sensitivity, local Lipschitz, relative input/output
  stability of every recipe from one trace per perturbed input.
* :mod:`~vitcam_nb.evaluate.randomisation.parameters`: model-parameter randomisation and the randomised-logit check;
  :mod:`~vitcam_nb.evaluate.randomisation.mprt`: smooth and efficient MPRT.
* :mod:`~vitcam_nb.evaluate.scorecard.card`: every recipe x every registered metric
  (:mod:`~vitcam_nb.evaluate.metric_registry`, filled by :mod:`~vitcam_nb.evaluate.metrics_builtin`) over many
  images, with bootstrap intervals; read with :mod:`~vitcam_nb.evaluate.scorecard.plot`.
* :mod:`~vitcam_nb.evaluate.metrics`: the metrics that are one module each and register themselves (found by
  walking that package, listed nowhere); each one's public functions are ``vc.evaluate.<name>`` too. Their shared
  helpers (correlation with the NaN rule, ...) are :mod:`~vitcam_nb.evaluate.metric_helpers`.
* :mod:`~vitcam_nb.evaluate.audit.position_probe`: how well each token site's activations still predict the tokens' grid
  positions (a cross-validated ridge probe), the evidence for or against the raster reshape.
* :mod:`~vitcam_nb.evaluate.shapley.values`: exact Shapley values of a grid of patch groups (all 2^n masked forward
  passes) and :mod:`~vitcam_nb.evaluate.shapley.agreement`, a map's rank agreement with them.
* :mod:`~vitcam_nb.evaluate.report.known_answer`: the known-answer report ranking every variant on the bundled model.
* :mod:`~vitcam_nb.evaluate.report.known_answer_video`: the video known answer (right-frames share, pointing per
  frame) on the bundled ``shapes-video``.

Metrics return plain floats; NaN only with a :class:`MetricWarning` that says why; bad input raises
``ValueError`` naming the argument.

Example:
    >>> from vitcam_nb import evaluate
    >>> evaluate.spearman([[0, 1], [2, 3]], [[3, 2], [1, 0]])
    -1.0
"""

from __future__ import annotations

from vitcam_nb.evaluate import metrics as _metric_modules
from vitcam_nb.evaluate._common import MetricWarning, resolve_k
from vitcam_nb.evaluate.agreement.atlas import atlas, plot_atlas, recipe_labels
from vitcam_nb.evaluate.agreement.metrics import (
    AGREEMENT_METRICS,
    SIGNED_METRICS,
    cosine,
    feature_agreement,
    pearson,
    rank_agreement,
    sign_agreement,
    signed_rank_agreement,
    spearman,
    ssim,
    topk_iou,
)
from vitcam_nb.evaluate.ambiguity.analysis import Ambiguity, ambiguity
from vitcam_nb.evaluate.ambiguity.many import AmbiguityMany
from vitcam_nb.evaluate.ambiguity.spread import localising_share
from vitcam_nb.evaluate.audit.position_probe import position_probe
from vitcam_nb.evaluate.complexity.metrics import COMPLEXITY_METRICS, complexity, effective_complexity, sparseness
from vitcam_nb.evaluate.faithfulness.correlation import (
    MODEL_FAITHFULNESS_METRICS,
    faithfulness_correlation,
    monotonicity_correlation,
    saco,
)
from vitcam_nb.evaluate.faithfulness.curves import deletion, insertion, lerf_morf_area, road
from vitcam_nb.evaluate.faithfulness.irof import irof
from vitcam_nb.evaluate.faithfulness.perturbation import model_input
from vitcam_nb.evaluate.faithfulness.substrates import SUBSTRATES, noisy_linear_imputation
from vitcam_nb.evaluate.faithfulness.sufficiency import sufficiency
from vitcam_nb.evaluate.localisation.metrics import (
    LOCALISATION_METRICS,
    auroc,
    default_tolerance,
    energy_pointing_game,
    pointing_game,
    relevance_mass_accuracy,
    relevance_rank_accuracy,
    topk_intersection,
)
from vitcam_nb.evaluate.metric_registry import (
    CATEGORIES,
    METRICS,
    MetricInputs,
    metric_names,
    on_maps,
    on_model_maps,
    register_metric,
)
from vitcam_nb.evaluate.randomisation.mprt import discrete_entropy, efficient_mprt, smooth_mprt
from vitcam_nb.evaluate.randomisation.parameters import (
    model_parts,
    model_randomisation,
    plot_randomisation,
    randomise_parts,
    randomised_logit,
)
from vitcam_nb.evaluate.report.known_answer import report_known_answer
from vitcam_nb.evaluate.report.known_answer_detection import report_known_answer_detection
from vitcam_nb.evaluate.report.known_answer_video import frame_pointing, report_known_answer_video, right_frames
from vitcam_nb.evaluate.report.known_answer_vlm import report_known_answer_vlm
from vitcam_nb.evaluate.robustness.stability import ROBUSTNESS_METRICS, perturb, robustness, robustness_scores
from vitcam_nb.evaluate.scorecard.card import bootstrap_interval, scorecard
from vitcam_nb.evaluate.scorecard.plot import metric_agreement, plot_agreement, plot_scorecard
from vitcam_nb.evaluate.shapley.agreement import shapley_agreement
from vitcam_nb.evaluate.shapley.values import shapley_patches

__all__ = [
    "MODEL_FAITHFULNESS_METRICS",
    "smooth_mprt",
    "efficient_mprt",
    "discrete_entropy",
    "sufficiency",
    "irof",
    "saco",
    "monotonicity_correlation",
    "faithfulness_correlation",
    "AGREEMENT_METRICS",
    "CATEGORIES",
    "COMPLEXITY_METRICS",
    "LOCALISATION_METRICS",
    "METRICS",
    "ROBUSTNESS_METRICS",
    "SIGNED_METRICS",
    "SUBSTRATES",
    "Ambiguity",
    "AmbiguityMany",
    "MetricInputs",
    "MetricWarning",
    "ambiguity",
    "atlas",
    "bootstrap_interval",
    "auroc",
    "complexity",
    "cosine",
    "default_tolerance",
    "deletion",
    "effective_complexity",
    "energy_pointing_game",
    "feature_agreement",
    "insertion",
    "lerf_morf_area",
    "localising_share",
    "metric_agreement",
    "metric_names",
    "model_input",
    "model_parts",
    "model_randomisation",
    "noisy_linear_imputation",
    "on_maps",
    "on_model_maps",
    "pearson",
    "perturb",
    "plot_agreement",
    "plot_atlas",
    "plot_randomisation",
    "plot_scorecard",
    "pointing_game",
    "position_probe",
    "randomise_parts",
    "randomised_logit",
    "rank_agreement",
    "recipe_labels",
    "register_metric",
    "relevance_mass_accuracy",
    "relevance_rank_accuracy",
    "report_known_answer",
    "report_known_answer_detection",
    "report_known_answer_video",
    "report_known_answer_vlm",
    "resolve_k",
    "road",
    "robustness",
    "robustness_scores",
    "scorecard",
    "shapley_agreement",
    "shapley_patches",
    "sign_agreement",
    "signed_rank_agreement",
    "sparseness",
    "spearman",
    "ssim",
    "topk_intersection",
    "topk_iou",
    "frame_pointing",
    "right_frames",
]

# The metric modules were walked above (scorecard.card imports metrics_builtin): their public names join __all__.
__all__ += [_name for _name in _metric_modules.exported() if _name not in __all__]


def __getattr__(name: str) -> object:
    # vc.evaluate.<name> for the public functions of the metric modules (vitcam_nb.evaluate.metrics), which are
    # found by walking their package: a new metric needs no import or __all__ entry here.
    table = _metric_modules.exported()
    if name in table:
        return table[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_metric_modules.exported()})
