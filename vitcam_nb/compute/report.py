"""The reporting checklist and the methods paragraph of a recipe on a trace: the five categories of the audit
(feature representation, gradient target, token handling, aggregation, spatial reconstruction), the recipe's
id and preset, and the model facts a trace records. Trace kinds add what is particular to them. Since 0.2 it also
says in words what the map is made from (the schema's site meanings), carries the caveat of the raster reshape, and
quotes the trace's ``position_r2`` (``vc.evaluate.position_probe``) when it holds one, states the device, the
compute and the storage dtype, and lists the blocks ``layer="all"`` stands for; a trace 0.1 wrote keeps its 0.1
report.

Example:
    >>> import vitcam_nb as vc
    >>> build_checklist(vc.Recipe())["aggregation"]["weighting"][:7]
    'gradcam'
    >>> describe(vc.Recipe()).startswith("Heatmaps were computed")
    True
"""

from __future__ import annotations

import json
import math
from typing import Any

from vitcam_nb.compute.vlm_targets import answer_target_text
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.errors import RecipeError, TraceError
from vitcam_nb.core.input_geometry import geometry_text
from vitcam_nb.core.presets import preset_text
from vitcam_nb.core.recipe import HEAD_SITES, ROLLOUTS, STAGE_BLOCK, Recipe, is_int
from vitcam_nb.core.rules import rule_items, rule_sentence
from vitcam_nb.core.schema import POSITION_R2, SITE_MEANINGS, TOKEN_SITES
from vitcam_nb.core.weighting import WEIGHTINGS

__all__ = ["ATTN_ROW_TEXT", "FUSION_TEXT", "HEAD_RULE_TEXT", "PROBE_SUPPORTS", "PROBE_WEAK", "RASTER_CAVEAT",
           "build_checklist", "describe", "map_words"]

HEAD_RULE_TEXT = {
    "channels": "heads are channels: contributions summed over all heads",
    "mean_then_relu": "per-head maps averaged over heads, then the ReLU",
    "relu_then_mean": "ReLU of each per-head map, then averaged over heads",
    "max": "maximum over per-head maps",
}
ATTN_ROW_TEXT = {"cls": "the CLS query row", "mean": "the mean over all query rows",
                 "patch_mean": "the mean over patch query rows"}
FUSION_TEXT = {
    "none": "a single layer",
    "mean": "per-layer maps (ReLU, normalised, upsampled) averaged over layers",
    "sum": "per-layer maps (ReLU, normalised, upsampled) summed over layers",
    "max": "per-layer maps (ReLU, normalised, upsampled), pixelwise maximum over layers",
    "rollout": "attention rollout R = prod_l (0.5 mean_h A_l + 0.5 I) (Abnar & Zuidema 2020)",
    "grad_rollout": "gradient-weighted rollout R <- R + mean_h(relu(G_l * A_l)) R from R = I (Chefer et al. 2021b)",
    "transition": "transition attention map: S = mean_h A_last (mean_h A_l + I) ... over the earlier listed blocks, "
                  "times W = mean_h relu(IG), IG the integrated gradient of the last block's attention (Yuan et al. "
                  "2021)",
    "bt_head": "Beyond Intuition head-wise: R <- R + (sum_h I_h A_h) R from R = I, I_h = mean |A_h^T G_h| normalised "
               "over heads, times W = mean_h relu(IG) (Chen et al. 2023)",
    "bt_token": "Beyond Intuition token-wise: R <- R + mean_h(A_l) diag(|v W_o| / |z|) R from R = I, then W = mean_h "
                "relu(IG) times |R| (Chen et al. 2023)",
}

#: What a raster reshape assumes (the audit's open problem: raster order may not hold for mixed representations).
RASTER_CAVEAT = ("Tokens are placed on the grid in raster order (patch_row, patch_col): this assumes each token "
                 "still stands for its own patch, which may not hold in deep layers where attention mixes tokens")
#: R^2 of ``vc.evaluate.position_probe`` from which the checklist calls raster order consistent with the features,
#: and below which it calls the raster reshape an assumption; in between, the features carry positions in part.
PROBE_SUPPORTS, PROBE_WEAK = 0.8, 0.5


def map_words(recipe: Recipe) -> str:
    """What the map of ``recipe`` is made from, in words: the kind of quantity (token activations, attention
    weights, cross-modal interaction) and the site's meaning as the schema states it.

    Example:
        >>> map_words(Recipe(site="F1")).split(":")[0]
        'token activations x gradients'
    """
    site, weighting = recipe.site, WEIGHTINGS.get(recipe.weighting)
    meaning = f"the {SITE_MEANINGS.get(site, site)} ({site})"
    if weighting.method:
        return f"the published method's own combination of sites (see the recipe's method line); its site is {meaning}"
    if recipe.layer_fusion in ROLLOUTS:
        grad = "" if recipe.layer_fusion == "rollout" else " x gradients"  # the others weight attention by them
        return (f"attention weights{grad}: {meaning} of each listed block, chained over the blocks by the rollout; a "
                f"patch's value is the attention its token receives from {ATTN_ROW_TEXT[recipe.attn_rows]} through "
                "the chain")
    grad = " x gradients" if weighting.uses_gradient and not weighting.scores else ""
    how = ("with weights from the model's scores of perturbed inputs (vc.score)" if weighting.scores else
           "with weights from the target's gradients" if weighting.uses_gradient else "without gradients")
    if site == "xattn":
        return (f"cross-modal interaction{grad}: {meaning}, per head; a patch's value is the attention the text "
                f"tokens pay to its image key, combined over heads {how}")
    if site in TOKEN_SITES:
        return f"token activations{grad}: {meaning} of each patch token, combined over channels {how}"
    kind, what = ("attention scores", "score") if site == "attn_scores" else ("attention weights", "attention")
    return (f"{kind}{grad}: {meaning}; a patch's value comes from the {what} its token receives as a key from "
            f"{ATTN_ROW_TEXT[recipe.attn_rows]}, combined over heads {how}")


def _words_apply(attrs: Any) -> bool:
    """0.1 reports said no words about the map and had no raster caveat; a trace 0.1 wrote keeps its 0.1 report
    (the 0.1 contract reproduces it exactly)."""
    return not str(attrs.get("vitcam_nb_version", "")).startswith("0.1.")


def _probe_layers(recipe: Recipe, probed: list[int], attrs: Any) -> list[int]:
    """The global blocks of ``recipe.layer`` the probe measured (a "stage.block" layer is not matched)."""
    if recipe.layer == "all":
        return probed
    values = recipe.layer if isinstance(recipe.layer, tuple) else (recipe.layer,)
    total = int(attrs["num_layers"]) if "num_layers" in attrs else None
    wanted = [v % total if total and v < 0 else v for v in values if is_int(v)]
    return [v for v in wanted if v in probed]


def _probe_text(recipe: Recipe, trace: Any, attrs: Any) -> str:
    """The position probe's R^2 for the map's site and blocks, when the trace holds one ("" otherwise)."""
    probe = getattr(trace, "variables", {}).get(POSITION_R2) if trace is not None else None
    if probe is None or set(probe.dims) != {"site", "layer"}:
        return ""
    sites = [str(s) for s in trace[POSITION_R2]["site"].values]
    if recipe.site not in sites:
        return ""
    own = str(probe.attrs.get("trace_id", ""))
    if not own:  # attrs lost (e.g. by arithmetic or a merge): nothing says the probe is of this trace
        return (f"not quoted: the trace's {POSITION_R2} states no trace_id (its attrs were lost), so it may be "
                "another trace's")
    if own != str(attrs.get("trace_id", "")):
        return f"not quoted: the trace's {POSITION_R2} was computed on another trace ({own})"
    probed = [int(v) for v in trace[POSITION_R2]["layer"].values]
    r2 = trace[POSITION_R2].sel(site=recipe.site)
    picks = [(v, float(r2.sel(layer=v))) for v in _probe_layers(recipe, probed, attrs)]
    picks = [(v, r) for v, r in picks if math.isfinite(r)]
    if not picks:
        return ""
    worst = min(r for _, r in picks)
    verdict = ("the positions are linearly recoverable from these features, as raster order needs"
               if worst >= PROBE_SUPPORTS else
               "the positions are only partly recoverable from these features; read the raster reshape with care"
               if worst >= PROBE_WEAK else
               "the positions are not linearly recoverable from these features; the raster reshape is an assumption "
               "here")
    values = ", ".join(f"{r:.2f} (block {v})" for v, r in picks)
    return (f"a ridge probe (vc.evaluate.position_probe, {probe.attrs.get('folds', '?')}-fold CV over patch tokens) "
            f"predicts each token's grid position from its {recipe.site} activations with R^2 = {values}: {verdict}")


def _layer_text(recipe: Recipe, num_layers: int | None = None, traced: list[int] | None = None) -> str:
    """The blocks of ``recipe.layer``; for ``"all"``, the trace's own blocks when ``traced`` lists them (a trace
    made with ``layers=`` holds only some, and the map is of those)."""
    if recipe.layer == "all":
        if traced is None:
            return "all traced blocks"
        return f"all traced blocks ({', '.join(map(str, traced))}" + \
            (f" of 0..{num_layers - 1})" if num_layers is not None else ")")
    values = recipe.layer if isinstance(recipe.layer, tuple) else (recipe.layer,)
    if num_layers is None:
        text = ", ".join(map(str, values)) + (" (the last block)" if values == (-1,) else "")
    else:
        absolute = [v % num_layers if is_int(v) else f"{v} (stage.block)" for v in values]
        text = ", ".join(map(str, absolute)) + f" of 0..{num_layers - 1}"
        if absolute == [num_layers - 1]:
            text += " (the last block)"
    return ("blocks " if len(values) > 1 else "block ") + text


def _traced_blocks(trace: Any) -> list[int] | None:
    """The blocks a trace holds (its ``layer`` coordinate), or None when it has none (a tree's root, no trace)."""
    layer = getattr(trace, "coords", {}).get("layer") if trace is not None else None
    return None if layer is None else [int(v) for v in layer.values]


def _target_scalar(attrs: Any, cls: str) -> tuple[str, str] | None:
    """(what s_c is, what the scores s_j of all classes are) for a target other than a classifier's logits, or
    None for class targets (their 0.1 text names the raw logit z_c). A region trace made before ``target_reduce``
    was recorded says its reduce as the first word of ``target_scores``."""
    kind = str(attrs.get("target_kind", "class"))
    if kind == "region":
        reduce = str(attrs.get("target_reduce", "") or str(attrs.get("target_scores", "")).split(" ", 1)[0])
        if reduce not in ("sum", "mean"):
            reduce = "sum (or mean, see scores)"
        norm = " / sum_yx m[y,x]" if reduce == "mean" else ""
        return (f"the region score s_c of {cls}: the {reduce} of its logits over the region, s_c = sum_yx m[y,x] "
                f"z_c[y,x]{norm} (m the region mask, z_c[y,x] the class's dense pre-softmax logits)",
                f"the region scores s_j of all classes, s_j = sum_yx m[y,x] z_j[y,x]{norm} (m the region mask, "
                "z_j[y,x] the dense pre-softmax logits of class j)")
    if kind == "dense":
        return (f"the user score s_c of {cls}: score c of the target's function of the dense output",
                "the user scores s_j the target's function computes from the dense output")
    if kind != "class":  # similarity, image-text matching, layer-wise or a user's target: its own description
        scores = str(attrs.get("target_scores", "")) or f"the {kind} target's scores"
        return f"the target score s_c of {cls} ({scores})", f"the target's scores s_j ({scores})"
    return None


def _target_text(recipe: Recipe, attrs: Any = None) -> tuple[str, str]:
    cls = f"class {recipe.class_}" if is_int(recipe.class_) else \
        f"the class ranked {recipe.class_[3:]} by logit ({recipe.class_})"
    if recipe.layer_fusion == "rollout":
        return "none: attention rollout uses no gradient", "not applicable"
    if (answer := answer_target_text(recipe, attrs or {})) is not None:  # a VLM answer: the vocabulary softmax
        return answer
    dense = _target_scalar(attrs or {}, cls)
    z = "s" if dense else "z"
    if dense:  # what was differentiated is the target's score of the dense output, not a classifier logit
        one, every = dense
        scalar = {"logit": one,
                  "prob": f"the softmax probability p_c = softmax(s)_c of {cls} over {every}",
                  "logprob": f"the log-probability log p_c = log softmax(s)_c of {cls} over {every}"}[recipe.target]
    else:
        scalar = {"logit": "the raw logit z_c (pre-softmax)",
                  "prob": "the softmax probability p_c",
                  "logprob": "the log-probability log p_c"}[recipe.target] + f" of {cls}"
    how = f"direct: stored gradient of {z}_c" if recipe.target == "logit" else (
        f"derived exactly from the stored gradients: dp_c = p_c (d{z}_c - dE), E = sum_j p_j {z}_j with p detached"
        if recipe.target == "prob" else f"derived exactly: dlog p_c = d{z}_c - dE, E = sum_j p_j {z}_j, p detached")
    weighting = WEIGHTINGS.get(recipe.weighting)
    if weighting.scores:
        how = f"no gradient: {weighting.title} weights are model outputs on perturbed inputs, stored in the trace's " \
              f"{weighting.scores!r} variable by vc.score"
        if dense:
            how += f" (the target's score {z}_c of each perturbed input)"
        if weighting.uses_gradient:
            how = f"the stored gradient of {z}_c selects the top-{recipe.k} channels; {how}"
        return scalar, how
    if not weighting.uses_gradient:
        return f"none: {weighting.title or weighting.name} uses no gradient", "not applicable"
    return scalar, how


def _stage_modules(template: str, layer: Any, stages: list[list[int]]) -> str:
    """Module paths of a hierarchical model's blocks named by ``layer`` (global ints or "stage.block")."""
    where = {g: (s, b) for s, ids in enumerate(stages) for b, g in enumerate(ids)}
    total = len(where)
    wanted = list(where) if layer == "all" else list(layer) if isinstance(layer, tuple) else [layer]
    paths = []
    for v in wanted:
        if isinstance(v, str):
            s, b = (int(x) for x in STAGE_BLOCK.fullmatch(v).groups())
            if s >= len(stages) or not -len(stages[s]) <= b < len(stages[s]):
                continue
            s, b = s, b % len(stages[s])
        elif -total <= v < total:
            s, b = where[v % total]
        else:
            continue
        paths.append(template.replace("{stage}", str(s)).replace("{block}", str(b)))
    return ", ".join(paths) or template


def build_checklist(recipe: Recipe, trace: Any = None) -> Checklist:
    """Build the checklist of ``recipe``; pass a trace to add module paths, tokens and model facts.

    Example:
        >>> build_checklist(Recipe())["aggregation"]["weighting"][:7]
        'gradcam'
    """
    attrs = dict(getattr(trace, "attrs", {}) or {})
    hook = attrs.get(f"hook_{recipe.site}", "")
    module, _, io = hook.partition(":")
    if module and "{block}" in module and "stage_layers" in attrs:
        module = _stage_modules(module, recipe.layer, json.loads(attrs["stage_layers"]))
    elif module and is_int(recipe.layer) and "num_layers" in attrs:
        module = module.replace("{layer}", str(recipe.layer % int(attrs["num_layers"])))
    elif module:
        module = module.replace("{layer}", "<l>") + " for each block l listed"
    scalar, how = _target_text(recipe, attrs)
    prefix = int(attrs.get("num_prefix_tokens", -1))
    if trace is not None and "token_kind" in getattr(trace, "coords", {}):
        kinds = [str(k) for k in trace["token_kind"].values[:prefix]] if prefix > 0 else []
        prefix_text = f"{prefix} ({', '.join(kinds)})" if kinds else "none"
    else:
        prefix_text = "see trace"
    site_text = recipe.site
    if recipe.site == "F2":
        site_text += f" (softmax attention, key tokens of {ATTN_ROW_TEXT[recipe.attn_rows]})"
    weighting = recipe.weighting if recipe.layer_fusion not in ROLLOUTS else "not used"
    formula = WEIGHTINGS.get(recipe.weighting).formula
    heads = recipe.heads if recipe.site in HEAD_SITES else "not applicable (no heads at this site)"
    if is_int(recipe.heads):
        heads_text = f"head {recipe.heads} only"
    elif recipe.site in HEAD_SITES:
        heads_text = f"{heads}: {HEAD_RULE_TEXT[recipe.heads]}"
        if recipe.layer_fusion in ROLLOUTS:
            heads_text = "mean over heads (the rollout's own rule)"
    else:
        heads_text = heads
    weight_tokens = {"patch": "patch tokens only (prefix tokens dropped)", "all": "all tokens incl. prefix",
                     "cls": "the CLS token only"}[recipe.weight_tokens]
    if not WEIGHTINGS.get(recipe.weighting).pools_tokens or recipe.layer_fusion in ROLLOUTS:
        weight_tokens = "none (the formula is per token, no channel weights are pooled)"
    grid = f"{attrs['grid_h']} x {attrs['grid_w']} grid" if "grid_h" in attrs else "patch grid of the model"
    size = attrs.get("img_size", "the input size")
    checklist = Checklist({
        "feature representation": {
            "site": site_text,
            "module": module or "see trace (hook template per site)",
            "input or output": io or "see trace",
            "layer": _layer_text(recipe, int(attrs["num_layers"]) if "num_layers" in attrs else None,
                                 _traced_blocks(trace) if _words_apply(attrs) else None),
        },
        "gradient target": {
            "scalar": scalar,
            "derivation": how,
            "scores": str(attrs.get("target_scores", "classifier logits" if attrs else "see trace")),
            **json.loads(attrs.get("target_checklist", "{}")),  # a target's own items (e.g. each detection)
            **rule_items(attrs),
        },
        "token handling": {
            "prefix tokens present": prefix_text,
            "map over": "patch tokens only (prefix tokens have no grid position and are dropped from the map)",
            "weight tokens": weight_tokens,
        },
        "aggregation": {
            "weighting": f"{weighting}: {formula}" if weighting != "not used"
            else "not used",
            "heads": heads_text,
            "relu": ("ReLU applied to the rollout map before normalisation" if recipe.layer_fusion in ROLLOUTS
                     else "ReLU applied to each layer map before normalisation") if recipe.relu == "after"
            else "no ReLU (signed map)",
            "layer fusion": f"{recipe.layer_fusion}: {FUSION_TEXT[recipe.layer_fusion]}",
        },
        "spatial reconstruction": {
            "reshape": f"raster: row-major {grid} from the patch_row/patch_col of each token",
            "upsampling": "none (token grid)" if recipe.upsample == "none" else
            f"{recipe.upsample} to {size} (half-pixel centres, align_corners=False)",
            "normalisation": {"minmax": "min-max to [0, 1] per layer and again after upsampling and fusion",
                              "max": "divided by the maximum per layer and again after fusion",
                              "none": "none (raw values)"}[recipe.normalize],
        },
        "recipe": {"id": recipe.id, "json": recipe.to_json(), "preset": preset_text(recipe) or "none"},
    })
    if _words_apply(attrs):
        _add_map_words(checklist, recipe, trace, attrs)
    if attrs:
        checklist["model and input"] = {
            "model": _model_text(attrs),
            "weights sha256": str(attrs.get("weights_sha256", "?")),
            "input size": str(size),
            "preprocessing": str(attrs.get("preprocessing", "?")),  # then the resize and crop in words, where recorded
            **({"resize and crop": crop} if (crop := geometry_text(attrs.get("preprocessing"))) else {}),
            "attention backend": str(attrs.get("attention_backend",
                                               "explicit softmax attention (fused_attn=False) so F2 exists")),
            "trace id": str(attrs.get("trace_id", "?")),
            "versions": f"vitcam_nb {attrs.get('vitcam_nb_version', '?')}, torch "
                        f"{attrs.get('torch_version', '?')}, timm {attrs.get('timm_version', '?')}",
        }
        if _words_apply(attrs):  # 0.1 reports did not state them (the 0.1 contract reproduces those exactly)
            checklist["model and input"].update(_run_items(trace, attrs))
        if attrs.get("model_wrapper"):
            checklist["model and input"]["wrapper"] = str(attrs["model_wrapper"])
        if attrs.get("single_head_attention"):  # the model was changed for the trace: every map should say so
            checklist["model and input"]["single-head attention"] = (
                f"block(s) {attrs['single_head_attention']} ran as ONE head over all channels (traced inside "
                "vitcam_nb.adapters.single_head_attention), not with the model's own heads")
    return checklist


def _add_map_words(checklist: Checklist, recipe: Recipe, trace: Any, attrs: Any) -> None:
    """What the map shows, in words; the raster caveat; the position probe's R^2 when the trace holds one."""
    checklist["feature representation"]["what the map shows"] = map_words(recipe)
    if recipe.reshape == "raster":
        checklist["spatial reconstruction"]["raster order"] = RASTER_CAVEAT
    probe = _probe_text(recipe, trace, attrs)
    if probe:
        checklist["spatial reconstruction"]["position probe"] = probe


NOT_RECORDED = "not recorded"


def _run_items(trace: Any, attrs: Any) -> dict[str, str]:
    """Where and in which precision the pass ran and the trace is stored: maps of float16 and float32 traces
    differ in the last digits. A store keeps the device per image (a coordinate); an attribute a trace lacks is
    said to be not recorded."""
    device = str(attrs.get("device", ""))
    per_image = getattr(trace, "coords", {}).get("device") if trace is not None and not device else None
    if per_image is not None:
        device = ", ".join(sorted({str(v) for v in per_image.values.ravel()} - {""}))
    return {"device": device or NOT_RECORDED,
            "compute dtype": str(attrs.get("compute_dtype", NOT_RECORDED)),
            "storage dtype": str(attrs.get("dtype", NOT_RECORDED))}


def _run_words(mi: Any) -> str:
    """The methods paragraph's words for the device and dtypes of the checklist's ``model and input``."""
    if "device" not in mi:  # a 0.1 report
        return ""
    words = [f"{what} not recorded" if mi[item] == NOT_RECORDED else f"{how} {mi[item]}"
             for item, what, how in (("device", "device", "run on"), ("compute dtype", "compute dtype", "computed in"),
                                     ("storage dtype", "storage dtype", "stored as"))]
    return "; " + ", ".join(words)


def _model_text(attrs: Any) -> str:
    """The model line; traces since 0.2 say where the weights came from (0.1 files keep their 0.1 text)."""
    text = f"{attrs.get('model_name', '?')} ({attrs.get('pretrained_tag', '') or 'no tag'})"
    origin = attrs.get("weights_origin")
    if origin is None:
        return text
    if origin == "random-init":
        return f"{attrs.get('model_name', '?')} (random-init weights, untrained)"
    if str(origin).startswith(("bundled ", "pretrained ", "file ")):
        return f"{text}; weights {origin}"
    return f"{text}; weights of unknown origin (a tag is the config's, not a check of the loaded weights)"


def _reproduce_text(recipe: Recipe, trace: Any) -> str:
    """The recipe as a line a reader can paste (``Recipe.parse``, ``vitcam-nb cam``), its canonical id and the trace."""
    try:
        resolved = recipe.resolve(trace) if trace is not None else recipe
    except (RecipeError, TraceError, KeyError, TypeError):  # a trace that cannot place the layers: as written
        resolved = recipe
    trace_id = str(getattr(trace, "attrs", {}).get("trace_id", "")) if trace is not None else ""
    return (f"Recipe as text: {resolved.to_string()} (canonical id {resolved.id}"
            + (f"; trace {trace_id})." if trace_id else ")."))


def describe(recipe: Recipe, trace: Any = None, checklist: Checklist | None = None) -> str:
    """Render the recipe as a methods paragraph; ``checklist``: its checklist on ``trace``, if already built.

    Example:
        >>> describe(Recipe()).startswith("Heatmaps were computed")
        True
    """
    c = build_checklist(recipe, trace) if checklist is None else checklist
    fr, gt, th, ag, sr = (c[k] for k in ("feature representation", "gradient target", "token handling",
                                         "aggregation", "spatial reconstruction"))
    model = ""
    if "model and input" in c:
        mi = c["model and input"]
        model = (f" on {mi['model']} (weights sha256 {mi['weights sha256'][:12]}…, input {mi['input size']}"
                 f"{_run_words(mi)})")
    where = f"{fr['site']} at {fr['layer']}"
    if fr["module"] and not fr["module"].startswith("see"):
        where += f" (the {fr['input or output']} of {fr['module']})"
    words = "".join(f" {text[0].upper()}{text[1:]}." for text in (
        f"what the map shows: {fr['what the map shows']}" if "what the map shows" in fr else "",
        sr.get("raster order", ""),
        f"position probe: {sr['position probe']}" if "position probe" in sr else "") if text)
    if "what the map shows" in fr:  # 0.1 files keep their 0.1 paragraph (a contract)
        words += f" {_reproduce_text(recipe, trace)}"
    return (
        f"Heatmaps were computed with vitcam_nb recipe {recipe.id}{model}. "
        f"Feature representation: {where}. "
        f"Gradient target: {gt['scalar']}; {gt['derivation']}{rule_sentence(gt)}. "
        f"Token handling: prefix tokens {th['prefix tokens present']}; the map covers {th['map over']}; "
        f"channel weights pooled over: {th['weight tokens']}. "
        f"Aggregation: {ag['weighting']}; heads: {ag['heads']}; {ag['relu']}; layer fusion: {ag['layer fusion']}. "
        f"Spatial reconstruction: {sr['reshape']}; upsampling {sr['upsampling']}; normalisation {sr['normalisation']}."
        f"{words}")
