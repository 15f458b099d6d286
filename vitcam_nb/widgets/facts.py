"""What the widget controls need to know about a trace: its sites, layers, heads, traced classes and labels,
the image, and the recipe to start from.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> tr = vc.trace(timm.create_model("vit_tiny_patch16_224"), np.zeros((224, 224, 3), np.uint8), targets="top2")
    >>> facts = TraceFacts.of(tr)
    >>> facts.sites[:2], facts.top_ranks(), default_recipe(facts).site
    (('F1', 'F2'), [1, 2], 'F1')
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.compute.vlm import VLM_SITES
from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError
from vitcam_nb.core.recipe import SITES, Recipe, is_int

__all__ = ["TraceFacts", "default_recipe", "is_video"]

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Recipe)}


def is_video(trace: xr.Dataset) -> bool:
    """Whether a trace is a video trace: its frames in ``clip`` (maps (frame, y, x)), no single ``image``.

    Example:
        >>> is_video(xr.Dataset({"clip": (("frame", "y", "x", "rgb"), np.zeros((2, 1, 1, 3), np.uint8))}))
        True
    """
    return "clip" in trace.variables and "image" not in trace.variables


@dataclass(frozen=True)
class TraceFacts:
    """What the controls need to know about a trace: sites, layers, heads, traced classes and labels.

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> facts = TraceFacts.of(vc.trace(m, np.zeros((32, 32, 3), np.uint8), targets=[4, 7], sites=["F4"]))
        >>> facts.sites, facts.layers, facts.classes, facts.num_heads
        (('F4',), (0, 1), (4, 7), 3)
    """

    sites: tuple[str, ...]
    layers: tuple[int, ...]
    num_layers: int
    num_heads: int
    classes: tuple[int, ...]
    labels: dict[int, str]
    ranked: tuple[int, ...]
    image: np.ndarray
    text_tokens: tuple[str, ...] = ()
    #: A video trace's frames (frame, y, x, 3) uint8 (``image`` is its first frame); None for an image trace.
    clip: np.ndarray | None = None
    #: Sites whose layers are not the tower's, with their layer count: a generative VLM's ``projector`` (one) and
    #: LM sites (the LM's decoder layers).
    site_layers: tuple[tuple[str, int], ...] = ()
    #: A generative VLM's answer trace: ``classes`` are its answer tokens, then the sequence log-prob (last).
    answer: bool = False

    @classmethod
    def of(cls, trace: xr.Dataset, view: str | None = None) -> TraceFacts:
        """Read the facts from a trace Dataset. ``view``: the name of a widget that shows one image only
        (``"Compare"``, ``"Gallery"``): a video trace is then refused, naming what shows one.

        Example:
            >>> facts = TraceFacts.of(tr)  # doctest: +SKIP
        """
        if not isinstance(trace, xr.Dataset):
            hint = ("; widgets show one stage of a hierarchical trace: pass vc.stages.stage_dataset(tr, stage)"
                    if isinstance(trace, xr.DataTree) else "")
            raise ArgumentTypeError(f"trace: expected an xarray.Dataset from vitcam_nb.trace(), got "
                                    f"{type(trace).__name__}{hint}")
        clip = None
        if is_video(trace):
            if view is not None:
                # Compare and Gallery draw one image under one (y, x) map; say what shows a clip instead.
                raise ArgumentError(f"trace: a video trace (its frames in 'clip', maps (frame, y, x)); {view} shows "
                                    f"one image's trace. Show a video trace with vc.Explorer(trace) (a frame slider) "
                                    f"or vc.export_html, or draw a map with vc.plot.frame_strip(trace, vc.cam(trace, "
                                    f"recipe))")
            clip = np.asarray(trace["clip"].values)
            if clip.ndim != 4 or clip.shape[-1] != 3 or clip.shape[0] == 0:
                raise ArgumentError(f"trace: clip has shape {clip.shape}; expected (frame, y, x, 3)")
            trace = trace.assign(image=(("y", "x", "rgb"), clip[0]))
        for name in ("image", "logits", "target_class", "layer"):
            if name not in trace.variables:
                raise ArgumentError(f"trace: has no {name!r}; pass a Dataset made by vitcam_nb.trace()")
        traced = {str(s) for s in trace["site"].values} if "site" in trace.variables else set()
        if "attn" in trace.variables or "attn_window" in trace.variables:
            traced.add("F2")
        if "xattn" in trace.variables:
            traced.add("xattn")
        # a generative VLM's projector and LM sites: their own variables, indexed by the LM's decoder layers
        site_layers = tuple((s, 1 if s == "projector" else int(trace.sizes.get("lm_layer", 1))) for s in VLM_SITES
                            if s in trace.variables and f"{s}_grad" in trace.variables)
        traced |= {s for s, _ in site_layers}
        text = tuple(str(v) for v in trace["text_token_str"].values) if "text_token_str" in trace.variables else ()
        sites = tuple(s for s in SITES if s in traced)
        layers = tuple(int(v) for v in trace["layer"].values)
        num_layers = int(trace.attrs.get("num_layers", max(layers) + 1))
        classes = tuple(int(c) for c in trace["target_class"].values if int(c) >= 0)
        logits = np.asarray(trace["logits"].values, dtype=np.float64)
        if "class_label" in trace.variables:
            names = [str(v) for v in trace["class_label"].values]
        else:
            names = [str(i) for i in range(logits.size)]
        labels = {c: names[c] if c < len(names) else str(c) for c in classes}
        ranked = tuple(int(c) for c in np.argsort(-logits, kind="stable"))
        answer = trace.attrs.get("target_kind") == "answer"
        if answer:
            # the answer tokens and the sequence log-prob; the entries after them (each answer position's
            # logsumexp over the vocabulary, traced so prob/logprob are exact) are no answer a map explains. No
            # "topN": ranking a token's logit against a log-prob sum and logsumexps would compare unlike scores.
            n_answer = len([v for v in str(trace.attrs.get("answer_ids", "")).split(",") if v.strip()])
            classes = tuple(c for c in classes if c <= n_answer)
            ranked = ()
        image = np.asarray(trace["image"].values)
        if image.ndim != 3 or image.shape[-1] != 3:
            raise ArgumentError(f"trace: image has shape {image.shape}; expected (y, x, 3)")
        if image.dtype != np.uint8:
            image = np.clip(image, 0, 255).astype(np.uint8)
        if clip is not None and clip.dtype != np.uint8:
            clip = np.clip(clip, 0, 255).astype(np.uint8)
        return cls(sites=sites, layers=layers, num_layers=num_layers,
                   num_heads=int(trace.attrs.get("num_heads", 1)), classes=classes, labels=labels,
                   ranked=ranked, image=image, text_tokens=text, clip=clip, site_layers=site_layers, answer=answer)

    @property
    def all_layers(self) -> tuple[int, ...]:
        """Every layer index some site of the trace has: the tower's traced layers and a VLM's projector and LM
        layers (an LM may be deeper than its tower: LLaVA-1.5-7B reads 24 tower blocks into 32 LM layers).

        Example:
            >>> TraceFacts.of(tr).all_layers  # doctest: +SKIP
            (0, 1, 2, 3)
        """
        return tuple(sorted({*self.layers, *(i for _, n in self.site_layers for i in range(n))}))

    @property
    def max_layers(self) -> int:
        """The largest layer count of any site (the tower's blocks without a VLM's LM sites).

        Example:
            >>> TraceFacts.of(tr).max_layers  # doctest: +SKIP
            4
        """
        return max([self.num_layers, *(n for _, n in self.site_layers)])

    def layers_of(self, site: str) -> tuple[tuple[int, ...], int]:
        """The traced layers of ``site`` and its layer count: the LM's decoder layers at a VLM's LM sites, one
        at its ``projector``, the tower's (``layers``, ``num_layers``) elsewhere.

        Example:
            >>> TraceFacts.of(tr).layers_of("lm_resid")  # doctest: +SKIP
            ((0, 1), 2)
        """
        n = dict(self.site_layers).get(site)
        return (self.layers, self.num_layers) if n is None else (tuple(range(n)), n)

    def fit_layer(self, site: str, layer: object) -> object:
        """``layer`` if ``site`` has it, else that site's last layer: a single layer chosen on the tower (4
        blocks) names no layer of a 2-layer LM.

        Example:
            >>> TraceFacts.of(tr).fit_layer("lm_resid", 3)  # doctest: +SKIP
            1
        """
        layers, n = self.layers_of(site)
        if is_int(layer) and not -n <= int(layer) < n:
            return layers[-1] if layers else -1
        return layer

    @property
    def frames(self) -> int:
        """The number of frames of a video trace's clip (0 for an image trace).

        Example:
            >>> TraceFacts.of(tr).frames  # doctest: +SKIP
            0
        """
        return 0 if self.clip is None else int(self.clip.shape[0])

    def top_ranks(self) -> list[int]:
        """The N of every "topN" class choice whose class was traced.

        Example:
            >>> TraceFacts.of(tr).top_ranks()  # doctest: +SKIP
            [1, 2, 3, 4, 5]
        """
        return [n for n in range(1, len(self.ranked) + 1) if self.ranked[n - 1] in self.classes][:len(self.classes)]


def default_recipe(facts: TraceFacts) -> Recipe:
    """The package default recipe, moved to a site and class this trace holds if it lacks F1 or top1.

    Example:
        >>> default_recipe(TraceFacts.of(tr)).site  # doctest: +SKIP
        'F1'
    """
    changes: dict[str, Any] = {}
    if facts.sites and _DEFAULTS["site"] not in facts.sites:
        # A token site first: F2's default query row is CLS, which not every model has.
        changes["site"] = next((s for s in facts.sites if s != "F2"), facts.sites[0])
    if facts.classes and 1 not in facts.top_ranks():
        changes["class_"] = facts.classes[0]
    if facts.layers and (_DEFAULTS["layer"] % facts.num_layers) not in facts.layers:
        changes["layer"] = facts.layers[-1]
    return Recipe(**changes)
