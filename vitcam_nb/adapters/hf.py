"""Adapters for Hugging Face ``transformers`` vision transformers with a flat token layout (``vitcam_nb[hf]``):
ViT, DeiT (class + distillation token), DINOv2, DINOv2 with registers and BEiT.

These families share one pre-norm layer (``x + attn(norm_before(x))``, then ``x + mlp(norm_after(x))``, with a
layer scale in DINOv2 and BEiT) and one attention module that returns ``(output, weights)``. With the eager
attention implementation the weights are the softmax matrix itself, so F2 is element 1 of the attention
module's output; the trace switches ``sdpa`` (or any other implementation) to eager and restores it after.
The layers of ``transformers`` 5 are read (``q_proj``/``k_proj``/``v_proj``/``o_proj`` attention); a model whose
layers do not have that layout is refused with the version to install.

transformers is never imported here: a model is recognised by its class name and module, so
``import vitcam_nb`` stays light.

Example:
    >>> HfVitAdapter().matches(object())
    False
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vitcam_nb.adapters.base import Adapter, SiteSpec
from vitcam_nb.adapters.registry import declare_family, scoped
from vitcam_nb.core import module_walk
from vitcam_nb.core.errors import ArgumentTypeError, TraceError

__all__ = ["HfBeitAdapter", "HfDeitAdapter", "HfDinov2Adapter", "HfDinov2RegistersAdapter", "HfSiteSpec",
           "HfVitAdapter", "eager_attention", "is_transformers_model", "transformers_configs"]

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
HALF_MEAN, HALF_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class HfSiteSpec(SiteSpec):
    """A site of a Hugging Face layer; ``blocks`` is the path of the layer list from the model's top (e.g.
    ``vit.layers``), so the checklist names the exact module whatever ``block_template`` says.

    Example:
        >>> HfSiteSpec("layernorm_before", "output", blocks="vit.layers").hook("")
        'vit.layers.{layer}.layernorm_before:output'
    """

    blocks: str = ""

    def hook(self, block_template: str) -> str:
        return super().hook(f"{self.blocks}.{{layer}}" if self.blocks else block_template)


def is_transformers_model(model: object, names: tuple[str, ...]) -> bool:
    """Whether ``model`` is (a subclass of) one of transformers' classes ``names``, without importing it.

    Example:
        >>> is_transformers_model(object(), ("ViTModel",))
        False
    """
    return any(cls.__name__ in names and cls.__module__.startswith("transformers") for cls in type(model).__mro__)


def transformers_configs(model: torch.nn.Module) -> list[Any]:
    """Every distinct Hugging Face config reachable from the model's modules, sub-configs included.

    Example:
        >>> transformers_configs(torch.nn.Linear(1, 1))
        []
    """
    seen: dict[int, Any] = {}
    for m in module_walk.modules(model):
        cfg = _config_of(m)
        if cfg is not None and hasattr(cfg, "_attn_implementation_internal"):
            seen.setdefault(id(cfg), cfg)
    for cfg in list(seen.values()):
        for name in ("vision_config", "text_config"):
            sub = getattr(cfg, name, None)
            if sub is not None and hasattr(sub, "_attn_implementation_internal"):
                seen.setdefault(id(sub), sub)
    return list(seen.values())


def _config_of(m: torch.nn.Module) -> Any:
    """``getattr(m, "config", None)`` without raising and catching an AttributeError on every module that has none
    (most of a model's; a trace walks them all)."""
    kind = type(m)
    if hasattr(kind, "config") or kind.__getattr__ is not torch.nn.Module.__getattr__ or \
            kind.__getattribute__ is not object.__getattribute__:
        return getattr(m, "config", None)
    if "config" in m.__dict__:
        return m.__dict__["config"]
    for where in (m._parameters, m._buffers, m._modules):  # where Module.__getattr__ looks, in its order
        if "config" in where:
            return where["config"]
    return None


@contextlib.contextmanager
def eager_attention(model: torch.nn.Module) -> Iterator[list[str]]:
    """Switch every config of the model to the eager attention implementation (the one that materialises the
    softmax matrix), yielding the implementations it replaced; restored on exit, also on error.

    Example:
        >>> with eager_attention(torch.nn.Linear(1, 1)) as replaced:
        ...     replaced
        []
    """
    saved = [(cfg, cfg._attn_implementation_internal) for cfg in transformers_configs(model)]
    try:
        replaced = []
        for cfg, impl in saved:
            if impl not in (None, "eager"):
                # The private field, not the property setter: the setter would also rewrite sub-configs.
                cfg._attn_implementation_internal = "eager"
                replaced.append(str(impl))
        yield replaced
    finally:
        for cfg, impl in saved:
            cfg._attn_implementation_internal = impl


@declare_family(needs="transformers", priority=200)
class HfVitAdapter(Adapter):
    """transformers ``ViTModel`` / ``ViTForImageClassification``: one class token, then the patches.

    Subclasses change the class names, the backbone attribute, the norm names, the prefix tokens and the
    image processor's defaults.

    Example:
        >>> a = HfVitAdapter()
        >>> a.family, a.classes[:2]
        ('hf_vit', ('ViTModel', 'ViTForImageClassification'))
    """

    family = "hf_vit"
    block_template = "{blocks}.{layer}"
    classes: tuple[str, ...] = ("ViTModel", "ViTForImageClassification", "ViTForMaskedImageModeling")
    base_prefix = "vit"
    norm_before, norm_after = "layernorm_before", "layernorm_after"
    attention, out_proj = "attention", "o_proj"
    patch_conv = "embeddings.patch_embeddings.projection"
    layer_scale = ""
    #: The image processor's defaults (transformers' ViTImageProcessor): resize to the size, no crop.
    processor_defaults: dict[str, Any] = {"mean": HALF_MEAN, "std": HALF_STD, "interpolation": "bilinear",
                                          "crop_pct": 1.0, "crop_mode": "squash"}
    interpolates = False  # the embeddings interpolate position embeddings at every input size (DINOv2)

    def matches(self, model: torch.nn.Module) -> bool:
        return is_transformers_model(model, self.classes)

    # ----------------------------------------------------------------------------- the module tree

    def backbone_path(self, model: torch.nn.Module) -> str:
        """Path of the backbone (``vit``) inside the model, "" when the model is the backbone itself.

        Example:
            >>> HfVitAdapter().backbone_path(torch.nn.Linear(1, 1))
            ''
        """
        return self.base_prefix if hasattr(model, self.base_prefix) else ""

    def backbone(self, model: torch.nn.Module) -> torch.nn.Module:
        """The backbone module (embeddings and layers).

        Example:
            >>> lin = torch.nn.Linear(1, 1)
            >>> HfVitAdapter().backbone(lin) is lin
            True
        """
        path = self.backbone_path(model)
        return model.get_submodule(path) if path else model

    def blocks_path(self, model: torch.nn.Module) -> str:
        """Path of the layer list from the model's top: ``vit.layers`` or ``dinov2.encoder.layer`` (found once per
        trace call: :func:`~vitcam_nb.adapters.registry.scoped`)."""
        return scoped(self, model, "blocks_path", lambda: self._blocks_path(model))

    def _blocks_path(self, model: torch.nn.Module) -> str:
        base, root = self.backbone(model), self.backbone_path(model)
        for rel in ("layers", "encoder.layer", "encoder.layers"):
            try:
                layers = base.get_submodule(rel)
            except AttributeError:
                continue
            if isinstance(layers, torch.nn.ModuleList):
                self._check_layout(model, layers)
                return f"{root}.{rel}" if root else rel
        raise ArgumentTypeError(f"model: {type(model).__name__} has no layer list at layers or encoder.layer; "
                                f"the {self.family} adapter does not fit it")

    def _check_layout(self, model: torch.nn.Module, layers: torch.nn.ModuleList) -> None:
        first = layers[0]
        attn = getattr(first, self.attention, None)
        if attn is None or not hasattr(attn, self.out_proj) or not hasattr(first, self.norm_before):
            raise ArgumentTypeError(f"model: {type(model).__name__}'s layers are not the transformers 5 layout "
                                    f"({self.attention} with q_proj/k_proj/v_proj/{self.out_proj}, "
                                    f"{self.norm_before}); the {self.family} adapter reads that layout: pip install "
                                    f"'transformers>=5'")

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return list(scoped(self, model, "blocks", lambda: model.get_submodule(self.blocks_path(model))))

    def site_table(self, model: torch.nn.Module) -> dict[str, SiteSpec]:  # a copy: the caller's to change
        return dict(scoped(self, model, "site_table", lambda: self.relative_sites(self.blocks_path(model))))

    def relative_sites(self, path: str) -> dict[str, SiteSpec]:
        """The site table with the layer list at ``path`` (the hook names start there).

        Example:
            >>> HfVitAdapter().relative_sites("vit.layers")["F1"].hook("")
            'vit.layers.{layer}.layernorm_before:output'
        """
        scaled = f" (before the layer scale {self.layer_scale})" if self.layer_scale else ""
        return {
            "F1": HfSiteSpec(self.norm_before, "output", "LayerNorm output before multi-head attention", path),
            "F2": HfSiteSpec(self.attention, "output[1]", "softmax attention matrix per head (the weights the "
                             "eager attention returns)", path),
            "F3": HfSiteSpec(f"{self.attention}.{self.out_proj}", "input",
                             "attention output, heads concatenated, before the output projection", path),
            "F4": HfSiteSpec(self.norm_after, "output", "LayerNorm output before the MLP", path),
            "F5": HfSiteSpec("mlp", "output", f"MLP output{scaled}", path),
            "F6": HfSiteSpec("", "output", "residual stream after the MLP (layer output)", path),
            "resid_pre": HfSiteSpec("", "input", "residual stream entering the layer", path),
            "attn_out": HfSiteSpec(self.attention, "output", f"attention output after {self.out_proj}{scaled}", path),
            "resid_mid": HfSiteSpec(self.norm_after, "input", "residual stream after the attention residual", path),
        }

    @property
    def sites(self) -> dict[str, SiteSpec]:  # type: ignore[override]
        """The sites of this family, module paths relative to a layer (:meth:`site_table` names them in full)."""
        return self.relative_sites("")

    def prefix_kinds(self, model: torch.nn.Module) -> list[str]:
        return ["cls"]

    def grid_module(self, model: torch.nn.Module) -> torch.nn.Module:
        # The convolution's output keeps the (rows, columns) grid that the patch embedding flattens.
        return self.backbone(model).get_submodule(self.patch_conv)

    def grid_from_output(self, model: torch.nn.Module, output: torch.Tensor) -> tuple[int, int]:
        return int(output.shape[-2]), int(output.shape[-1])

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [getattr(blk, self.attention) for blk in self.blocks(model)]

    # ----------------------------------------------------------------------------- the trace

    @contextlib.contextmanager
    def patched(self, model: torch.nn.Module) -> Iterator[None]:
        """Eager attention for the trace (sdpa and flash attention never materialise F2), restored after."""
        with eager_attention(model):
            yield

    def configured_size(self, model: torch.nn.Module) -> tuple[int, int]:
        """(height, width) the config's ``image_size`` states.

        Example:
            >>> class M(torch.nn.Module): config = type("C", (), {"image_size": 32})()
            >>> HfVitAdapter().configured_size(M())
            (32, 32)
        """
        size = self.vision_config(model).image_size
        return (int(size[0]), int(size[1])) if isinstance(size, (tuple, list)) else (int(size), int(size))

    def check_input(self, model: torch.nn.Module, x: torch.Tensor) -> None:
        got = (int(x.shape[-2]), int(x.shape[-1]))
        patch = int(self.vision_config(model).patch_size)
        if got[0] % patch or got[1] % patch:
            raise TraceError(f"image: {got[0]}x{got[1]} is not a multiple of the patch size {patch}; crop or resize "
                             "it")
        expected = self.configured_size(model)
        if not self.interpolates and got != expected:
            raise TraceError(f"image: the model was built for {expected[0]}x{expected[1]} input (config.image_size), "
                             f"got {got[0]}x{got[1]}; pass a PIL image or uint8 array to have it resized, or wrap the "
                             "model so that its forward passes interpolate_pos_encoding=True (its position "
                             "embeddings are fixed to the configured size otherwise)")

    def data_config(self, model: torch.nn.Module) -> dict:
        """The image processor's defaults for this family as a timm data config, at the config's image size;
        a processor handed to the trace replaces them.

        Example:
            >>> class M(torch.nn.Module): config = type("C", (), {"image_size": 32})()
            >>> HfVitAdapter().data_config(M())["mean"]
            (0.5, 0.5, 0.5)
        """
        h, w = self.configured_size(model)
        return {"input_size": (3, h, w), **self.processor_defaults,
                "source": f"defaults of the {self.family} image processor (no processor given)"}

    def vision_config(self, model: torch.nn.Module) -> Any:
        """The config of the vision tower (the model's own, or ``config.vision_config`` of a two-tower model).

        Example:
            >>> class M(torch.nn.Module): config = type("C", (), {"image_size": 32})()
            >>> HfVitAdapter().vision_config(M()).image_size
            32
        """
        return getattr(model.config, "vision_config", None) or model.config

    def describe(self, model: torch.nn.Module) -> dict[str, object]:
        cfg = self.vision_config(model)
        heads = int(cfg.num_attention_heads)
        return {
            "num_heads": heads,
            "head_dim": int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads),
            "embed_dim": int(cfg.hidden_size),
            "global_pool": self.pooling(model),
            "patch_size": int(cfg.patch_size),
            "dynamic_img_size": int(self.interpolates),
            "position_encoding": self.position_encoding(model),
            "hf_class": type(model).__name__,
            "hf_name_or_path": str(getattr(model.config, "_name_or_path", "") or ""),
            "hf_attn_implementation": str(cfg._attn_implementation_internal or "default"),
            "attention_backend": f"eager attention (the model's {cfg._attn_implementation_internal or 'default'} "
                                 "implementation switched to eager for the trace and restored after) so F2 exists",
        }

    def pooling(self, model: torch.nn.Module) -> str:
        """How the head reads the tokens (the trace's ``global_pool``).

        Example:
            >>> HfVitAdapter().pooling(torch.nn.Linear(1, 1))
            'none'
        """
        return "token (class token after the final LayerNorm)" if hasattr(model, "classifier") else "none"

    def position_encoding(self, model: torch.nn.Module) -> str:
        """The position encoding, for the trace attrs.

        Example:
            >>> HfVitAdapter().position_encoding(torch.nn.Linear(1, 1))
            'absolute'
        """
        return "absolute"


@declare_family(needs="transformers", priority=210)
class HfDeitAdapter(HfVitAdapter):
    """transformers DeiT (``DeiTModel``, ``DeiTForImageClassification(WithTeacher)``): class token, then the
    distillation token, then the patches. The teacher model's logits average the two heads.

    Example:
        >>> HfDeitAdapter().prefix_kinds(None)
        ['cls', 'dist']
    """

    family = "hf_deit_distilled"
    classes = ("DeiTModel", "DeiTForImageClassification", "DeiTForImageClassificationWithTeacher",
               "DeiTForMaskedImageModeling")
    base_prefix = "deit"
    #: DeiTImageProcessor: resize 256 bicubic, centre crop 224 (crop_pct 224/256), ImageNet statistics.
    processor_defaults = {"mean": IMAGENET_MEAN, "std": IMAGENET_STD, "interpolation": "bicubic",
                          "crop_pct": 0.875, "crop_mode": "center"}

    def prefix_kinds(self, model: torch.nn.Module) -> list[str]:
        # DeiTEmbeddings concatenates (class token, distillation token, patches).
        return ["cls", "dist"]

    def pooling(self, model: torch.nn.Module) -> str:
        if hasattr(model, "distillation_classifier"):
            return "token (mean of the class-token head and the distillation-token head)"
        return super().pooling(model)


@declare_family(needs="transformers", priority=220)
class HfDinov2Adapter(HfVitAdapter):
    """transformers ``Dinov2Model`` / ``Dinov2ForImageClassification``: class token, then the patches; layer
    scales after attention and MLP; position embeddings interpolated at every input size.

    Example:
        >>> HfDinov2Adapter().family
        'hf_dinov2'
    """

    family = "hf_dinov2"
    classes = ("Dinov2Model", "Dinov2ForImageClassification")
    base_prefix = "dinov2"
    norm_before, norm_after = "norm1", "norm2"
    layer_scale = "layer_scale1/2"
    #: BitImageProcessor as DINOv2 ships it: resize 256 bicubic, centre crop 224, ImageNet statistics.
    processor_defaults = {"mean": IMAGENET_MEAN, "std": IMAGENET_STD, "interpolation": "bicubic",
                          "crop_pct": 0.875, "crop_mode": "center"}
    interpolates = True

    def pooling(self, model: torch.nn.Module) -> str:
        if hasattr(model, "classifier"):
            return "class token and mean of the patch tokens, concatenated"
        return "none"

    def position_encoding(self, model: torch.nn.Module) -> str:
        return "absolute (interpolated to the input size)"


@declare_family(needs="transformers", priority=230)
class HfDinov2RegistersAdapter(HfDinov2Adapter):
    """transformers ``Dinov2WithRegistersModel`` / ``...ForImageClassification``: class token, the register
    tokens, then the patches.

    Example:
        >>> HfDinov2RegistersAdapter().family
        'hf_dinov2_registers'
    """

    family = "hf_dinov2_registers"
    classes = ("Dinov2WithRegistersModel", "Dinov2WithRegistersForImageClassification")
    base_prefix = "dinov2_with_registers"

    def prefix_kinds(self, model: torch.nn.Module) -> list[str]:
        # Dinov2WithRegistersEmbeddings inserts the registers between the class token and the patches.
        return ["cls"] + ["reg"] * int(model.config.num_register_tokens)


@declare_family(needs="transformers", priority=240)
class HfBeitAdapter(HfVitAdapter):
    """transformers ``BeitModel`` / ``BeitForImageClassification``: class token, then the patches; relative
    position bias added to the attention scores before the softmax; layer scales ``lambda_1``/``lambda_2``.

    Example:
        >>> HfBeitAdapter().family
        'hf_beit'
    """

    family = "hf_beit"
    classes = ("BeitModel", "BeitForImageClassification")
    base_prefix = "beit"
    layer_scale = "lambda_1/2"
    #: BeitImageProcessor: resize to the size bicubic, no crop, mean/std 0.5.
    processor_defaults = {"mean": HALF_MEAN, "std": HALF_STD, "interpolation": "bicubic", "crop_pct": 1.0,
                          "crop_mode": "squash"}

    def pooling(self, model: torch.nn.Module) -> str:
        if not hasattr(model, "classifier"):
            return "none"
        if getattr(model.config, "use_mean_pooling", True):
            return "avg (mean of the patch tokens, then the pooler's LayerNorm)"
        return "token (class token after the final LayerNorm)"

    def position_encoding(self, model: torch.nn.Module) -> str:
        cfg, parts = model.config, []
        if getattr(cfg, "use_absolute_position_embeddings", False):
            parts.append("absolute")
        if getattr(cfg, "use_relative_position_bias", False):
            parts.append("relative position bias")
        if getattr(cfg, "use_shared_relative_position_bias", False):
            parts.append("shared relative position bias")
        return " + ".join(parts) or "none"
