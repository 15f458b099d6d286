"""Hand-made traces and the direct NumPy reference the tests of ``vc.cam`` (``test_flat_*.py``) compare against.

The reference is written from the formulas of docs/architecture.md ("Recipes and formulas") only; each channel
weighting's formula is its registered ``reference``, written plainly beside (never calling) its kernel in
vitcam_nb/compute/weightings/, so that a new weighting is tested here by registration alone. It runs on small
hand-made Datasets in the trace schema (1 CLS + a 2x3 patch grid, 4 channels, 2 heads of dim 2,
2 layers, sites F1 and F3 + F2) whose values are small quarter-integers, so every expected answer is
computed independently of vitcam_nb's kernels. ``handmade(perm=...)`` stores the very same tokens in a shuffled token
order (CLS included), to prove that maps are placed by ``patch_row``/``patch_col``.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F
import xarray as xr

import vitcam_nb as vc
from vitcam_nb.core.weighting import WEIGHTINGS

# --------------------------------------------------------------------------------------------------
# Hand-made traces

GH, GW, C, NH, NL = 2, 3, 4, 2, 2          # grid, channels, heads (head_dim 2), layers
P = GH * GW
T = 1 + P                                    # CLS + patches
IMG_H, IMG_W = 8, 12                         # 4x upsampling
LOGITS = np.array([0.5, 2.0, -1.0], np.float32)   # top1 = class 1, top2 = class 0; class 2 NOT traced
TRACED = [0, 1]                              # target order: logit_0, logit_1, expected_logit
TOP1_POS, TOP2_POS, E_POS = 1, 0, 2
# A seed whose F2 maps keep positive cells after the ReLU and whose Grad-CAM++ / SVD cases are well posed
# (the reference asserts the latter).
SEED = 30


def handmade(seed: int = SEED, perm: np.ndarray | None = None, *, expected: bool = True,
             zero_patch_grad: tuple[int, str] | None = None) -> xr.Dataset:
    """A trace-schema Dataset built by hand. Canonical token order: CLS, then the raster patch grid.

    ``perm`` (a permutation of the T tokens) stores token ``perm[i]`` at position i, for every variable
    and coordinate: the same trace, another token order. ``zero_patch_grad=(layer, site)`` zeroes every
    target's gradient at that site's patch tokens (what CLS pooling gives at the last block).
    """
    rng = np.random.default_rng(seed)
    n_t = len(TRACED) + (1 if expected else 0)
    # Quarter-integer activations: channel sums over 1, 6 or 7 tokens are never -2/G for integer G, so the
    # Grad-CAM++ denominator G^2 (2 + S G) stays away from 0 and the comparison is well conditioned.
    act = (rng.integers(-3, 4, size=(NL, 2, T, C)) + 0.25).astype(np.float32)
    grad = rng.integers(-3, 4, size=(n_t, NL, 2, T, C)).astype(np.float32)
    attn = rng.random((NL, NH, T, T)) + 0.1
    attn = (attn / attn.sum(-1, keepdims=True)).astype(np.float32)
    attn_grad = (rng.integers(-6, 7, size=(n_t, NL, NH, T, T)) / 2).astype(np.float32)
    if zero_patch_grad is not None:
        layer, site = zero_patch_grad
        if site == "F2":
            attn_grad[:, layer, :, 1:, :] = 0  # only the CLS query row keeps a gradient
        else:
            grad[:, layer, ["F1", "F3"].index(site), 1:, :] = 0
    kinds = np.array(["cls"] + ["patch"] * P)
    rows = np.array([-1] + [r for r in range(GH) for _ in range(GW)])
    cols = np.array([-1] + [c for _ in range(GH) for c in range(GW)])
    if perm is not None:
        act, grad = act[..., perm, :], grad[..., perm, :]
        attn = attn[..., perm, :][..., perm]
        attn_grad = attn_grad[..., perm, :][..., perm]
        kinds, rows, cols = kinds[perm], rows[perm], cols[perm]
    classes = TRACED + ([-1] if expected else [])
    names = [f"logit_{c}" for c in TRACED] + (["expected_logit"] if expected else [])
    coords = {
        "layer": ("layer", np.arange(NL)),
        "site": ("site", np.array(["F1", "F3"])),
        "token": ("token", np.arange(T)),
        "token_kind": ("token", kinds),
        "patch_row": ("token", rows),
        "patch_col": ("token", cols),
        "channel": ("channel", np.arange(C)),
        "head": ("head", np.arange(NH)),
        "target": ("target", np.array(names)),
        "target_class": ("target", np.array(classes)),
        "class": ("class", np.arange(LOGITS.size)),
    }
    for axis in ("query", "key"):
        coords[axis] = (axis, np.arange(T))
        coords[f"{axis}_kind"] = (axis, kinds)
        coords[f"{axis}_patch_row"] = (axis, rows)
        coords[f"{axis}_patch_col"] = (axis, cols)
    data = {
        "act": (("layer", "site", "token", "channel"), act),
        "grad": (("target", "layer", "site", "token", "channel"), grad),
        "attn": (("layer", "head", "query", "key"), attn),
        "attn_grad": (("target", "layer", "head", "query", "key"), attn_grad),
        "logits": (("class",), LOGITS),
        "image": (("y", "x", "rgb"), np.zeros((IMG_H, IMG_W, 3), np.uint8)),
    }
    attrs = {"schema_version": 1, "grid_h": GH, "grid_w": GW, "num_prefix_tokens": 1, "num_heads": NH,
             "head_dim": C // NH, "num_layers": NL, "trace_id": f"handmade-{seed}", "img_height": IMG_H,
             "img_width": IMG_W, "model_name": "handmade", "hook_F1": "blocks.{layer}.norm1:output",
             "hook_F2": "blocks.{layer}.attn.attn_drop:output", "hook_F3": "blocks.{layer}.attn.proj:input"}
    return xr.Dataset(data, coords=coords, attrs=attrs)


def canonical_arrays(seed: int = SEED, **kw) -> dict[str, np.ndarray]:
    """The canonical-order arrays (float64) the reference works from."""
    ds = handmade(seed, **kw)
    return {k: ds[k].values.astype(np.float64) for k in ("act", "grad", "attn", "attn_grad", "logits")}


# --------------------------------------------------------------------------------------------------
# The direct NumPy reference (docs/architecture.md, "Recipes and formulas"), canonical token order: token 0 = CLS,
# 1.. raster

PATCH = np.arange(1, T)
WMASK = {"patch": PATCH, "all": np.arange(T), "cls": np.array([0])}


def relu(x):
    return np.maximum(x, 0)


def ref_target_grad(g: np.ndarray, logits: np.ndarray, target: str, cls_pos: int) -> np.ndarray:
    """g: (target, ...) -> the gradient of the recipe's scalar (derived for prob/logprob)."""
    gc, ge = g[cls_pos], g[E_POS]
    if target == "logit":
        return gc
    if target == "logprob":
        return gc - ge
    p = np.exp(logits - logits.max())
    p /= p.sum()
    cls = TRACED[cls_pos]
    return p[cls] * (gc - ge)


def ref_map(A: np.ndarray, G: np.ndarray, weighting: str, wtok: str = "patch") -> np.ndarray:
    """(T, K) activations and gradients -> map over the patch tokens (P,), by the weighting's registered
    ``reference``: the formula written plainly in its own module (vitcam_nb/compute/weightings/), not the kernel."""
    reference = WEIGHTINGS.get(weighting).reference
    assert reference is not None, f"{weighting} has no reference formula to test against"
    return reference(A, G, WMASK[wtok], PATCH)


def ref_heads(per_head: list[np.ndarray], rule) -> np.ndarray:
    if isinstance(rule, int):
        return per_head[rule]
    stack = np.stack(per_head)
    return {"channels": stack.sum(0), "mean_then_relu": stack.mean(0), "relu_then_mean": relu(stack).mean(0),
            "max": stack.max(0)}[rule]


def ref_rows(x: np.ndarray, rows: str) -> np.ndarray:
    """x: (..., query, key) -> (..., key)."""
    return {"cls": x[..., 0, :], "mean": x.mean(-2), "patch_mean": x[..., PATCH, :].mean(-2)}[rows]


def ref_raw(arr: dict, *, site="F1", layer=1, target="logit", cls_pos=TOP1_POS, weighting="gradcam",
            wtok="patch", heads="channels", rows="cls") -> np.ndarray:
    """The raw signed map of one layer on the (GH, GW) grid (canonical raster order)."""
    if site == "F2":
        A = ref_rows(arr["attn"][layer], rows)                       # (H, T)
        G = ref_rows(ref_target_grad(arr["attn_grad"][:, layer], arr["logits"], target, cls_pos), rows)
        if heads == "channels":   # heads are the channels k, key tokens the tokens t
            per_head = [ref_map(A.T, G.T, weighting, wtok)]
        else:
            per_head = [ref_map(A[h][:, None], G[h][:, None], weighting, wtok) for h in range(NH)]
    else:
        s = ["F1", "F3"].index(site)
        A = arr["act"][layer, s]
        G = ref_target_grad(arr["grad"][:, layer, s], arr["logits"], target, cls_pos)
        if site == "F3" and heads != "channels":
            d = C // NH
            per_head = [ref_map(A[:, h * d:(h + 1) * d], G[:, h * d:(h + 1) * d], weighting, wtok)
                        for h in range(NH)]
        else:
            per_head = [ref_map(A, G, weighting, wtok)]
    return ref_heads(per_head, heads if len(per_head) > 1 else "channels").reshape(GH, GW)


def minmax(x):
    span = x.max() - x.min()
    return (x - x.min()) / span if span > 0 else np.zeros_like(x)


def torch_resize(grid: np.ndarray, mode: str = "bilinear", size=(IMG_H, IMG_W)) -> np.ndarray:
    kw = {} if mode == "nearest" else {"align_corners": False}
    t = torch.from_numpy(np.ascontiguousarray(grid, dtype=np.float64))[None, None]
    return F.interpolate(t, size=size, mode=mode, **kw)[0, 0].numpy()


def raw_cam(tr, **fields) -> np.ndarray:
    m = vc.cam(tr, vc.Recipe(relu="none", normalize="none", **fields), grid=True)
    assert m.dims == ("patch_row", "patch_col")
    return m.values


def close(got, want, rtol=1e-5, nontrivial=True):
    want = np.asarray(want, np.float64)
    if nontrivial:   # a constant expected map would let a wrong implementation pass
        assert np.ptp(want) > 0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(1.0, np.abs(want).max()))


def cam_warns(tr, r, **kw):
    """``vc.cam(tr, r, **kw)`` and the DegenerateMapWarnings it gave."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        m = vc.cam(tr, r, **kw)
    return m, [w for w in rec if issubclass(w.category, vc.DegenerateMapWarning)]
