"""The caching tracer: one forward pass and one batched backward pass store every block's activations and
gradients, at every site, in a labeled ``xarray.Dataset`` (the schema in ``docs/architecture.md``).

Example:
    >>> import timm, numpy as np
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    >>> trace(m, np.zeros((224, 224, 3), np.uint8), targets="top1", sites="F1")["act"].sizes["layer"]
    12
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xarray as xr

from vitcam_nb.adapters.registry import lookup_scope
from vitcam_nb.capture.assemble import assemble
from vitcam_nb.capture.budget import fit_budget
from vitcam_nb.capture.crops import assemble_crops
from vitcam_nb.capture.passes import run_pass
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.capture.prealloc import writes_arrays
from vitcam_nb.capture.runtime import exclusive, on_device
from vitcam_nb.capture.staged import assemble_tree
from vitcam_nb.preprocess import prepare_input
from vitcam_nb.targets.base import Target

__all__ = ["trace"]


def trace(
    model: torch.nn.Module,
    image: object,
    targets: str | int | Sequence[int] | Target = "top5",
    *,
    sites: Sequence[str] | str | None = None,
    layers: int | Sequence[int] | None = None,
    dtype: str = "float32",
    device: str | torch.device | None = None,
    labels: Sequence[str] | None = None,
    processor: object = None,
    max_bytes: float | None = None,
    rule: str = "gradient",
) -> xr.Dataset:
    """Trace ``model`` on ``image``: one forward pass, one batched backward pass, everything stored.

    Activations and gradients of every requested site and block are kept in an ``xarray.Dataset``
    (schema in ``docs/architecture.md``). Gradients are taken for the logits of the chosen classes and for
    the expected logit ``E = sum_j p_j z_j`` (``p`` detached), so probability and log-probability
    targets are derived exactly later. The model is returned as it was given: hooks, ``fused_attn``
    flags, train/eval mode, device and gradient state are restored, also when an exception is raised.

    Args:
        model: a timm VisionTransformer (or a family with a registered adapter).
        image: PIL image, HxWx3 uint8 array (preprocessed with the model's timm data config), or a
            (1,3,H,W) float tensor used as given; for a video family (VideoMAE, ViViT, TimeSformer) one clip, a
            normalised float tensor (T,C,H,W) or (1,T,C,H,W) with the model's ``config.num_frames`` frames.
        targets: "top5" (default: the min(5, num_classes) highest), "topK", an int class, a list of ints, or a
            target from :mod:`vitcam_nb.targets` (similarity to vectors, text prompts, image-text matching).
        sites: subset of F1..F6 and the extended sites resid_pre, attn_out, resid_mid (default F1..F6).
        layers: block indices to keep (default all; negative counts from the end).
        dtype: storage dtype, "float32" or "float16" (computation stays in the model's dtype).
        device: where to run (default: the model's device); results always come back to CPU.
        labels: class names (default: the model's ``pretrained_cfg["label_names"]``, a Hugging Face model's
            ``config.id2label``, or ImageNet's for a 1000-class timm model with known pretrained weights).
        processor: a Hugging Face image processor to preprocess a PIL image or uint8 array with (default: the
            model's data config); a normalisation that differs from the model's is warned about and recorded.
        max_bytes: refuse (``TraceError``) when the estimated peak memory (:func:`vitcam_nb.estimate`) is
            above this; default half the memory available when the trace starts.
        rule: the backward rule (:mod:`vitcam_nb.core.rules`): "gradient" (default, autograd's gradient),
            "cp_lrp", "attnlrp" or "libragrad" (timm ViT/DeiT/DINOv2 and BEiT families; others are refused by
            name), or "chefer_lrp" (Chefer et al.'s LRP relevance pass, timm ViT/DeiT: the stored gradients ARE
            the LRP relevance, and ``attn_plain_grad`` holds the plain gradient at F2). The forward pass and the
            activations are unchanged; the stored gradients are the rule's, and input x gradient is the rule's
            relevance. The rule is recorded in ``attrs["backward_rule"]`` and the
            trace id (a "gradient" trace keeps both as before).

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> tr = vc.trace(m, np.zeros((224, 224, 3), np.uint8), targets="top2")
        >>> tr["grad"].dims
        ('target', 'layer', 'site', 'token', 'channel')
    """
    with lookup_scope():  # the model's adapter is looked up once for the whole call
        return _trace(model, image, targets, sites, layers, dtype, device, labels, processor, max_bytes, rule)


def _trace(model: torch.nn.Module, image: object, targets: object, sites: object, layers: object, dtype: str,
           device: object, labels: object, processor: object, max_bytes: float | None, rule: str) -> xr.Dataset:
    plan = TracePlan.for_trace(model, targets, sites=sites, layers=layers, dtype=dtype, device=device,
                               labels=labels, rule=rule)
    model = plan.model  # the model inside torch.compile, DataParallel, ... (the wrapper itself is not called)
    # A family whose input is not one image (a video clip) prepares it itself.
    prepared = (plan.adapter.prepare_traced_input(model, image, processor, plan.target)
                or prepare_input(model, image, processor))
    crops = plan.adapter.runs_crops(model)  # the tower runs on every crop the input holds, at most
    fit_budget(plan, tuple(prepared.tensor.shape[-2:]), max_bytes, batch=int(prepared.tensor.shape[1]) if crops else 1)
    with exclusive(model), on_device(model, plan.run_device):
        # Narrower storage: the pass writes every activation and gradient into the Dataset's own arrays as it goes.
        run = run_pass(plan, prepared.tensor, arrays=writes_arrays(plan))
    if run.crops:  # one image's crops: every crop kept, one row of the crop dim each
        return assemble_crops(plan, prepared, run)
    image = run.image(0)
    # The image's views become the only references to the pass's tensors, so assembly frees each one as it
    # copies it into the Dataset: the peak holds one copy of the gradients, not two.
    run.acts.clear()
    run.grads.clear()
    if getattr(plan.adapter, "hierarchical", False):
        return assemble_tree(plan, prepared, image, run)
    return assemble(plan, prepared, image, run)
