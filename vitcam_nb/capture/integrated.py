"""Model-in-the-loop passes for the integrated-gradient rollouts (Transition Attention Maps, Beyond Intuition) and
the routing of ``vc.score`` requests that are neither Score-CAM nor Ablation-CAM (these and ViT-CX).

The integrated gradient of the last block's attention is, as in the official TAM and Beyond Intuition code,
``IG = (1/steps) sum_i d s_j / d A_L (alpha_i x)`` over ``alpha_i = linspace(0, 1, steps)`` (a zero baseline, no
multiplication by the attention): every step is an input of one batched trace pass (the same pass as
:func:`vitcam_nb.trace`, so every traced class target and the expected score are differentiated at once), and
the mean is stored as ``attn_grad_ig`` (target, head, query, key) with ``ig_steps`` and ``ig_layer`` in its
attrs. Beyond Intuition's token-wise rule also needs ``|v W_o| / |z|`` per block and token, stored as
``value_ratio`` (layer, token): ``v`` the values of all heads (timm's ``attn.qkv`` output), ``W_o`` the weight
of ``attn.proj`` (no bias), ``z`` the block input.

Example:
    >>> import numpy as np, timm, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    >>> img = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    >>> tr = vc.trace(m, img, targets="top1", sites="F2")
    >>> tr = vc.score(tr, m, vc.presets.transition_attention_maps(start_layer=-2), img, steps=4)
    >>> tr["attn_grad_ig"].dims, int(tr["attn_grad_ig"].attrs["ig_steps"])
    (('target', 'head', 'query', 'key'), 4)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from vitcam_nb.adapters.registry import find_adapter
from vitcam_nb.capture.hooks import eval_mode, removable_hooks
from vitcam_nb.capture.passes import run_pass
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.capture.runtime import exclusive, on_device
from vitcam_nb.capture.vitcx import VITCX_OPTIONS, score_vitcx
from vitcam_nb.core.errors import ArgumentTypeError, RecipeError, TraceError
from vitcam_nb.core.provenance import check_traced_scores, check_traced_source
from vitcam_nb.core.recipe import INTEGRATED_ROLLOUTS, Recipe
from vitcam_nb.core.schema import VARIABLES
from vitcam_nb.preprocess import prepare_input
from vitcam_nb.targets.classes import ClassTargets

__all__ = ["IG_OPTIONS", "check_traced", "loop_scorer", "score_integrated", "traced_classes", "value_ratios"]

#: Keyword arguments of ``vc.score`` that belong to the integrated gradient (not recipe fields).
IG_OPTIONS = ("steps",)


def _as_recipes(recipes_or_method: Any, fields: dict) -> list[Recipe] | None:
    recipe_fields = {k: v for k, v in fields.items() if k not in (*IG_OPTIONS, *VITCX_OPTIONS)}
    if isinstance(recipes_or_method, str):
        if recipes_or_method in INTEGRATED_ROLLOUTS:
            return [Recipe.from_dict({"site": "F2", "layer": "all", **recipe_fields,
                                      "layer_fusion": recipes_or_method})]
        if recipes_or_method == "vitcx":
            return [Recipe.from_dict({**recipe_fields, "weighting": "vitcx"})]
        return None
    if isinstance(recipes_or_method, Recipe):
        return [recipes_or_method]
    if isinstance(recipes_or_method, Sequence) and recipes_or_method and \
            all(isinstance(r, Recipe) for r in recipes_or_method):
        return list(recipes_or_method)
    return None


def loop_scorer(recipes_or_method: Any, fields: dict) -> Callable[..., xr.Dataset] | None:
    """The scorer of a ``vc.score`` request for the integrated-gradient rollouts or ViT-CX, bound to its
    recipes and options; None when the request is for the perturbation weightings (Score-CAM, Ablation-CAM).

    Example:
        >>> import vitcam_nb as vc
        >>> loop_scorer("scorecam", {}) is None, callable(loop_scorer(vc.presets.vit_cx(), {}))
        (True, True)
    """
    recipes = _as_recipes(recipes_or_method, fields)
    if recipes is None:
        return None
    integrated = [r.layer_fusion in INTEGRATED_ROLLOUTS for r in recipes]
    vitcx = [r.weighting == "vitcx" for r in recipes]
    if not any(integrated) and not any(vitcx):
        return None
    if not all(a or b for a, b in zip(integrated, vitcx)) or (any(integrated) and any(vitcx)):
        raise RecipeError("recipes_or_method: score the integrated-gradient rollouts, ViT-CX and the perturbation "
                          "weightings in separate vc.score calls")
    options = {k: v for k, v in fields.items() if k in (*IG_OPTIONS, *VITCX_OPTIONS)}
    if any(vitcx):
        if any(k in IG_OPTIONS for k in options):
            raise ArgumentTypeError(f"vc.score: {sorted(k for k in options if k in IG_OPTIONS)} apply to the "
                                    f"integrated gradient, not to ViT-CX")
        return lambda trace, model, image, **kw: score_vitcx(trace, model, recipes, image, **options, **kw)
    if any(k in VITCX_OPTIONS for k in options):
        raise ArgumentTypeError(f"vc.score: {sorted(k for k in options if k in VITCX_OPTIONS)} apply to ViT-CX only")
    return lambda trace, model, image, **kw: score_integrated(trace, model, recipes, image, **options, **kw)


def check_traced(trace: Any, model: torch.nn.Module, x: torch.Tensor) -> None:
    """The trace must be a single-image class-target trace of this model on this input.

    Example:
        >>> check_traced(None, torch.nn.Linear(1, 1), torch.zeros(1))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        vitcam_nb.core.errors.ArgumentTypeError: trace: expected a single-image trace Dataset ... got NoneType
    """
    if not isinstance(trace, xr.Dataset) or "image" in trace.dims or "target_class" not in trace.variables:
        raise ArgumentTypeError(f"trace: expected a single-image trace Dataset from vitcam_nb.trace(), got "
                                f"{type(trace).__name__}")
    if str(trace.attrs.get("target_kind", "class")) != "class":
        raise TraceError(f"targets: this pass scores the trace's classes along the path alpha * x; the trace's "
                         f"targets are {trace.attrs.get('target_kind')!r}, not class logits")
    check_traced_source(trace.attrs, model, x)


def traced_classes(trace: xr.Dataset) -> list[int]:
    """The class of every traced class target, in the trace's order (the expected score comes last).

    Example:
        >>> traced_classes(xr.Dataset(coords={"target_class": ("target", [3, 1, -1])}))
        [3, 1]
    """
    return [int(c) for c in trace["target_class"].values if int(c) >= 0]


def _integrated_gradient(model: torch.nn.Module, x: torch.Tensor, classes: list[int], last: int, steps: int,
                         batch_size: int, device: Any, show: bool) -> np.ndarray:
    from vitcam_nb.core.progress import progress_bar as tqdm

    plan = TracePlan.for_trace(model, classes, sites=["F2"], layers=[last], device=device)
    alphas = np.linspace(0, 1, steps)
    total = None
    with tqdm(total=-(-steps // batch_size), desc="vc.score (integrated gradient)", disable=not show) as bar:
        for start in range(0, steps, batch_size):
            alpha = torch.tensor(alphas[start:start + batch_size], dtype=x.dtype)
            run = run_pass(plan, x * alpha[:, None, None, None])
            part = run.grads[(last, "F2")].double().sum(dim=1)  # (targets, head, query, key): summed over steps
            total = part if total is None else total + part
            bar.update(1)
    return (total / steps).float().cpu().numpy()


def value_ratios(model: torch.nn.Module, x: torch.Tensor, layers: list[int]) -> np.ndarray:
    """``|v W_o| / |z|`` per token (layer, token) for timm-style blocks (``attn.qkv``, ``attn.proj``), ``z`` the
    block input: Beyond Intuition's token-wise attention perception.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> value_ratios(m.eval(), torch.zeros(1, 3, 32, 32), [0, 1]).shape
        (2, 17)
    """
    blocks = find_adapter(model).blocks(model)
    for i in layers:
        attn = getattr(blocks[i], "attn", None)
        if not isinstance(getattr(attn, "qkv", None), torch.nn.Linear) or \
                not isinstance(getattr(attn, "proj", None), torch.nn.Linear):
            raise TraceError("model: bt_token reads the values of block.attn.qkv and the weight of block.attn.proj "
                             f"(timm ViT blocks); block {i} of {type(model).__name__} has no such modules")
    seen: dict[tuple[int, str], torch.Tensor] = {}
    with removable_hooks() as handles, torch.no_grad():
        for i in layers:
            handles.append(blocks[i].register_forward_pre_hook(
                lambda _m, args, i=i: seen.__setitem__((i, "z"), args[0].detach())))
            handles.append(blocks[i].attn.qkv.register_forward_hook(
                lambda _m, _a, out, i=i: seen.__setitem__((i, "qkv"), out.detach())))
        model(x)
    out = []
    for i in layers:
        z, qkv = seen[(i, "z")][0].double(), seen[(i, "qkv")][0].double()
        width = qkv.shape[-1] // 3
        v = qkv[..., 2 * width:]
        vproj = v @ blocks[i].attn.proj.weight.detach().double().T
        out.append((torch.linalg.norm(vproj, dim=-1) / torch.linalg.norm(z, dim=-1)).cpu().numpy())
    return np.stack(out).astype(np.float32)


def score_integrated(trace: xr.Dataset, model: torch.nn.Module, recipes: list[Recipe], image: object, *,
                     steps: int = 20, batch_size: int = 32, device: Any = None, progress: bool | None = None,
                     targets: Any = None) -> xr.Dataset:
    """Store the integrated gradient of the last attention (and, for ``bt_token``, the value ratios) that the
    recipes read; what the trace holds already (with the same ``steps``) is not recomputed.

    Example:
        >>> import numpy as np, timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> img = np.zeros((32, 32, 3), np.uint8)
        >>> recipe = vc.presets.beyond_intuition_token(start_layer=-2)
        >>> tr = score_integrated(vc.trace(m, img, targets="top1"), m, [recipe], img, steps=2)
        >>> tr["value_ratio"].dims
        ('layer', 'token')
    """
    if not isinstance(model, torch.nn.Module):
        raise ArgumentTypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if targets is not None:
        raise TraceError("targets: the integrated gradient differentiates the trace's class logits along alpha * "
                         "x; other targets are not supported")
    if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps < 1:
        raise TraceError(f"steps: expected an int >= 1 (points on the path alpha * x), got {steps!r}")
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise TraceError(f"batch_size: expected an int >= 1 (steps per pass), got {batch_size!r}")
    if image is None:
        raise TraceError("image: vc.score needs the image the trace was made from")
    rule = trace.attrs.get("backward_rule") if isinstance(trace, xr.Dataset) else None
    if rule:  # the integrated gradient is autograd's: mixed with a rule trace's gradients, the map would be neither
        raise TraceError(f"trace: it was made with backward rule {rule!r}, and this pass integrates autograd's "
                         "gradient; score a trace made with rule='gradient'")
    x = prepare_input(model, image).tensor
    check_traced(trace, model, x)
    n_layers = int(trace.attrs["num_layers"])
    last = n_layers - 1
    old = trace.get("attn_grad_ig")
    need_ig = old is None or int(old.attrs.get("ig_steps", -1)) != steps
    layers = [int(v) for v in trace["layer"].values]
    need_ratio = any(r.layer_fusion == "bt_token" for r in recipes) and "value_ratio" not in trace.variables
    if not need_ig and not need_ratio:
        return trace
    run_device = torch.device(device) if device is not None else next(model.parameters()).device
    show = bool(progress) if progress is not None else steps > batch_size
    new: dict[str, Any] = {}
    with exclusive(model), on_device(model, run_device), eval_mode(model):
        xd = x.to(run_device, next(model.parameters()).dtype)
        with torch.no_grad():  # the hashes do not fix the model's behaviour: its logits must be the trace's
            logits = ClassTargets("top1").batch_scores(model, xd)[0]
        check_traced_scores(trace.attrs, trace["logits"].values, logits, str(run_device),
                            "the integrated gradient would belong to another model: ")
        if need_ig:
            ig = _integrated_gradient(model, xd, traced_classes(trace), last, steps, batch_size, run_device, show)
            new["attn_grad_ig"] = (VARIABLES["attn_grad_ig"].dims, ig,
                                   {"meaning": VARIABLES["attn_grad_ig"].meaning, "ig_steps": steps,
                                    "ig_layer": last, "ig_baseline": "zeros (alpha * x, x the model input)"})
        if need_ratio:
            new["value_ratio"] = (VARIABLES["value_ratio"].dims, value_ratios(model, xd, layers),
                                  {"meaning": VARIABLES["value_ratio"].meaning})
    return trace.assign(new)
