"""Qwen2-VL and Qwen2.5-VL (``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``,
transformers 5) as generative VLM families: the two :class:`~vitcam_nb.adapters.hf_vlm.VlmFamily` rows and the
adapter that reads their tower.

What each site is for Qwen:

- tower sites F1..F6, resid_pre, attn_out, resid_mid on ``model.visual.blocks`` (:mod:`~vitcam_nb.adapters.
  qwen_tower`): the tower's patch tokens (14 px patches, no class token), stored in raster order of the h x w
  patch grid of ``image_grid_thw`` (the tower's own packed order, merge blocks and in Qwen2.5-VL windows, undone
  by its cell map), so the standard trace form maps them to the image;
- ``projector``: the output of ``model.visual.merger``, one token per 2x2 patch block (the merger concatenates a
  block's four patch vectors and runs its MLP: it is the projector); Qwen2.5-VL's merger emits the blocks in window
  order and the tower puts them back in raster order after it, so its rows are put in that order here;
- ``lm_resid`` / ``lm_attn``: the decoder layers' input residual stream and attention probabilities at the
  image-token positions (M-RoPE positions from ``image_grid_thw`` and ``mm_token_type_ids``, which the kit gives
  as the processor does: 1 at image tokens, 2 at video tokens, 0 elsewhere).

Input: the processor's ``pixel_values`` ``(N_patches, C*T*P*P)`` as the image and its ``image_grid_thw`` in the
answer target's ``model_kwargs``; one image per prompt. The trace's ``image`` is rebuilt from the patches (the
processor's mean/std undone: the ``processor`` given to the trace, else Qwen2-VL's defaults, the OpenAI CLIP
statistics).

Example:
    >>> from vitcam_nb.adapters.hf_vlm import VLM_FAMILIES
    >>> VLM_FAMILIES["qwen2_vl"].projector, VLM_FAMILIES["qwen2_5_vl"].token_types_key
    ('model.visual.merger', 'mm_token_type_ids')
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from vitcam_nb.adapters.base import SiteSpec, TraceContext
from vitcam_nb.adapters.hf import is_transformers_model
from vitcam_nb.adapters.hf_clip import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from vitcam_nb.adapters.hf_vlm import VLM_FAMILIES, HfVlmAdapter, VlmFamily, image_token_id, register_vlm_family
from vitcam_nb.adapters.qwen_tower import (
    BLOCKS,
    explicit_tower_attention,
    grid_of,
    merged_order,
    pack_order,
    packed_pixels,
    qwen_sites,
    unpatchify,
)
from vitcam_nb.adapters.registry import declare_family
from vitcam_nb.adapters.vlm_layout import ImageTokenLayout
from vitcam_nb.adapters.vlm_layouts.qwen import (
    QWEN2_5_VL_ANATOMY,
    QWEN2_VL_ANATOMY,
    qwen2_5_vl_layout,
    qwen2_vl_layout,
)
from vitcam_nb.core.errors import ArgumentError, TraceError

__all__ = ["HfQwenVlmAdapter", "QWEN_CLASSES", "mm_token_types"]

QWEN_CLASSES = (QWEN2_VL_ANATOMY.model_class, QWEN2_5_VL_ANATOMY.model_class)


def mm_token_types(model: torch.nn.Module, seq: torch.Tensor, n_prompt: int) -> torch.Tensor:
    """``mm_token_type_ids`` of a sequence as Qwen2-VL's processor makes them: 1 image, 2 video, 0 text.

    Example:
        >>> class M(torch.nn.Module): config = type("C", (), {"image_token_id": 5, "video_token_id": 6})()
        >>> mm_token_types(M(), torch.tensor([1, 5, 5, 6, 2]), 4).tolist()
        [0, 1, 1, 2, 0]
    """
    out = (seq == image_token_id(model)).long()
    video = getattr(model.config, "video_token_id", None)
    return out + 2 * (seq == int(video)).long() if video is not None else out


def _layout_fn(fn: Any) -> Any:
    def layout(model: torch.nn.Module, ids: np.ndarray, grid: tuple[int, int],
               extra: Mapping[str, Any] | None = None) -> ImageTokenLayout:
        extra = dict(extra or {})
        if extra.get("image_grid_thw") is None:
            raise TraceError(f"model_kwargs: {type(model).__name__} needs image_grid_thw (the processor's output for "
                             "the image), e.g. vc.targets.answer(..., model_kwargs={'image_grid_thw': "
                             "inputs['image_grid_thw']})")
        grid_of(extra["image_grid_thw"])  # one image per prompt
        types = extra.get("mm_token_type_ids")
        if types is not None and int(np.asarray(types).shape[-1]) != len(ids):
            raise TraceError(f"model_kwargs: mm_token_type_ids covers {np.asarray(types).shape[-1]} tokens but the "
                             f"prompt with its answer has {len(ids)}; leave it out (the kit makes it as the "
                             "processor does)")
        try:
            lay = fn(model.config, ids, extra["image_grid_thw"])
        except ArgumentError as exc:
            raise TraceError(f"input_ids: {exc}") from exc
        windows = " and window" if hasattr(model.config.vision_config, "fullatt_block_indexes") else ""
        return dataclasses.replace(lay, description=(
            f"{lay.description}; tower sites: one token per patch, no class token, the tower's merge-block{windows} "
            "order put in raster order of the patch grid by the tower's own cell map"))

    layout.__doc__ = (f"Qwen's layout (``{fn.__name__}``) of the prompt ``ids`` for the image of the target's "
                      "``image_grid_thw``: one token per 2x2 merged patch block, raster order over the merged grid.")
    return layout


_TYPES = ("mm_token_type_ids 1 at the image tokens, 2 at video tokens, 0 elsewhere (as the processor gives them; "
          "M-RoPE reads them with image_grid_thw)")
_READS = ("the last tower block's output; the merger (the projector) concatenates each 2x2 patch block and runs "
          "its MLP")
for _name, _anat, _fn in (("qwen2_vl", QWEN2_VL_ANATOMY, qwen2_vl_layout),
                          ("qwen2_5_vl", QWEN2_5_VL_ANATOMY, qwen2_5_vl_layout)):
    if _name not in VLM_FAMILIES:  # a reloaded module keeps the rows it registered
        register_vlm_family(VlmFamily(
            _name, (_anat.model_class,), tower="model.visual", projector=_anat.projector,
            lm_layers=_anat.lm_layers, layout=_layout_fn(_fn), tower_prefix=(), reads=_READS,
            token_types=mm_token_types, token_types_text=_TYPES, token_types_key="mm_token_type_ids"))


class _GridProbe(torch.nn.Module):
    """Passes the tower's ``grid_thw`` through, so the capture's grid hook reads the patch grid off it."""

    def forward(self, grid_thw: torch.Tensor) -> torch.Tensor:
        return grid_thw


@declare_family(needs="transformers", priority=365, before=("hf_vlm",))
class HfQwenVlmAdapter(HfVlmAdapter):
    """Qwen2-VL and Qwen2.5-VL: the Qwen tower's sites (no class token, packed patches put in raster order),
    ``projector`` (the merger), ``lm_resid`` and ``lm_attn``.

    Example:
        >>> HfQwenVlmAdapter().family, HfQwenVlmAdapter().prefix_kinds(None)
        ('hf_vlm_qwen', [])
    """

    family = "hf_vlm_qwen"
    classes = QWEN_CLASSES

    def matches(self, model: torch.nn.Module) -> bool:
        return is_transformers_model(model, QWEN_CLASSES)

    def backbone_path(self, model: torch.nn.Module) -> str:
        return "model.visual"

    def blocks_path(self, model: torch.nn.Module) -> str:
        return BLOCKS

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return list(model.get_submodule(BLOCKS))

    def site_table(self, model: torch.nn.Module) -> dict[str, SiteSpec]:
        return dict(qwen_sites(BLOCKS))

    def relative_sites(self, path: str) -> dict[str, SiteSpec]:
        return dict(qwen_sites(path))

    def prefix_kinds(self, model: torch.nn.Module) -> list[str]:
        return []  # the tower's sequence is patches only

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [blk.attn for blk in self.blocks(model)]

    def block_facts(self, model: torch.nn.Module, layer: int) -> dict[str, int]:
        attn = self.blocks(model)[layer].attn
        return {"num_heads": int(attn.num_heads), "head_dim": int(attn.head_dim), "stage_dim": int(attn.dim)}

    def tower_grid(self, model: torch.nn.Module) -> tuple[int, int]:
        """Not fixed: the grid of each image is its ``image_grid_thw`` (the layout reads that)."""
        return (0, 0)

    def grid_module(self, model: torch.nn.Module) -> torch.nn.Module:
        probe = getattr(model.get_submodule("model.visual"), "_vitcam_grid_probe", None)
        if probe is None:
            raise TraceError("model: the Qwen tower's grid is read during a trace only")
        return probe

    def grid_from_output(self, model: torch.nn.Module, output: torch.Tensor) -> tuple[int, int]:
        _, h, w = grid_of(output)
        return h, w

    @contextlib.contextmanager
    def tracing(self, ctx: TraceContext) -> Iterator[None]:
        """The explicit tower attention (F2), eager attention elsewhere, and a pre-hook on the tower recording the
        grid and the tower's token order into ``ctx.facts``; the model's ``rope_deltas`` (which its forward
        caches) restored after."""
        model = ctx.model
        visual, inner = model.get_submodule("model.visual"), model.get_submodule("model")
        probe = _GridProbe()
        saved = inner.__dict__.get("rope_deltas", None)

        def grab(_m: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
            ctx.facts["qwen_order"] = pack_order(model, grid)
            probe(grid)

        # the merger's (M, C) output passes through an identity as (1, M, C), the capture's batch of one
        merged = torch.nn.Identity()
        # not children: the module tree stays as it was
        object.__setattr__(visual, "_vitcam_grid_probe", probe)
        object.__setattr__(visual, "_vitcam_projector", merged)
        handles = [visual.register_forward_pre_hook(grab, with_kwargs=True),
                   visual.get_submodule("merger").register_forward_hook(lambda _m, _i, out: merged(out[None])[0])]
        try:
            with explicit_tower_attention(model):
                yield
        finally:
            for handle in handles:
                handle.remove()
            visual.__dict__.pop("_vitcam_grid_probe", None)
            visual.__dict__.pop("_vitcam_projector", None)
            inner.rope_deltas = saved

    def extra_sites(self, model: torch.nn.Module) -> dict[str, list[tuple[torch.nn.Module, str]]]:
        sites = super().extra_sites(model)
        merged = model.get_submodule("model.visual").__dict__.get("_vitcam_projector")
        if merged is not None:  # during a trace: the merger's output with its batch of one
            sites["projector"] = [(merged, "output")]
        return sites

    def arrange_traced(self, ctx: TraceContext, site: str, layer: int, tensor: torch.Tensor) -> torch.Tensor:
        """The packed (N, C) tower tensor (gradients (targets, N, C); F2 (heads, N, N)) as (1, token, channel)
        (gradients (targets, 1, ...)), tokens in raster order of the patch grid."""
        order = ctx.facts["qwen_order"].to(tensor.device)
        grad = tensor.ndim == (4 if site == "F2" else 3)
        out = tensor.index_select(-2, order)
        if site == "F2":
            out = out.index_select(-1, order)
        return out.unsqueeze(1) if grad else out.unsqueeze(0)

    def check_input(self, model: torch.nn.Module, x: torch.Tensor) -> None:
        c, tp, p = (int(getattr(model.config.vision_config, "in_channels", 3)),
                    int(model.config.vision_config.temporal_patch_size), int(model.config.vision_config.patch_size))
        if x.ndim != 3 or x.shape[0] != 1 or x.shape[-1] != c * tp * p * p:
            raise TraceError(f"image: expected packed pixel_values (1, N, {c * tp * p * p}) of one image, got "
                             f"{tuple(x.shape)}; trace one image with vitcam_nb.trace()")

    def prepare_input(self, model: torch.nn.Module, image: object, processor: object = None) -> Any:
        raise TraceError("image: Qwen2-VL's pixel_values are read with the answer target's image_grid_thw; trace it "
                         "with vitcam_nb.trace(model, pixel_values, targets=vc.targets.answer(..., "
                         "model_kwargs={'image_grid_thw': ...}))")

    def prepare_traced_input(self, model: torch.nn.Module, image: object, processor: object = None,
                             target: object = None) -> Any:
        """The packed ``pixel_values`` as given (1, N, C*T*P*P), and the image rebuilt from them for display."""
        from vitcam_nb.preprocess import PreparedInput  # the preprocessing module imports the adapters

        kwargs = getattr(target, "model_kwargs", None)
        if not isinstance(kwargs, Mapping) or kwargs.get("image_grid_thw") is None:
            raise TraceError("targets: Qwen2-VL is traced for an answer target with the processor's image_grid_thw: "
                             "vc.targets.answer(..., model_kwargs={'image_grid_thw': inputs['image_grid_thw']})")
        grid = kwargs["image_grid_thw"]
        x = packed_pixels(model, image, grid)
        mean, std, source = self._statistics(processor)
        img = unpatchify(model, x, grid) * torch.tensor(std)[:, None, None] + torch.tensor(mean)[:, None, None]
        display = np.round(img.clamp(0, 1).permute(1, 2, 0).numpy() * 255.0).astype(np.uint8)
        _, h, w = grid_of(grid)
        facts = {"input_kind": "pixel_values (used as given)", "image_grid_thw": [1, h, w],
                 "mean": list(mean), "std": list(std),
                 "display": f"patches put back at their cells, the first temporal copy, {source} undone for display"}
        return PreparedInput(x, display, facts)

    @staticmethod
    def _statistics(processor: object) -> tuple[tuple[float, ...], tuple[float, ...], str]:
        ip = getattr(processor, "image_processor", processor)
        mean, std = getattr(ip, "image_mean", None), getattr(ip, "image_std", None)
        if processor is not None and (mean is None or std is None):
            raise TraceError("processor: expected the model's processor or image processor (with image_mean and "
                             f"image_std), got {type(processor).__name__}")
        if processor is None:
            return OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, "Qwen2-VL's default normalisation (OpenAI CLIP mean/std)"
        return (tuple(float(v) for v in mean), tuple(float(v) for v in std),
                "the given processor's normalisation")

    def data_config(self, model: torch.nn.Module) -> dict:
        return {"input_size": (3, 0, 0), "mean": OPENAI_CLIP_MEAN, "std": OPENAI_CLIP_STD,
                "source": "Qwen2-VL image processor defaults (its size follows the image: image_grid_thw)"}

    def pooling(self, model: torch.nn.Module) -> str:
        return f"none: the merger projects {_READS.split(';')[0]} into the LM"

    def assemble_extra(self, model: torch.nn.Module, site: str, acts: list[np.ndarray], grads: list[np.ndarray],
                       target: object) -> tuple[dict, dict]:
        if site == "projector":
            # the merger's rows are merge blocks in the tower's order; the LM reads them in raster order
            kwargs = getattr(target, "model_kwargs", {}) or {}
            blocks = merged_order(model, kwargs.get("image_grid_thw")).numpy()
            acts = [a[:, blocks] for a in acts]
            grads = [g.reshape(g.shape[0], *a.shape)[:, :, blocks] for g, a in zip(grads, acts)]
        return super().assemble_extra(model, site, acts, grads, target)

    def describe(self, model: torch.nn.Module) -> dict[str, object]:
        vc, tc, fam = model.config.vision_config, model.config.text_config, self._family(model)
        heads = int(vc.num_heads)
        width = int(getattr(vc, "embed_dim", None) or vc.hidden_size)
        windows = (f"; windows of {int(vc.window_size)} px except at blocks {list(vc.fullatt_block_indexes)}"
                   if hasattr(vc, "fullatt_block_indexes") else "")
        impl = vc._attn_implementation_internal or "default"
        return {"num_heads": heads, "head_dim": width // heads, "embed_dim": width,
                "global_pool": self.pooling(model), "patch_size": int(vc.patch_size), "dynamic_img_size": 1,
                "position_encoding": "2-D rotary (row, col) on q and k" + windows,
                "token_order": "raster over the image_grid_thw patches (the tower's packed merge-block"
                               + (" and window" if windows else "") + " order undone)",
                "hf_class": type(model).__name__,
                "hf_name_or_path": str(getattr(model.config, "_name_or_path", "") or ""),
                "hf_attn_implementation": str(impl),
                "attention_backend": f"explicit attention per cu_seqlens chunk (the family's rotary and float32 "
                                     f"softmax; the model's {impl} implementation restored after) so F2 exists",
                "vlm_family": fam, "lm_num_layers": int(tc.num_hidden_layers),
                "lm_num_heads": int(tc.num_attention_heads), "lm_hidden_size": int(tc.hidden_size),
                "vision_feature_layer": "-1", "tower_layers_unused": "", "image_token_id": image_token_id(model)}

    @staticmethod
    def _family(model: torch.nn.Module) -> str:
        return "qwen2_5_vl" if is_transformers_model(model, (QWEN2_5_VL_ANATOMY.model_class,)) else "qwen2_vl"
