"""Architecture families with a flat token layout (issue #8): BEiT, EVA / EVA-02, ViT / DeiT / DINOv2 variants,
timm CLIP image towers, and a family registered by the user.

Every family is a tiny random-init model. The reference never calls vitcam_nb: it deep-copies the model, hooks
the modules that docs/architecture.md ("The sites") names for each site (read from timm's source for each family,
written out below), keeps the hooked tensors with ``retain_grad()`` and runs one fresh forward + ``backward()`` per
target scalar. Values are compared by coordinate label (``sel(site=..., layer=..., target=...)``), never by position.

Naming convention (scripts/support_matrix.py builds the README support matrix from it): ``test_site_reference``
and ``test_site_not_applicable`` have ids ``"<family>-<site>"``, one family label per matrix row.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn
from vitcam_testing import assert_rel_close, assert_unchanged, make_model, plain_presets, snapshot, traced

import vitcam_nb as vc
from vitcam_nb import presets
from vitcam_nb.adapters import Adapter, SiteSpec, find_adapter, register_adapter, supported_families, unregister_adapter

torch.set_num_threads(1)

CORE = ("F1", "F2", "F3", "F4", "F5", "F6")
ROOT = Path(__file__).resolve().parents[3]


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


# --------------------------------------------------------------------------------------------------
# The independent reference


def reference(fam: Family, model: nn.Module, x: torch.Tensor, scalar: Callable[[torch.Tensor], torch.Tensor]):
    """One forward + backward of ``scalar(scores)`` on a deep copy with my own hooks; returns
    ({(layer, site): (act, grad)} in the trace's token order, float64) and the scores."""
    m = copy.deepcopy(model).eval()
    for mod in m.modules():
        if hasattr(mod, "fused_attn"):
            mod.fused_attn = False
    store: dict[tuple[int, str], torch.Tensor] = {}

    def keep(key, t):
        assert key not in store, f"{key} fired twice"
        t.retain_grad()
        store[key] = t

    for layer, blk in enumerate(getattr(m, fam.block_list)):
        for site, (path, io) in fam.sites.items():
            mod = blk.get_submodule(path) if path else blk
            if io == "output":
                mod.register_forward_hook(lambda _m, _i, out, key=(layer, site): keep(key, out))
            else:
                mod.register_forward_pre_hook(lambda _m, args, key=(layer, site): keep(key, args[0]))
    order = model_order(fam)
    with torch.enable_grad():
        scores = fam.scores(m(x.detach().clone().requires_grad_(True)))
        scalar(scores).backward()
    out = {}
    for (layer, site), t in store.items():
        a, g = t.detach()[0].double().numpy(), t.grad[0].double().numpy()
        if site == "F2":
            a, g = a[:, order][:, :, order], g[:, order][:, :, order]
        else:
            a, g = a[order], g[order]
        out[(layer, site)] = (a, g)
    return out, scores.detach().double().numpy()


def expected_scalar(z: torch.Tensor) -> torch.Tensor:
    return (torch.softmax(z.detach(), dim=0) * z).sum()


def scalar_for(target_class: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return expected_scalar if target_class < 0 else (lambda z: z[target_class])






@functools.cache
def family_run(label: str):
    """(model, x, trace, {target: reference}, reference scores, state before, state after) of one family."""
    fam = FAMILIES[label]
    model, x = fam.build(), make_input(fam)
    before = snapshot(model)
    tr = vc_trace(fam, model, x, targets=fam.targets(), sites=list(fam.sites))
    after = snapshot(model)
    refs, ref_scores = {}, None
    for target, c in zip(tr["target"].values, tr["target_class"].values, strict=True):
        refs[str(target)], ref_scores = reference(fam, model, x, scalar_for(int(c)))
    return model, x, tr, refs, ref_scores, before, after


def _matrix(applicable: bool) -> list:
    return [pytest.param(label, site, id=f"{label}-{site}") for label, fam in FAMILIES.items() for site in CORE
            if (site in fam.sites) == applicable]


# --------------------------------------------------------------------------------------------------
# 1. The support matrix: every (family, site) against the reference; sites a family lacks are refused


@pytest.mark.parametrize(("label", "site"), _matrix(True))
def test_site_reference(label, site):
    fam = FAMILIES[label]
    model, _, tr, refs, ref_scores, _, _ = family_run(label)
    assert tr.attrs["model_family"] == (fam.adapter.family if fam.adapter else find_adapter(model).family)
    assert list(tr["layer"].values) == list(range(len(getattr(model, fam.block_list))))
    assert_rel_close(tr["logits"].values, ref_scores, f"{label} logits")
    for target, ref in refs.items():
        for layer in tr["layer"].values:
            act, grad = ref[(int(layer), site)]
            assert_rel_close(traced(tr, site, int(layer)), act, f"{label} act {site}@{layer}")
            assert_rel_close(traced(tr, site, int(layer), target), grad, f"{label} grad {site}@{layer} {target}")
    # the gradients are not trivially zero: a mistake in the hooks could not pass as "0 == 0"
    assert any(np.abs(ref[(0, site)][1]).max() > 0 for ref in refs.values())


@pytest.mark.parametrize(("label", "site"), _matrix(False))
def test_site_not_applicable(label, site):
    fam = FAMILIES[label]
    model, x = fam.build(), make_input(fam)
    before = snapshot(model)
    with pytest.raises(vc.TraceError) as info:
        vc_trace(fam, model, x, sites=[site])
    msg = str(info.value)
    assert msg.startswith("sites:") and f"{site!r}" in msg and "does not have" in msg
    listed = re.search(r"model has (\[.*\])", msg)
    assert listed, f"the refusal should list the model's sites: {msg}"
    for other in CORE:  # every site the family has, and not the refused one
        assert (f"'{other}'" in listed.group(1)) == (other in fam.sites), f"{other} in {listed.group(1)}"
    assert_unchanged(before, model)


# --------------------------------------------------------------------------------------------------
# 2. Token layout: prefix kinds in the model's real order, patch tokens on the right pixel cells


def assert_tokens_on_their_cells(fam: Family, model: nn.Module, x: torch.Tensor, tr) -> None:
    """Known evidence: with my own hook at layer 0 of a site that sees only its own token, d(token features) /
    d(image) is non-zero only inside the pixel cell of the token's (patch_row, patch_col), and zero everywhere
    for prefix tokens. Checks the first, last and one off-diagonal middle patch token, and every prefix token."""
    n_prefix = len(fam.prefix)
    rows, cols = tr["patch_row"].values, tr["patch_col"].values
    m = copy.deepcopy(model)
    path, io = fam.sites[fam.evidence_site]
    blk = getattr(m, fam.block_list)[0]
    mod = blk.get_submodule(path) if path else blk
    seen = {}
    if io == "output":
        mod.register_forward_hook(lambda _m, _i, out: seen.setdefault("t", out))
    else:
        mod.register_forward_pre_hook(lambda _m, args: seen.setdefault("t", args[0]))
    xx = x.clone().requires_grad_(True)
    with torch.enable_grad():
        m(xx)
    hooked, order, p = seen["t"], model_order(fam), fam.patch
    stored = traced(tr, fam.evidence_site, 0)
    patch_tokens = list(range(n_prefix, len(order)))
    checks = sorted({patch_tokens[0], patch_tokens[-1], patch_tokens[len(patch_tokens) // 2 + 1]}) + \
        list(range(n_prefix))
    for t in checks:
        assert_rel_close(stored[t], hooked[0, order[t]].detach().double(), f"{fam.label} token {t}")
        (g,) = torch.autograd.grad(hooked[0, order[t]].sum(), xx, retain_graph=True)
        support = g[0].abs().sum(0).numpy() > 0
        if t < n_prefix:  # a prefix token's layer-0 features do not depend on any pixel
            assert not support.any(), f"{fam.label}: prefix token {t} depends on pixels"
            continue
        cell = np.zeros_like(support)
        cell[rows[t] * p:(rows[t] + 1) * p, cols[t] * p:(cols[t] + 1) * p] = True
        assert support.any() and not (support & ~cell).any(), \
            f"{fam.label}: token {t} (row {rows[t]}, col {cols[t]}) depends on pixels outside its cell"


@pytest.mark.parametrize("label", list(FAMILIES))
def test_token_layout_and_grid(label):
    fam = FAMILIES[label]
    model, x, tr, _, _, _, _ = family_run(label)
    n_prefix = len(fam.prefix)
    gh, gw = fam.grid
    assert (tr.attrs["grid_h"], tr.attrs["grid_w"]) == (gh, gw)
    assert tr.attrs["num_prefix_tokens"] == n_prefix
    assert tuple(tr["token_kind"].values[:n_prefix]) == fam.prefix
    assert set(tr["token_kind"].values[n_prefix:]) == {"patch"}
    rows, cols = tr["patch_row"].values, tr["patch_col"].values
    assert (rows[:n_prefix] == -1).all() and (cols[:n_prefix] == -1).all()
    assert sorted(zip(rows[n_prefix:], cols[n_prefix:])) == [(r, c) for r in range(gh) for c in range(gw)]

    assert_tokens_on_their_cells(fam, model, x, tr)


PREFIX_PARAMS = {"cls_token": "cls", "dist_token": "dist", "reg_token": "reg", "cls": "cls"}


@pytest.mark.parametrize("label", list(FAMILIES))
def test_prefix_kinds_follow_the_model_sequence(label):
    """Perturb one prefix parameter (class, distillation, register j) at a time: the one sequence position of the
    first block's input that changes must be the trace token of that kind, in the model's order."""
    fam = FAMILIES[label]
    model, x, tr, _, _, _, _ = family_run(label)
    kinds, order = tr["token_kind"].values, model_order(fam)

    def block0_input(m):
        seen = {}
        getattr(m, fam.block_list)[0].register_forward_pre_hook(lambda _m, a: seen.setdefault("x", a[0]))
        with torch.no_grad():
            m(x)
        return seen["x"][0]

    base = block0_input(copy.deepcopy(model))
    found = []
    for name, kind in PREFIX_PARAMS.items():
        param = getattr(model, name, None)
        if not isinstance(param, torch.Tensor):
            continue
        for j in range(param.shape[1]):
            m = copy.deepcopy(model)
            with torch.no_grad():
                getattr(m, name)[0, j] += 1.0
            changed = np.flatnonzero((block0_input(m) - base).abs().sum(-1).numpy() > 0)
            assert len(changed) == 1, f"{name}[{j}] changed positions {changed}"
            t = int(np.flatnonzero(order == changed[0])[0])
            assert kinds[t] == kind, f"{name}[{j}] sits at trace token {t} of kind {kinds[t]}"
            found.append(t)
    assert sorted(found) == list(range(len(fam.prefix)))


# --------------------------------------------------------------------------------------------------
# 3. Presets, model state, adapter facts


@pytest.mark.parametrize("label", list(FAMILIES))
def test_presets_finite_and_model_unchanged(label):
    fam = FAMILIES[label]
    _, _, tr, _, _, before, after = family_run(label)
    for key in before:
        assert after[key] == before[key], f"{label}: model state {key!r} changed by the trace"
    first_token_site = next(s for s in fam.core_sites if s != "F2")
    h, w = fam.input_hw
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        for name in plain_presets():
            recipe = presets.get(name)
            if recipe.layer_fusion != "rollout":  # top1 may not be traced; rollout has no class at all
                recipe = recipe.replace(class_=int(tr["target_class"].values[0]))
            if recipe.site not in fam.sites:  # e.g. F1 of a post-norm model: refused, then another site
                with pytest.raises(vc.RecipeError, match="^site"):
                    vc.cam(tr, recipe)
                recipe = recipe.replace(site=first_token_site)
            if recipe.site == "F2" and recipe.attn_rows == "cls" and "cls" not in fam.prefix:
                with pytest.raises(vc.RecipeError, match="^attn_rows='cls'"):
                    vc.cam(tr, recipe)
                recipe = recipe.replace(attn_rows="mean")
            m = vc.cam(tr, recipe)
            assert m.shape == (h, w), f"{label} {name}: shape {m.shape}"
            assert np.isfinite(m.values).all(), f"{label} {name}: non-finite map"


@pytest.mark.parametrize(("label", "family", "encoding"), [
    ("beit", "beit", "relative position bias"),
    ("beit_shared_bias", "beit", "absolute + shared relative position bias"),
    ("eva02", "eva", "absolute + rope"),
    ("eva_postnorm", "eva", "absolute"),
    ("eva_rope_registers", "eva", "rope"),
    ("dinov2", "vit", "absolute"),
])
def test_describe_facts(label, family, encoding):
    fam = FAMILIES[label]
    model, _, tr, _, _, _, _ = family_run(label)
    blk = getattr(model, fam.block_list)[0]
    assert tr.attrs["model_family"] == family
    assert tr.attrs["position_encoding"] == encoding
    assert tr.attrs["num_heads"] == 4 and tr.attrs["head_dim"] == 8 and tr.attrs["embed_dim"] == 32
    assert tr.attrs["patch_size"] == fam.patch
    assert tr.attrs["num_heads"] == tr["attn"].sizes["head"] == blk.attn.num_heads
    assert tr.attrs["global_pool"] == (model.global_pool or "none")
    if family == "eva":
        assert tr.attrs["block_norm"] == ("post-norm" if label == "eva_postnorm" else "pre-norm")
    for k, v in tr.attrs.items():
        assert isinstance(v, (str, int, float)) and not isinstance(v, bool), f"attr {k} is {type(v)}"


@torch.no_grad()  # rebuilt from the weights: no autograd wanted
def test_eva_sub_layernorm_and_f3_meaning():
    """EVA-02 CLIP blocks have a sub-LayerNorm (attn.norm) between the heads and attn.proj: F3 is the raw head
    concatenation, rebuilt here from F2 and the value projection, and attn_out = proj(norm(F3))."""
    model, _, tr, _, _, _, _ = family_run("eva02_clip")
    for layer, blk in enumerate(model.blocks):
        attn = blk.attn
        assert not isinstance(attn.norm, nn.Identity) and tr.attrs["attn_sub_norm"] == 1
        f1 = torch.from_numpy(traced(tr, "F1", layer)).double()
        a = torch.from_numpy(traced(tr, "F2", layer)).double()
        v = F.linear(f1, attn.v_proj.weight.double(), attn.v_proj.bias.double())
        n, h = f1.shape[0], attn.num_heads
        f3 = (a @ v.reshape(n, h, -1).transpose(0, 1)).transpose(0, 1).reshape(n, -1)
        assert_rel_close(traced(tr, "F3", layer), f3, f"F3@{layer}")
        normed = F.layer_norm(f3, (f3.shape[-1],), attn.norm.weight.double(), attn.norm.bias.double(),
                              attn.norm.eps)
        out = F.linear(normed, attn.proj.weight.double(), attn.proj.bias.double())
        assert_rel_close(traced(tr, "attn_out", layer), out, f"attn_out@{layer}")
        np.testing.assert_allclose(traced(tr, "F2", layer).sum(-1), 1.0, atol=1e-5)


@torch.no_grad()  # rebuilt from the weights: no autograd wanted
def test_eva_postnorm_residuals():
    """Post-norm: F6 = resid_mid + norm2(F5) and resid_mid = resid_pre + norm1(attn_out)."""
    model, _, tr, _, _, _, _ = family_run("eva_postnorm")
    for layer, blk in enumerate(model.blocks):
        def t(site, layer=layer):
            return torch.from_numpy(traced(tr, site, layer)).double()

        def ln(norm, v):
            return F.layer_norm(v, (v.shape[-1],), norm.weight.double(), norm.bias.double(), norm.eps)

        assert_rel_close(t("resid_mid"), t("resid_pre") + ln(blk.norm1, t("attn_out")), f"resid_mid@{layer}")
        assert_rel_close(t("F6"), t("resid_mid") + ln(blk.norm2, t("F5")), f"F6@{layer}")


@torch.no_grad()  # rebuilt from the weights: no autograd wanted
def test_beit_attention_includes_the_relative_bias():
    """F2 of BEiT is softmax(q k^T / sqrt(d) + relative position bias), rebuilt from F1 and the weights."""
    model, _, tr, _, _, _, _ = family_run("beit")
    for layer, blk in enumerate(model.blocks):
        attn = blk.attn
        f1 = torch.from_numpy(traced(tr, "F1", layer)).double()
        bias = torch.cat([attn.q_bias, attn.k_bias, attn.v_bias]).double()
        n, h = f1.shape[0], attn.num_heads
        q, k, _ = F.linear(f1, attn.qkv.weight.double(), bias).reshape(n, 3, h, -1).permute(1, 2, 0, 3)
        table, index = attn.relative_position_bias_table.double(), attn.relative_position_index
        rel = table[index.reshape(-1)].reshape(n, n, h).permute(2, 0, 1)
        expected = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + rel, dim=-1)
        assert_rel_close(traced(tr, "F2", layer), expected, f"F2@{layer}")


# --------------------------------------------------------------------------------------------------
# 4. ViT / DINOv2 sizes: patch 14 and 16, 224, 384, 518 and non-square inputs, registers


def assert_block0_matches_reference(fam, model, x, tr, cls: int) -> None:
    """Logits, and block 0's activations and gradients (class ``cls`` and the expected logit) at the family's
    sites, against the autograd reference."""
    for target, c in ((f"logit_{cls}", cls), ("expected_logit", -1)):
        ref, scores = reference(fam, model, x, scalar_for(c))
        assert_rel_close(tr["logits"].values, scores, "logits")
        for site in fam.sites:
            assert_rel_close(traced(tr, site, 0), ref[(0, site)][0], f"act {site}")
            assert_rel_close(traced(tr, site, 0, target), ref[(0, site)][1], f"grad {site} {target}")


@pytest.mark.parametrize(("name", "img_size", "grid", "prefix", "extra"), [
    ("vit_small_patch16_224", 224, (14, 14), 1, {}),
    ("vit_small_patch16_384", 384, (24, 24), 1, {}),
    ("vit_small_patch14_dinov2", 518, (37, 37), 1, {}),
    ("vit_small_patch14_reg4_dinov2", 224, (16, 16), 5, {}),
    ("vit_small_patch14_dinov2", (42, 70), (3, 5), 1, {}),
    ("vit_small_patch16_224", (48, 80), (3, 5), 1, {}),
    ("vit_small_patch14_reg4_dinov2", (28, 56), (2, 4), 5, {"dynamic_img_size": True}),
], ids=["vit16-224", "vit16-384", "dinov2-518", "dinov2reg-224", "dinov2-42x70", "vit16-48x80", "dinov2reg-dyn"])
def test_vit_sizes(name, img_size, grid, prefix, extra):
    model = tiny_timm(name, img_size=img_size, embed_dim=16, depth=1, num_heads=2, num_classes=5, **extra)
    h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
    p = model.patch_embed.patch_size[0]
    x = torch.randn((1, 3, h, w), generator=torch.Generator().manual_seed(3))
    tr = vc.trace(model, x, targets=[2], sites=["F1", "F2", "F6"])
    assert (tr.attrs["grid_h"], tr.attrs["grid_w"]) == grid and tr.attrs["patch_size"] == p
    assert tr.sizes["token"] == prefix + grid[0] * grid[1]
    fam = Family(name, lambda: model, (h, w), p, grid, tuple(tr["token_kind"].values[:prefix]),
                 {s: PRE_NORM[s] for s in ("F1", "F2", "F6")})
    assert_block0_matches_reference(fam, model, x, tr, 2)
    assert_tokens_on_their_cells(fam, model, x, tr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        assert np.isfinite(vc.cam(tr, vc.Recipe(layer=0, class_=2)).values).all()


@pytest.mark.parametrize(("name", "kwargs", "hw", "grid", "sites"), [
    ("eva02_tiny_patch14_224", dict(img_size=28, patch_size=7, ref_feat_shape=(4, 4), dynamic_img_size=True),
     (21, 35), (3, 5), EVA_PRE_NORM),
    ("eva02_tiny_patch14_224", dict(img_size=224, ref_feat_shape=(16, 16)), (224, 224), (16, 16), EVA_PRE_NORM),
    ("beitv2_base_patch16_224", dict(img_size=(24, 40), patch_size=8), (24, 40), (3, 5), PRE_NORM),
], ids=["eva02-dynamic-21x35", "eva02-224", "beit-24x40"])
def test_beit_eva_sizes(name, kwargs, hw, grid, sites):
    """RoPE and relative position bias on non-square, dynamic and full-size grids."""
    model = tiny_timm(name, embed_dim=16, depth=1, num_heads=2, num_classes=5, **kwargs)
    x = torch.randn((1, 3, *hw), generator=torch.Generator().manual_seed(4))
    tr = vc.trace(model, x, targets=[3], sites=["F1", "F2", "F3"])
    assert (tr.attrs["grid_h"], tr.attrs["grid_w"]) == grid and tr.sizes["token"] == 1 + grid[0] * grid[1]
    fam = Family(name, lambda: model, hw, model.patch_embed.patch_size[0], grid, ("cls",),
                 {s: sites[s] for s in ("F1", "F2", "F3")})
    assert_block0_matches_reference(fam, model, x, tr, 3)
    assert_tokens_on_their_cells(fam, model, x, tr)


def test_weight_tokens_cls_refused_without_class_token():
    _, _, tr, _, _, _, _ = family_run("vit_avgpool_no_cls")
    assert tr.attrs["num_prefix_tokens"] == 0
    with pytest.raises(vc.RecipeError, match=r"^weight_tokens='cls'.*no prefix tokens.*'patch'"):
        vc.cam(tr, vc.Recipe(weight_tokens="cls", class_=1))
    with pytest.raises(vc.RecipeError, match=r"^attn_rows='cls'"):
        vc.cam(tr, vc.Recipe(site="F2", attn_rows="cls", class_=1))
    _, _, tr_reg, _, _, _, _ = family_run("eva_rope_registers")  # registers but no class token
    with pytest.raises(vc.RecipeError, match=r"^weight_tokens='cls'.*\['reg'\]"):
        vc.cam(tr_reg, vc.Recipe(weight_tokens="cls", class_=1))


# --------------------------------------------------------------------------------------------------
# 5. CLIP image towers: similarity targets


@pytest.mark.parametrize(("metric", "scale"), [("cosine", 10.0), ("dot", 0.5)])
def test_clip_similarity_logits_and_gradients(metric, scale):
    fam = FAMILIES["clip_timm"]
    model, x = fam.build(), make_input(fam, seed=1)
    target = vc.targets.similarity(SIM_VECTORS.numpy(), ["a", "b", "c"], metric=metric, scale=scale)
    tr = vc.trace(model, x, targets=target, sites=["F1", "F2", "F6"])

    def scores(out):
        e = out[0].double()
        v = SIM_VECTORS.double()
        return scale * (v @ e / (v.norm(dim=1) * e.norm()) if metric == "cosine" else v @ e)

    with torch.no_grad():
        expected = scores(copy.deepcopy(model)(x)).numpy()
    assert_rel_close(tr["logits"].values, expected, "similarities")
    assert list(tr["class_label"].values) == ["a", "b", "c"]
    assert tr.attrs["target_kind"] == "similarity" and tr.attrs["similarity_metric"] == metric
    fam = Family("clip", lambda: model, fam.input_hw, 8, (4, 4), ("cls",),
                 {s: PRE_NORM[s] for s in ("F1", "F2", "F6")}, scores=lambda out: scores(out).float())
    for target_name, c in zip(tr["target"].values, tr["target_class"].values, strict=True):
        ref, _ = reference(fam, model, x, scalar_for(int(c)))
        for layer in (0, 1):
            for site in ("F1", "F2", "F6"):
                assert_rel_close(traced(tr, site, layer, str(target_name)), ref[(layer, site)][1],
                                 f"{metric} grad {site}@{layer} {target_name}")


def test_clip_class_targets_refused_and_checklist_names_similarity():
    fam = FAMILIES["clip_timm"]
    model, x = fam.build(), make_input(fam)
    before = snapshot(model)
    with pytest.raises(vc.TraceError, match="num_classes=0.*similarity"):
        vc.trace(model, x, targets="top5")
    assert_unchanged(before, model)
    _, _, tr, _, _, _, _ = family_run("clip_timm")
    checklist = json.loads(vc.cam(tr, vc.Recipe()).attrs["checklist"])
    scores = checklist["gradient target"]["scores"]
    assert "cosine similarity" in scores and "3 given vectors" in scores and "times 10" in scores


# --------------------------------------------------------------------------------------------------
# 6. A user-supplied adapter


def test_unknown_family_refused_with_pointer_to_register_adapter():
    model = tiny_net()
    assert "tinynet" not in supported_families()
    with pytest.raises(TypeError, match=r"TinyNet.*register_adapter"):
        vc.trace(model, torch.randn(1, 3, 24, 24))


def test_custom_adapter_registration_is_undone():
    before = supported_families()
    adapter = TinyNetAdapter()
    with registered(adapter):
        assert supported_families()[0] == "tinynet"
        assert find_adapter(tiny_net()) is adapter
    assert supported_families() == before
    with pytest.raises(ValueError, match="not registered"):
        unregister_adapter(adapter)
    with pytest.raises(ValueError, match="no registered adapter of family 'tinynet'"):
        unregister_adapter("tinynet")


def test_custom_adapter_site_refusal_lists_its_sites():
    class NoF4(TinyNetAdapter):
        def site_table(self, model):
            return {k: v for k, v in self.sites.items() if k != "F4"}

    with registered(NoF4()):
        with pytest.raises(vc.TraceError, match=r"'F4'.*tinynet model has \['F1', 'F2', 'F3', 'F5', 'F6'"):
            vc.trace(tiny_net(), torch.randn(1, 3, 24, 24), sites=["F4"])
    assert "tinynet" not in supported_families()


def _readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Adding a model family", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "README: no python block under 'Adding a model family'"
    return blocks[0]


def test_readme_adapter_example_runs():
    before = supported_families()
    namespace: dict = {}
    exec(compile(_readme_snippet(), "README.md", "exec"), namespace)  # noqa: S102 (our own README)
    assert supported_families() == before, "the README example must unregister its adapter"
    tr = namespace["tr"]
    assert tr.attrs["model_family"] == "mynet"
    assert {"act", "grad", "attn", "attn_grad"} <= set(tr.data_vars)
    assert tr.attrs["grid_h"] * tr.attrs["grid_w"] == tr.sizes["token"] - 1


# --------------------------------------------------------------------------------------------------
# 7. The README support matrix agrees with the adapters


def _readme_matrix() -> dict[str, dict[str, str]]:
    text = (ROOT / "README.md").read_text()
    body = text.split("<!-- support-matrix:start -->", 1)[1].split("<!-- support-matrix:end -->", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    table = {}
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        table[cells[0].strip("`")] = dict(zip(header[1:], cells[1:], strict=True))
    return table


def test_readme_support_matrix_matches_site_tables():
    table = _readme_matrix()
    for label, fam in FAMILIES.items():
        assert label in table, f"README support matrix lacks {label}; run scripts/support_matrix.py"
        model = fam.build()
        adapter = fam.adapter() if fam.adapter else find_adapter(model)
        sites = adapter.site_table(model)
        for site, cell in table[label].items():
            if cell == "✓":
                assert site in sites, f"README: {label} {site} marked working but the adapter lacks it"
            elif cell == "n/a":
                assert site not in sites, f"README: {label} {site} marked n/a but the adapter lists it"
        assert {s for s, c in table[label].items() if c == "✓"} | {s for s, c in table[label].items()
                                                                   if c == "n/a"} == set(CORE)
