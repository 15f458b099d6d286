"""The trace view: a trace's arrays as plain numpy views plus the bookkeeping every computation needs
(patch positions, grid, layer and site positions, the target combination of a recipe), validated once and
cached per trace.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> tr = vc.trace(timm.create_model("vit_tiny_patch16_224"), np.zeros((224, 224, 3), np.uint8), targets="top2")
    >>> v = TraceView.of(tr)
    >>> (v.gh, v.gw), v.layer_positions(-1), TraceView.of(tr) is v
    ((14, 14), [11], True)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.compute.vlm_targets import answer_weights, is_answer_trace
from vitcam_nb.core.errors import ArgumentTypeError, RecipeError, TraceError
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.schema import ATTENTION_SITE, LOOP_VARIABLES, SCORE_VARIABLES, SUPPORTED_SCHEMAS

__all__ = ["ActivationNorms", "TraceView", "clear_views"]

_VIEWS: dict[int, tuple[weakref.ref, TraceView]] = {}


def clear_views() -> None:
    """Forget every cached view (benchmarks measure cold computations with it).

    Example:
        >>> clear_views()
    """
    _VIEWS.clear()


@dataclass
class ActivationNorms:
    """Per-token sums of ``|act|`` over each channel group at the patch tokens of some (layer, site) cells of a
    trace, (layer, site, patch token, group) float32: kept with the trace's view, as they depend on the trace
    alone, and they bound the magnitude scale of every channel-weighted map on those cells
    (``vitcam_nb.compute.kernels.channel_token_maps``). ``values`` and ``known`` are the view's whole cache;
    ``layers`` and ``sites`` select the cells.

    Example:
        >>> cache = ActivationNorms(np.zeros((2, 1, 3, 1), np.float32), np.zeros((2, 1), bool), slice(0, 1), 0)
        >>> print(cache.get()); cache.put(np.ones((1, 3, 1), np.float32)); cache.get()[..., 0]
        None
        array([[1., 1., 1.]], dtype=float32)
    """

    values: np.ndarray
    known: np.ndarray
    layers: slice | np.ndarray
    sites: slice | int

    def get(self) -> np.ndarray | None:
        """The norms of the cells, or None until every one of them is known."""
        return self.values[self.layers, self.sites] if self.known[self.layers, self.sites].all() else None

    def put(self, norms: np.ndarray) -> None:
        """Keep the norms of the cells, computed with a map on them."""
        self.values[self.layers, self.sites] = norms
        self.known[self.layers, self.sites] = True


def _int_attr(attrs: dict, name: str, default: int | None = None) -> int:
    """An int attribute of a trace (``default`` when it has none); a value that is no int, as an edited or damaged
    trace may hold, is refused naming the attribute and the value.

    Example:
        >>> _int_attr({"num_layers": "x"}, "num_layers")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceError: trace: attribute 'num_layers' is 'x'; expected an int ...
    """
    if name not in attrs and default is not None:
        return default
    value = attrs.get(name)
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TraceError(f"trace: attribute {name!r} is {value!r:.60}; expected an int (the trace was edited or "
                         "damaged: trace the image again, or restore the attribute)") from exc


@dataclass
class TraceView:
    """Plain numpy views of a trace plus the bookkeeping every computation needs (cached per trace).

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> view = TraceView.of(vc.trace(m, np.zeros((32, 32, 3), np.uint8), targets="top2"))
        >>> view.sites, view.patch[:3].tolist(), view.target_weights(vc.Recipe(target="logprob"))[0]
        (['F1', 'F3', 'F4', 'F5', 'F6', 'F2'], [1, 2, 3], {0: 1.0, 2: -1.0})
    """

    attrs: dict
    arrays: dict[str, np.ndarray]
    layers: np.ndarray
    sites: list[str]
    kinds: np.ndarray
    patch: np.ndarray
    flat: np.ndarray
    gh: int
    gw: int
    height: int
    width: int
    num_layers: int
    rtol: float
    signature: tuple
    norms: dict = field(default_factory=dict, repr=False, compare=False)

    @staticmethod
    def _signature(trace: xr.Dataset) -> tuple:
        # Identity of each variable's data: a trace whose arrays were replaced gets a fresh view.
        return tuple((k, id(v._data)) for k, v in trace.variables.items())

    @classmethod
    def of(cls, trace: Any) -> TraceView:
        if not isinstance(trace, xr.Dataset):
            raise ArgumentTypeError(f"trace: expected an xarray.Dataset from vitcam_nb.trace(), got "
                                    f"{type(trace).__name__}")
        key = id(trace)
        signature = cls._signature(trace)
        ref, cached = _VIEWS.get(key, (None, None))
        if cached is not None and ref() is trace and cached.signature == signature:
            return cached
        view = cls._build(trace, signature)
        # Datasets are unhashable, so cache by id and drop the entry when the trace is collected.
        _VIEWS[key] = (weakref.ref(trace, lambda _r, k=key: _VIEWS.pop(k, None)), view)
        return view

    @classmethod
    def _build(cls, trace: xr.Dataset, signature: tuple) -> TraceView:
        version = trace.attrs.get("schema_version")
        if version is None:
            raise TraceError("trace: not a vitcam_nb trace (no schema_version attribute)")
        if _int_attr(trace.attrs, "schema_version") not in SUPPORTED_SCHEMAS:
            raise TraceError(f"trace: schema_version {version} is not supported (this vitcam_nb reads "
                             f"{list(SUPPORTED_SCHEMAS)}); re-trace the model with this version")
        missing = [k for k in ("token_kind", "patch_row", "patch_col", "logits", "target_class")
                   if k not in trace.variables]
        if missing:
            raise TraceError(f"trace: missing {missing}; it does not follow the vitcam_nb schema")
        arrays = {k: trace.variables[k].values for k in ("act", "grad", "attn", "attn_grad", "logits",
                                                         "target_class", "site", "attn_window", "attn_window_grad",
                                                         "attn_window_key", *SCORE_VARIABLES, *LOOP_VARIABLES)
                  if k in trace.variables}
        kinds = trace.variables["token_kind"].values
        patch = np.flatnonzero(kinds == "patch")
        gh, gw = _int_attr(trace.attrs, "grid_h"), _int_attr(trace.attrs, "grid_w")
        rows = trace.variables["patch_row"].values[patch]
        cols = trace.variables["patch_col"].values[patch]
        sites = [str(s) for s in arrays["site"]] if "site" in arrays else []
        if "attn" in arrays or "attn_window" in arrays:
            sites.append(ATTENTION_SITE)
        stored = [arrays[k] for k in ("grad", "attn_grad", "attn_window_grad", "act", "attn", "attn_window")
                  if k in arrays]
        if not stored:
            raise RecipeError("site: this trace holds no block sites (e.g. only 'xattn'); use site='xattn' or "
                              "trace again with sites=[..., 'F1']")
        dtype = stored[0].dtype
        if patch.size != gh * gw:
            raise TraceError(f"trace: it holds {patch.size} of the {gh}x{gw} = {gh * gw} patch tokens (sliced "
                             "along token?); maps need every patch token. Select layers, sites or targets instead")
        height = trace.sizes["y"] if "y" in trace.sizes else _int_attr(trace.attrs, "img_height", gh)
        width = trace.sizes["x"] if "x" in trace.sizes else _int_attr(trace.attrs, "img_width", gw)
        return cls(
            attrs=trace.attrs, arrays=arrays, layers=trace.variables["layer"].values, sites=sites,
            kinds=kinds, patch=patch, flat=rows * gw + cols, gh=gh, gw=gw, height=height, width=width,
            num_layers=_int_attr(trace.attrs, "num_layers", int(trace.variables["layer"].values.max()) + 1),
            rtol=1e-2 if dtype == np.float16 else 1e-5, signature=signature,
        )

    @property
    def pad(self) -> tuple[int, int]:
        """Pixels the model padded at the bottom and right (timm ``dynamic_img_pad``): the patch grid covers the
        image and this margin, so maps are upsampled over both and the margin cropped, never stretched."""
        if not int(self.attrs.get("dynamic_img_pad", 0)):
            return 0, 0
        size = str(self.attrs.get("patch_size", "1"))
        ph, pw = (int(v) for v in size.split("x")) if "x" in size else (int(size), int(size))
        return max(0, self.gh * ph - self.height), max(0, self.gw * pw - self.width)

    def activation_norms(self, groups: int, layers: slice | np.ndarray, sites: slice | int) -> ActivationNorms:
        """The cached activation norms of the stored ``layers`` and ``sites`` (positions), by ``groups``
        channel groups: see :class:`ActivationNorms`.

        Example:
            >>> import timm, numpy as np, vitcam_nb as vc
            >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
            >>> view = TraceView.of(vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)))
            >>> print(view.activation_norms(1, slice(0, 2), 0).get())
            None
        """
        if groups not in self.norms:
            act = self.arrays["act"]
            self.norms[groups] = (np.empty((*act.shape[:2], self.patch.size, groups), np.float32),
                                  np.zeros(act.shape[:2], bool))
        return ActivationNorms(*self.norms[groups], layers, sites)

    def token_index(self, kind: str, field: str) -> int:
        where = np.flatnonzero(self.kinds == kind)
        if where.size == 0:
            present = sorted(set(map(str, self.kinds)) - {"patch"})
            has = f"prefix tokens {present}" if present else "no prefix tokens (e.g. class_token=False)"
            instead = {"weight_tokens": "weight_tokens='patch' or 'all'",
                       "attn_rows": "attn_rows='mean' or 'patch_mean'"}.get(field, "another choice")
            raise RecipeError(f"{field}={kind!r}: needs a {kind} token, but this model has {has}; "
                              f"use {instead} instead")
        return int(where[0])

    def layer_positions(self, layer: int | tuple | str) -> list[int]:
        traced = [int(v) for v in self.layers]
        if layer == "all":
            return list(range(len(traced)))
        wanted = layer if isinstance(layer, tuple) else (layer,)
        out = []
        for v in wanted:
            if isinstance(v, str):
                raise RecipeError(f"layer: {v!r} is a 'stage.block' address, which only hierarchical (Swin) traces "
                                  "have; this trace's blocks are numbered by int")
            if not -self.num_layers <= v < self.num_layers:
                raise RecipeError(f"layer: {v} is out of range for a model with {self.num_layers} blocks "
                                  f"(allowed -{self.num_layers}..{self.num_layers - 1})")
            absolute = v % self.num_layers
            if absolute not in traced:
                raise RecipeError(f"layer: block {absolute} was not traced (traced: {traced}); trace again "
                                  "with layers=None or include it")
            if traced.index(absolute) in out:
                raise RecipeError(f"layer: {wanted!r} names block {absolute} twice on a model with "
                                  f"{self.num_layers} blocks; list each block once")
            out.append(traced.index(absolute))
        return out

    def site_check(self, site: str) -> None:
        model_sites = str(self.attrs.get("model_sites", "")).split(",") + \
            [s for s in str(self.attrs.get("model_optional_sites", "")).split(",") if s]
        if site not in self.sites and self.attrs.get("model_sites") and site not in model_sites:
            raise RecipeError(f"site: this {self.attrs.get('model_family', '')} model has no {site!r} (its blocks "
                              f"lack that module); its sites are {model_sites}")
        if site not in self.sites:
            raise RecipeError(f"site: {site!r} is not in this trace (traced sites: {self.sites}); trace again "
                              f"with sites=[..., {site!r}]")

    def target_weights(self, recipe: Recipe) -> tuple[dict[int, float], int]:
        """Target positions and coefficients whose combination is the recipe's gradient, and the class."""
        logits = self.arrays["logits"].astype(np.float64)
        classes = [int(c) for c in self.arrays["target_class"]]
        if is_answer_trace(self.attrs):  # prob/logprob over the LM's vocabulary, not over the traced entries
            return answer_weights(logits, classes, recipe, self.attrs)
        if isinstance(recipe.class_, str):
            rank = int(recipe.class_[3:])
            if rank > logits.size:
                raise RecipeError(f"class_: {recipe.class_} but the model has {logits.size} classes")
            cls = int(np.argmax(logits)) if rank == 1 else int(np.argsort(-logits, kind="stable")[rank - 1])
        else:
            cls = int(recipe.class_)
            if cls >= logits.size:
                raise RecipeError(f"class_: {cls} is out of range (the model has {logits.size} classes)")
        traced = [c for c in classes if c >= 0]
        if cls not in classes:
            raise RecipeError(f"class_: class {cls} was not traced (traced classes: {traced}); trace again with "
                              f"targets=[..., {cls}] or targets='topK' with a larger K")
        pos = classes.index(cls)
        if recipe.target == "logit" or recipe.layer_fusion == "rollout":
            return {pos: 1.0}, cls
        if self.attrs.get("backward_rule") == "chefer_lrp":  # relevance is not linear in its start: no p_j sum
            raise RecipeError(f"target: a chefer_lrp trace holds the relevance of each class's one-hot; "
                              f"{recipe.target!r} is not derived from it (the relevance of the expected logit is not "
                              "the sum of p_j times each class's). Use target='logit'")
        if -1 not in classes:
            raise RecipeError(f"target: {recipe.target!r} is derived from the expected-logit gradient, which this "
                              "trace lacks; use target='logit' or trace again with vitcam_nb.trace()")
        expected = classes.index(-1)
        if recipe.target == "logprob":
            return {pos: 1.0, expected: -1.0}, cls
        p = np.exp(logits - logits.max())
        p_c = float(p[cls] / p.sum())
        return {pos: p_c, expected: -p_c}, cls
