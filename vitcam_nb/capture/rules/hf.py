"""The backward rules on Hugging Face vision transformers (transformers 5 layout): ViT, DeiT, DINOv2 (with and
without registers), CLIP's and SigLIP's vision towers.

transformers computes ``softmax(q k^T) @ V`` in an attention *function* (eager during a trace), with no module
around the softmax matrix or the product. Every module the rules need is still there: the layer's attention holds
``q_proj``, ``k_proj``, ``v_proj`` and the output projection, so each rule is a set of hooks on them (added when
the pass starts, after the capture's, and removed when it ends):

- LayerNorm (every ``nn.LayerNorm`` of the vision backbone): standard deviation constant;
- the MLP's activation (``mlp.activation_fn``: GELU, its tanh forms, or CLIP's quick GELU): the identity rule
  (cp_lrp, attnlrp) or the gate detached (libragrad: ``Phi(x)``, or ``sigmoid(1.702 x)`` for the quick GELU);
- attention, constant (cp_lrp, libragrad): ``q_proj``'s and ``k_proj``'s outputs continue as new leaves. The
  softmax matrix, made of them alone, is then a function of constants: nothing flows into ``q k^T`` or further
  back, while the matrix itself (site F2, the weights the eager attention returns and multiplies with V) still
  has its gradient, the same as when the matrix itself is the leaf (timm's ``attn_drop``);
- attention, uniform (attnlrp): half the gradient into ``q_proj``'s and ``k_proj``'s outputs (``q k^T``) and
  into the output projection's input (``A @ V``: F3 holds the product's gradient, A and V half of it);
- SigLIP's attention-pooling head (a learned probe attending over the patches with ``nn.MultiheadAttention``):
  constant: its output keeps its value and takes the gradient of the same attention with the softmax matrix
  detached (the probe's query is a parameter, so only the keys carried gradient into it); uniform: half the
  gradient into its output (``A @ V``; the probe's ``q k^T`` is linear in the keys). Its MLP as the layers'.

The q/k hooks come after the capture's, so the optional sites ``q`` and ``k`` (CLIP, SigLIP) read the projection
outputs before the rule: their gradient is zero under a constant attention and halved under the uniform rule, as
on timm. The layer scales and the classifier are linear; ViT's pooler (``tanh``) takes its gradient.

Example:
    >>> import transformers
    >>> from vitcam_nb.adapters import find_adapter
    >>> from vitcam_nb.capture.rules import check_rule_for
    >>> cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
    ...                              num_attention_heads=2, intermediate_size=64)
    >>> m = transformers.ViTForImageClassification(cfg)
    >>> check_rule_for("attnlrp", m, find_adapter(m))
    'attnlrp'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch
import torch.nn.functional as F

from vitcam_nb.adapters.base import Adapter
from vitcam_nb.capture.hooks import removable_hooks
from vitcam_nb.capture.rules.base import RuleImpl
from vitcam_nb.capture.rules.common import (
    activation_hook,
    constant_output,
    gelu_variant,
    half_input,
    half_output,
    layer_norm_hook,
)
from vitcam_nb.capture.rules.grad import scale_gradient
from vitcam_nb.core.errors import TraceError

__all__ = ["HF_FAMILIES", "check_hf", "constant_attention_pool", "hf_hooks", "hf_impls"]

#: family -> (layer, attention and MLP class names of transformers, the models the rules cover)
HF_FAMILIES: dict[str, tuple[str, str, str, str]] = {
    "hf_vit": ("ViTLayer", "ViTAttention", "ViTMLP", "transformers ViTModel/ViTForImageClassification"),
    "hf_deit_distilled": ("DeiTLayer", "DeiTAttention", "DeiTMLP",
                          "transformers DeiTModel/DeiTForImageClassification(WithTeacher)"),
    "hf_clip": ("CLIPEncoderLayer", "CLIPAttention", "CLIPMLP",
                "transformers CLIPModel/CLIPVisionModel(WithProjection) vision tower"),
    "hf_siglip": ("SiglipEncoderLayer", "SiglipAttention", "SiglipMLP",
                  "transformers SiglipModel/SiglipVisionModel vision tower, with its attention-pooling head"),
    "hf_dinov2": ("Dinov2Layer", "Dinov2Attention", "Dinov2MLP",
                  "transformers Dinov2Model/Dinov2ForImageClassification with a GELU MLP (not SwiGLU)"),
    "hf_dinov2_registers": ("Dinov2WithRegistersLayer", "Dinov2WithRegistersAttention", "Dinov2WithRegistersMLP",
                            "transformers Dinov2WithRegistersModel/...ForImageClassification with a GELU MLP"),
}
#: The attention-pooling head of a SigLIP vision tower (a probe, nn.MultiheadAttention, a LayerNorm and an MLP).
POOL_HEAD = "SiglipMultiheadAttentionPoolingHead"
_GELU = "GELU (exact, tanh approximation or quick)"


def _check_mlp(where: str, what: str, mlp: torch.nn.Module, mlp_class: str) -> None:
    if type(mlp).__name__ != mlp_class or not all(isinstance(getattr(mlp, n, None), torch.nn.Linear)
                                                  for n in ("fc1", "fc2")):
        raise TraceError(f"{where} {what}'s MLP is a {type(mlp).__name__}, not {mlp_class} (fc1, activation, fc2)")
    act = getattr(mlp, "activation_fn", None)
    if act is None or gelu_variant(act) is None:
        raise TraceError(f"{where} {what}'s MLP activation is a {type(act).__name__}, not a {_GELU}")


def check_hf(model: torch.nn.Module, adapter: Adapter, rule: str) -> None:
    """Refuse a Hugging Face model whose vision backbone holds a module ``rule`` is not defined on here (another
    layer or attention class, a SwiGLU MLP or another activation, an RMS norm, another attention pooling).

    Example:
        >>> import transformers
        >>> from vitcam_nb.adapters import find_adapter
        >>> cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
        ...                              num_attention_heads=2, intermediate_size=64, hidden_act="relu")
        >>> m = transformers.ViTModel(cfg)
        >>> check_hf(m, find_adapter(m), "cp_lrp")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceError: rule: rule='cp_lrp' is defined here for transformers ViTModel...; layer 0's MLP activation ...
    """
    layer_class, attn_class, mlp_class, models = HF_FAMILIES[adapter.family]
    where = f"rule: rule={rule!r} is defined here for {models};"
    for i, layer in enumerate(adapter.blocks(model)):
        what = f"layer {i}"
        if type(layer).__name__ != layer_class:
            raise TraceError(f"{where} {what} is a {type(layer).__name__}, not {layer_class}")
        attn = getattr(layer, adapter.attention)
        if type(attn).__name__ != attn_class or not all(
                isinstance(getattr(attn, n, None), torch.nn.Linear)
                for n in ("q_proj", "k_proj", "v_proj", adapter.out_proj)):
            raise TraceError(f"{where} {what}'s attention is a {type(attn).__name__}, not {attn_class} with "
                             f"q_proj, k_proj, v_proj and {adapter.out_proj}")
        for name in (adapter.norm_before, adapter.norm_after):
            if not isinstance(getattr(layer, name), torch.nn.LayerNorm):
                raise TraceError(f"{where} {what}'s {name} is a {type(getattr(layer, name)).__name__}, not a "
                                 "LayerNorm")
        _check_mlp(where, what, layer.mlp, mlp_class)
    modules = dict(adapter.backbone(model).named_modules())
    pooling = set()
    for name, module in modules.items():
        if type(module).__name__ == POOL_HEAD:
            if not module.attention.batch_first or module.attention.in_proj_bias is None:
                raise TraceError(f"{where} {name}'s attention is not batch-first with an input bias")
            _check_mlp(where, name, module.mlp, mlp_class)
            pooling.add(module.attention)
    for name, module in modules.items():
        if "Norm" in type(module).__name__ and not isinstance(module, torch.nn.LayerNorm):
            raise TraceError(f"{where} {name} is a {type(module).__name__}, not a LayerNorm")
        if isinstance(module, torch.nn.MultiheadAttention) and module not in pooling:
            raise TraceError(f"{where} {name} is an nn.MultiheadAttention outside a {POOL_HEAD}")


def constant_attention_pool(mha: torch.nn.MultiheadAttention, args: tuple, out: tuple) -> tuple:
    """Forward hook on a batch-first ``nn.MultiheadAttention`` (SigLIP's pooling head): the output keeps its value
    and takes the gradient of the same attention with the softmax matrix detached (the gradient reaches the
    values only).

    Example:
        >>> mha = torch.nn.MultiheadAttention(4, 2, batch_first=True).eval()
        >>> q, kv = torch.randn(1, 1, 4), torch.randn(1, 3, 4, requires_grad=True)
        >>> out = mha(q, kv, kv)
        >>> bool(torch.equal(constant_attention_pool(mha, (q, kv, kv), out)[0], out[0]))
        True
    """
    query, key, value = args[:3]
    heads, width = mha.num_heads, mha.embed_dim // mha.num_heads
    w_q, w_k, w_v = mha.in_proj_weight.chunk(3)
    b_q, b_k, b_v = mha.in_proj_bias.chunk(3)

    def split(t: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # (N, L, E) -> (N, h, L, d)
        return F.linear(t, w, b).unflatten(-1, (heads, width)).transpose(1, 2)

    with torch.no_grad():
        probs = ((split(query, w_q, b_q) * width ** -0.5) @ split(key, w_k, b_k).transpose(-2, -1)).softmax(-1)
    mixed = (probs @ split(value, w_v, b_v)).transpose(1, 2).flatten(-2)
    path = F.linear(mixed, mha.out_proj.weight, mha.out_proj.bias)
    return (out[0].detach() + (path - path.detach()), *out[1:])


def _half_first_output(_module: torch.nn.Module, _args: tuple, out: tuple) -> tuple:
    return (scale_gradient(out[0], 0.5), *out[1:])


@contextlib.contextmanager
def hf_hooks(model: torch.nn.Module, adapter: Adapter, *, attention: str, gelu: str) -> Iterator[None]:
    """The hooks of one rule on a Hugging Face vision backbone, removed on exit, also on error.

    Example:
        >>> import transformers
        >>> from vitcam_nb.adapters import find_adapter
        >>> cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
        ...                              num_attention_heads=2, intermediate_size=64)
        >>> m = transformers.ViTModel(cfg)
        >>> with hf_hooks(m, find_adapter(m), attention="constant", gelu="gate"):
        ...     len(m.layers[0].attention.q_proj._forward_hooks)
        1
        >>> len(m.layers[0].attention.q_proj._forward_hooks)
        0
    """
    act = partial(activation_hook, gelu)
    with removable_hooks() as handles:
        for module in adapter.backbone(model).modules():
            if isinstance(module, torch.nn.LayerNorm):
                handles.append(module.register_forward_hook(layer_norm_hook, prepend=True))
            if type(module).__name__ == POOL_HEAD:
                handles.append(module.mlp.activation_fn.register_forward_hook(act, prepend=True))
                pool = constant_attention_pool if attention == "constant" else _half_first_output
                handles.append(module.attention.register_forward_hook(pool, prepend=True))
        for layer in adapter.blocks(model):
            handles.append(layer.mlp.activation_fn.register_forward_hook(act, prepend=True))
            attn = getattr(layer, adapter.attention)
            # appended, after the capture's hooks: the sites q and k read the projections before the rule
            for proj in (attn.q_proj, attn.k_proj):
                handles.append(proj.register_forward_hook(constant_output if attention == "constant"
                                                          else half_output))
            if attention == "uniform":
                handles.append(getattr(attn, adapter.out_proj).register_forward_pre_hook(half_input, prepend=True))
        yield


def hf_impls(rule: str, *, attention: str, gelu: str) -> list[RuleImpl]:
    """Rule ``rule`` on each Hugging Face family of :data:`HF_FAMILIES`, with the given attention and GELU treatment.

    Example:
        >>> [i.family for i in hf_impls("cp_lrp", attention="constant", gelu="identity")][:2]
        ['hf_vit', 'hf_deit_distilled']
    """
    return [RuleImpl(family, partial(check_hf, rule=rule), partial(hf_hooks, attention=attention, gelu=gelu), models)
            for family, (*_, models) in HF_FAMILIES.items()]
