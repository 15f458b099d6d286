"""What a trace differentiates: a vector of scores computed from the model's output, and which of them.

- class targets (the default, ``"top5"``, an int or a list of ints): the classifier's logits;
- :func:`similarity`: the similarity of a model's pooled embedding (``num_classes=0``, e.g. a CLIP image
  tower) to given vectors, cosine or dot product, times a stated scale;
- :func:`prompts` (``vitcam_nb[clip]``): :func:`similarity` to the text embeddings of prompts;
- :func:`answer` and :func:`generated` (``vitcam_nb[hf]``): a generative VLM's answer tokens (teacher forcing) and
  its sequence log-prob;
- :func:`itm` (``vitcam_nb[vlm]``): BLIP's image-text matching logits (no match, match);
- :func:`layerwise`: one class's score read out after every block (exact LeGrad), all in one backward;
- :func:`region` and :func:`dense`: scores of a dense (B, C, H, W) output, e.g. a segmentation model's class
  logits summed over a pixel region;
- :func:`detection` (``vitcam_nb[hf]``): scores of chosen detections of a YOLOS or OWL-ViT/OWLv2 detector (by
  index or matched to a box by IoU), each its own target of one backward pass;
- :func:`segmentation_loss`: the cross-entropy of a dense output against a label map, as torch computes it;
- :func:`contrast`: a class logit minus a weighted sum of other logits (FinerCAM's "nearest" classes and softmax
  weights, or classes and constant weights given).

Every target's scores are stored as the trace's ``logits``; see :class:`Target` for writing your own. A built-in
target is one module of this package whose constructor is decorated with :func:`register_target`: the package is
walked on import, so the constructor is ``vc.targets.<name>`` and listed by :func:`target_names` with no line
added here.

Example:
    >>> import torch, vitcam_nb as vc
    >>> t = vc.targets.similarity(torch.eye(3, 8), labels=["a", "b", "c"])
    >>> t.labels
    ['a', 'b', 'c']
"""

from __future__ import annotations

import importlib
import pkgutil

from vitcam_nb.targets.base import TARGETS, Target, register_target, unregister_target
from vitcam_nb.targets.blip_matching import ItmTarget, itm
from vitcam_nb.targets.classes import ClassTargets, as_target, class_labels
from vitcam_nb.targets.clip_prompts import ClipPrompts, prompts
from vitcam_nb.targets.contrast import Contrast, contrast
from vitcam_nb.targets.dense import DenseScores, Region, dense, region
from vitcam_nb.targets.detection import Detection, detection
from vitcam_nb.targets.embedding import Similarity, similarity, similarity_scores
from vitcam_nb.targets.layerwise import Layerwise, layerwise
from vitcam_nb.targets.segmentation import SegmentationLoss, segmentation_loss
from vitcam_nb.targets.vlm_answer import AnswerTarget, answer, generated

__all__ = ["AnswerTarget", "ClassTargets", "ClipPrompts", "Contrast", "DenseScores", "Detection", "ItmTarget",
           "Layerwise", "Region", "SegmentationLoss", "Similarity", "Target", "answer", "as_target",
           "class_labels", "contrast", "dense", "detection", "generated", "itm", "layerwise", "prompts", "region",
           "register_target", "segmentation_loss", "similarity", "similarity_scores", "target_names",
           "unregister_target"]


def target_names() -> list[str]:
    """The public target constructors, ``vc.targets.<name>``, sorted (the docs' list of targets).

    Example:
        >>> {"similarity", "region", "detection"} <= set(target_names())
        True
    """
    return sorted(TARGETS)


# Every module of the package, sorted by name (one order in every process): each registers its constructors.
for _module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_module.name}")
for _name, _make in TARGETS.items():
    if _name not in globals():  # a module added to the package: its constructor gets the public path
        globals()[_name] = _make
        __all__.append(_name)
