"""The published attention-gradient methods as a trace kind: Grad-SAM, AttCAT, AG-CAM, LeGrad and
Grad-ECLIP, each computed from a single-image trace exactly as its formula (and official code) reads the stored
sites, with no model call.

These methods combine several stored quantities per layer (attention and its gradient, pre-softmax scores,
hidden states, queries/keys/values, one target per layer), which the one-site weighting pipeline does not, so
each is a weighting name (registered for the recipe and the checklist, with its formula) computed here. The
recipe still chooses the layers, the gradient target, the query rows where the method leaves them open, the
upsampling and the final normalisation. Maps are placed on the patch grid, summed or averaged over layers as the
method says, ReLU'd if ``relu="after"``, upsampled, then normalised.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2).eval()
    >>> tr = vc.trace(m, np.zeros((32, 32, 3), np.uint8), targets="top1", sites=["F2"])
    >>> vc.cam(tr, vc.presets.grad_sam()).shape
    (32, 32)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.compute.maps import map_array, warn_degenerate
from vitcam_nb.compute.pipeline import combine
from vitcam_nb.compute.report import build_checklist, describe
from vitcam_nb.compute.spatial import normalise, to_grid, upsample
from vitcam_nb.compute.view import TraceView
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.errors import RecipeError, user_stacklevel
from vitcam_nb.core.kinds import TRACE_KINDS, MapValues, TraceKind
from vitcam_nb.core.presets_attention import ATTENTION_CITATIONS as CITATIONS
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.weighting import Weighting, register_weighting

__all__ = ["CITATION_OF", "LEGRAD_READOUT", "METHODS", "PUBLISHED", "PublishedKind", "eclip_heads_text",
           "single_head_blocks"]


def _needs(trace: xr.Dataset, recipe: Recipe, names: tuple[str, ...], sites: tuple[str, ...] = ()) -> None:
    missing = [n for n in names if n not in trace.variables]
    have = [str(s) for s in trace["site"].values] if "site" in trace.variables else []
    missing += [s for s in sites if s not in have]
    if missing:
        wanted = sorted({"F2" if n in ("attn", "attn_grad") else "attn_scores" if n.startswith("attn_scores") else n
                         for n in missing})
        raise RecipeError(f"weighting: {recipe.weighting} reads {missing}, which this trace does not hold; trace "
                          f"again with sites=[..., {', '.join(repr(w) for w in wanted)}]")


def _rows(view: TraceView, x: np.ndarray, rows: str) -> np.ndarray:
    """(..., query, key) -> (..., key): the CLS row or the mean over all query rows."""
    if rows == "cls":
        return x[..., view.token_index("cls", "attn_rows"), :]
    if rows == "mean":
        return x.mean(axis=-2)
    raise RecipeError(f"attn_rows: {rows!r} is not used by this method; choose 'cls' or 'mean'")


def _attn_grad(view: TraceView, recipe: Recipe, layer_pos: list[int]) -> np.ndarray:
    weights, _ = view.target_weights(recipe)
    return combine(view.arrays["attn_grad"], weights, (layer_pos,)).astype(np.float64)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free logistic


def grad_sam(view: TraceView, trace: xr.Dataset, recipe: Recipe, layer_pos: list[int]) -> np.ndarray:
    """mean over layers and heads of A * relu(dA), read at the recipe's attention rows, per patch key."""
    _needs(trace, recipe, ("attn", "attn_grad"))
    A = view.arrays["attn"][layer_pos].astype(np.float64)
    terms = _rows(view, A * np.maximum(_attn_grad(view, recipe, layer_pos), 0), recipe.attn_rows)
    return terms.mean(axis=(0, 1))[view.patch]


def attcat(view: TraceView, trace: xr.Dataset, recipe: Recipe, layer_pos: list[int]) -> np.ndarray:
    """sum over layers of (sum_k h_l[t,k] dh_l[t,k]) * mean over heads of the attention at the recipe's rows."""
    _needs(trace, recipe, ("attn",), ("resid_pre",))
    si = view.sites.index("resid_pre")
    weights, _ = view.target_weights(recipe)
    h = view.arrays["act"][layer_pos, si].astype(np.float64)
    dh = combine(view.arrays["grad"], weights, (layer_pos, si)).astype(np.float64)
    alpha = _rows(view, view.arrays["attn"][layer_pos].astype(np.float64), recipe.attn_rows).mean(axis=1)
    return ((h * dh).sum(-1) * alpha).sum(0)[view.patch]


def agcam(view: TraceView, trace: xr.Dataset, recipe: Recipe, layer_pos: list[int]) -> np.ndarray:
    """sum over layers and heads of sigmoid(S[cls, p]) * relu(dA[cls, p]) (S: pre-softmax scores)."""
    _needs(trace, recipe, ("attn_grad", "attn_scores"))
    S = trace["attn_scores"].values[layer_pos].astype(np.float64)
    terms = _sigmoid(S) * np.maximum(_attn_grad(view, recipe, layer_pos), 0)
    return _rows(view, terms, "cls").sum(axis=(0, 1))[view.patch]


#: LeGrad weighting -> the layer-wise read-out its trace must have (``vc.targets.layerwise(readout=...)``)
LEGRAD_READOUT = {"legrad_mean": "mean", "legrad": "model"}


def legrad(view: TraceView, trace: xr.Dataset, recipe: Recipe, layer_pos: list[int]) -> np.ndarray:
    """sum over layers l of mean over heads and query rows of relu(d s_l / d A_l), s_l the layer-wise target read
    out as the weighting says (``legrad_mean``: LeGrad's official read-out; ``legrad``: the model's own pooling)."""
    _needs(trace, recipe, ("attn_grad",))
    want = LEGRAD_READOUT[recipe.weighting]
    if str(view.attrs.get("target_kind", "")) != "layerwise":
        raise RecipeError(f"weighting: {recipe.weighting} differentiates each block's own read-out score; trace "
                          f"with targets=vc.targets.layerwise(..., readout={want!r}) (one target per block, one "
                          "backward pass)")
    # traces made before the read-out option hold the model's own pooling and no attribute for it
    have = str(view.attrs.get("layerwise_readout", "model"))
    if have != want:
        preset = {"mean": "legrad", "model": "legrad_cls"}
        raise RecipeError(f"weighting: {recipe.weighting} (preset {preset[want]}) reads the layer-wise scores read "
                          f"out by {want!r}, but this trace's were read out by {have!r}; trace with "
                          f"targets=vc.targets.layerwise(..., readout={want!r}), or use vc.presets.{preset[have]}()")
    target_of = {int(c): i for i, c in enumerate(view.arrays["target_class"]) if int(c) >= 0}
    out = 0.0
    for p in layer_pos:
        block = int(view.layers[p])
        if block not in target_of:
            raise RecipeError(f"layer: block {block} has no layer-wise score in this trace")
        g = view.arrays["attn_grad"][target_of[block], p].astype(np.float64)
        out = out + np.maximum(g, 0).mean(axis=(0, 1))
    return np.asarray(out)[view.patch]


def _minmax(x: np.ndarray) -> np.ndarray:
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    return (x - lo) / (hi - lo)


def _eclip(view: TraceView, trace: xr.Dataset, recipe: Recipe, layer_pos: list[int], heads: int,
           qk: tuple[str, str]) -> np.ndarray:
    _needs(trace, recipe, (), ("F3", *qk, "v"))
    cls = view.token_index("cls", "weight_tokens")
    weights, _ = view.target_weights(recipe)
    pos = {s: view.sites.index(s) for s in ("F3", *qk, "v")}
    out = 0.0
    for p in layer_pos:
        g = combine(view.arrays["grad"], weights, (p, pos["F3"])).astype(np.float64)[cls]
        q, k, v = (view.arrays["act"][p, pos[s]].astype(np.float64) for s in (*qk, "v"))
        qh = q[cls].reshape(heads, -1)
        kh = k[view.patch].reshape(len(view.patch), heads, -1)
        cos = (kh * qh).sum(-1) / (np.linalg.norm(kh, axis=-1) * np.linalg.norm(qh, axis=-1))
        lam = _minmax(cos.T)  # (heads, patch), min-max over the patches of each head
        terms = (g * v[view.patch]).reshape(len(view.patch), -1, v.shape[-1] // len(lam)).sum(-1)  # (patch, heads)
        out = out + np.maximum((terms * lam.T).sum(-1), 0)
    return np.asarray(out)


def single_head_blocks(trace: Any) -> list[int]:
    """The blocks a trace ran as one head (it was made inside ``vitcam_nb.adapters.single_head_attention``).

    Example:
        >>> import xarray as xr
        >>> single_head_blocks(xr.Dataset(attrs={"single_head_attention": "10,11"})), single_head_blocks(None)
        ([10, 11], [])
    """
    text = str(getattr(trace, "attrs", {}).get("single_head_attention", ""))
    return [int(b) for b in text.split(",") if b]


def _blocks(view: TraceView, layer_pos: list[int]) -> list[int]:
    return [int(view.layers[p]) for p in layer_pos]


def grad_eclip(view: TraceView, trace: xr.Dataset, recipe: Recipe, layer_pos: list[int]) -> np.ndarray:
    """relu(sum_c dF3[cls,c] v[p,c] minmax_p cos(q_out_cls, k_out_p)), q_out/k_out: q and k through out_proj;
    refused unless the trace ran the recipe's blocks as one head, as the official code does."""
    _needs(trace, recipe, (), ("F3", "q_out", "k_out", "v"))
    multi = [b for b in _blocks(view, layer_pos) if b not in single_head_blocks(trace)]
    if multi:
        raise RecipeError(
            f"weighting: grad_eclip follows Grad-ECLIP's generate_emap.py, which recomputes block(s) {multi} as ONE "
            f"head; this trace ran them with the model's own {view.attrs.get('num_heads', '?')} heads (it was not "
            "made inside vitcam_nb.adapters.single_head_attention), so its map would not be the official one. "
            f"Trace again inside `with vc.adapters.single_head_attention(model, layers={tuple(multi)}):`, or use "
            "grad_eclip_paper (the paper's per-head formula on the model as it is)")
    return _eclip(view, trace, recipe, layer_pos, 1, ("q_out", "k_out"))


def grad_eclip_paper(view: TraceView, trace: xr.Dataset, recipe: Recipe, layer_pos: list[int]) -> np.ndarray:
    """relu(sum_h sum_{c in h} dF3[cls,c] v[p,c] minmax_p cos(q^h_cls, k^h_p)): one cosine per head; warns when
    the trace ran the recipe's blocks as one head (the gradient is then the changed model's)."""
    single = [b for b in _blocks(view, layer_pos) if b in single_head_blocks(trace)]
    if single:
        warnings.warn(f"grad_eclip_paper: this trace ran block(s) {single} as ONE head (made inside "
                      "vitcam_nb.adapters.single_head_attention), so the gradient is the changed model's, not the "
                      "paper's multi-head model's; trace outside that context for the paper's version, or use "
                      "grad_eclip (the official code's)", UserWarning, stacklevel=user_stacklevel())
    return _eclip(view, trace, recipe, layer_pos, int(view.attrs.get("num_heads", 1)), ("q", "k"))


def eclip_heads_text(recipe: Recipe, trace: Any) -> str:
    """The checklist's heads line for Grad-ECLIP: whether the recipe's blocks ran as one head in the trace.

    Example:
        >>> import xarray as xr, vitcam_nb as vc
        >>> eclip_heads_text(vc.presets.grad_eclip(), None)[:40]
        'one head over all channels, as generate_'
    """
    code = recipe.weighting == "grad_eclip"
    if not isinstance(trace, xr.Dataset) or "layer" not in trace.coords:
        return ("one head over all channels, as generate_emap.py (trace inside vitcam_nb.adapters."
                "single_head_attention)" if code else "one cosine per head of the model's own attention")
    view = TraceView.of(trace)
    blocks = _blocks(view, view.layer_positions(recipe.layer))
    single = [b for b in blocks if b in single_head_blocks(trace)]
    listed = ",".join(str(b) for b in single)
    if single and code:
        return (f"one head over all channels: the trace ran block(s) {listed} as ONE head (made inside "
                "vitcam_nb.adapters.single_head_attention), as generate_emap.py recomputes CLIP's last block")
    if single:
        return (f"one cosine per head, but the trace ran block(s) {listed} as ONE head (made inside "
                "vitcam_nb.adapters.single_head_attention): the gradient is the changed model's, not the paper's")
    own = f"the model's own {view.attrs.get('num_heads', '?')} heads (not a single-head trace)"
    if code:
        return (f"{own}: NOT the official code's single-head block, so grad_eclip refuses this trace (trace "
                "inside vitcam_nb.adapters.single_head_attention)")
    return f"one cosine per head of {own}"


Method = Callable[[TraceView, xr.Dataset, Recipe, list[int]], np.ndarray]
#: weighting name -> (method, formula for the checklist, title)
METHODS: dict[str, tuple[Method, str, str]] = {
    "gradsam": (grad_sam, "map[p] = mean over layers l and heads h of A_lh[r,p] relu(dy/dA_lh[r,p]) at the "
                          "attention rows r (Grad-SAM)", "Grad-SAM"),
    "attcat": (attcat, "map[p] = sum over layers l of (sum_k h_l[p,k] dy/dh_l[p,k]) mean_h A_lh[r,p], h_l the "
                       "hidden state entering block l (resid_pre), r the attention rows (AttCAT)", "AttCAT"),
    "agcam": (agcam, "map[p] = sum over layers l and heads h of sigmoid(S_lh[cls,p]) relu(dy/dA_lh[cls,p]), S the "
                     "pre-softmax scores, A the softmax attention (AG-CAM)", "AG-CAM"),
    "legrad": (legrad, "map[p] = sum over layers l of mean over heads and query rows of relu(d s_l/dA_l[q,p]), "
                       "s_l block l's output through the final norm, the model's own pooling (the class token) and "
                       "head (LeGrad with the kit's class-token read-out, not the official mean over tokens)",
               "LeGrad, class-token read-out (the kit's variant)"),
    "legrad_mean": (legrad, "map[p] = sum over layers l of mean over heads and query rows of relu(d s_l/dA_l[q,p]), "
                            "s_l = head(norm(mean over all tokens of block l's output)) (LeGrad, its official "
                            "read-out)", "LeGrad"),
    "grad_eclip": (grad_eclip, "map[p] = relu(sum_c dy/dF3[cls,c] v[p,c] minmax_p cos(out_proj(q_cls), "
                               "out_proj(k_p))), cosine over all channels (single-head, as Grad-ECLIP's "
                               "generate_emap.py)", "Grad-ECLIP"),
    "grad_eclip_paper": (grad_eclip_paper, "map[p] = relu(sum_h sum_(c in h) dy/dF3[cls,c] v[p,c] minmax_p "
                                           "cos(q^h_cls, k^h_p)), one cosine per head (Grad-ECLIP, paper)",
                         "Grad-ECLIP (paper)"),
}


#: weighting name -> the citation of its preset
CITATION_OF = {"gradsam": CITATIONS["grad_sam"], "attcat": CITATIONS["attcat"], "agcam": CITATIONS["agcam"],
               "legrad": CITATIONS["legrad_cls"], "legrad_mean": CITATIONS["legrad"],
               "grad_eclip": CITATIONS["grad_eclip"], "grad_eclip_paper": CITATIONS["grad_eclip_paper"]}


def _refuse(*_args: Any, **_kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    raise RecipeError("weighting: this published method combines several sites per layer and is computed on "
                      "single-image traces of one token grid (vc.trace of a ViT-like model) only")


for _name, (_fn, _formula, _title) in METHODS.items():
    register_weighting(Weighting(_name, _formula, _refuse, title=_title, method=True), replace=True)


def _values(trace: xr.Dataset, recipe: Recipe) -> MapValues:
    view = TraceView.of(trace)
    layer_pos = view.layer_positions(recipe.layer)
    grid = to_grid(view, METHODS[recipe.weighting][0](view, trace, recipe, layer_pos).astype(np.float32))
    if recipe.relu == "after":
        grid = np.maximum(grid, 0)
    notes = []
    if not np.isfinite(grid).all() or np.ptp(grid) <= 0:
        notes.append("the map is constant (or not finite: a min-max over constant cosines)")
        grid = np.zeros_like(grid)
    out = upsample(grid, (view.height, view.width), recipe.upsample, view.pad)
    return normalise(out, recipe.normalize), notes, []


class PublishedKind(TraceKind):
    """Single-image, one-grid traces with a recipe whose weighting is a published method of :data:`METHODS`.

    Example:
        >>> import vitcam_nb as vc
        >>> PUBLISHED.accepts(None, vc.presets.agcam())
        False
    """

    name = "published"

    def accepts(self, trace: Any, recipe: Recipe | None) -> bool:
        return (recipe is not None and recipe.weighting in METHODS and isinstance(trace, xr.Dataset)
                and "image" not in trace.dims and "grid_h" in trace.attrs)

    def compute(self, trace: xr.Dataset, recipe: Recipe) -> MapValues:
        return _values(trace, recipe)

    def cam(self, trace: xr.Dataset, recipe: Recipe) -> xr.DataArray:
        values, notes, partial = _values(trace, recipe)
        reason = warn_degenerate(recipe, notes) if notes else ""
        checklist, methods = self.checklist(recipe, trace).to_json(), self.describe(recipe, trace)
        view = TraceView.of(trace)
        blocks = ",".join(str(int(view.layers[p])) for p in view.layer_positions(recipe.layer))
        return map_array(values, recipe, str(trace.attrs.get("trace_id", "")), checklist, methods, reason, partial,
                         blocks=blocks, blocks_of=str(view.num_layers))

    def gallery(self, trace: xr.Dataset, recipe: Recipe, vary: Any) -> xr.DataArray:
        raise RecipeError(f"vary: {recipe.weighting} is a fixed published method; compute its maps with vc.cam")

    def checklist(self, recipe: Recipe, trace: Any) -> Checklist:
        out = build_checklist(recipe, trace)
        # The method's formula fixes heads, layer sums and ReLUs; only the final map is normalised.
        _, formula, title = METHODS[recipe.weighting]
        out["aggregation"]["heads"] = "as the method's formula states (see weighting)"
        if recipe.weighting in ("grad_eclip", "grad_eclip_paper"):
            out["aggregation"]["heads"] = eclip_heads_text(recipe, trace)
        out["aggregation"]["layer fusion"] = (f"{recipe.layer_fusion} over the listed blocks inside the formula; no "
                                              "per-layer ReLU or normalisation")
        out["spatial reconstruction"]["normalisation"] = f"{recipe.normalize} once, after upsampling"
        out["recipe"]["method"] = f"this is {title} ({CITATION_OF.get(recipe.weighting, '')})"
        return out

    def describe(self, recipe: Recipe, trace: Any) -> str:
        # The generic paragraph, with the lines the method's formula fixes taken from this kind's checklist.
        plain, ours = build_checklist(recipe, trace), self.checklist(recipe, trace)
        text = describe(recipe, trace)
        for category, item, sep in (("aggregation", "heads", ": "), ("aggregation", "layer fusion", ": "),
                                    ("spatial reconstruction", "normalisation", " ")):
            text = text.replace(f"{item}{sep}{plain[category][item]}", f"{item}{sep}{ours[category][item]}")
        return f"{text} {ours['recipe']['method'][0].upper()}{ours['recipe']['method'][1:]}."


PUBLISHED = PublishedKind()
# Lookup priority: before flat: a method recipe on a flat trace.
TRACE_KINDS.register(PUBLISHED.name, PUBLISHED, replace=True, priority=60)
