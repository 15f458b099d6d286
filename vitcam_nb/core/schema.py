"""The trace schema, written down once: site names, variables with their dimensions, coordinates,
attributes, and the names a hierarchical trace and a many-image store use.

This is the reference the code is held to: site lists, versions and the store's names are used from here, and
``docs/architecture.md`` shows the table :func:`markdown_table` renders (a test keeps the two equal). Names are
added, never renamed: files written by 0.1 (schema version 1) must keep loading.

Example:
    >>> VARIABLES["grad"].dims
    ('target', 'layer', 'site', 'token', 'channel')
    >>> target_name(207)
    'logit_207'
"""

from __future__ import annotations

from dataclasses import dataclass

from vitcam_nb.core.escape import escape_markdown

SCHEMA_VERSION = 1
SUPPORTED_SCHEMAS = (1,)

# -- sites ---------------------------------------------------------------------------------------------
CORE_SITES = ("F1", "F2", "F3", "F4", "F5", "F6")
EXTENDED_SITES = ("resid_pre", "attn_out", "resid_mid")
#: Per-head queries, keys and values (heads concatenated as channel groups, as F3), read only when asked for.
QKV_SITES = ("q", "k", "v")
#: Queries and keys passed through the attention's output projection (``out_proj(q)``; values only: they are not
#: on the path to the output, so their gradients are zero), as Grad-ECLIP's official code compares them.
PROJECTED_QK_SITES = ("q_out", "k_out")
#: Pre-softmax attention scores per head, stored like F2 and read only when asked for.
SCORES_SITE = "attn_scores"
#: A generative VLM's logit lens (the LM head's logits at the image tokens and the text context, for the token
#: activation map), stored in its own variables (lm_logit, lm_logit_text) and read only when asked for.
LOGIT_LENS_SITE = "lm_logit"
#: Sites read only when asked for by name (None leaves them out).
OPTIONAL_SITES = (*QKV_SITES, *PROJECTED_QK_SITES, SCORES_SITE, LOGIT_LENS_SITE)
ATTENTION_SITE = "F2"
#: Sites read outside the block stack (vision-language cross-attention; a generative VLM's projector, LM residual
#: stream and LM attention over the image tokens).
EXTRA_SITES = ("xattn", "projector", "lm_resid", "lm_attn", LOGIT_LENS_SITE)
#: Sites stored as (token, channel) in ``act`` / ``grad``.
TOKEN_SITES = ("F1", "F3", "F4", "F5", "F6", *EXTENDED_SITES, *QKV_SITES, *PROJECTED_QK_SITES)
SITES = (*CORE_SITES, *EXTENDED_SITES, *EXTRA_SITES, *QKV_SITES, *PROJECTED_QK_SITES, SCORES_SITE)
#: Sites with a head structure (heads as channel groups, or an attention matrix per head).
HEAD_SITES = ("F2", "F3", "xattn", "lm_attn")
#: Variables written by ``vc.score`` (model-in-the-loop weightings): one per kind of perturbation, and the
#: logsumexp of every perturbed input's scores, from which its prob / logprob targets follow exactly.
SCORE_VARIABLES = ("score", "ablation", "score_logsumexp", "ablation_logsumexp")
#: Other variables ``vc.score`` writes: integrated gradients (TAM, Beyond Intuition) and ViT-CX mask scores.
LOOP_VARIABLES = ("attn_grad_ig", "value_ratio", "vitcx_cluster", "vitcx_score")
#: The analysis variable ``vc.evaluate.position_probe`` returns, (site, layer): how well a ridge probe predicts each
#: patch token's grid position from its activations (cross-validated R^2). Not written by ``vc.trace``; a user may
#: store it in a trace, and every checklist of a map on that trace then quotes it.
POSITION_R2 = "position_r2"
SITE_MEANINGS = {
    "F1": "LayerNorm output before attention",
    "F2": "softmax attention per head",
    "F3": "attention output, heads concatenated, before the output projection",
    "F4": "LayerNorm output before the MLP",
    "F5": "MLP output",
    "F6": "residual stream after the block",
    "resid_pre": "residual stream entering the block",
    "attn_out": "attention output after the projection",
    "resid_mid": "residual stream after the attention residual",
    "xattn": "cross-attention of text queries over image keys",
    "q": "attention queries, heads concatenated (before the 1/sqrt(d) scale)",
    "k": "attention keys, heads concatenated",
    "v": "attention values, heads concatenated",
    "q_out": "queries through the attention's output projection (values only, zero gradient)",
    "k_out": "keys through the attention's output projection (values only, zero gradient)",
    "attn_scores": "pre-softmax attention scores per head (scaled q k^T, the softmax input)",
    "lm_logit": "a generative VLM's logit lens: the LM head's logits at the image tokens and the text context",
}

# -- targets -------------------------------------------------------------------------------------------
EXPECTED_TARGET = "expected_logit"
EXPECTED_LABEL = "expected logit"
#: Storage dtypes a trace may be written in (computation stays in the model's dtype).
STORAGE_DTYPES = ("float32", "float16")


def target_name(class_index: int) -> str:
    """Name of the logit target of a class in the trace's ``target`` coordinate.

    Example:
        >>> target_name(3)
        'logit_3'
    """
    return f"logit_{class_index}"


# -- variables, coordinates, attributes -----------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One named item of the schema: its dimensions (empty for attributes) and what it holds.

    Example:
        >>> VARIABLES["attn"].meaning
        'softmax attention (F2)'
    """

    dims: tuple[str, ...]
    meaning: str


VARIABLES: dict[str, Entry] = {
    "act": Entry(("layer", "site", "token", "channel"), "activations of the token sites"),
    "grad": Entry(("target", "layer", "site", "token", "channel"), "d target / d act"),
    "attn": Entry(("layer", "head", "query", "key"), "softmax attention (F2)"),
    "attn_grad": Entry(("target", "layer", "head", "query", "key"), "d target / d attn"),
    "attn_window": Entry(("layer", "head", "query", "wkey"), "window attention (F2 of Swin stages)"),
    "attn_window_grad": Entry(("target", "layer", "head", "query", "wkey"), "d target / d attn_window"),
    "xattn": Entry(("xattn_layer", "head", "text_token", "key"),
                   "cross-attention (site xattn); head is xattn_head when the text tower has another head count"),
    "xattn_grad": Entry(("target", "xattn_layer", "head", "text_token", "key"), "d target / d xattn"),
    "attn_scores": Entry(("layer", "head", "query", "key"),
                         "pre-softmax attention scores (site attn_scores, optional; softmax of it is F2)"),
    "attn_scores_grad": Entry(("target", "layer", "head", "query", "key"), "d target / d attn_scores"),
    "attn_plain_grad": Entry(("target", "layer", "head", "query", "key"),
                             "backward rule chefer_lrp only (where attn_grad holds the LRP relevance of F2): the "
                             "plain gradient d target / d attn, from a second batched backward of the same pass"),
    "score": Entry(("layer", "site", "target", "channel"),
                   "Score-CAM: target score of the input times each channel's upsampled min-max map (vc.score; NaN: "
                   "not scored)"),
    "ablation": Entry(("layer", "site", "target", "channel"),
                      "Ablation-CAM: target score with each channel zeroed at the site (vc.score; NaN: not scored)"),
    "score_logsumexp": Entry(("layer", "site", "channel"),
                             "logsumexp over all scores of each Score-CAM input, for prob / logprob targets "
                             "(vc.score)"),
    "ablation_logsumexp": Entry(("layer", "site", "channel"),
                                "logsumexp over all scores with each channel zeroed, for prob / logprob targets "
                                "(vc.score)"),
    "attn_grad_ig": Entry(("target", "head", "query", "key"),
                          "integrated gradient of the last block's attention: mean of d target / d attn at alpha x "
                          "over alpha in linspace(0, 1, ig_steps) (vc.score; TAM, Beyond Intuition)"),
    "value_ratio": Entry(("layer", "token"),
                         "Beyond Intuition token-wise: |v W_o| / |z| per token, v the values of all heads, W_o the "
                         "output projection, z the block input (vc.score)"),
    "vitcx_cluster": Entry(("channel",), "ViT-CX: the mask (cluster) each channel of F1 at vitcx_layer belongs to "
                                         "(vc.score)"),
    "vitcx_score": Entry(("target", "vitcx_mask"),
                         "ViT-CX: p_c(masked input + noise) - p_c(input + noise) per mask (vc.score; NaN: not a "
                         "class target)"),
    POSITION_R2: Entry(("site", "layer"), "optional, stored by the user: cross-validated R^2 of a ridge probe from the "
                                        "patch tokens' activations to their grid positions "
                                        "(vc.evaluate.position_probe); quoted by the checklist"),
    "logits": Entry(("class",), "the scores the targets are taken from (classifier logits, similarities)"),
    "image": Entry(("y", "x", "rgb"), "uint8 display copy of the model input"),
    "clip": Entry(("frame", "y", "x", "rgb"), "video traces only, instead of image: uint8 display copy of the clip's "
                                             "frames (min-max scaled over the clip for display)"),
}
COORDINATES: dict[str, Entry] = {
    "layer": Entry(("layer",), "global block index"),
    "site": Entry(("site",), "token site name"),
    "token": Entry(("token",), "token position in the sequence"),
    "token_kind": Entry(("token",), '"cls", "dist", "reg", "det" (a YOLOS detection token) or "patch"'),
    "patch_row": Entry(("token",), "grid row of a patch token, -1 for prefix tokens"),
    "patch_col": Entry(("token",), "grid column of a patch token, -1 for prefix tokens"),
    "patch_frame": Entry(("token",), "video traces only: frame or tubelet of a patch token on the (t, y, x) grid, -1 "
                                     "for prefix tokens (also query_patch_frame, key_patch_frame)"),
    "query": Entry(("query",), "query token (mirrors token; query_kind, query_patch_row/col)"),
    "key": Entry(("key",), "key token (mirrors token; key_kind, key_patch_row/col)"),
    "head": Entry(("head",), "attention head"),
    "attn_window_key": Entry(("layer", "query", "wkey"), "raster token of each window key, -1 for padding"),
    "target": Entry(("target",), "logit_<class> for each traced class, then expected_logit"),
    "target_class": Entry(("target",), "class of each target, -1 for the expected logit"),
    "target_label": Entry(("target",), "label of each target"),
    "class": Entry(("class",), "class index"),
    "class_label": Entry(("class",), "class name"),
    "text_token_str": Entry(("text_token",), "text of each text token (xattn)"),
    "text_token_mask": Entry(("text_token",), "1 where the text token is attended (xattn)"),
}
ATTRIBUTES: dict[str, Entry] = {
    "schema_version": Entry((), "1"),
    "trace_id": Entry((), "hash of what was asked: weights, input, classes, layers, sites, storage dtype (and "
                          "non-class targets); not of the numbers, which may differ in the last bits with "
                          "threads, device and versions (recorded in attrs)"),
    "model_name": Entry((), "architecture name"),
    "model_family": Entry((), "adapter family"),
    "pretrained_tag": Entry((), "pretrained tag from the model's config; empty for random-init weights"),
    "weights_origin": Entry((), "random-init, bundled <name> (file sha256 <hash>), pretrained <name.tag> from <source> "
                                "(file sha256 <hash>), file <name> (file sha256 <hash>) or unknown"),
    "weights_sha256": Entry((), "hash of the state dict's tensors (not of a weights file)"),
    "input_sha256": Entry((), "hash of the model input tensor"),
    "img_height": Entry((), "input height"),
    "img_width": Entry((), "input width"),
    "grid_h": Entry((), "patch grid rows"),
    "grid_w": Entry((), "patch grid columns"),
    "grid_t": Entry((), "video traces only: frames or tubelets of the (t, y, x) token grid"),
    "clip_frames": Entry((), "video traces only: frames of the traced clip"),
    "tubelet_size": Entry((), "video traces only: frames x rows x columns of pixels one token covers"),
    "token_order": Entry((), "video traces only: the order of the stored patch tokens, (t, y, x), and the model's own"),
    "num_prefix_tokens": Entry((), "tokens before the patches"),
    "num_layers": Entry((), "blocks in the model"),
    "num_heads": Entry((), "attention heads"),
    "preprocessing": Entry((), "canonical JSON of how the input was made"),
    "dtype": Entry((), "storage dtype"),
    "compute_dtype": Entry((), "dtype the model ran in"),
    "memory_mode": Entry((), "how the pass held its memory: plain, or blocks recomputed, one target at a time (the "
                             "head in <n> groups); the values are the same to float32 rounding. In a store: every "
                             "mode its batches ran in. Absent from traces and stores written before 0.2"),
    "device": Entry((), "device the pass ran on"),
    "torch_threads": Entry((), "torch.get_num_threads() during the pass (CPU sums may round differently)"),
    "deterministic": Entry((), "1: the pass ran with deterministic kernels"),
    "deterministic_settings": Entry((), "which settings made it deterministic"),
    "model_sites": Entry((), "sites this model has"),
    "model_optional_sites": Entry((), "optional sites (q, k, v, q_out, k_out, attn_scores) this model also has, "
                                      "read only when asked for"),
    "hook_<site>": Entry((), "module path template and input/output read for the site"),
    "single_head_attention": Entry((), "blocks (comma-separated) whose attention ran as ONE head over all channels "
                                       "(traced inside vitcam_nb.adapters.single_head_attention, as Grad-ECLIP's "
                                       "code); absent otherwise. Part of the trace id only when present"),
}

# -- hierarchical traces (Swin) ------------------------------------------------------------------------
#: Variables and coordinates a hierarchical trace keeps at its root (one child per stage holds the rest).
ROOT_VARS = ("logits", "image")
ROOT_COORDS = ("class", "class_label", "target", "target_class", "target_label", "y", "x", "rgb")

# -- many-image stores (trace_many) ---------------------------------------------------------------------
STORE_KIND = "vitcam_nb.traces"
#: What vc.map_many stores are marked with (here, below capture, so vc.save can refuse one by name).
MAPS_STORE_KIND = "vitcam_nb.maps"
STORE_VERSION = 1
SUPPORTED_STORE_VERSIONS = (1,)
#: Attributes only a store has (its own bookkeeping); a single image read from it drops them.
STORE_ATTRS = ("store_kind", "store_version", "settings", "settings_id", "n_expected", "n_images", "batch_size",
               "complete")
#: In a store the image dimension is ``image``, so the display copy is stored as ``pixels``.
STORE_PIXELS = "pixels"
#: Attributes of a single trace that differ from image to image: (image,) coordinates in a store.
PER_IMAGE_ATTRS = ("trace_id", "input_sha256", "preprocessing", "device", "deterministic")
#: Facts about the software that wrote a batch: a resumed run may differ; a store keeps its first run's.
ENV_ATTRS = ("vitcam_nb_version", "torch_version", "timm_version", "numpy_version", "xarray_version")
#: How a batch's pass held its memory: the budget chooses it batch by batch (the same values to float32 rounding), so
#: a store lists every mode its batches ran in ("; "-separated), and a store begun before it was recorded names none.
MODE_ATTR = "memory_mode"


# -- validation of a trace read from a file -------------------------------------------------------------
#: Dimension names a variable may use instead of the schema's (the text tower's own head count, BLIP).
DIM_ALTERNATIVES = {"xattn": {"head": "xattn_head"}, "xattn_grad": {"head": "xattn_head"}}


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (Python or NumPy), not a bool, a float or a string of digits.

    Example:
        >>> is_int(1), is_int(1.7), is_int("1"), is_int(True)
        (True, False, False, False)
    """
    import numbers

    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value).__name__ != "bool_"


def _attribute_problem(key: str, value: object) -> str | None:
    if isinstance(value, (str, float)) or is_int(value):
        return None
    shape = getattr(value, "shape", None)
    kind = f"{type(value).__name__} of shape {shape}" if shape is not None else type(value).__name__
    return f"attribute {key!r} is {kind}; a trace's attributes are single str, int or float values"


def _expected_dims(name: str) -> set[tuple[str, ...]]:
    dims = VARIABLES[name].dims
    swaps = DIM_ALTERNATIVES.get(name, {})
    return {dims, tuple(swaps.get(d, d) for d in dims)}


def problems(ds: object) -> list[str]:
    """What makes a Dataset read from a file no trace of this schema (empty when nothing does): attributes
    that are not single str/int/float values, a ``schema_version`` that is not an int, schema variables with
    other dimensions (a transposed ``grad``), and patch positions outside the patch grid (frames too, on a video
    trace's (t, y, x) grid).

    Example:
        >>> import numpy as np, xarray as xr
        >>> ds = xr.Dataset({"logits": ("class", np.zeros(3))}, attrs={"schema_version": 1.7})
        >>> problems(ds)
        ['schema_version is 1.7 (float); it is an int']
        >>> problems(xr.Dataset({"logits": (("class", "x"), np.zeros((3, 1)))}))
        ["variable 'logits' has dimensions ('class', 'x'); the schema's are ('class',)"]
    """
    attrs = dict(getattr(ds, "attrs", {}))
    out = [p for p in (_attribute_problem(str(k), v) for k, v in attrs.items()) if p]
    version = attrs.get("schema_version")
    if version is not None and not is_int(version) and not any("'schema_version'" in p for p in out):
        out.append(f"schema_version is {repr(version)[:40]} ({type(version).__name__}); it is an int")
    variables = getattr(ds, "variables", {})
    for name, var in variables.items():
        dims = tuple(var.dims)
        if dims[:1] == ("crop",) and "crops" in attrs:
            dims = dims[1:]  # a tower run on several crops of one image: one row per crop (vitcam_nb.capture.crops)
        if name in VARIABLES and dims not in _expected_dims(name):
            out.append(f"variable {name!r} has dimensions {tuple(var.dims)}; the schema's are {VARIABLES[name].dims}")
    for axis, size_key in (("row", "grid_h"), ("col", "grid_w"), ("frame", "grid_t")):
        size = attrs.get(size_key)
        if not is_int(size):
            continue
        for prefix in ("", "query_", "key_"):
            name = f"{prefix}patch_{axis}"
            if name not in variables:
                continue
            values = variables[name].values
            if values.dtype.kind not in "iu" or values.size and (values.min() < -1 or values.max() >= size):
                out.append(f"coordinate {name!r} holds values outside -1..{int(size) - 1} ({size_key} {size})")
    return out


def markdown_table() -> str:
    """The variables, coordinates and attributes as the markdown table ``docs/architecture.md`` shows.

    Example:
        >>> markdown_table().splitlines()[0]
        '| name | kind | dims | holds |'
    """
    rows = ["| name | kind | dims | holds |", "| --- | --- | --- | --- |"]
    for kind, table in (("variable", VARIABLES), ("coordinate", COORDINATES), ("attribute", ATTRIBUTES)):
        for name, entry in table.items():
            dims = ", ".join(entry.dims) if entry.dims else "—"
            # Meanings hold placeholders such as <name>: escaped, so that a page shows them instead of swallowing
            # them as HTML tags.
            rows.append(f"| `{name}` | {kind} | {dims} | {escape_markdown(entry.meaning, inline=True)} |")
    return "\n".join(rows)
