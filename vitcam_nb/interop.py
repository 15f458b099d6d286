"""What did that library call compute? Translate a pytorch-grad-cam, torchcam or Captum Grad-CAM call on a ViT
into the :class:`~vitcam_nb.Recipe` it computes, with findings on what it gets wrong.

The site and layer come from the hooked module (found in the model's adapter site table), the target from the
target object, and the token handling from running the ``reshape_transform`` on a labelled tensor (value
``token * C + channel``), never from reading its source. A call that computes something no recipe expresses
(a reshape that keeps a distillation or register token as a patch, a hard-coded grid of another size, a
reduction over the token axis) gets ``recipe = None``, a finding that says why, and the ``corrected`` recipe.

Example:
    >>> import timm
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    >>> rt = lambda t: t[:, 1:, :].reshape(t.size(0), 4, 4, t.size(2)).permute(0, 3, 1, 2)
    >>> t = from_pytorch_grad_cam(m, "GradCAM", target_layers=[m.blocks[-1].norm1], reshape_transform=rt)
    >>> t.recipe.site, t.recipe.layer, t.findings
    ('F1', 1, [])
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from vitcam_nb.adapters.registry import find_adapter
from vitcam_nb.adapters.swin import WINDOWED
from vitcam_nb.core.errors import RecipeError, TraceError
from vitcam_nb.core.escape import escape_markdown
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.targets.contrast import Contrast, contrast

__all__ = ["FAMILIES", "Finding", "Translation", "from_captum", "from_pytorch_grad_cam", "from_torchcam"]

#: pytorch-grad-cam (and torchcam) method class names -> recipe weighting.
METHODS = {"GradCAM": "gradcam", "HiResCAM": "hirescam", "GradCAMElementWise": "gradcam_elementwise",
           "GradCAMPlusPlus": "gradcampp", "XGradCAM": "xgradcam", "LayerCAM": "layercam", "EigenCAM": "eigencam",
           "EigenGradCAM": "eigengradcam", "GradCAMpp": "gradcampp", "AblationCAM": "ablationcam"}
#: The adapter families whose module outputs this module knows (timm's token ViTs and Swin); a call on a model
#: of another family is refused rather than judged on a layout it does not read.
FAMILIES = ("vit", "beit", "eva", "swin")
# pytorch-grad-cam 1.5.7's AblationLayer / AblationLayerVit: the value written into an ablated channel.
ABLATION = ("pytorch-grad-cam's ablation layer writes min(activations) - 1e7 into the ablated channel whenever "
            "the activation minimum is not exactly 0 (always at a LayerNorm output such as F1 or F4), where "
            "vitcam_nb's ablationcam sets the channel to 0; the ablated scores, hence the channel weights, differ "
            "unless the site's minimum is 0")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing a translated call gets wrong or leaves implicit: a short ``kind`` and a sentence.

    Example:
        >>> Finding("grid", "hard-coded 14x14 on a 24x24 model").kind
        'grid'
    """

    kind: str
    message: str


@dataclasses.dataclass(frozen=True)
class Translation:
    """The recipe a call computes (None when no recipe expresses it), the findings, and the ``corrected``
    recipe (what the call meant, when it computes something else; equal to ``recipe`` when it is right). A call
    whose score is not a class logit (FinerCAM's contrast) also gives the ``target`` to trace with.

    Example:
        >>> t = Translation(Recipe(), [], Recipe(), "pytorch-grad-cam")
        >>> t.ok
        True
    """

    recipe: Recipe | None
    findings: list[Finding]
    corrected: Recipe | None
    library: str
    target: Contrast | None = None

    @property
    def ok(self) -> bool:
        """Whether the call computes a recipe exactly (it may still have findings worth reading).

        Example:
            >>> Translation(None, [Finding("grid", "wrong")], Recipe(), "torchcam").ok
            False
        """
        return self.recipe is not None

    def report(self) -> str:
        """A paragraph: what the call computes, or why no recipe does and which recipe it meant.

        Example:
            >>> Translation(Recipe(), [], Recipe(), "pytorch-grad-cam").report()[:34]
            'This pytorch-grad-cam call compute'
        """
        if self.recipe is not None:
            text = f"This {self.library} call computes recipe {self.recipe.id}: {self.recipe.to_json()}."
        else:
            text = f"No recipe expresses this {self.library} call: it computes something else than Grad-CAM on the " \
                   "patch grid."
            if self.corrected is not None:
                text += f" The corrected call computes recipe {self.corrected.id}: {self.corrected.to_json()}."
        if self.target is not None:
            text += (f" Its gradient target is a contrast score: trace with targets={self.target!r} "
                     f"({self.target.description}); the recipe maps that score (class_=0).")
        return " ".join([text, *(f"[{f.kind}] {f.message}" for f in self.findings)])

    def _repr_markdown_(self) -> str:
        return escape_markdown(self.report())


def _module_name(model: torch.nn.Module, module: Any, argument: str) -> tuple[str, torch.nn.Module]:
    if isinstance(module, str):
        try:
            return module, model.get_submodule(module)
        except AttributeError as exc:
            raise RecipeError(f"{argument}: {module!r} is not a module of this model ({exc})") from exc
    for name, m in model.named_modules():
        if m is module:
            return name, m
    raise RecipeError(f"{argument}: {type(module).__name__} is not a module of this model")


def _locate(model: torch.nn.Module, module: Any, argument: str) -> tuple[str, int]:
    """The site and absolute layer whose value is the output of ``module``; refused (naming the sites of the
    nearest block) when the module is not a site."""
    adapter = _adapter(model)
    name, mod = _module_name(model, module, argument)
    blocks = adapter.blocks(model)
    table = adapter.site_table(model)
    block_names = {id(b): n for n, b in model.named_modules() if any(b is blk for blk in blocks)}
    nearest: list[str] = []
    for layer, blk in enumerate(blocks):
        prefix = block_names.get(id(blk), f"block {layer}")
        outputs = {site: blk.get_submodule(spec.module) if spec.module else blk
                   for site, spec in table.items() if spec.io == "output"}
        attn = getattr(blk, "attn", None)
        if attn is not None and isinstance(getattr(attn, "norm", None), torch.nn.Module) and "F3" in table:
            outputs["F3"] = attn.norm  # timm applies attn.norm right before proj: its output is proj's input
        for site, m in outputs.items():
            if m is mod:
                return site, layer
        if name == prefix or name.startswith(prefix + "."):
            nearest = [f"{site} ({prefix}.{spec.module}:{spec.io})" if spec.module else f"{site} ({prefix}:{spec.io})"
                       for site, spec in table.items()]
    near = f"; the sites of that block are {', '.join(nearest)}" if nearest else \
        f"; sites are read in the blocks ({', '.join(sorted(table))})"
    raise RecipeError(f"{argument}: module {name!r} ({type(mod).__name__}) is not a site, so no recipe reads it"
                      + near)


def _adapter(model: Any) -> Any:
    """The model's adapter, refused unless its family is one whose module outputs this module reads."""
    if not isinstance(model, torch.nn.Module):
        raise RecipeError(f"model: expected the torch.nn.Module the call runs on, got {type(model).__name__}")
    adapter = find_adapter(model)
    if adapter.family not in FAMILIES:
        raise RecipeError(f"model: vc.interop translates calls on the {', '.join(FAMILIES)} families (timm); this "
                          f"{type(model).__name__} is family {adapter.family!r}, whose module outputs it does not "
                          "read, so it gives no verdict. Trace the model with vc.trace and choose the recipe directly")
    return adapter


@dataclasses.dataclass(frozen=True)
class _Layout:
    """One image's activation at a site as the hooked module outputs it: ``prefix`` tokens, then the ``grid``
    (rows, cols) of ``channels`` channels, as (tokens, channels) or, ``nhwc``, as (rows, cols, channels)."""

    prefix: tuple[str, ...]
    grid: tuple[int, int]
    channels: int
    nhwc: bool = False
    windowed: bool = False

    def describe(self) -> str:
        if self.nhwc:
            return f"(batch, {self.grid[0]} rows, {self.grid[1]} cols, {self.channels} channels)"
        return f"(batch, {len(self.prefix) + self.grid[0] * self.grid[1]} tokens, {self.channels} channels)"


def _grid(model: torch.nn.Module, input_size: Any) -> tuple[int, int]:
    """The patch grid at ``input_size`` (None: the model's own size), which a dynamic-size model needs."""
    pe = model.patch_embed
    own = tuple(int(v) for v in pe.img_size)
    dynamic = bool(getattr(model, "dynamic_img_size", False))
    if input_size is None:
        if dynamic:
            raise RecipeError(f"input_size: {type(model).__name__} takes any input size (dynamic_img_size), so its "
                              "patch grid depends on the images; pass input_size=(height, width) of the call's input")
        return tuple(int(v) for v in pe.grid_size)
    if (not isinstance(input_size, Sequence) or len(input_size) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in input_size)):
        raise RecipeError(f"input_size: expected (height, width) in pixels, got {input_size!r}")
    if not dynamic and tuple(input_size) != own:
        raise RecipeError(f"input_size: this model takes {own[0]}x{own[1]} images only, got {tuple(input_size)}")
    return tuple(int(v) for v in pe.dynamic_feat_size(tuple(input_size))) if dynamic else \
        tuple(int(v) for v in pe.grid_size)


def _layout(model: torch.nn.Module, site: str, layer: int, input_size: Any = None) -> _Layout:
    adapter = _adapter(model)
    if adapter.family == "swin":  # each stage has its own grid and width; some sites are NHWC or per window
        _grid(model, input_size)  # refuses another input size than the model's
        blk = adapter.blocks(model)[layer]
        return _Layout((), tuple(int(v) for v in blk.input_resolution), adapter.block_facts(model, layer)["stage_dim"],
                       nhwc=site in adapter.grid_sites, windowed=site in WINDOWED)
    return _Layout(tuple(adapter.prefix_kinds(model)), _grid(model, input_size),
                   int(getattr(model, "embed_dim", model.num_features)))


def _probe_reshape(reshape_transform: Any, lay: _Layout) -> list[Finding]:
    """Run ``reshape_transform`` on one image's activation, laid out as the module outputs it, whose entries are
    ``token * C + channel``, and compare the grid it returns with the site's raster patch grid."""
    prefix, (gh, gw), channels = list(lay.prefix), lay.grid, lay.channels
    if lay.windowed:
        return [Finding("windows", f"the module outputs window tokens (windows * batch, window area, {channels} "
                                   "channels): pytorch-grad-cam takes each window for an image, which no recipe "
                                   "expresses")]
    n = len(prefix) + gh * gw
    shape = (1, gh, gw, channels) if lay.nhwc else (1, n, channels)
    labelled = torch.arange(n * channels, dtype=torch.float64).reshape(shape)
    try:
        out = reshape_transform(labelled)
    except Exception as exc:  # any failure of the user's function is the finding
        return [Finding("reshape", f"reshape_transform fails on this site's activations {lay.describe()} "
                                   f"({len(prefix)} prefix {prefix} + {gh}x{gw} patches): {type(exc).__name__}: {exc}")]
    if not isinstance(out, torch.Tensor) or out.ndim != 4 or out.shape[0] != 1 or out.shape[1] != channels:
        return [Finding("reshape", f"reshape_transform returns {tuple(getattr(out, 'shape', ()))}; pytorch-grad-cam "
                                   f"needs (batch, {channels} channels, rows, cols)")]
    out = out.to(torch.float64)
    if bool(((out < 0) | (out >= n * channels) | (out != out.floor())).any()):
        return [Finding("reshape", "reshape_transform changes the activation values (not only their layout)")]
    token, channel = torch.div(out[0], channels, rounding_mode="floor").long(), (out[0] % channels).long()
    findings = []
    if tuple(out.shape[2:]) != (gh, gw):
        findings.append(Finding("grid", f"reshape_transform makes a {out.shape[2]}x{out.shape[3]} grid; this "
                                        f"site's patch grid is {gh}x{gw}"))
    if not torch.equal(channel, torch.arange(channels)[:, None, None].expand_as(channel)):
        findings.append(Finding("channels", "reshape_transform mixes channels between grid cells"))
    cells = token[0]
    kept_prefix = sorted({int(t) for t in cells.unique() if int(t) < len(prefix)})
    if kept_prefix:
        kinds = [prefix[t] for t in kept_prefix]
        findings.append(Finding("prefix token", f"reshape_transform keeps prefix token(s) {kept_prefix} ({kinds}) "
                                                f"as patches: this model has {len(prefix)} prefix tokens {prefix}, "
                                                "so the grid is shifted and the last patch(es) dropped"))
    if not findings:
        expected = len(prefix) + torch.arange(gh * gw).reshape(gh, gw)
        if not torch.equal(cells, expected):
            findings.append(Finding("order", "reshape_transform places the patch tokens in another order than the "
                                             "row-major raster grid"))
    return findings


def _class_index(value: Any, argument: str, model: torch.nn.Module) -> int:
    """``value`` as one class index of ``model``, or a refusal naming ``argument`` and the classes."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise RecipeError(f"{argument}: expected one class index (an int), got {value!r}")
    n = getattr(model, "num_classes", None)
    if value < 0 or (isinstance(n, int) and n > 0 and value >= n):
        known = f"0..{n - 1}" if isinstance(n, int) and n > 0 else "a non-negative index"
        raise RecipeError(f"{argument}: class {int(value)} is not a class of this model ({known})")
    return int(value)


def _target(targets: Any, model: torch.nn.Module) -> tuple[dict[str, Any], list[Finding]]:
    headless = getattr(model, "num_classes", None) == 0 or isinstance(getattr(model, "head", None),
                                                                         torch.nn.Identity)
    if headless:
        return {}, [Finding("target", "the model returns features (no classifier head): a target chosen as the "
                                      "output's argmax is an embedding dimension, not a class")]
    if targets is None:
        return {"target": "logit", "class_": "top1"}, []
    if not isinstance(targets, Sequence) or isinstance(targets, str) or len(targets) != 1:
        return {}, [Finding("target", f"expected one target object per image (one image), got {targets!r}")]
    t = targets[0]
    name = type(t).__name__
    if name == "ClassifierOutputTarget":
        return {"target": "logit", "class_": _class_index(getattr(t, "category", None), "targets", model)}, []
    if name == "ClassifierOutputSoftmaxTarget":
        return {"target": "prob", "class_": _class_index(getattr(t, "category", None), "targets", model)}, []
    return {}, [Finding("target", f"{name} differentiates a score no recipe target names (logit, prob, logprob "
                                  "of a class)")]


def _method_name(method: Any) -> str:
    return method if isinstance(method, str) else getattr(method, "__name__", type(method).__name__)


def _finer_target(targets: Any, model: torch.nn.Module, alpha: Any, comparison_categories: Any,
                  target_idx: Any) -> tuple[Contrast | None, dict[str, Any], list[Finding]]:
    """What FinerCAM differentiates: with ``targets=None`` its own FinerWeightedTarget of the top class (or
    ``target_idx``) against the classes at ``comparison_categories`` in the order of logit distance; with a
    FinerWeightedTarget, that target's classes; with any other target, that target (FinerCAM passes it on)."""
    try:
        if targets is None:
            main = "top1" if target_idx is None else _class_index(target_idx, "target_idx", model)
            t = contrast(main, "nearest", ranks=comparison_categories, alpha=alpha)
        elif (isinstance(targets, Sequence) and not isinstance(targets, str) and len(targets) == 1
              and type(targets[0]).__name__ == "FinerWeightedTarget"):
            f = targets[0]
            # pytorch-grad-cam names the compared classes comparison_categories (1.5.5) or reference_categories
            against = getattr(f, "comparison_categories", getattr(f, "reference_categories", None)) or []
            t = contrast(_class_index(getattr(f, "main_category", None), "targets", model),
                         [_class_index(c, "targets", model) for c in against], alpha=getattr(f, "alpha", 1.0))
        else:
            target, bad = _target(targets, model)
            return None, target, bad
        t.check(model)
    except TraceError as exc:  # the call's own arguments: refused as a recipe question, naming them
        raise RecipeError(str(exc)) from exc
    return t, {"target": "logit", "class_": 0}, []


def from_pytorch_grad_cam(model: torch.nn.Module, method: Any, target_layers: Sequence[Any],
                          reshape_transform: Any = None, targets: Any = None,
                          input_size: tuple[int, int] | None = None, *, base_method: Any = "GradCAM",
                          alpha: float = 1.0, comparison_categories: Sequence[int] = (1, 2, 3),
                          target_idx: int | None = None) -> Translation:
    """The recipe ``method(model, target_layers, reshape_transform)(input, targets)`` computes in
    pytorch-grad-cam 1.5.x: channel weights pooled over the cells the reshape keeps, ReLU, min-max, bilinear
    resize to the input, several layers averaged (``layer_fusion="mean"``). The reshape is run on the hooked
    module's own output layout (on Swin: the grid and width of the stage the module sits in). A model of
    another family than :data:`FAMILIES` is refused; ``input_size`` (height, width) is needed only by a model
    that takes any input size. An AblationCAM call gets a finding on the value its ablation writes.

    ``FinerCAM`` (pass its ``base_method`` and call keywords here) is the base method's recipe on FinerCAM's
    contrast score, whose :func:`vitcam_nb.targets.contrast` is the translation's ``target``, to trace with.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> rt = lambda t: t[:, 1:, :].reshape(t.size(0), 14, 14, t.size(2)).permute(0, 3, 1, 2)
        >>> t = from_pytorch_grad_cam(m, "GradCAM", target_layers=[m.blocks[-1].norm1], reshape_transform=rt)
        >>> t.recipe is None, t.findings[0].kind, t.corrected.site
        (True, 'reshape', 'F1')
    """
    name = _method_name(method)
    finer = name == "FinerCAM"
    if finer:
        name = _method_name(base_method)
        if name not in METHODS or METHODS[name] == "ablationcam":
            raise RecipeError(f"base_method: {name} is not a gradient CAM method with a recipe; FinerCAM's base "
                              f"methods translated are {sorted(k for k, v in METHODS.items() if v != 'ablationcam')}")
    elif name not in METHODS:
        raise RecipeError(f"method: {name} is not a CAM method with a recipe; translatable methods are "
                          f"{sorted([*METHODS, 'FinerCAM'])}")
    if not isinstance(target_layers, Sequence) or isinstance(target_layers, str) or not target_layers:
        raise RecipeError(f"target_layers: expected a non-empty list of modules, got {target_layers!r}")
    located = [_locate(model, m, "target_layers") for m in target_layers]
    sites = {s for s, _ in located}
    findings: list[Finding] = []
    if len(sites) > 1:
        raise RecipeError(f"target_layers: modules at different sites {sorted(sites)}; pytorch-grad-cam averages "
                          "them, which no recipe (one site) expresses")
    layers = tuple(layer for _, layer in located)
    site = sites.pop()
    fields = dict(site=site, layer=layers[0], weighting=METHODS[name], weight_tokens="patch", relu="after",
                  normalize="minmax", upsample="bilinear")
    if len(layers) > 1:
        fields.update(layer=layers, layer_fusion="mean")
    finer_target = None
    if finer:
        finer_target, target, bad_target = _finer_target(targets, model, alpha, comparison_categories, target_idx)
    else:
        target, bad_target = _target(targets, model)
    findings += bad_target
    if site == "F2":
        findings.append(Finding("site", "the module outputs attention matrices (batch, heads, tokens, tokens); a "
                                        "reshape_transform built for token activations does not read them"))
    if reshape_transform is None:
        findings.append(Finding("reshape", "no reshape_transform: pytorch-grad-cam needs (batch, channels, rows, "
                                           "cols) activations and fails on ViT tokens (batch, tokens, channels)"))
    elif site != "F2":
        # Every layout the layers have (a Swin stage each): a reshape right for one stage can be wrong for another.
        for lay in dict.fromkeys(_layout(model, site, layer, input_size) for layer in layers):
            findings += [f for f in _probe_reshape(reshape_transform, lay) if f not in findings]
    if METHODS[name] == "ablationcam":
        findings.append(Finding("ablation", ABLATION + "; on ViT tokens the call also needs ablation_layer="
                                "AblationLayerVit(), and the corrected recipe needs vc.score(tr, model, recipe, "
                                "image) before vc.cam"))
    corrected = Recipe(**fields, **(target or {"target": "logit", "class_": "top1"}))
    wrong = bool(findings)
    return Translation(None if wrong else corrected, findings, corrected, "pytorch-grad-cam", finer_target)


def _token_axis_finding(library: str, model: torch.nn.Module, site: str, layer: int) -> Finding:
    if site == "F2":
        what = ("on attention matrices (batch, heads, tokens, tokens) it weights heads and sums them, so its output "
                "is indexed by (query, key)")
    else:
        lay = _layout(model, site, layer, None if not getattr(model, "dynamic_img_size", False) else
                      tuple(int(v) for v in model.patch_embed.img_size))
        what = f"on this site's activations {lay.describe()} it weights " + \
            ("rows and sums them, so its output is indexed by (column, channel)" if lay.nhwc else
             "tokens and sums them, so its output is indexed by embedding dimension")
    return Finding("token axis", f"{library} treats dimension 1 of the activations as channels and pools over the "
                                 f"rest; {what}, not by patch: no map on the patch grid")


def from_torchcam(model: torch.nn.Module, method: Any, target_layer: Any, class_idx: int | None = None) -> Translation:
    """The recipe ``torchcam.methods.<method>(model, target_layer=...)`` computes on a ViT: none, since torchcam
    (0.5) pools over every axis after dimension 1 (tokens on a ViT); the finding says so and ``corrected`` is the
    Grad-CAM the call meant at that site. A module that is not a site is refused, naming the nearest sites.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> t = from_torchcam(m, "GradCAM", target_layer="blocks.1.norm1")
        >>> t.recipe, t.findings[0].kind, t.corrected.layer
        (None, 'token axis', 1)
    """
    name = _method_name(method)
    gradient = sorted(k for k, v in METHODS.items() if v != "ablationcam")
    if name not in gradient:
        raise RecipeError(f"method: {name} is not a gradient CAM with a recipe; translatable methods are {gradient}")
    site, layer = _locate(model, target_layer, "target_layer")
    cls = "top1" if class_idx is None else _class_index(class_idx, "class_idx", model)
    corrected = Recipe(site=site, layer=layer, weighting=METHODS[name], class_=cls, upsample="bilinear")
    return Translation(None, [_token_axis_finding("torchcam", model, site, layer)], corrected, "torchcam")


def from_captum(layer_method: Any, target: int | None = None, model: torch.nn.Module | None = None) -> Translation:
    """The recipe Captum's ``LayerGradCam(forward_func, layer).attribute(x, target=...)`` computes on a ViT
    token module: none, since Captum averages gradients over dimensions 2.. (channels on a ViT) and sums over
    dimension 1 (tokens); ``corrected`` is the Grad-CAM the call meant at that site.

    Example:
        >>> import timm
        >>> from captum.attr import LayerGradCam
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> t = from_captum(LayerGradCam(m, m.blocks[0].norm2), target=3)
        >>> t.corrected.site, t.corrected.class_, t.ok
        ('F4', 3, False)
    """
    if type(layer_method).__name__ != "LayerGradCam":
        raise RecipeError("layer_method: only captum.attr.LayerGradCam is translated, got "
                          f"{type(layer_method).__name__}")
    model = model if model is not None else getattr(layer_method, "forward_func", None)
    if not isinstance(model, torch.nn.Module):
        raise RecipeError("model: the LayerGradCam's forward_func is not the model; pass model=")
    site, layer = _locate(model, getattr(layer_method, "layer", None), "layer")
    cls = "top1" if target is None else _class_index(target, "target", model)
    corrected = Recipe(site=site, layer=layer, weighting="gradcam", class_=cls, upsample="bilinear")
    return Translation(None, [_token_axis_finding("Captum LayerGradCam", model, site, layer)], corrected, "captum")
