"""Randomisation checks after Hedström et al. (2023/2024): smooth MPRT (the model-parameter randomisation test on
maps denoised by averaging over noisy copies of the input) and efficient MPRT (the rise in the map's complexity when
every part of the model is randomised, one comparison instead of one per part).

Both re-initialise parts of a deep copy of the model with
:func:`~vitcam_nb.evaluate.randomisation.parameters.randomise_parts`
(``init="reset"`` is Quantus's scheme) and trace each copy again; maps are compared on the token grid. The class is
fixed to the one the recipe selects on the original model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import xarray as xr

from vitcam_nb.capture.trace import trace
from vitcam_nb.core.errors import ArgumentError, RecipeError
from vitcam_nb.evaluate._common import grid_map, nan_because, warn
from vitcam_nb.evaluate.agreement.metrics import agreement_functions
from vitcam_nb.evaluate.faithfulness.perturbation import model_input
from vitcam_nb.evaluate.faithfulness.removal import check_count
from vitcam_nb.evaluate.randomisation.parameters import model_parts, randomise_parts

__all__ = ["discrete_entropy", "efficient_mprt", "smooth_mprt"]


def _class_and_recipe(model: torch.nn.Module, x: torch.Tensor, recipe: object, kw: dict) -> tuple[int, object]:
    cls_request = recipe.class_
    if isinstance(cls_request, int):
        cls = int(cls_request)
    else:
        with torch.no_grad():
            modes = [(m, m.training) for m in model.modules()]
            model.eval()
            try:
                logits = model(x).float()[0]
            finally:
                for m, mode in modes:
                    m.training = mode
        cls = int(torch.argsort(logits, descending=True, stable=True)[int(cls_request[3:]) - 1])
    try:
        return cls, recipe.replace(class_=cls)
    except RecipeError:  # attention rollout takes no class
        return cls, recipe


def _map(model: torch.nn.Module, inputs: Sequence[torch.Tensor], recipe: object, cls: int, kw: dict) -> np.ndarray:
    maps = [np.asarray(grid_map(trace(model, xi[0], targets=[cls], **kw), recipe).values, np.float64)
            for xi in inputs]
    return np.mean(maps, axis=0)


def _check(seed: object, parts: Sequence[str] | None, model: torch.nn.Module) -> list[str]:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ArgumentError(f"seed: expected a non-negative int, got {seed!r}")
    available = [name for name, _ in model_parts(model)]
    order = list(available) if parts is None else list(parts)
    if not order or any(p not in available for p in order):
        raise ArgumentError(f"parts: expected a non-empty list from {available}, got {parts!r}")
    return order


def smooth_mprt(
    model: torch.nn.Module,
    image: object,
    recipe: object,
    mode: str = "cascading",
    *,
    n_samples: int = 50,
    noise: float = 0.1,
    seed: int = 0,
    metrics: Sequence[str | Callable[..., float]] = ("spearman",),
    init: str = "matched",
    parts: Sequence[str] | None = None,
    trace_kwargs: dict | None = None,
    progress: bool | None = None,
) -> xr.DataArray:
    """Smooth MPRT (Hedström et al. 2023): the model-parameter randomisation test on maps averaged over
    ``n_samples`` noisy copies of the input, for the original model and each randomised one.

    The copies are the model input plus Gaussian noise of std ``noise * (max - min)`` of the input, drawn from
    ``numpy.random.default_rng(seed)``; the last copy is the clean input (Quantus's convention). The same copies
    serve every model state (a paired comparison).

    Args:
        model, image, recipe, mode, init, parts, trace_kwargs: as in
            :func:`vitcam_nb.evaluate.model_randomisation` (``image`` as in :func:`vitcam_nb.evaluate.model_input`;
            a trace made with other weights is refused).
        n_samples: noisy copies per model state, 1..1000 (1 = the plain MPRT). noise: relative noise level >= 0.
        seed: seed of the noise and of the re-initialisation. metrics: agreement metrics (names or callables).
        progress: progress bar over the model states (None: shown for more than 8 parts).

    Returns:
        DataArray ``(layer, metric)`` as model_randomisation's; attrs hold the settings and ``value`` (the mean
        similarity over the layers, lower = the map depends more on the parameters).

    Example:
        >>> import timm, vitcam_nb as vc
        >>> _ = torch.manual_seed(0)
        >>> m = timm.create_model("vit_tiny_patch16_224", depth=1, img_size=32, num_classes=3)
        >>> x = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(1))
        >>> r = smooth_mprt(m, x, vc.Recipe(layer=0, class_=0), n_samples=2, trace_kwargs={"sites": ["F1"]})
        >>> r["layer"].values.tolist()
        ['head', 'blocks.0', 'embed']
    """
    from vitcam_nb.core.progress import progress_bar as tqdm

    if mode not in ("cascading", "independent"):
        raise ArgumentError(f"mode: expected 'cascading' or 'independent', got {mode!r}")
    n_samples = check_count("n_samples", n_samples, 1, 1000)
    if not (np.isfinite(noise) and noise >= 0):
        raise ArgumentError(f"noise: expected a non-negative number, got {noise!r}")
    order = _check(seed, parts, model)
    fns = agreement_functions(metrics)
    kw = {k: v for k, v in (trace_kwargs or {}).items() if k != "targets"}
    x, _ = model_input(model, image)
    std = float(noise) * float(x.max() - x.min())
    rng = np.random.default_rng(seed)
    inputs = [x + torch.from_numpy(rng.standard_normal(tuple(x.shape)).astype(np.float32)) * std
              for _ in range(n_samples - 1)] + [x]
    cls, fixed = _class_and_recipe(model, x, recipe, kw)
    ref = _map(model, inputs, fixed, cls, kw)
    if np.ptp(ref) == 0:
        raise ArgumentError("recipe: the smoothed map on the original model is constant; a randomisation test needs a "
                            "map that carries information")
    rows = []
    show = len(order) > 8 if progress is None else bool(progress)
    for i, part in enumerate(tqdm(order, desc=f"smooth MPRT ({mode})", disable=not show, leave=False)):
        chosen = order[: i + 1] if mode == "cascading" else [part]
        other = _map(randomise_parts(model, chosen, seed=seed, init=init), inputs, fixed, cls, kw)
        if np.ptp(other) == 0:
            warn(f"smooth_mprt: the smoothed map after randomising {part} is constant; its similarities are NaN")
            rows.append([float("nan")] * len(fns))
        else:
            rows.append([float(fn(ref, other)) for _, fn in fns])
    values = np.array(rows, dtype=np.float64)
    return xr.DataArray(
        values, dims=("layer", "metric"), coords={"layer": order, "metric": [n for n, _ in fns]},
        name="similarity",
        attrs={"test": "smooth model parameter randomisation (Hedstrom et al. 2023)", "mode": mode,
               "seed": int(seed), "init": init, "n_samples": n_samples, "noise": float(noise), "noise_std": std,
               "recipe": fixed.to_json(), "recipe_id": fixed.id, "target_class": cls,
               "grid": "token grid (upsample='none')", "value": float(np.nanmean(values[:, 0]))
               if np.isfinite(values[:, 0]).any() else float("nan")},
    )



def discrete_entropy(values: object, n_bins: int = 100) -> float:
    """Shannon entropy (nats) of the histogram of ``values`` in ``n_bins`` equal bins over their range.

    Example:
        >>> round(discrete_entropy([0.0, 1.0], n_bins=2), 6)
        0.693147
    """
    counts, _ = np.histogram(np.asarray(values, dtype=np.float64).ravel(), bins=n_bins)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def efficient_mprt(
    model: torch.nn.Module,
    image: object,
    recipe: object,
    *,
    n_bins: int = 100,
    seed: int = 0,
    init: str = "matched",
    parts: Sequence[str] | None = None,
    trace_kwargs: dict | None = None,
) -> xr.DataArray:
    """Efficient MPRT (Hedström et al. 2024): the relative rise of the map's discrete entropy when all ``parts``
    (default every part) of the model are randomised at once: ``(H(random) - H(original)) / H(original)``
    (higher = the map depends more on what the model learned).

    Args:
        n_bins: histogram bins of :func:`discrete_entropy`, 2..10000. Others as in :func:`smooth_mprt`.

    Returns:
        0-d DataArray holding the score; attrs ``value``, ``entropy_original``,
        ``entropy_randomised`` and the settings. NaN with a MetricWarning when the original map's entropy is 0.

    Example:
        >>> import timm, vitcam_nb as vc
        >>> _ = torch.manual_seed(0)
        >>> m = timm.create_model("vit_tiny_patch16_224", depth=1, img_size=32, num_classes=3)
        >>> r = efficient_mprt(m, torch.rand(3, 32, 32), vc.Recipe(layer=0, class_=0), trace_kwargs={"sites": ["F1"]})
        >>> sorted(k for k in r.attrs if k.startswith("entropy"))
        ['entropy_original', 'entropy_randomised']
    """
    n_bins = check_count("n_bins", n_bins, 2, 10_000)
    order = _check(seed, parts, model)
    kw = {k: v for k, v in (trace_kwargs or {}).items() if k != "targets"}
    x, _ = model_input(model, image)
    cls, fixed = _class_and_recipe(model, x, recipe, kw)
    h0 = discrete_entropy(_map(model, [x], fixed, cls, kw), n_bins)
    h1 = discrete_entropy(_map(randomise_parts(model, order, seed=seed, init=init), [x], fixed, cls, kw), n_bins)
    if h0 == 0.0:
        value = nan_because("efficient_mprt", "the original map is constant (entropy 0); a relative rise is undefined")
    else:
        value = (h1 - h0) / h0
    return xr.DataArray(value, name="efficient_mprt", attrs={
        "test": "efficient model parameter randomisation (Hedstrom et al. 2024)", "value": value,
        "entropy_original": h0, "entropy_randomised": h1, "n_bins": n_bins, "seed": int(seed), "init": init,
        "parts": ",".join(order), "recipe": fixed.to_json(), "recipe_id": fixed.id, "target_class": cls,
        "grid": "token grid (upsample='none')"})
