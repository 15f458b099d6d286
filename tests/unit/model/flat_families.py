"""The architecture families with a flat token layout that the adapter tests (``test_adapters*.py``) trace, each
described independently of vitcam_nb: BEiT, EVA / EVA-02, ViT / DeiT / DINOv2 variants, timm CLIP image towers,
and TinyNet, a transformer that is not timm's, with the adapter a user would write for it.

Every family is a tiny random-init model. Its sites are the modules docs/architecture.md ("The sites") names,
read from timm's source for each family and written out here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import timm
import torch
import torch.nn.functional as F
from torch import nn
from vitcam_testing import make_model

import vitcam_nb as vc
from vitcam_nb.adapters import Adapter, SiteSpec, register_adapter, unregister_adapter

torch.set_num_threads(1)

CORE = ("F1", "F2", "F3", "F4", "F5", "F6")


# --------------------------------------------------------------------------------------------------
# Tiny weights at a scale where attention, logits and gradients are O(1)


def redraw(model: nn.Module, seed: int = 0) -> nn.Module:
    """Redraw every parameter with a fixed seed. timm's init gives near-uniform attention and, with layer scale
    (init_values=1e-5), blocks that barely change the residual stream, which would hide wrong hooks."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("cls_token", "dist_token", "reg_token", "pos_embed", "cls", "pos",
                        "relative_position_bias_table"):
                p.copy_(0.5 * noise)
            elif leaf in ("gamma", "gamma_1", "gamma_2") or (leaf == "weight" and p.ndim == 1):
                p.copy_(1.0 + 0.2 * noise)  # layer scales and norm weights
            elif p.ndim >= 2:
                p.copy_(noise / math.sqrt(p[0].numel()))
            else:
                p.copy_(0.1 * noise)
    return model.eval()


def tiny_timm(name: str, seed: int = 0, **kwargs) -> nn.Module:
    """``timm.create_model(name, pretrained=False, **kwargs)`` with redrawn weights (never downloads)."""
    torch.manual_seed(seed)
    return redraw(timm.create_model(name, pretrained=False, **kwargs), seed)


# --------------------------------------------------------------------------------------------------
# A transformer that is not timm's, and the adapter a user would write for it


class TinyMixer(nn.Module):
    """Multi-head self-attention written out with an explicit ``nn.Softmax`` module (no fused path)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.softmax = nn.Softmax(dim=-1)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        a = self.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim))
        return self.out((a @ v).transpose(1, 2).reshape(b, n, c))


class TinyLayer(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln_attn = nn.LayerNorm(dim)
        self.mixer = TinyMixer(dim, heads)
        self.ln_ff = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.ln_attn(x))
        return x + self.ff(self.ln_ff(x))


class TinyNet(nn.Module):
    """Conv patchify, the class token appended *after* the patches (not timm's order), pre-norm layers."""

    def __init__(self, img: int = 24, patch: int = 6, dim: int = 24, heads: int = 3, depth: int = 2,
                 num_classes: int = 7):
        super().__init__()
        n = (img // patch) ** 2
        self.num_classes = num_classes
        self.patchify = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.zeros(1, n + 1, dim))
        self.layers = nn.ModuleList([TinyLayer(dim, heads) for _ in range(depth)])
        self.ln_out = nn.LayerNorm(dim)
        self.classifier = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.patchify(x).flatten(2).transpose(1, 2)
        t = torch.cat([t, self.cls.expand(t.shape[0], -1, -1)], dim=1) + self.pos
        for layer in self.layers:
            t = layer(t)
        return self.classifier(self.ln_out(t[:, -1]))


class TinyNetAdapter(Adapter):
    """The adapter a user writes for TinyNet: a site table, the token layout, and a reorder of the sequence to
    the schema's prefix-first order (the class token is last in TinyNet)."""

    family = "tinynet"
    block_template = "layers.{layer}"
    sites = {
        "F1": SiteSpec("ln_attn", "output", "LayerNorm output before attention"),
        "F2": SiteSpec("mixer.softmax", "output", "softmax attention matrix per head"),
        "F3": SiteSpec("mixer.out", "input", "heads concatenated, before the output projection"),
        "F4": SiteSpec("ln_ff", "output", "LayerNorm output before the MLP"),
        "F5": SiteSpec("ff", "output", "MLP output"),
        "F6": SiteSpec("", "output", "block output"),
        "resid_pre": SiteSpec("", "input", "block input"),
        "attn_out": SiteSpec("mixer", "output", "attention output after the projection"),
        "resid_mid": SiteSpec("ln_ff", "input", "residual stream after the attention residual"),
    }

    def matches(self, model):
        return isinstance(model, TinyNet)

    def blocks(self, model):
        return list(model.layers)

    def prefix_kinds(self, model):
        return ["cls"]

    def grid_module(self, model):
        return model.patchify

    def grid_from_output(self, model, output):
        return int(output.shape[-2]), int(output.shape[-1])

    def attention_modules(self, model):
        return []  # the attention is always explicit

    def describe(self, model):
        mixer = model.layers[0].mixer
        return {"num_heads": mixer.heads, "head_dim": mixer.head_dim, "global_pool": "token (last)",
                "patch_size": int(model.patchify.kernel_size[0]), "position_encoding": "absolute"}

    def arrange(self, model, site, layer, tensor):
        # TinyNet's class token is last; move it first. Negative dims: activations have a leading batch dim,
        # gradients a leading target dim as well.
        n = tensor.shape[-1] if site == "F2" else tensor.shape[-2]
        order = torch.tensor([n - 1, *range(n - 1)], device=tensor.device)
        if site == "F2":
            return tensor.index_select(-2, order).index_select(-1, order)
        return tensor.index_select(-2, order)


class registered:
    """``with registered(adapter):`` registers it first and always unregisters it on exit."""

    def __init__(self, adapter: Adapter):
        self.adapter = adapter

    def __enter__(self) -> Adapter:
        register_adapter(self.adapter)
        return self.adapter

    def __exit__(self, *exc: object) -> None:
        unregister_adapter(self.adapter)


def tiny_net(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return redraw(TinyNet(), seed)


# --------------------------------------------------------------------------------------------------
# The families, each described independently of vitcam_nb: where its sites are (from timm's source), its token
# order, its grid and its scores.

# (module path relative to the block, "input"/"output"), per site
PRE_NORM = {"F1": ("norm1", "output"), "F2": ("attn.attn_drop", "output"), "F3": ("attn.proj", "input"),
            "F4": ("norm2", "output"), "F5": ("mlp", "output"), "F6": ("", "output"), "resid_pre": ("", "input"),
            "attn_out": ("attn", "output"), "resid_mid": ("norm2", "input")}
# Eva attention: heads concatenated -> attn.norm (sub-LayerNorm or Identity) -> gate -> proj
EVA_PRE_NORM = {**PRE_NORM, "F3": ("attn.norm", "input")}
# EvaBlockPostNorm: x + norm1(attn(x)); x + norm2(mlp(x)); no LayerNorm before attention or MLP
EVA_POST_NORM = {"F2": ("attn.attn_drop", "output"), "F3": ("attn.norm", "input"), "F5": ("mlp", "output"),
                 "F6": ("", "output"), "resid_pre": ("", "input"), "attn_out": ("attn", "output"),
                 "resid_mid": ("mlp", "input")}
TINYNET = {"F1": ("ln_attn", "output"), "F2": ("mixer.softmax", "output"), "F3": ("mixer.out", "input"),
           "F4": ("ln_ff", "output"), "F5": ("ff", "output"), "F6": ("", "output"), "resid_pre": ("", "input"),
           "attn_out": ("mixer", "output"), "resid_mid": ("ln_ff", "input")}

SIM_VECTORS = torch.from_numpy(np.random.default_rng(7).normal(size=(3, 32)).astype(np.float32))


def class_scores(out: torch.Tensor) -> torch.Tensor:
    return out[0]


def cosine_scores(out: torch.Tensor, scale: float = 10.0) -> torch.Tensor:
    """The similarity target, written independently: scale * cos(embedding, v_i)."""
    return scale * F.cosine_similarity(out[0][None, :], SIM_VECTORS, dim=1)


@dataclass(frozen=True)
class Family:
    label: str
    build: Callable[[], nn.Module]
    input_hw: tuple[int, int]
    patch: int
    grid: tuple[int, int]
    prefix: tuple[str, ...]
    sites: dict
    block_list: str = "blocks"
    cls_last: bool = False  # the model's own sequence has its class token after the patches
    targets: Callable[[], object] = lambda: [1, 4]
    scores: Callable[[torch.Tensor], torch.Tensor] = class_scores
    adapter: Callable[[], Adapter] | None = None  # a user adapter to register while tracing

    @property
    def core_sites(self) -> list[str]:
        return [s for s in CORE if s in self.sites]

    @property
    def evidence_site(self) -> str:
        # a site of layer 0 that depends on its own patch only (before any attention)
        return "F1" if "F1" in self.sites else "resid_pre"


_C10 = dict(num_classes=10)
FAMILIES: dict[str, Family] = {f.label: f for f in [
    Family("vit", lambda: make_model("vit", depth=2), (32, 32), 8, (4, 4), ("cls",), PRE_NORM),
    Family("deit_distilled", lambda: make_model("deit_distilled", depth=2), (32, 32), 8, (4, 4), ("cls", "dist"),
           PRE_NORM),
    Family("vit_registers", lambda: make_model("vit_reg", depth=2), (32, 32), 8, (4, 4),
           ("cls", "reg", "reg", "reg", "reg"), PRE_NORM),
    Family("vit_avgpool_no_cls", lambda: make_model("vit_avgpool", depth=2), (32, 32), 8, (4, 4), (), PRE_NORM),
    Family("dinov2", lambda: tiny_timm("vit_small_patch14_dinov2", img_size=42, embed_dim=32, depth=2, num_heads=4,
                                       **_C10), (42, 42), 14, (3, 3), ("cls",), PRE_NORM),
    Family("dinov2_registers", lambda: tiny_timm("vit_small_patch14_reg4_dinov2", img_size=(28, 42), embed_dim=32,
                                                 depth=2, num_heads=4, **_C10),
           (28, 42), 14, (2, 3), ("cls", "reg", "reg", "reg", "reg"), PRE_NORM),
    Family("beit", lambda: tiny_timm("beitv2_base_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2,
                                     num_heads=4, **_C10), (32, 32), 8, (4, 4), ("cls",), PRE_NORM),
    Family("beit_shared_bias", lambda: tiny_timm("beit_base_patch16_224", img_size=32, patch_size=8, embed_dim=32,
                                                 depth=2, num_heads=4, use_abs_pos_emb=True, use_rel_pos_bias=False,
                                                 use_shared_rel_pos_bias=True, global_pool="token", **_C10),
           (32, 32), 8, (4, 4), ("cls",), PRE_NORM),
    Family("eva02", lambda: tiny_timm("eva02_tiny_patch14_224", img_size=28, patch_size=7, embed_dim=32, depth=2,
                                      num_heads=4, ref_feat_shape=(4, 4), **_C10),
           (28, 28), 7, (4, 4), ("cls",), EVA_PRE_NORM),
    Family("eva02_clip", lambda: tiny_timm("eva02_base_patch16_clip_224", img_size=32, patch_size=8, embed_dim=32,
                                           depth=2, num_heads=4, ref_feat_shape=(4, 4), **_C10),
           (32, 32), 8, (4, 4), ("cls",), EVA_PRE_NORM),
    Family("eva_postnorm", lambda: tiny_timm("eva02_enormous_patch14_clip_224", img_size=28, patch_size=7,
                                             embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0, **_C10),
           (28, 28), 7, (4, 4), ("cls",), EVA_POST_NORM),
    Family("eva_rope_registers", lambda: tiny_timm("vit_betwixt_patch16_rope_reg4_gap_256", img_size=(24, 40),
                                                   patch_size=8, embed_dim=32, depth=2, num_heads=4,
                                                   ref_feat_shape=(3, 5), **_C10),
           (24, 40), 8, (3, 5), ("reg", "reg", "reg", "reg"), EVA_PRE_NORM),
    Family("eva_pe_core", lambda: tiny_timm("vit_pe_core_tiny_patch16_384", img_size=32, patch_size=8, embed_dim=32,
                                            depth=2, num_heads=4, ref_feat_shape=(4, 4), attn_pool_num_heads=4,
                                            **_C10), (32, 32), 8, (4, 4), ("cls",), EVA_PRE_NORM),
    Family("clip_timm", lambda: tiny_timm("vit_base_patch16_clip_224", img_size=32, patch_size=8, embed_dim=32,
                                          depth=2, num_heads=4, num_classes=0), (32, 32), 8, (4, 4), ("cls",),
           PRE_NORM, targets=lambda: vc.targets.similarity(SIM_VECTORS, ["a", "b", "c"], scale=10.0),
           scores=cosine_scores),
    Family("custom_adapter", tiny_net, (24, 24), 6, (4, 4), ("cls",), TINYNET, block_list="layers", cls_last=True,
           adapter=TinyNetAdapter),
]}


def make_input(fam: Family, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn((1, 3, *fam.input_hw), generator=g)


def model_order(fam: Family) -> np.ndarray:
    """``order[t]``: position in the model's own sequence of trace token ``t`` (trace: prefix tokens first)."""
    n = len(fam.prefix) + fam.grid[0] * fam.grid[1]
    return np.array([n - 1, *range(n - 1)]) if fam.cls_last else np.arange(n)


def vc_trace(fam: Family, model: nn.Module, x: torch.Tensor, **kwargs):
    """vc.trace with the family's user adapter registered for the duration (and unregistered after)."""
    if fam.adapter is None:
        return vc.trace(model, x, **kwargs)
    with registered(fam.adapter()):
        return vc.trace(model, x, **kwargs)
