"""The choices a description of a generative VLM's map leaves open (issue 55): on a trace of ``vc.targets.answer``
(or ``generated``) the default space of :func:`vitcam_nb.ambiguity` gains

========  ==========================================================================================================
field     values on an answer trace
========  ==========================================================================================================
site      the tower's sites the trace holds, then ``projector``, ``lm_resid``, ``lm_attn`` (those it holds)
layer     every tower block and every LM decoder layer (a number names a tower block at a tower site and an LM
          layer at an LM site; a site without that layer is a combination the trace cannot compute: skipped, counted)
class\\_   each answer token (0, 1, ...) and the sequence log-prob (the last traced class) in place of ``top1``
========  ==========================================================================================================

``projector`` has one layer, so its layer is not a choice (every layer value names the same recipe); the LM sites
store image tokens only, so ``weight_tokens`` does not apply there (:func:`vitcam_nb.evaluate.ambiguity.space.
canonical`). ``lm_logit`` (TAM, :func:`vitcam_nb.presets.tam`) joins the sites where the trace holds it: there the
weighting is ``tam``, the target the logit and the layer the LM's last (a description stating another weighting
or target has no recipe there; the sequence score has no token: skipped). On LLaVA (one layout grid equal to the
tower's patch grid) the maps are compared on that grid as before; every other answer trace (crops, several tiles,
another grid, no tower site) is compared on the image per tile group: :mod:`vitcam_nb.evaluate.ambiguity.vlm_maps`.

Example:
    >>> import xarray as xr
    >>> vlm_axes(xr.Dataset(), [], [0, 1], (2, 2))
    {}
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xarray as xr

from vitcam_nb.compute.vlm import VLM_SITES
from vitcam_nb.evaluate.ambiguity.space import default_space
from vitcam_nb.evaluate.ambiguity.vlm_maps import is_special, tower_axes

__all__ = ["VLM_SITES", "special_space", "vlm_axes"]


def vlm_axes(trace: xr.Dataset, sites: Sequence[str], layers: Sequence[int], grid: tuple[int, int]
             ) -> dict[str, tuple]:
    """The default values of site, layer and class_ on an answer trace whose tower has ``sites``, ``layers`` and
    patch ``grid``; {} on any other trace (the documented defaults hold there).

    Example:
        >>> vlm_axes(xr.Dataset(attrs={"target_kind": "answer"}, coords={"class": [0, 1, 2]}), ["F1"], [0], (1, 1))
        {'class_': (0, 1, 2)}
    """
    if trace.attrs.get("target_kind") != "answer" or "class" not in trace.sizes:
        return {}
    # the answer tokens and the sequence log-prob; the entries after them (each answer position's logsumexp over
    # the vocabulary, traced for prob/logprob) are not a class a map may pick
    n_answer = len([s for s in str(trace.attrs.get("answer_ids", "")).split(",") if s.strip()])
    n_class = min(int(trace.sizes["class"]), n_answer + 1) if n_answer else int(trace.sizes["class"])
    out: dict[str, tuple] = {"class_": tuple(range(n_class))}
    lm = [s for s in VLM_SITES if s in trace.variables and f"{s}_grad" in trace.variables]
    lm += ["lm_logit"] if "lm_logit" in trace.variables and "lm_logit_text" in trace.variables else []
    if not lm or not all(k in trace.variables for k in ("image_token_row", "image_token_col", "image_token_tile")):
        return out
    rows, cols = trace["image_token_row"].values, trace["image_token_col"].values
    one_tile = np.unique(trace["image_token_tile"].values).size == 1
    if not is_special(trace) and (not one_tile or (int(rows.max()) + 1, int(cols.max()) + 1) != tuple(grid)):
        return out
    n_lm = int(trace.sizes.get("lm_layer", 1))
    out["site"] = (*sites, *lm)
    out["layer"] = tuple(sorted({int(v) for v in layers} | set(range(n_lm))))
    return out


def special_space(trace: xr.Dataset, fields: Sequence[str], space: dict) -> dict[str, tuple]:
    """The values of the open ``fields`` on an answer trace compared per tile group (``vlm_maps.is_special``):
    ``space`` where given, else the trace's own sites, layers and answer tokens, else the documented defaults.

    Example:
        >>> special_space(xr.Dataset(attrs={"target_kind": "answer"}, coords={"class": [0, 1]}), ["class_"], {})
        {'class_': (0, 1)}
    """
    sites, layers, grid = tower_axes(trace)
    vlm = vlm_axes(trace, sites, layers, grid or (0, 0))
    return {f: tuple(space[f] if f in space else vlm[f] if f in vlm else default_space(f, sites, layers))
            for f in fields}
