"""ViT-CX (Xie et al., IJCAI 2023) in the loop: the F1 feature maps of one block are clustered into masks and the
masked inputs are scored in batches; the scores are stored in the trace so that ``vc.cam`` computes the map
with no model call.

As in the official code (github.com/vaynexie/CausalX-ViT): every channel's patch map is resized bilinearly to the
input size and min-max normalised; channels are clustered by complete-linkage agglomerative clustering of the
cosine distance ``1 - cos`` with ``distance_threshold`` (0.1); each mask is the sum of its cluster's maps,
min-max normalised. Mask ``M_i`` is scored with Gaussian noise ``n_i`` (std ``noise``, 0.1) on its unmasked
part: ``d_i = p_c(x M_i + n_i (1 - M_i)) - p_c(x + n_i (1 - M_i))``, ``p`` the softmax of the model's scores.
The map is ``sum_i (d_i + p_c(x)) M_i / sum_k M_k / N`` (:func:`vitcx_map`). The masks are a function of the
stored activations, so the trace keeps only each channel's cluster (``vitcx_cluster``) and the ``d_i``
(``vitcx_score``: target, vitcx_mask); the noise is drawn from a generator seeded with ``seed``.

Example:
    >>> feats = np.stack([np.eye(2), np.eye(2), 1 - np.eye(2)]).astype(np.float32)  # (channel, gh, gw)
    >>> masks = channel_masks(feats, (2, 2))
    >>> cluster_labels(masks, 0.1).tolist()
    [0, 0, 1]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import xarray as xr

from vitcam_nb.capture.hooks import eval_mode
from vitcam_nb.capture.runtime import exclusive, on_device
from vitcam_nb.core.errors import ArgumentTypeError, RecipeError, TraceError
from vitcam_nb.core.provenance import array_sha256, check_traced_scores, weights_sha256
from vitcam_nb.core.recipe import Recipe, is_int
from vitcam_nb.core.schema import VARIABLES
from vitcam_nb.preprocess import prepare_input
from vitcam_nb.targets.classes import ClassTargets

__all__ = ["VITCX_OPTIONS", "channel_masks", "cluster_labels", "cluster_masks", "feature_grid", "score_vitcx",
           "vitcx_map"]

#: Keyword arguments of ``vc.score`` that belong to ViT-CX (not recipe fields).
VITCX_OPTIONS = ("distance_threshold", "noise", "seed")


def feature_grid(trace: xr.Dataset, layer: int, site: str) -> np.ndarray:
    """The patch tokens of ``site`` at block ``layer`` as (channel, grid_h, grid_w) float32.

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
        >>> feature_grid(vc.trace(m, np.zeros((32, 32, 3), np.uint8), sites="F1"), 0, "F1").shape
        (192, 4, 4)
    """
    patch = np.flatnonzero(trace["token_kind"].values == "patch")
    gh, gw = int(trace.attrs["grid_h"]), int(trace.attrs["grid_w"])
    act = trace["act"].sel(layer=layer, site=site).values[patch].astype(np.float32)
    grid = np.zeros((act.shape[1], gh, gw), np.float32)
    grid[:, trace["patch_row"].values[patch], trace["patch_col"].values[patch]] = act.T
    return grid


def _minmax_rows(x: torch.Tensor) -> torch.Tensor:
    lo, hi = x.min(dim=1, keepdim=True).values, x.max(dim=1, keepdim=True).values
    return (x - lo) / (hi - lo)  # the official code has no epsilon: a constant map becomes NaN


def channel_masks(grid: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Every channel's map resized bilinearly (half-pixel centres) to ``size`` and min-max normalised:
    (channel, H * W) float64; a constant channel is NaN, as in the official code.

    Example:
        >>> channel_masks(np.arange(4, dtype=np.float32).reshape(1, 2, 2), (2, 2)).tolist()
        [[0.0, 0.3333333333333333, 0.6666666666666666, 1.0]]
    """
    up = F.interpolate(torch.from_numpy(grid)[None].float(), size=size, mode="bilinear", align_corners=False)[0]
    return _minmax_rows(up.reshape(up.shape[0], -1).double()).numpy()


def cluster_labels(masks: np.ndarray, distance_threshold: float) -> np.ndarray:
    """Complete-linkage clusters of the masks under the cosine distance (NaN similarities count as 0), merged
    while the distance is below ``distance_threshold``; clusters numbered in order of their first channel.

    Example:
        >>> cluster_labels(np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]]), 0.1).tolist()
        [0, 0, 1]
    """
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform

    m = torch.from_numpy(masks)
    norms = torch.linalg.norm(m, dim=1)
    similarity = (m @ m.T) / (norms[:, None] * norms[None, :])
    similarity[torch.isnan(similarity)] = 0
    distance = (1 - similarity).numpy()
    np.fill_diagonal(distance, 0)
    if len(masks) == 1:
        return np.zeros(1, np.int64)
    tree = linkage(squareform(np.maximum(distance, 0), checks=False), method="complete")
    # scipy keeps merges at distance <= t; the official clustering merges strictly below the threshold.
    raw = fcluster(tree, np.nextafter(distance_threshold, -np.inf), criterion="distance")
    order = {c: i for i, c in enumerate(dict.fromkeys(raw.tolist()))}
    return np.array([order[c] for c in raw.tolist()], np.int64)


def cluster_masks(masks: np.ndarray, labels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Each cluster's summed masks, min-max normalised: (cluster, H, W) float64 (NaN entries of a constant
    channel make the cluster's mask NaN, as in the official code).

    Example:
        >>> cluster_masks(np.array([[0.0, 1.0], [0.0, 0.5]]), np.array([0, 0]), (1, 2)).tolist()
        [[[0.0, 1.0]]]
    """
    n = int(labels.max()) + 1
    summed = np.zeros((n, masks.shape[1]))
    np.add.at(summed, labels, masks)
    return _minmax_rows(torch.from_numpy(summed)).numpy().reshape(n, *size)


def vitcx_map(masks: np.ndarray, deltas: np.ndarray, p_class: float) -> np.ndarray:
    """``sum_i (d_i + p_c) M_i / sum_k M_k / N`` over the N masks (H, W); 0 where no mask covers a pixel.

    Example:
        >>> vitcx_map(np.array([[[1.0, 0.0]], [[1.0, 1.0]]]), np.array([0.5, -0.5]), 0.5).tolist()
        [[0.25, 0.0]]
    """
    cover = masks.sum(axis=0)
    safe = np.where(cover > 0, cover, 1.0)
    weighted = np.tensordot(deltas + p_class, masks / safe, axes=1)
    return np.where(cover > 0, weighted / len(masks), 0.0)


def _layer(trace: xr.Dataset, recipe: Recipe) -> int:
    n = int(trace.attrs["num_layers"])
    if not is_int(recipe.layer) or not -n <= recipe.layer < n:
        raise RecipeError(f"layer: ViT-CX uses the feature maps of one block (an int -{n}..{n - 1}), got "
                          f"{recipe.layer!r}")
    layer = int(recipe.layer) % n
    if "act" not in trace.variables or recipe.site not in [str(s) for s in trace["site"].values] or \
            layer not in [int(v) for v in trace["layer"].values]:
        raise RecipeError(f"site: ViT-CX needs {recipe.site} at block {layer} in the trace; trace again with "
                          f"sites=[{recipe.site!r}, ...] and that block")
    return layer


def score_vitcx(trace: xr.Dataset, model: torch.nn.Module, recipes: list[Recipe], image: object, *,
                distance_threshold: float = 0.1, noise: float = 0.1, seed: int = 0, batch_size: int = 32,
                device: Any = None, progress: bool | None = None, targets: Any = None) -> xr.Dataset:
    """Cluster the recipe's feature maps into masks, score every mask with noise for every traced class, and
    store ``vitcx_cluster`` and ``vitcx_score``. One block per trace: a second call with other settings replaces it.

    Example:
        >>> import numpy as np, timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
        >>> img = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
        >>> tr = score_vitcx(vc.trace(m, img, targets="top1"), m, [vc.presets.vit_cx()], img)
        >>> tr["vitcx_score"].dims
        ('target', 'vitcx_mask')
    """
    from vitcam_nb.core.progress import progress_bar as tqdm

    if targets is not None:
        raise TraceError("targets: ViT-CX scores the softmax probabilities of the trace's classes; other targets "
                         "are not supported")
    if not isinstance(trace, xr.Dataset) or "image" in trace.dims or "target_class" not in trace.variables:
        raise ArgumentTypeError(f"trace: expected a single-image trace Dataset from vitcam_nb.trace(), got "
                                f"{type(trace).__name__}")
    if len({(r.site, _layer(trace, r)) for r in recipes}) != 1:
        raise RecipeError("recipes_or_method: ViT-CX keeps the masks of one site and block per trace")
    if not is_int(batch_size) or batch_size < 1:
        raise TraceError(f"batch_size: expected an int >= 1 (masked inputs per pass), got {batch_size!r}")
    if not 0 < float(distance_threshold) <= 2 or float(noise) < 0:
        raise TraceError(f"distance_threshold, noise: expected 0 < distance_threshold <= 2 and noise >= 0, got "
                         f"{distance_threshold!r}, {noise!r}")
    if image is None:
        raise TraceError("image: vc.score needs the image the trace was made from")
    site, layer = recipes[0].site, _layer(trace, recipes[0])
    x = prepare_input(model, image).tensor
    if weights_sha256(model) != str(trace.attrs.get("weights_sha256", "")):
        raise TraceError("model: its weights are not those the trace was made with; pass the traced model")
    if array_sha256(x) != str(trace.attrs.get("input_sha256", "")):
        raise TraceError("image: its model input is not the traced input; pass the image the trace was made from")
    if str(trace.attrs.get("target_kind", "class")) != "class":
        raise TraceError("targets: ViT-CX scores class probabilities; this trace's targets are not classes")
    run_device = torch.device(device) if device is not None else next(model.parameters()).device
    with exclusive(model), on_device(model, run_device), eval_mode(model), torch.no_grad():
        xd = x.to(run_device, next(model.parameters()).dtype)
        # Before the clustering and the masked passes: the hashes do not fix the model's behaviour, its logits on
        # the traced input must be the trace's.
        check_traced_scores(trace.attrs, trace["logits"].values, ClassTargets("top1").batch_scores(model, xd)[0],
                            str(run_device), "the ViT-CX scores would belong to another model: ")
        size = (int(x.shape[-2]), int(x.shape[-1]))
        per_channel = channel_masks(feature_grid(trace, layer, site), size)
        labels = cluster_labels(per_channel, float(distance_threshold))
        masks = torch.from_numpy(cluster_masks(per_channel, labels, size)).float()
        n = masks.shape[0]
        generator = torch.Generator().manual_seed(int(seed))
        classes = [int(c) for c in trace["target_class"].values]
        deltas = np.full((len(classes), n), np.nan, np.float32)
        show = bool(progress) if progress is not None else n > 4 * batch_size
        with tqdm(total=-(-n // batch_size), desc="vc.score (ViT-CX)", disable=not show) as bar:
            for start in range(0, n, batch_size):
                m = masks[start:start + batch_size, None].to(run_device, xd.dtype)
                draw = torch.randn((m.shape[0], *xd.shape[1:]), generator=generator).to(run_device, xd.dtype)
                outside = draw * float(noise) * (1 - m)
                probs = torch.softmax(model(torch.cat([xd * m + outside, xd + outside])).double(), dim=1)
                diff = (probs[:m.shape[0]] - probs[m.shape[0]:]).cpu().numpy()
                for j, c in enumerate(classes):
                    if c >= 0:
                        deltas[j, start:start + m.shape[0]] = diff[:, c]
                bar.update(1)
    attrs = {"vitcx_layer": layer, "vitcx_site": site, "distance_threshold": float(distance_threshold),
             "noise": float(noise), "seed": int(seed)}
    clean = trace.drop_vars([v for v in ("vitcx_cluster", "vitcx_score") if v in trace.variables])
    return clean.assign({
        "vitcx_cluster": (VARIABLES["vitcx_cluster"].dims, labels,
                          {"meaning": VARIABLES["vitcx_cluster"].meaning, **attrs}),
        "vitcx_score": (VARIABLES["vitcx_score"].dims, deltas, {"meaning": VARIABLES["vitcx_score"].meaning, **attrs}),
    })
