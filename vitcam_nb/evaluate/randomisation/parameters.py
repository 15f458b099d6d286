"""Sanity checks (Adebayo et al. 2018): a map that survives the destruction of what the model learned,
or that does not change with the class, explains nothing about the model.

* :func:`model_randomisation` re-initialises the model's parameters part by part, from the top (the
  classifier head, then the last block down to the first, then the patch and position embeddings),
  on a deep copy: *cascading* (each step adds the next part) or *independent* (one part at a time).
  Each randomised copy is traced again and the map compared with the original's on the token grid.
* :func:`randomised_logit` compares the map of the predicted class with the map of another class.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Sequence

import numpy as np
import torch
import xarray as xr

from vitcam_nb.capture.trace import trace
from vitcam_nb.core.errors import ArgumentError, RecipeError
from vitcam_nb.evaluate._common import grid_map, warn
from vitcam_nb.evaluate.agreement.metrics import agreement_functions

__all__ = ["model_parts", "model_randomisation", "plot_randomisation", "randomise_parts", "randomised_logit"]

_HEAD_PREFIXES = ("norm.", "fc_norm.", "head.", "head_dist.", "attn_pool.", "head_drop.")
_EMBED_PREFIXES = ("patch_embed.", "cls_token", "dist_token", "reg_token", "pos_embed", "norm_pre.")
_INITS = ("matched", "timm", "reset")


def model_parts(model: torch.nn.Module) -> list[tuple[str, list[str]]]:
    """The model's parameters grouped into parts, from the top: ``head`` (final norm and classifier),
    ``blocks.L-1`` ... ``blocks.0``, ``embed`` (patch and position embeddings, prefix tokens).

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", depth=2)
        >>> [name for name, _ in model_parts(m)]
        ['head', 'blocks.1', 'blocks.0', 'embed']
    """
    names = [n for n, _ in model.named_parameters()]
    blocks = sorted({int(m.group(1)) for n in names if (m := re.match(r"blocks\.(\d+)\.", n))}, reverse=True)
    parts = [("head", [n for n in names if n.startswith(_HEAD_PREFIXES)])]
    parts += [(f"blocks.{i}", [n for n in names if n.startswith(f"blocks.{i}.")]) for i in blocks]
    parts.append(("embed", [n for n in names if n.startswith(_EMBED_PREFIXES)]))
    return [(name, params) for name, params in parts if params]


def randomise_parts(
    model: torch.nn.Module, parts: Sequence[str], seed: int = 0, init: str = "matched"
) -> torch.nn.Module:
    """A deep copy of ``model`` with the parameters of ``parts`` (names from :func:`model_parts`)
    re-initialised; the given model is never modified.

    ``init="matched"``: each tensor is redrawn from a Gaussian with that tensor's own mean and std, so
    activations keep their trained scale while the learned structure is destroyed (a block re-drawn at
    timm's init scale, std 0.02, is nearly an identity on the residual stream and would hide the
    effect). ``init="timm"``: timm's initialisation (truncated normal std 0.02 for weights and tokens,
    zeros for biases, ones for norm weights). Part ``i`` always gets the same draws (seeded by
    ``seed`` and the part's name), so cascading and independent randomisation use the same values.
    ``init="reset"``: Quantus's scheme — every module of the parts that has ``reset_parameters`` (Linear,
    Conv2d, LayerNorm) calls it right after ``torch.manual_seed(seed + 1)``; parameters outside such modules
    (class token, position embedding) are kept. The caller's global torch generator is left as it was.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", depth=2)
        >>> r = randomise_parts(m, ["head"])
        >>> bool((r.head.weight != m.head.weight).any()), r is m
        (True, False)
    """
    if init not in _INITS:
        raise ArgumentError(f"init: expected one of {list(_INITS)}, got {init!r}")
    table = dict(model_parts(model))
    unknown = [p for p in parts if p not in table]
    if unknown:
        raise ArgumentError(f"parts: unknown part(s) {unknown}; this model has {list(table)}")
    out = copy.deepcopy(model)
    if init == "reset":
        chosen = {name for part in parts for name in table[part]}
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for prefix, module in out.named_modules():
                own = [f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters(recurse=False)]
                if hasattr(module, "reset_parameters") and own and set(own) <= chosen:
                    torch.manual_seed(int(seed) + 1)
                    module.reset_parameters()
        return out
    params = dict(out.named_parameters())
    with torch.no_grad():
        for part in parts:
            g = torch.Generator().manual_seed(int(seed) * 1_000_003 + _stable_hash(part))
            for name in table[part]:
                p = params[name]
                noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
                if init == "matched":
                    flat = p.detach().float().reshape(-1)
                    std = float(flat.std()) if flat.numel() > 1 else 0.0
                    value = float(flat.mean()) + (std if std > 0 else 0.02) * noise
                else:
                    leaf = name.rsplit(".", 1)[-1]
                    if leaf == "bias":
                        value = torch.zeros(p.shape)
                    elif p.ndim == 1 and leaf == "weight":
                        value = torch.ones(p.shape)
                    else:
                        value = 0.02 * noise.clamp(-2.0, 2.0)
                p.copy_(value.to(p.dtype))
    return out


def _stable_hash(text: str) -> int:
    return int.from_bytes(text.encode()[:8].ljust(8, b"\0"), "little") % 1_000_003 + len(text)



def _fix_class(recipe: object, cls: int) -> object:
    try:
        return recipe.replace(class_=cls)
    except RecipeError:  # attention rollout takes no class
        return recipe


def _similarities(ref: xr.DataArray, other: xr.DataArray, metrics: list, label: str) -> list[float]:
    if other.attrs.get("degenerate"):
        warn(f"model_randomisation: the map after randomising {label} is degenerate "
             f"({other.attrs['degenerate']}); its similarities are NaN")
        return [float("nan")] * len(metrics)
    return [float(fn(ref, other)) for _, fn in metrics]


def model_randomisation(
    model: torch.nn.Module,
    image: object,
    recipe: object,
    mode: str = "cascading",
    *,
    seed: int = 0,
    metrics: Sequence[str | Callable[..., float]] = ("spearman", "ssim"),
    init: str = "matched",
    parts: Sequence[str] | None = None,
    trace_kwargs: dict | None = None,
    return_maps: bool = False,
    progress: bool | None = None,
) -> xr.DataArray | tuple[xr.DataArray, xr.DataArray]:
    """Model-parameter randomisation test: similarity of each randomised model's map to the original.

    The class is fixed to the one ``recipe`` selects on the original model (so ``top1`` does not follow
    the randomised model's prediction). Maps are compared on the token grid. The user's model is never
    modified: each randomised model is a deep copy (:func:`randomise_parts`).

    Args:
        model: a timm ViT (anything ``vc.trace`` accepts).
        image: what ``vc.trace`` accepts.
        recipe: the variant under test.
        mode: ``"cascading"`` (randomise from the top, cumulatively) or ``"independent"`` (one part).
        seed, init: see :func:`randomise_parts`.
        metrics: agreement metrics (names or callables), default Spearman and SSIM.
        parts: which parts, in order (default all of :func:`model_parts`, top first).
        trace_kwargs: extra arguments to ``vc.trace`` (e.g. ``sites=["F1"]`` to trace less).
        return_maps: also return the maps, ``(layer, patch_row, patch_col)`` with "original" first.
        progress: progress bar over the parts (None: shown for more than 8 parts).

    Returns:
        DataArray ``(layer, metric)``: ``layer`` names the part randomised last (cascading) or alone
        (independent), with coordinates ``n_randomised`` and ``degenerate``; attrs hold the settings.

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", depth=2)
        >>> img = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)
        >>> sim = model_randomisation(m, img, vc.Recipe(layer=0), trace_kwargs={"sites": ["F1"]})
        >>> sim["layer"].values.tolist(), sim.dims
        (['head', 'blocks.1', 'blocks.0', 'embed'], ('layer', 'metric'))
    """
    from vitcam_nb.core.progress import progress_bar as tqdm

    if mode not in ("cascading", "independent"):
        raise ArgumentError(f"mode: expected 'cascading' or 'independent', got {mode!r}")
    fns = agreement_functions(metrics)
    available = [name for name, _ in model_parts(model)]
    order = list(available) if parts is None else list(parts)
    unknown = [p for p in order if p not in available]
    if unknown or not order:
        raise ArgumentError(f"parts: expected a non-empty list from {available}, got {parts!r}")
    kw = dict(trace_kwargs or {})
    kw.pop("targets", None)
    cls_request = recipe.class_
    first_targets = [cls_request] if isinstance(cls_request, int) else f"top{int(cls_request[3:])}"
    tr0 = trace(model, image, targets=first_targets, **kw)
    logits = tr0["logits"].values
    cls = int(cls_request) if isinstance(cls_request, int) else int(np.argsort(-logits, kind="stable")[
        int(cls_request[3:]) - 1])
    fixed = _fix_class(recipe, cls)
    ref = grid_map(tr0, fixed)
    if ref.attrs.get("degenerate"):
        raise ArgumentError(f"recipe: the map on the original model is degenerate ({ref.attrs['degenerate']}); "
                            "a randomisation test needs a map that carries information")
    rows, maps, labels, counts, reasons = [], [ref], [], [], []
    show = len(order) > 8 if progress is None else bool(progress)
    for i, part in enumerate(tqdm(order, desc=f"{mode} randomisation", disable=not show, leave=False)):
        chosen = order[: i + 1] if mode == "cascading" else [part]
        rand = randomise_parts(model, chosen, seed=seed, init=init)
        m = grid_map(trace(rand, image, targets=[cls], **kw), fixed)
        del rand
        rows.append(_similarities(ref, m, fns, part))
        maps.append(m)
        labels.append(part)
        counts.append(len(chosen))
        reasons.append(str(m.attrs.get("degenerate", "")))
    names = [n for n, _ in fns]
    sim = xr.DataArray(
        np.array(rows, dtype=np.float64), dims=("layer", "metric"),
        coords={"layer": labels, "metric": names, "n_randomised": ("layer", counts),
                "degenerate": ("layer", reasons)},
        name="similarity",
        attrs={"test": "model parameter randomisation (Adebayo et al. 2018)", "mode": mode, "seed": int(seed),
               "init": init, "recipe": fixed.to_json(), "recipe_id": fixed.id, "target_class": cls,
               "grid": "token grid (upsample='none')", "trace_id": str(tr0.attrs.get("trace_id", "")),
               "parts": json.dumps({p: n for p, n in model_parts(model) if p in order})},
    )
    if not return_maps:
        return sim
    dims = ref.dims
    stack = xr.DataArray(np.stack([np.asarray(m.values) for m in maps]), dims=("layer", *dims),
                         coords={"layer": ["original", *labels], **{d: ref[d].values for d in dims}},
                         name="cam", attrs={"recipe": fixed.to_json(), "mode": mode})
    return sim, stack


def plot_randomisation(sim: xr.DataArray, maps: xr.DataArray | None = None):
    """Similarity to the original map per randomised part (one line per metric); with ``maps`` (from
    ``return_maps=True``) a row of the maps above.

    Example:
        >>> sim = xr.DataArray([[0.9], [0.2]], dims=("layer", "metric"),
        ...                    coords={"layer": ["head", "blocks.0"], "metric": ["spearman"]})
        >>> fig = plot_randomisation(sim)
    """
    import matplotlib.pyplot as plt

    if not isinstance(sim, xr.DataArray) or set(sim.dims) != {"layer", "metric"}:
        raise ArgumentError("sim: expected the (layer, metric) DataArray of model_randomisation")
    labels = [str(v) for v in sim["layer"].values]
    n = len(labels)
    if maps is not None:
        fig = plt.figure(figsize=(max(6.0, 1.1 * (n + 1)), 5.2), constrained_layout=True)
        grid = fig.add_gridspec(2, n + 1, height_ratios=[1, 2.2])
        for i, name in enumerate(maps["layer"].values):
            ax = fig.add_subplot(grid[0, i])
            ax.imshow(maps.sel(layer=name).values, cmap="inferno")
            ax.set_title(str(name), fontsize=7)
            ax.axis("off")
        ax = fig.add_subplot(grid[1, :])
    else:
        fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * n + 2), 3.4), constrained_layout=True)
    for metric in sim["metric"].values:
        ax.plot(range(n), sim.sel(metric=metric).values, marker="o", label=str(metric))
    ax.axhline(0.0, color="0.6", lw=0.8)
    ax.set_xticks(range(n), labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylim(-1.05, 1.05)
    ax.set_ylabel("similarity to the original map")
    mode = sim.attrs.get("mode", "")
    ax.set_xlabel(("randomised down to" if mode == "cascading" else "randomised part") if mode else "part")
    ax.set_title(f"model randomisation ({mode})" if mode else "model randomisation", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def randomised_logit(
    tr: xr.Dataset,
    recipe: object,
    other: int | None = None,
    *,
    seed: int = 0,
    metrics: Sequence[str | Callable[..., float]] = ("spearman", "ssim"),
) -> xr.DataArray:
    """Randomised-logit check: similarity of the predicted class's map to another class's map.

    A class-sensitive explanation should differ (low similarity). ``other`` defaults to a class drawn
    (seeded) from the other traced classes, so trace with ``targets=[pred, other]`` or ``"top5"``. Maps
    are compared on the token grid.

    Returns:
        DataArray over ``metric``; attrs ``predicted``, ``other`` and the settings.

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> img = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)
        >>> tr = vc.trace(timm.create_model("vit_tiny_patch16_224"), img)
        >>> randomised_logit(tr, vc.Recipe(layer=0)).dims
        ('metric',)
    """
    if recipe.layer_fusion == "rollout":
        raise ArgumentError("recipe: attention rollout does not depend on the class; the check does not apply")
    fns = agreement_functions(metrics)
    pred = int(np.argmax(tr["logits"].values))
    traced = [int(c) for c in tr["target_class"].values if int(c) >= 0]
    if pred not in traced:
        raise ArgumentError(f"tr: the predicted class {pred} was not traced (traced {traced}); trace with "
                            f"targets=[{pred}, other]")
    candidates = [c for c in traced if c != pred]
    if other is None:
        if not candidates:
            raise ArgumentError(f"tr: the trace holds no class other than the predicted {pred}; trace with "
                                f"targets=[{pred}, other] or targets='top5'")
        other = int(candidates[np.random.default_rng(seed).integers(len(candidates))])
    elif other not in candidates:
        raise ArgumentError(f"other: class {other!r} is not a traced class other than the predicted {pred} "
                            f"(traced {traced})")
    a = grid_map(tr, recipe.replace(class_=pred))
    b = grid_map(tr, recipe.replace(class_=int(other)))
    values = []
    for name, fn in fns:
        bad = [f"class {c}: {m.attrs['degenerate']}" for c, m in ((pred, a), (other, b))
               if m.attrs.get("degenerate")]
        if bad:
            warn(f"randomised_logit: {name} is NaN because a map is degenerate ({'; '.join(bad)})")
            values.append(float("nan"))
        else:
            values.append(float(fn(a, b)))
    return xr.DataArray(
        np.array(values), dims=("metric",), coords={"metric": [n for n, _ in fns]}, name="similarity",
        attrs={"test": "randomised logit (predicted class vs another class)", "predicted": pred,
               "other": int(other), "seed": int(seed), "recipe": recipe.to_json(), "recipe_id": recipe.id,
               "grid": "token grid (upsample='none')", "trace_id": str(tr.attrs.get("trace_id", ""))},
    )
