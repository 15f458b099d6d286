"""Model-in-the-loop scores: the forward passes the perturbation weightings need (Score-CAM, Ablation-CAM,
gScore-CAM), run once in channel batches and stored in the trace as ``score`` and ``ablation`` (layer, site,
target, channel), so that every recipe reading them is a pure computation of the trace again.

- ``score[l, s, j, k]``: target j's score of the input multiplied by channel k's map at site s of block l
  (patch tokens on the grid, upsampled bilinearly with ``align_corners=True`` to the input size, min-max
  normalised with ``+1e-8``), as pytorch-grad-cam 1.5.7's ScoreCAM;
- ``ablation[l, s, j, k]``: target j's score with channel k set to zero at every token of site s (a hook on
  the site's module). pytorch-grad-cam 1.5.7's AblationCAM with its ViT ablation layer does the same where the
  site's activation minimum is 0; elsewhere (every LayerNorm site) it writes ``min - 1e7`` into the ablated
  channel, which is not copied here.

Before any of these passes, the model's scores on the traced input must be the trace's ``logits`` (whatever the
target kind): equal weights and input hashes do not make the same model (another ``global_pool``, a forward
hook or a patched forward change the output, not the weights).

Channels not scored yet are NaN; a second call scores only what is missing.

Example:
    >>> import numpy as np, timm, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    >>> img = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    >>> tr = score(vc.trace(m, img, targets="top1"), m, "scorecam", img, layer=0, progress=False)
    >>> tr["score"].dims, int(np.isfinite(tr["score"].sel(layer=0, site="F1")).all())
    (('layer', 'site', 'target', 'channel'), 1)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import xarray as xr

from vitcam_nb.adapters.base import Adapter, TraceContext
from vitcam_nb.adapters.registry import find_adapter
from vitcam_nb.capture.hooks import eval_mode, removable_hooks
from vitcam_nb.capture.integrated import loop_scorer
from vitcam_nb.capture.runtime import check_autocast, on_device
from vitcam_nb.core.errors import ArgumentTypeError, RecipeError, TraceError
from vitcam_nb.core.provenance import check_traced_scores, check_traced_source
from vitcam_nb.core.recipe import Recipe, is_int
from vitcam_nb.core.schema import SCORE_VARIABLES, VARIABLES
from vitcam_nb.core.weighting import WEIGHTINGS
from vitcam_nb.preprocess import prepare_input
from vitcam_nb.targets.base import Target
from vitcam_nb.targets.classes import ClassTargets

__all__ = ["pending", "refuse_unscorable", "score", "top_channels"]

Job = dict[tuple[int, str, str], set[int]]


def top_channels(G: np.ndarray, patch: Any, k: int) -> np.ndarray:
    """The k channels with the largest gradient weight ``mean over patch tokens of G[t,k]`` (..., k), ties by
    channel order (gScore-CAM's selection; its kernel and :func:`score` both use this one).

    Example:
        >>> top_channels(np.array([[1.0, 3.0, 2.0]]), slice(None), 2)
        array([1, 2])
    """
    alpha = G[..., patch, :].astype(np.float32).mean(axis=-2)
    return np.argsort(-alpha, axis=-1, kind="stable")[..., :k]


def _recipes(recipes_or_method: Any, fields: dict) -> list[Recipe]:
    if isinstance(recipes_or_method, str):
        recipes = [Recipe.from_dict({**fields, "weighting": recipes_or_method})]
    elif isinstance(recipes_or_method, Recipe):
        recipes = [recipes_or_method.replace(**fields) if fields else recipes_or_method]
    elif isinstance(recipes_or_method, Sequence) and recipes_or_method and \
            all(isinstance(r, Recipe) for r in recipes_or_method):
        recipes = list(recipes_or_method)
    else:
        raise ArgumentTypeError(f"recipes_or_method: expected a weighting name, a vitcam_nb.Recipe or a list of them, "
                                f"got {recipes_or_method!r}")
    for r in recipes:
        if not WEIGHTINGS.get(r.weighting).scores:
            scored = [w.name for w in WEIGHTINGS.values() if w.scores]
            raise RecipeError(f"recipes_or_method: {r.weighting} needs no model outputs (vc.cam computes it from "
                              f"the trace); vc.score stores them for {scored}")
    return recipes


def _layers(trace: xr.Dataset, layer: Any) -> list[int]:
    traced = [int(v) for v in trace["layer"].values]
    n = int(trace.attrs.get("num_layers", max(traced) + 1))
    if layer == "all":
        return traced
    out = []
    for v in layer if isinstance(layer, tuple) else (layer,):
        if not is_int(v) or not -n <= v < n:
            raise RecipeError(f"layer: {v!r} is not a block of this {n}-block model (ints -{n}..{n - 1})")
        if v % n not in traced:
            raise RecipeError(f"layer: block {v % n} was not traced (traced: {traced})")
        out.append(v % n)
    return out


def _class_position(trace: xr.Dataset, recipe: Recipe) -> int:
    logits = trace["logits"].values.astype(np.float64)
    if is_int(recipe.class_):
        cls = int(recipe.class_)
    else:
        cls = int(np.argsort(-logits, kind="stable")[int(recipe.class_[3:]) - 1])
    classes = [int(c) for c in trace["target_class"].values]
    if cls not in classes:
        raise RecipeError(f"class_: class {cls} was not traced (traced: {[c for c in classes if c >= 0]})")
    return classes.index(cls)


def _plan(trace: xr.Dataset, recipes: list[Recipe]) -> Job:
    """(layer, site, variable) -> channels to score, leaving out those the trace holds already."""
    sites = [str(s) for s in trace["site"].values] if "site" in trace.coords else []
    patch = np.flatnonzero(trace["token_kind"].values == "patch")
    n_channels = int(trace.sizes["channel"])
    jobs: Job = {}
    for r in recipes:
        if r.site not in sites:
            raise RecipeError(f"site: {r.site!r} is not in this trace (traced sites: {sites})")
        var = WEIGHTINGS.get(r.weighting).scores
        for layer in _layers(trace, r.layer):
            if r.k is not None:
                if r.k > n_channels:
                    raise RecipeError(f"k: {r.k} is more than the {n_channels} channels of site {r.site}")
                G = trace["grad"].isel(target=_class_position(trace, r)).sel(layer=layer, site=r.site).values
                wanted = {int(c) for c in top_channels(G, patch, r.k)}
            else:
                wanted = set(range(n_channels))
            done = np.ones(n_channels, bool)
            # prob / logprob read each perturbed input's logsumexp too (traces scored before it was stored lack it)
            for name in (var, f"{var}_logsumexp") if r.target != "logit" else (var,):
                held = trace[name].sel(layer=layer, site=r.site).values if name in trace.variables else None
                done &= np.isfinite(held).reshape(-1, n_channels).all(axis=0) if held is not None else False
            wanted = {c for c in wanted if not done[c]}
            if wanted:
                jobs.setdefault((layer, r.site, var), set()).update(wanted)
    return jobs


def pending(trace: xr.Dataset, recipes_or_method: Any = "scorecam",
            **fields: Any) -> dict[tuple[int, str, str], list[int]]:
    """What :func:`score` would run on ``trace``: (layer, site, variable) -> the channels not scored yet (empty
    when every score the recipes read is stored; then ``score`` calls no model).

    Example:
        >>> import numpy as np, timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> tr = vc.trace(m, np.zeros((32, 32, 3), np.uint8), targets="top1")
        >>> {key: len(ch) for key, ch in pending(tr, "ablationcam", layer=1, site="F4").items()}
        {(1, 'F4', 'ablation'): 192}
    """
    return {key: sorted(ch) for key, ch in _plan(trace, _recipes(recipes_or_method, fields)).items()}


def _target_scores(z: torch.Tensor, classes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, targets): the score of each traced class, and E = sum_j p_j z_j for the expected-score target;
    and (batch,) the logsumexp of all scores (log p_c = z_c - logsumexp)."""
    if not isinstance(z, torch.Tensor) or z.ndim != 2:
        raise TraceError(f"targets: vc.score needs (batch, scores) from the target, got "
                         f"{tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__}")
    z = z.float()
    expected = (torch.softmax(z, dim=1) * z).sum(dim=1)
    return torch.stack([z[:, c] if c >= 0 else expected for c in classes], dim=1), torch.logsumexp(z, dim=1)


def _masks(trace: xr.Dataset, layer: int, site: str, size: tuple[int, int], channels: list[int]) -> torch.Tensor:
    """The patch maps of ``channels``, upsampled (align_corners=True) and min-max normalised: (len(channels), H, W);
    only those channels, so that a partial or top-k call upsamples no more than it scores."""
    kinds = trace["token_kind"].values
    patch = np.flatnonzero(kinds == "patch")
    gh, gw = int(trace.attrs["grid_h"]), int(trace.attrs["grid_w"])
    act = trace["act"].sel(layer=layer, site=site).values[patch][:, channels].astype(np.float32)
    grid = np.zeros((act.shape[1], gh, gw), np.float32)
    grid[:, trace["patch_row"].values[patch], trace["patch_col"].values[patch]] = act.T
    up = F.interpolate(torch.from_numpy(grid)[None], size=size, mode="bilinear", align_corners=True)[0]
    flat = up.reshape(up.shape[0], -1)
    lo, hi = flat.min(dim=1)[0][:, None, None], flat.max(dim=1)[0][:, None, None]
    return (up - lo) / (hi - lo + 1e-8)


@contextlib.contextmanager
def _ablating(model: torch.nn.Module, adapter: Adapter, layer: int, site: str, rows: list[int]) -> Iterator[None]:
    """Zero channel ``rows[i]`` at every token of the site for batch row i, by a hook on the site's module."""
    spec = adapter.site_table(model)[site]
    block = adapter.blocks(model)[layer]
    module = block.get_submodule(spec.module) if spec.module else block
    index = torch.arange(len(rows))
    channels = torch.tensor(rows)

    def zeroed(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[index, ..., channels.to(t.device)] = 0
        return t

    with removable_hooks() as handles:
        if spec.io == "output":
            handles.append(module.register_forward_hook(lambda _m, _i, out: zeroed(out)))
        else:
            handles.append(module.register_forward_pre_hook(lambda _m, args: (zeroed(args[0]), *args[1:])))
        yield


def _check(trace: Any, model: Any, adapter: Adapter, x: torch.Tensor, batch_size: Any) -> None:
    if not isinstance(trace, xr.Dataset) or "image" in trace.dims or "act" not in trace.variables:
        raise ArgumentTypeError(f"trace: expected a single-image trace Dataset with token sites from "
                                f"vitcam_nb.trace(), got {type(trace).__name__}")
    if getattr(adapter, "hierarchical", False) or type(adapter).arrange is not Adapter.arrange or \
            type(adapter).arrange_traced is not Adapter.arrange_traced:
        raise TraceError(f"model: vc.score reads and zeroes sites in the model's own (batch, token, channel) layout; "
                         f"the {adapter.family} adapter rearranges its sites, which vc.score does not support")
    check_traced_source(trace.attrs, model, x, "the scores would belong to another model: ")
    if not is_int(batch_size) or batch_size < 1:
        raise TraceError(f"batch_size: expected an int >= 1 (channels per forward pass), got {batch_size!r}")


def _target(trace: xr.Dataset, targets: Target | None) -> Target:
    kind = str(trace.attrs.get("target_kind", "class"))
    if targets is None:
        if kind != "class":
            raise TraceError(f"targets: this trace's scores are {kind!r} targets; pass the same target object "
                             "the trace was made with: vc.score(..., targets=target)")
        return ClassTargets("top1")
    if not isinstance(targets, Target) or targets.kind != kind:
        raise TraceError(f"targets: expected the {kind!r} target the trace was made with, got {targets!r}")
    return targets


def _check_scores(target: Target, model: torch.nn.Module, x: torch.Tensor, trace: xr.Dataset) -> None:
    """The target on the unperturbed input must give the trace's scores: same model (its behaviour, not only its
    weights), input and target."""
    check_traced_scores(trace.attrs, trace["logits"].values, target.batch_scores(model, x)[0], str(x.device),
                        "the scores would belong to another model: ")


def refuse_unscorable(trace: Any) -> None:
    """Refuse what no ``vc.score`` pass can score faithfully, before anything is read or run: a hierarchical (Swin)
    trace, and a call inside ``torch.autocast`` (the scores would be computed in a lower precision than the
    trace's ``compute_dtype`` records).

    Example:
        >>> refuse_unscorable(xr.Dataset())  # a flat trace outside autocast: nothing to say
    """
    if isinstance(trace, xr.DataTree):
        raise ArgumentTypeError("trace: got a DataTree, the form of a hierarchical (Swin) trace; vc.score does not "
                                "support Swin (hierarchical) traces: Score-CAM, Ablation-CAM, gScore-CAM, ViT-CX and "
                                "the integrated-gradient rollouts read and perturb one flat patch grid. vc.cam "
                                "computes the gradient and attention recipes of this trace without vc.score")
    try:
        check_autocast()
    except TraceError:
        raise TraceError("model: torch.autocast is active; vc.score would compute the scores in a lower precision "
                         "than the trace's compute_dtype records. Call vc.score outside the autocast block, or "
                         "trace and score a model cast itself (model.half())") from None


def score(trace: xr.Dataset, model: torch.nn.Module, recipes_or_method: Any = "scorecam", image: object = None, *,
          batch_size: int = 32, device: str | torch.device | None = None, progress: bool | None = None,
          targets: Target | None = None, **fields: Any) -> xr.Dataset:
    """Run the forward passes that Score-CAM, Ablation-CAM and gScore-CAM need and return the trace with them
    stored (``score`` / ``ablation``, dims (layer, site, target, channel)); ``vc.cam`` then needs no model.
    Refused before any pass: a Swin (hierarchical) trace, a call inside ``torch.autocast``, a model that is not the
    traced one.

    Args:
        trace: a single-image trace of ``model`` on ``image`` (class targets).
        model: the traced model, behaving as when traced: its weights hash must be the trace's, and its scores
            on the traced input the trace's ``logits`` (another ``global_pool``, a forward hook or a patched
            forward is refused, with both values); returned exactly as it was.
        recipes_or_method: a weighting name ("scorecam", "ablationcam", "gscorecam"; ``fields`` complete the
            recipe, e.g. ``layer=0, site="F4"``), a Recipe, or a list of Recipes. Every traced target is scored
            at once; gscorecam scores only its top-k channels.
        image: the image the trace was made from (the trace keeps only a uint8 display copy); its model input
            must hash to the trace's ``input_sha256``.
        batch_size: channels per forward pass.
        device: where to run (default: the model's device).
        progress: show a tqdm bar (default: when there are more than 4 batches).
        targets: the target the trace was made with when it is not class logits (e.g.
            ``vc.targets.region(mask, 3)``); its scores on the traced input must be the trace's.
        fields: recipe fields; for the integrated-gradient rollouts (``layer_fusion`` "transition", "bt_head",
            "bt_token") also ``steps`` (20), for ViT-CX (``weighting="vitcx"``) ``distance_threshold`` (0.1),
            ``noise`` (0.1) and ``seed`` (0) (see :mod:`vitcam_nb.capture.integrated`, :mod:`~.vitcx`).

    Example:
        >>> import numpy as np, timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> img = np.zeros((32, 32, 3), np.uint8)
        >>> tr = vc.score(vc.trace(m, img, targets="top1"), m, vc.Recipe(weighting="ablationcam"), img)
        >>> vc.cam(tr, vc.Recipe(weighting="ablationcam")).shape
        (32, 32)
    """
    from vitcam_nb.core.progress import progress_bar as tqdm

    refuse_unscorable(trace)
    if not isinstance(model, torch.nn.Module):
        raise ArgumentTypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    scorer = loop_scorer(recipes_or_method, fields)
    if scorer is not None:  # integrated gradients (TAM, Beyond Intuition) and ViT-CX: capture.integrated
        return scorer(trace, model, image, batch_size=batch_size, device=device, progress=progress, targets=targets)
    recipes = _recipes(recipes_or_method, fields)
    adapter = find_adapter(model)
    if image is None:
        raise TraceError("image: vc.score needs the image the trace was made from (the trace keeps only a uint8 "
                         "display copy of the model input)")
    x = prepare_input(model, image).tensor
    _check(trace, model, adapter, x, batch_size)
    target = _target(trace, targets)
    jobs = _plan(trace, recipes)
    if not jobs:  # everything asked for is scored already: no model call
        return trace
    run_device = torch.device(device) if device is not None else next(model.parameters()).device
    classes = [int(c) for c in trace["target_class"].values]
    size = (int(x.shape[-2]), int(x.shape[-1]))
    out = {var: (trace[var].values.astype(np.float32) if var in trace.variables else
                 np.full([trace.sizes[d] for d in VARIABLES[var].dims], np.nan, np.float32))
           for var in SCORE_VARIABLES}
    layer_pos = {int(v): i for i, v in enumerate(trace["layer"].values)}
    site_pos = {str(s): i for i, s in enumerate(trace["site"].values)}
    n_batches = sum(-(-len(ch) // batch_size) for ch in jobs.values())
    show = n_batches > 4 if progress is None else bool(progress)
    with on_device(model, run_device), eval_mode(model), adapter.tracing(TraceContext(model)), torch.no_grad(), \
            tqdm(total=n_batches, desc="vc.score", disable=not show) as bar:
        xd = x.to(run_device, next(model.parameters()).dtype)
        # One forward of the unperturbed input, every target kind: the hashes do not fix the model's behaviour.
        _check_scores(target, model, xd, trace)
        for (layer, site, var), wanted in jobs.items():
            channels = sorted(wanted)
            masks = _masks(trace, layer, site, size, channels).to(run_device, xd.dtype) if var == "score" else None
            for start in range(0, len(channels), batch_size):
                rows = channels[start:start + batch_size]
                if var == "score":
                    z = target.batch_scores(model, xd * masks[start:start + batch_size, None])
                else:
                    with _ablating(model, adapter, layer, site, rows):
                        z = target.batch_scores(model, xd.expand(len(rows), *xd.shape[1:]))
                per_target, lse = _target_scores(z, classes)
                out[var][layer_pos[layer], site_pos[site], :, rows] = per_target.cpu().numpy()
                out[f"{var}_logsumexp"][layer_pos[layer], site_pos[site], rows] = lse.cpu().numpy()
                bar.update(1)
    dims = {var: VARIABLES[var].dims for var in SCORE_VARIABLES}
    return trace.assign({var: (dims[var], out[var], {"meaning": VARIABLES[var].meaning}) for var in SCORE_VARIABLES
                         if var in trace.variables or np.isfinite(out[var]).any()})
