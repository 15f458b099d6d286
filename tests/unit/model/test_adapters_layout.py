"""Token layout of the flat-layout families (issue #8): prefix kinds in the model's own order and patch tokens on
their pixel cells, for every family and for ViT / DINOv2 / BEiT / EVA models at full, non-square and dynamic
sizes, whose block 0 is checked against the independent reference."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from flat_families import EVA_PRE_NORM, FAMILIES, PRE_NORM, Family, model_order, tiny_timm
from flat_reference import family_run, reference, scalar_for
from torch import nn
from vitcam_testing import assert_rel_close, traced

import vitcam_nb as vc

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
