"""The token activation map's formula (TAM; Li, Wang, Ding, Wang & Li, ICCV 2025, arXiv:2506.23270) on plain
arrays: the estimated causal inference that removes the context's interference from an answer token's activation
map, the joint normalisation with the text context, and the rank Gaussian filter. :mod:`vitcam_nb.compute.tam`
applies it to a trace's ``lm_logit`` site.

Written from the authors' public code (github.com/xmed-lab/TAM, ``tam.py``: ``TAM``, ``least_squares``,
``rank_guassian_filter``, ``multimodal_process``), whose steps the paper's abstract and figure caption name; the
paper's method section itself could not be read here. For answer token k of class ``c_k``:

1. activations: ``M_s = relu(z_s)`` over the image tokens for each slot s (``z_s`` the LM head's logit of slot s's
   token at each image position, the "logit lens" of the last hidden state), ``t_k = relu(y_k)`` over the slots
   (``y_k[s]`` the logit of ``c_k`` at slot s's position);
2. estimated causal inference: over the context slots s before k whose token differs from ``c_k``,
   ``w = t_k[s] / (sum_s t_k[s] + 1e-8)``, the interference ``I = sum_s w_s M_s``, the least-squares scale
   ``lambda = argmin_x |M_k - x I|^2 = <M_k, I> / <I, I>`` (0 where ``I = 0``), and ``relu(M_k - lambda I)``;
3. the image scores and the context's text scores (every slot before k, repeated tokens included) min-maxed
   together;
4. the image scores on the image-token grid, through the rank Gaussian filter (3x3, reflected borders): each
   window's values sorted, weighted by a Gaussian over their rank offsets ``-4..4`` whose sigma is the window's
   coefficient of variation ``std / mean`` (0 where the window's mean is not positive).

Example:
    >>> eci_scale(np.array([2.0, 4.0]), np.array([1.0, 2.0]))
    2.0
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError

__all__ = ["ECI_EPS", "FILTER_SIZE", "eci_scale", "rank_gaussian_filter", "tam_scores"]

#: Added to the sum of the context weights before dividing, as the authors' code does.
ECI_EPS = 1e-8
#: The rank Gaussian filter's window (the authors' code calls it with 3).
FILTER_SIZE = 3


def rank_gaussian_filter(grid: np.ndarray, size: int = FILTER_SIZE) -> np.ndarray:
    """TAM's rank Gaussian filter of a 2-D map (float64 out): per pixel, the ``size x size`` window (borders
    reflected without repeating the edge, numpy's ``"reflect"``) sorted ascending and averaged with the weights
    ``exp(-r^2 / (2 sigma^2))`` (normalised to sum 1) over the rank offsets ``r = -(n//2)..n//2`` (``n = size^2``),
    ``sigma = std / mean`` of the window (population std); 0 where the window's mean is not positive. A constant
    positive window (``sigma = 0``) gives its value, the limit of the weights as sigma goes to 0 (the authors' code
    divides by zero there and returns NaN).

    Example:
        >>> rank_gaussian_filter(np.full((3, 3), 2.0)).tolist()[1]
        [2.0, 2.0, 2.0]
        >>> float(rank_gaussian_filter(np.zeros((2, 2)))[0, 0])
        0.0
    """
    if not isinstance(grid, np.ndarray) or grid.ndim != 2:
        raise ArgumentTypeError(f"grid: expected a 2-D numpy array, got {type(grid).__name__}"
                                f"{' of shape ' + str(grid.shape) if isinstance(grid, np.ndarray) else ''}")
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1 or size % 2 == 0:
        raise ArgumentError(f"size: the filter's window is an odd int >= 1, got {size!r}")
    half = size // 2
    if half and min(grid.shape) <= half:
        raise ArgumentError(f"grid: a {size}x{size} window reflects {half} cell(s) at each border, so the grid needs "
                            f"more than {half} cell(s) per side; got {grid.shape}")
    if not np.isfinite(grid).all():
        raise ArgumentError("grid: the map holds NaN or infinite values")
    padded = np.pad(grid.astype(np.float64), half, mode="reflect")
    windows = np.sort(sliding_window_view(padded, (size, size)).reshape(*grid.shape, size * size), axis=-1)
    mean = windows.mean(-1)
    std = windows.std(-1)
    ranks = np.arange(size * size, dtype=np.float64) - (size * size) // 2
    with np.errstate(divide="ignore", invalid="ignore"):
        sigma = np.where(mean > 0, std / np.where(mean > 0, mean, 1.0), 1.0)
    out = np.zeros(grid.shape, np.float64)
    flat = sigma == 0  # a constant positive window: all the weight on the middle rank
    spread = (mean > 0) & ~flat
    if spread.any():
        kernel = np.exp(-(ranks ** 2) / (2.0 * sigma[spread][:, None] ** 2))
        kernel /= kernel.sum(-1, keepdims=True)
        out[spread] = (windows[spread] * kernel).sum(-1)
    middle = (mean > 0) & flat
    out[middle] = windows[middle][:, (size * size) // 2]
    return out


def eci_scale(target: np.ndarray, interference: np.ndarray) -> float:
    """The least-squares scale ``argmin_x sum (target - x * interference)^2 = <target, I> / <I, I>`` (0 where the
    interference is all zero: then every x fits equally), what the authors' ``least_squares`` finds numerically.

    Example:
        >>> eci_scale(np.array([1.0, 0.0]), np.zeros(2))
        0.0
    """
    t, i = np.asarray(target, np.float64), np.asarray(interference, np.float64)
    denom = float(i @ i)
    return float(t @ i) / denom if denom > 0 else 0.0


def tam_scores(image_logit: np.ndarray, text_logit: np.ndarray, slot_class: np.ndarray, n_prompt: int, token: int
               ) -> tuple[np.ndarray, dict[str, object]]:
    """Steps 1-3 for answer token ``token``: its image scores after the estimated causal inference, min-maxed
    jointly with its context's text scores (image tokens' order), and what was done (``lambda``, the context
    slots weighed, those left out as repeats of the token, ``constant``: the joint min-max had no range, the
    scores are then zeros).

    ``image_logit`` (slot, image token): each slot's class logit over the image tokens; ``text_logit`` (answer
    token, slot): each answer token's class logit at the slots; ``slot_class``: each slot's token id; slots
    ``0..n_prompt-1`` are the prompt's, slot ``n_prompt + m`` answer token m's.

    Example:
        >>> img = np.array([[1.0, 0.0], [0.5, 2.0]])  # a prompt slot, then the answer's one slot
        >>> s, info = tam_scores(img, np.array([[3.0, 9.0]]), np.array([4, 7]), 1, 0)
        >>> round(info["lambda"], 6), s.round(3).tolist()  # I = [1, 0]: lambda = 0.5; the joint max is t = 3
        (0.5, [0.0, 0.667])
    """
    image_logit, text_logit = np.asarray(image_logit, np.float64), np.asarray(text_logit, np.float64)
    slot_class = np.asarray(slot_class)
    n_answer = text_logit.shape[0]
    if image_logit.ndim != 2 or text_logit.ndim != 2 or image_logit.shape[0] != text_logit.shape[1] \
            or slot_class.shape != (image_logit.shape[0],) or image_logit.shape[0] != n_prompt + n_answer:
        raise ArgumentError(f"image_logit, text_logit, slot_class: shapes {image_logit.shape}, {text_logit.shape}, "
                            f"{slot_class.shape} do not describe {n_prompt} prompt slots and {n_answer} answer "
                            "slots")
    if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < n_answer:
        raise ArgumentError(f"token: an answer-token index in 0..{n_answer - 1}, got {token!r}")
    own = n_prompt + int(token)
    maps = np.maximum(image_logit, 0.0)
    text = np.maximum(text_logit[token, :own + 1], 0.0)
    scores = maps[own]
    context = np.arange(own)
    kept = context[slot_class[context] != slot_class[own]]
    scale = 0.0
    if kept.size:
        w = text[kept] / (text[kept].sum() + ECI_EPS)
        interference = (maps[kept] * w[:, None]).sum(0)
        scale = eci_scale(scores, interference)
        scores = np.maximum(scores - scale * interference, 0.0)
    joint = np.concatenate([scores, text[:own]])
    low, high = float(joint.min()), float(joint.max())
    constant = not high > low
    out = np.zeros_like(scores) if constant else (scores - low) / (high - low)
    return out, {"lambda": scale, "context": int(own), "weighed": int(kept.size),
                 "repeats": int(own - kept.size), "constant": constant}
