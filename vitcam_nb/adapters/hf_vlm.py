"""The adapter for generative vision-language models of Hugging Face ``transformers`` 5 (``vitcam_nb[hf]``):
a vision tower, a projector and a decoder-only language model that reads the projected image tokens.

Vision side: the tower's layers with the sites F1..F6 (and the extended ones) exactly as the tower's own family
adapter gives them (for LLaVA the CLIP tower of :class:`~vitcam_nb.adapters.hf_clip.HfClipAdapter`). Language
side, three extra sites stored at the image-token positions only (:class:`~vitcam_nb.adapters.vlm_layout.
ImageTokenLayout` says which sequence positions those are and where each lands in the image):

- ``projector``: the projector's output per image token (one "layer");
- ``lm_resid``: the residual stream entering each decoder layer (read as the input of the layer's
  ``input_layernorm``, which is that stream exactly, whether the layer got it positionally or as a keyword);
- ``lm_attn``: each decoder layer's attention probabilities, per head, from the query rows that predict the
  answer tokens to the image tokens' key columns (eager attention forced for the trace, restored after).

A family is one :class:`VlmFamily` row: class names, module paths and its image-token layout function, so a new
family plugs in with only those. Known generative VLM classes without a row are refused by name. Read today:
LLaVA (CLIP tower), PaliGemma and Gemma 3 (SigLIP towers, no class token; :mod:`~vitcam_nb.adapters.vlm_layouts`
gives their layouts); LLaVA-NeXT and LLaVA-OneVision (:mod:`~vitcam_nb.adapters.hf_vlm_anyres`), Idefics3 and SmolVLM
(:mod:`~vitcam_nb.adapters.hf_vlm_idefics`), whose towers run on crops (:mod:`~vitcam_nb.adapters.vlm_crops`);
Qwen2-VL and Qwen2.5-VL (:mod:`~vitcam_nb.adapters.hf_vlm_qwen`, their own tower sites).

transformers is never imported here: a model is recognised by its class name and module.

Example:
    >>> {"gemma3", "llava", "paligemma"} <= set(VLM_FAMILIES)  # and the rows other modules register
    True
    >>> HfVlmAdapter().matches(object())
    False
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vitcam_nb.adapters.family_memo import by_class
from vitcam_nb.adapters.hf import is_transformers_model
from vitcam_nb.adapters.hf_clip import HfClipAdapter
from vitcam_nb.adapters.registry import declare_family, scoped
from vitcam_nb.adapters.vlm_crops import crop_geometry, crops_input, projector_rows
from vitcam_nb.adapters.vlm_layout import ImageTokenLayout, layout_coords
from vitcam_nb.adapters.vlm_layout_scope import scoped_layout
from vitcam_nb.adapters.vlm_layouts.gemma import (
    GEMMA3_ANATOMY,
    PALIGEMMA_ANATOMY,
    gemma3_layout,
    paligemma_layout,
    paligemma_token_types,
)
from vitcam_nb.adapters.vlm_logit import assemble_lm_logit, lm_logit_hook
from vitcam_nb.adapters.vlm_rows import proj_rows
from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError, TraceError

__all__ = ["HfVlmAdapter", "LM_SITES", "NOT_YET_SUPPORTED", "NOT_YET_WHY", "VLM_FAMILIES", "VlmFamily",
           "llava_layout", "register_vlm_family", "vlm_family_of"]

#: A family's layout function: (model, full sequence ids (L,), tower patch grid (rows, cols), the target's extra
#: forward arguments such as ``image_sizes`` or ``image_grid_thw``) -> layout.
LayoutFn = Callable[[torch.nn.Module, np.ndarray, tuple[int, int], Mapping[str, Any]], ImageTokenLayout]

LM_SITES = ("projector", "lm_resid", "lm_attn", "lm_logit")


@dataclass(frozen=True)
class VlmFamily:
    """One generative VLM family: its transformers classes, where its parts live, and its image-token layout.

    ``tower`` is the vision tower's path (its layers at ``{tower}.encoder.layers``), ``projector`` the module
    whose output is the image tokens' embeddings, ``lm_layers`` the decoder layer list, ``lm_norm`` the module
    inside a decoder layer whose input is the layer's input residual stream, ``lm_attention`` the attention
    module returning ``(output, probabilities)`` under eager attention, ``tower_prefix`` the tower's prefix
    token kinds.

    Example:
        >>> VLM_FAMILIES["llava"].lm_layers
        'model.language_model.layers'
    """

    name: str
    classes: tuple[str, ...]
    tower: str
    projector: str
    lm_layers: str
    layout: LayoutFn
    lm_norm: str = "input_layernorm"
    lm_attention: str = "self_attn"
    tower_prefix: tuple[str, ...] = ("cls",)
    #: what the projector reads of the tower, for the checklist ("" : LLaVA's vision_feature_layer sentence)
    reads: str = ""
    #: the ``token_type_ids`` the family's processor and ``generate`` give a prompt followed by its answer
    #: ((model, sequence ids, prompt length) -> ids), and what they do; None: the family takes none
    token_types: Callable[[torch.nn.Module, torch.Tensor, int], torch.Tensor] | None = None
    token_types_text: str = ""
    #: the forward argument the token types go to (Qwen2-VL's M-RoPE reads ``mm_token_type_ids``)
    token_types_key: str = "token_type_ids"
    #: the tower runs on several crops of one image (any-resolution tiles, image splitting): its sites hold one
    #: row per crop (the tower-side capture reads this flag; a family without crops gives one row)
    crops: bool = False
    #: with crops: (model, sequence ids, the target's model_kwargs) -> the layout tile name each tower crop becomes,
    #: in the order the tower runs them ("" for a crop the LM never reads); the tower-side capture labels its rows
    crop_tiles: Callable[[torch.nn.Module, np.ndarray, Mapping[str, Any]], tuple[str, ...]] | None = None
    #: with crops: the same arguments -> the Tile each crop covers in the original image (padding undone), for
    #: crops that are no tile of the layout on their own (a resampled grid); None: the layout's tile of that name
    crop_boxes: Callable[[torch.nn.Module, np.ndarray, Mapping[str, Any]], tuple[Any, ...]] | None = None
    #: the (mean, std) the family's processor normalises pixels with, to show crops as the tower saw them
    #: (None: the tower config's, else CLIP's)
    mean_std: tuple[tuple[float, ...], tuple[float, ...]] | None = None


def image_token_id(model: torch.nn.Module) -> int:
    """The id of the model's image placeholder token (``config.image_token_id``, older ``image_token_index``).

    Example:
        >>> class M(torch.nn.Module): config = type("C", (), {"image_token_id": 7})()
        >>> image_token_id(M())
        7
    """
    cfg = model.config
    value = getattr(cfg, "image_token_id", None)
    value = getattr(cfg, "image_token_index", None) if value is None else value
    if value is None:
        raise TraceError(f"model: {type(model).__name__}'s config names no image token (image_token_id)")
    return int(value)


def unused_tower_layers(model: torch.nn.Module, n_layers: int, chosen: Any = None) -> list[int]:
    """Tower layers above the highest ``vision_feature_layer`` LLaVA reads (``chosen``, else the config's): the
    LM never sees their output.

    Example:
        >>> class M(torch.nn.Module): config = type("C", (), {"vision_feature_layer": -2})()
        >>> unused_tower_layers(M(), 3)
        [2]
    """
    chosen = getattr(model.config, "vision_feature_layer", -1) if chosen is None else chosen
    chosen = list(chosen) if isinstance(chosen, (list, tuple)) else [chosen]
    # hidden_states[i] is the embeddings for i = 0 and layer i-1's output after; negative i counts from n + 1.
    highest = max(int(i) % (n_layers + 1) for i in chosen)
    return list(range(highest, n_layers))


def llava_layout(model: torch.nn.Module, ids: np.ndarray, grid: tuple[int, int],
                 extra: Mapping[str, Any] | None = None) -> ImageTokenLayout:
    """LLaVA-1.5's layout: the placeholder tokens take the projected tower tokens in raster order; the tower's
    class token goes too when ``vision_feature_select_strategy="full"`` (it maps to no cell and is counted).

    Example:
        >>> class M(torch.nn.Module):
        ...     config = type("C", (), {"image_token_id": 9, "vision_feature_select_strategy": "default"})()
        >>> llava_layout(M(), np.array([1, 9, 9, 9, 9, 2]), (2, 2)).positions.tolist()
        [1, 2, 3, 4]
    """
    positions = np.flatnonzero(np.asarray(ids) == image_token_id(model))
    full = getattr(model.config, "vision_feature_select_strategy", "default") == "full"
    gh, gw = grid
    expected = gh * gw + int(full)
    if positions.size != expected:
        raise TraceError(f"input_ids: {positions.size} image placeholder tokens (id {image_token_id(model)}) but "
                         f"the {gh}x{gw} tower grid{' plus its class token' if full else ''} gives {expected}; "
                         "give the prompt the processor made for this image size")
    if not full:
        return ImageTokenLayout.raster(positions, (gh, gw), description=(
            f"LLaVA: {gh}x{gw} image tokens at sequence positions {positions[0]}..{positions[-1]}, the tower's "
            "patches in raster order (class token not passed to the LM)"))
    base = ImageTokenLayout.raster(positions[1:], (gh, gw))
    return ImageTokenLayout(base.positions, base.tile_of, base.rows, base.cols, base.tiles, (
        f"LLaVA (strategy full): {gh}x{gw} image tokens at sequence positions {positions[1]}..{positions[-1]} in "
        f"raster order; 1 class token at position {positions[0]} dropped"), {"class token": 1})


VLM_FAMILIES: dict[str, VlmFamily] = {
    "llava": VlmFamily("llava", ("LlavaForConditionalGeneration",), tower="model.vision_tower",
                       projector="model.multi_modal_projector", lm_layers="model.language_model.layers",
                       layout=llava_layout),
}

def paligemma_layout_of(model: torch.nn.Module, ids: np.ndarray, grid: tuple[int, int],
                        extra: Mapping[str, Any] | None = None) -> ImageTokenLayout:
    """PaliGemma (:func:`~vitcam_nb.adapters.vlm_layouts.paligemma_layout`): one token per SigLIP patch, raster
    order, the image tokens before the prompt; the first image of the prompt."""
    try:
        return paligemma_layout(model.config, ids)
    except ArgumentError as exc:
        raise TraceError(f"input_ids: {exc}") from exc


def gemma3_layout_of(model: torch.nn.Module, ids: np.ndarray, grid: tuple[int, int],
                     extra: Mapping[str, Any] | None = None) -> ImageTokenLayout:
    """Gemma 3 (:func:`~vitcam_nb.adapters.vlm_layouts.gemma3_layout`): the projector average-pools the patch
    grid into ``mm_tokens_per_image`` tokens, raster order; the first image of the prompt."""
    try:
        return gemma3_layout(model.config, ids)
    except ArgumentError as exc:
        raise TraceError(f"input_ids: {exc}") from exc


def _image_types(model: torch.nn.Module, seq: torch.Tensor, n_prompt: int) -> torch.Tensor:
    """Gemma 3: 1 at the image tokens, 0 elsewhere, as its processor gives them."""
    return (seq == image_token_id(model)).long()


_SIGLIP_LAST = ("the tower's last hidden state (after its post_layernorm), every tower layer read")
VLM_FAMILIES["paligemma"] = VlmFamily(
    "paligemma", (PALIGEMMA_ANATOMY.model_class,), tower="model.vision_tower",
    projector=PALIGEMMA_ANATOMY.projector, lm_layers=PALIGEMMA_ANATOMY.lm_layers, layout=paligemma_layout_of,
    tower_prefix=(), reads=f"{_SIGLIP_LAST}; a linear projector per patch", token_types=paligemma_token_types,
    token_types_text="token_type_ids 0 over the image and prompt, 1 over the answer (the prefix attends "
                     "bidirectionally, the answer causally, as with the processor and generate)")
VLM_FAMILIES["gemma3"] = VlmFamily(
    "gemma3", (GEMMA3_ANATOMY.model_class,), tower="model.vision_tower",
    projector=GEMMA3_ANATOMY.projector, lm_layers=GEMMA3_ANATOMY.lm_layers, layout=gemma3_layout_of,
    tower_prefix=(), reads=f"{_SIGLIP_LAST}; the projector average-pools the patch grid into "
                           "mm_tokens_per_image tokens", token_types=_image_types,
    token_types_text="token_type_ids 1 at the image tokens (they attend to each other bidirectionally, the text "
                     "causally, as with the processor)")

_TILED = ("its processor tiles the image (pixel_values hold a batch of crops per image), so the tower sites would "
          "need one trace row per crop; not read yet")
#: Why each family not read yet is refused (its layout in vitcam_nb.adapters.vlm_layouts is ready and tested).
NOT_YET_WHY: dict[str, str] = {
    "llava_next": _TILED, "llava_onevision": _TILED, "idefics3": _TILED, "smolvlm": _TILED,
    "qwen2_vl": "its tower is not CLIP-like (Qwen2VLVisionBlock over a packed patch sequence with a fused qkv, "
                "mm_token_type_ids in the forward): it needs its own tower site table; not read yet",
    "qwen2_5_vl": "its tower is not CLIP-like (window attention over a packed patch sequence, a fused qkv, "
                  "mm_token_type_ids in the forward): it needs its own tower site table; not read yet",
}

#: Generative VLM classes this kit knows but does not read yet: class name -> family name.
NOT_YET_SUPPORTED: dict[str, str] = {
    "LlavaNextForConditionalGeneration": "llava_next", "LlavaOnevisionForConditionalGeneration": "llava_onevision",
    "Qwen2VLForConditionalGeneration": "qwen2_vl", "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Idefics3ForConditionalGeneration": "idefics3", "SmolVLMForConditionalGeneration": "smolvlm",
}


def register_vlm_family(family: VlmFamily, *, replace: bool = False) -> VlmFamily:
    """Add a generative VLM family (one :class:`VlmFamily` row, usually from its own module under
    ``vitcam_nb/adapters``): the adapter then reads its classes, and they leave :data:`NOT_YET_SUPPORTED`.

    Example:
        >>> row = VlmFamily("llava", VLM_FAMILIES["llava"].classes, "model.vision_tower",
        ...                 "model.multi_modal_projector", "model.language_model.layers", llava_layout)
        >>> register_vlm_family(row, replace=True).name
        'llava'
    """
    if not isinstance(family, VlmFamily):
        raise ArgumentTypeError(f"family: expected a VlmFamily, got {type(family).__name__}")
    if family.name in VLM_FAMILIES and not replace:
        raise ArgumentError(f"family: a VLM family named {family.name!r} is registered; pass replace=True")
    VLM_FAMILIES[family.name] = family
    for cls in family.classes:
        NOT_YET_SUPPORTED.pop(cls, None)
        if cls not in HfVlmAdapter.classes:
            HfVlmAdapter.classes = (*HfVlmAdapter.classes, cls)
    return family


def vlm_family_of(model: object) -> VlmFamily:
    """The model's :class:`VlmFamily`, or an ArgumentTypeError naming a known VLM family not supported yet.

    Example:
        >>> vlm_family_of(object())  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        vitcam_nb.core.errors.ArgumentTypeError: model: ...
    """
    return by_class(model, VLM_FAMILIES, _find_family)  # found once per class and table of rows


def _find_family(model: object) -> VlmFamily:
    for fam in VLM_FAMILIES.values():
        if is_transformers_model(model, fam.classes):
            return fam
    for cls in type(model).__mro__:
        if cls.__name__ in NOT_YET_SUPPORTED and cls.__module__.startswith("transformers"):
            name = NOT_YET_SUPPORTED[cls.__name__]
            raise ArgumentTypeError(f"model: {cls.__name__} (VLM family {name!r}) is not supported yet: "
                                    f"{NOT_YET_WHY.get(name, 'not read yet')}; the generative VLM families read "
                                    f"today: {', '.join(sorted(VLM_FAMILIES))}")
    raise ArgumentTypeError(f"model: {type(model).__name__} is not a generative VLM this kit reads; supported: "
                            f"{', '.join(sorted(VLM_FAMILIES))}")


@declare_family(needs="transformers", priority=370)
class HfVlmAdapter(HfClipAdapter):
    """Generative VLMs (:data:`VLM_FAMILIES`): tower sites as the tower's family, plus ``projector``,
    ``lm_resid`` and ``lm_attn`` at the image-token positions.

    Example:
        >>> HfVlmAdapter().family
        'hf_vlm'
    """

    family = "hf_vlm"
    classes = tuple(c for fam in VLM_FAMILIES.values() for c in fam.classes) + tuple(NOT_YET_SUPPORTED)

    def backbone_path(self, model: torch.nn.Module) -> str:
        return vlm_family_of(model).tower

    def prefix_kinds(self, model: torch.nn.Module) -> list[str]:
        return list(vlm_family_of(model).tower_prefix)

    def pooling(self, model: torch.nn.Module) -> str:
        fam = vlm_family_of(model)
        if fam.reads:
            return f"none: {fam.name} projects {fam.reads} into the LM"
        strategy = getattr(model.config, "vision_feature_select_strategy", "default")
        return (f"none: {fam.name} projects the tower's hidden states of vision_feature_layer="
                f"{getattr(model.config, 'vision_feature_layer', -1)} ({strategy} strategy) into the LM")

    def lm_layers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The decoder layers of the language model."""
        return list(model.get_submodule(vlm_family_of(model).lm_layers))

    def extra_sites(self, model: torch.nn.Module) -> dict[str, list[tuple[torch.nn.Module, str]]]:
        fam, layers = vlm_family_of(model), self.lm_layers(model)
        return {"projector": [(model.get_submodule(fam.projector), "output")],
                "lm_resid": [(layer.get_submodule(fam.lm_norm), "input") for layer in layers],
                "lm_attn": [(layer.get_submodule(fam.lm_attention), "output[1]") for layer in layers],
                "lm_logit": lm_logit_hook(model, fam.lm_layers)}  # TAM's logit lens (vitcam_nb.adapters.vlm_logit)

    def runs_crops(self, model: torch.nn.Module) -> bool:
        return vlm_family_of(model).crops

    def data_config(self, model: torch.nn.Module) -> dict:
        """The CLIP processor's defaults, or the family's own mean and std (:attr:`VlmFamily.mean_std`)."""
        config = super().data_config(model)
        fam = vlm_family_of(model)
        if fam.mean_std is None:
            return config
        return {**config, "mean": tuple(fam.mean_std[0]), "std": tuple(fam.mean_std[1]),
                "source": f"defaults of the {fam.name} image processor (no processor given)"}

    def prepare_input(self, model: torch.nn.Module, image: object, processor: object = None) -> Any:
        """A crops family's input: the processor's pixel_values, used as given (:mod:`~vitcam_nb.adapters.
        vlm_crops`); None (the image rules) for a family whose tower sees the one image."""
        fam = vlm_family_of(model)
        if not fam.crops:
            return None
        return crops_input(model, image, processor, self.configured_size(model), fam.name, self.data_config(model))

    def crop_tiles(self, model: torch.nn.Module, target: object) -> tuple[str, ...]:
        """The layout tile each tower crop becomes, in the tower's order, for the answer ``target``."""
        fam, ids = vlm_family_of(model), getattr(target, "sequence", None)
        if fam.crop_tiles is None or ids is None:
            raise TraceError(f"targets: {fam.name} runs its tower on crops; its tower sites need the answer target "
                             "(vitcam_nb.targets.answer) and the family's crop_tiles")
        return tuple(fam.crop_tiles(model, np.asarray(ids), dict(getattr(target, "model_kwargs", None) or {})))

    def crop_geometry(self, model: torch.nn.Module, target: object) -> list[Any]:
        """The :class:`~vitcam_nb.adapters.vlm_layout.Tile` each tower crop covers (None: never read)."""
        fam, ids = vlm_family_of(model), np.asarray(getattr(target, "sequence", []))
        extra = dict(getattr(target, "model_kwargs", None) or {})
        boxes = fam.crop_boxes(model, ids, extra) if fam.crop_boxes is not None else None
        return crop_geometry(self.layout(model, ids, extra), self.crop_tiles(model, target), boxes)

    def tower_grid(self, model: torch.nn.Module) -> tuple[int, int]:
        """The tower's patch grid at its configured size (LLaVA's tower does not interpolate)."""
        h, w = self.configured_size(model)
        patch = int(self.vision_config(model).patch_size)
        return h // patch, w // patch

    def layout(self, model: torch.nn.Module, ids: np.ndarray, extra: Mapping[str, Any] | None = None
               ) -> ImageTokenLayout:
        """Where the image tokens of ``ids`` sit and which image cell each covers (``extra``: the target's extra forward
        arguments, e.g. ``image_sizes``, which some families' layouts read); computed once per trace call."""
        return scoped_layout(self, model, ids, extra, lambda: vlm_family_of(model).layout(
            model, np.asarray(ids), self.tower_grid(model), dict(extra or {})))

    def describe(self, model: torch.nn.Module) -> dict[str, object]:
        fam, tcfg = vlm_family_of(model), model.config.text_config
        n_tower = len(self.blocks(model))
        unused = unused_tower_layers(model, n_tower)
        return {**super().describe(model), "vlm_family": fam.name, "lm_num_layers": int(tcfg.num_hidden_layers),
                "lm_num_heads": int(tcfg.num_attention_heads), "lm_hidden_size": int(tcfg.hidden_size),
                "vision_feature_layer": str(getattr(model.config, "vision_feature_layer", -1)),
                # as configured; a target's vision_feature_layer argument overrides it (its checklist says so)
                "tower_layers_unused": ",".join(map(str, unused)),
                "image_token_id": image_token_id(model)}

    def assemble_extra(self, model: torch.nn.Module, site: str, acts: list[np.ndarray], grads: list[np.ndarray],
                       target: object) -> tuple[dict, dict]:
        ids, answer_pos = getattr(target, "sequence", None), getattr(target, "answer_positions", None)
        if ids is None or answer_pos is None:
            raise TraceError(f"targets: site {site!r} needs the answer target (vitcam_nb.targets.answer or "
                             "generated), which names the sequence and its answer tokens")
        fam = vlm_family_of(model)
        lay = self.layout(model, np.asarray(ids), getattr(target, "model_kwargs", None))
        pos = lay.positions
        # the same coordinates and attributes for every extra site of one call: built once (issue 55's trace cost)
        coords, layout_attrs = scoped(lay, model, "layout_coords", lambda: layout_coords(lay))
        coords = dict(coords)
        if site == "projector" and fam.crops:  # (crops, rows, channels): each image token is one crop's row
            crop, row = projector_rows(lay, self.crop_tiles(model, target), acts[0].shape[-2])
            attrs = {"hook": f"{fam.projector}:output", "meaning": "projector output per image token (the row of "
                     "the crop whose tile holds it)", **layout_attrs}
            return {"projector": (("image_token", "lm_channel"), acts[0][crop, row], attrs),
                    "projector_grad": (("target", "image_token", "lm_channel"), grads[0][:, crop, row], attrs)}, coords
        acts = [a[0] for a in acts]  # drop the batch of one
        grads = [g.reshape(g.shape[0], *a.shape) for g, a in zip(grads, acts)]
        if site == "lm_logit":
            return assemble_lm_logit(model, acts[0], np.asarray(ids), answer_pos, pos, image_token_id(model),
                                     list(getattr(target, "labels", [])), fam.lm_layers,
                                     layout_attrs, coords)
        if site == "projector":
            # The projector runs on the tower tokens alone: its rows are the image tokens in the layout's order (the
            # kept ones: a dropped class token is the first row under strategy "full", a later image's come after).
            act, grad = proj_rows(ids, image_token_id(model), pos, acts[0], grads[0])
            attrs = {"hook": f"{fam.projector}:output", "meaning": "projector output per image token", **layout_attrs}
            return {"projector": (("image_token", "lm_channel"), act, attrs),
                    "projector_grad": (("target", "image_token", "lm_channel"), grad, attrs)}, coords
        n = len(acts)
        coords["lm_layer"] = ("lm_layer", np.arange(n, dtype=np.int64))
        if site == "lm_resid":
            attrs = {"hook": f"{fam.lm_layers}.{{layer}}.{fam.lm_norm}:input",
                     "meaning": "residual stream entering the decoder layer (input of its first norm)", **layout_attrs}
            return {"lm_resid": (("lm_layer", "image_token", "lm_channel"), np.stack([a[pos] for a in acts]), attrs),
                    "lm_resid_grad": (("target", "lm_layer", "image_token", "lm_channel"),
                                      np.stack([g[:, pos] for g in grads], axis=1), attrs)}, coords
        if site != "lm_attn":
            raise TraceError(f"sites: the hf_vlm adapter has no extra site {site!r}")
        rows = np.asarray(answer_pos, dtype=np.int64) - 1  # the query rows whose outputs predict the answer tokens
        attrs = {"hook": f"{fam.lm_layers}.{{layer}}.{fam.lm_attention}:output[1]",
                 "meaning": "attention probabilities of the decoder (eager, after softmax and dropout) from the query "
                            "rows predicting each answer token (its position - 1) to the image-token key columns",
                 **layout_attrs}
        coords["lm_head"] = ("lm_head", np.arange(acts[0].shape[0], dtype=np.int64))
        coords["answer_token"] = ("answer_token", np.arange(rows.size, dtype=np.int64))
        coords["answer_token_pos"] = ("answer_token", np.asarray(answer_pos, dtype=np.int64))
        coords["answer_token_str"] = ("answer_token", np.array(list(getattr(target, "labels", []))[:rows.size]
                                                                 or [str(i) for i in range(rows.size)], dtype=str))
        attn = np.stack([a[:, rows][:, :, pos] for a in acts])
        attn_grad = np.stack([g[:, :, rows][:, :, :, pos] for g in grads], axis=1)
        return {"lm_attn": (("lm_layer", "lm_head", "answer_token", "image_token"), attn, attrs),
                "lm_attn_grad": (("target", "lm_layer", "lm_head", "answer_token", "image_token"), attn_grad,
                                 attrs)}, coords
