"""Issue #17, "no trace eats the machine", for the layouts beyond a flat token grid: the memory estimate of
hierarchical Swin models (timm V1/V2, Hugging Face Swin/Swinv2: per-stage grids, windowed attention stored as
``attn_window`` with its ``attn_window_key`` coordinate) and of BLIP (the vision tower plus the cross-attention
``xattn``) against the traces' own ``nbytes``, and the budget refusal before any model call."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
from vitcam_testing import assert_unchanged, snapshot

import vitcam_nb as vc


def timm_swin(v2: bool = False, img: int = 56, window: int = 7) -> torch.nn.Module:
    torch.manual_seed(0)
    name = "swinv2_tiny_window8_256" if v2 else "swin_tiny_patch4_window7_224"
    return timm.create_model(name, pretrained=False, depths=(2, 2), num_heads=(2, 4), embed_dim=16, img_size=img,
                             window_size=window, num_classes=5).eval()


def hf_swin(v2: bool = False, img: int = 56, window: int = 4) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    kw = dict(image_size=img, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=window,
              num_labels=5)
    if v2:
        return transformers.Swinv2ForImageClassification(transformers.Swinv2Config(**kw)).eval()
    return transformers.SwinForImageClassification(transformers.SwinConfig(**kw)).eval()


SWINS = {
    "timm": lambda: timm_swin(),
    # 8x8 then 4x4 grids under a 7x7 window: stage 0 is padded to 14x14 in the pass, stage 1's window shrinks to 4
    "timm_padded": lambda: timm_swin(img=32),
    "timm_v2": lambda: timm_swin(v2=True, img=32, window=4),
    "hf": lambda: hf_swin(),
    "hf_padded": lambda: hf_swin(img=40),  # 10x10 then 5x5 grids: Hugging Face pads both to a 4x4-window multiple
    "hf_v2": lambda: hf_swin(v2=True),
}
# (targets, sites, layers, dtype); V2 blocks are post-norm (no F1, F4), so the sites are ones every Swin has.
SETTINGS = [("top2", None, None, "float32"), ("top1", ["F6"], [-1], "float16"), ([0, 3], ["F2"], [0], "float32"),
            ("top3", ["F2", "F3", "resid_mid"], [1, 2], "float16")]


def image_of(model: torch.nn.Module) -> np.ndarray:
    size = model.config.image_size if hasattr(model, "config") else model.patch_embed.img_size[0]
    return np.random.default_rng(3).integers(0, 255, (size, size, 3), dtype=np.uint8)


def stored_bytes(tr: object, name: str) -> int:
    """A variable's bytes over every node of a trace (a Swin DataTree has one per stage)."""
    nodes = [n.to_dataset(inherit=False) for n in tr.subtree] if hasattr(tr, "subtree") else [tr]
    return sum(ds[name].nbytes for ds in nodes if name in ds.variables)


@pytest.mark.parametrize("kind", sorted(SWINS))
@pytest.mark.parametrize("setting", SETTINGS, ids=[f"{s[0]}-{s[1]}-{s[2]}-{s[3]}" for s in SETTINGS])
def test_the_swin_estimate_is_the_trace_size(kind, setting):
    targets, sites, layers, dtype = setting
    model = SWINS[kind]()
    image = image_of(model)
    est = vc.estimate(model, image, targets, sites=sites, layers=layers, dtype=dtype)
    tr = vc.trace(model, image, targets, sites=sites, layers=layers, dtype=dtype)
    assert est["dataset_bytes"] == pytest.approx(tr.nbytes, rel=0.01), (est, tr.nbytes)
    names = ("act", "grad", "attn_window", "attn_window_grad", "attn_window_key")
    assert {n: est["parts"].get(n, 0) for n in names} == {n: stored_bytes(tr, n) for n in names}
    assert est["tokens"] == [tr[c].sizes["token"] for c in sorted(tr.children)] or layers is not None


def test_the_swin_estimate_is_the_published_architecture_arithmetic():
    # swin_tiny at 224: four stages of 56x56, 28x28, 14x14, 7x7 tokens, widths 96..768, depths 2, 2, 6, 2,
    # heads 3, 6, 12, 24, 7x7 windows (49 keys per query); top5 gives 5 + 1 targets.
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False)
    est = vc.estimate(model, targets="top5", sites=["F1", "F2"])
    tokens, widths, depths, heads = [3136, 784, 196, 49], [96, 192, 384, 768], [2, 2, 6, 2], [3, 6, 12, 24]
    act = 4 * sum(t * c * d for t, c, d in zip(tokens, widths, depths))
    attn = 4 * sum(h * t * 49 * d for h, t, d in zip(heads, tokens, depths))
    assert est["parts"]["act"] == act and est["parts"]["grad"] == 6 * act
    assert est["parts"]["attn_window"] == attn and est["parts"]["attn_window_grad"] == 6 * attn
    # the raster token of each window key: int64, one per (layer, query, key), shared by the heads
    assert est["parts"]["attn_window_key"] == 8 * sum(t * 49 * d for t, d in zip(tokens, depths))
    assert est["parts"]["attn"] == 0
    assert est["tokens"] == tokens


@pytest.mark.parametrize("kind", ["timm", "hf_v2"])
def test_a_swin_trace_over_its_budget_is_refused_before_the_model_runs(kind):
    model = SWINS[kind]()
    image = image_of(model)
    before = snapshot(model)
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    need = vc.estimate(model, image, "top3")
    with pytest.raises(vc.TraceError, match=r"^max_bytes: this trace needs about .* Cheapest ways down: ") as info:
        vc.trace(model, image, "top3", max_bytes=need["dataset_bytes"])  # below every mode's peak
    handle.remove()
    message = str(info.value)
    assert calls == [] and f"Dataset {need['dataset_bytes'] / 1e9:.2f} GB" in message
    for way in ("targets='top1' -> ", "sites without 'F2' -> ", "layers=[-1] -> ", "dtype='float16' -> "):
        assert way in message
    assert "trace_many" not in message  # it stores flat layouts only: not a way down for Swin
    assert_unchanged(before, model)
    vc.trace(model, image, "top3", max_bytes=need["peak_bytes"])  # at the estimate: allowed


# -- BLIP image-text matching ----------------------------------------------------------------------------

IDS = torch.tensor([[1, 5, 6, 7, 5, 9, 2, 0]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])


def blip(vision_heads: int = 2) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BlipConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                         vocab_size=100, max_position_embeddings=16, pad_token_id=0, bos_token_id=1,
                         sep_token_id=2, is_decoder=True),
        vision_config=dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=vision_heads,
                           intermediate_size=64, image_size=32, patch_size=8),
        image_text_hidden_size=16)
    torch.manual_seed(0)
    return transformers.BlipForImageTextRetrieval(cfg).eval()


BLIP_SETTINGS = [(2, None, None, "float32"), (2, ["F1", "xattn"], [-1], "float16"), (4, ["F2"], [0, 2], "float32"),
                 (4, ["xattn", "F3"], None, "float16")]


@pytest.mark.parametrize("setting", BLIP_SETTINGS, ids=[f"{s[0]}heads-{s[1]}-{s[2]}-{s[3]}" for s in BLIP_SETTINGS])
def test_the_blip_estimate_is_the_trace_size(setting):
    vision_heads, sites, layers, dtype = setting
    model = blip(vision_heads)
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    target = vc.targets.itm(IDS, MASK)
    est = vc.estimate(model, x, target, sites=sites, layers=layers, dtype=dtype)
    tr = vc.trace(model, x, target, sites=sites, layers=layers, dtype=dtype)
    assert est["dataset_bytes"] == pytest.approx(tr.nbytes, rel=0.02), (est, tr.nbytes)
    for name in ("act", "grad", "attn", "attn_grad", "xattn", "xattn_grad"):
        assert est["parts"].get(name, 0) == stored_bytes(tr, name), name
    # 2 text layers x 2 heads x 8 text tokens x (1 + 4x4) vision keys, 3 targets (no match, match, expected)
    if "xattn" in tr:
        assert est["parts"]["xattn"] == 2 * 2 * 8 * 17 * (2 if dtype == "float16" else 4)


def test_a_blip_trace_over_its_budget_is_refused_before_the_model_runs():
    model = blip()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    target = vc.targets.itm(IDS, MASK)
    before = snapshot(model)
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    need = vc.estimate(model, x, target)
    with pytest.raises(vc.TraceError, match=r"^max_bytes: this trace needs about .* Cheapest ways down: ") as info:
        vc.trace(model, x, target, max_bytes=need["peak_bytes"] - 1)
    handle.remove()
    message = str(info.value)
    assert calls == [] and "sites without 'F2' -> " in message and "layers=[-1] -> " in message
    assert "targets='top1'" not in message and "trace_many" not in message
    assert_unchanged(before, model)
    vc.trace(model, x, target, max_bytes=need["peak_bytes"])
