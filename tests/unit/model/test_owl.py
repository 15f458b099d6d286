"""Hugging Face OWL-ViT and OWLv2 (issue #37): a CLIP image tower whose every patch token predicts a box and one
logit per text query, traced with a detection target and hand-made text queries (no tokenizer download).

The reference never calls vitcam_nb: an eager deep copy of the model, hooks on the modules named below (read from
transformers' ``OwlViTEncoderLayer.forward``) with ``retain_grad()``, one forward of the whole detector with the
same input ids + ``backward()`` per target scalar. ``q_out``/``k_out`` are q and k through ``out_proj``, computed
here with ``F.linear``; they are not on the path to the output, so their gradient is zero.

Naming convention (scripts/support_matrix.py): ``test_site_reference`` ids are ``"<family>-<site>"``.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from torch import nn
from vitcam_testing import assert_rel_close, assert_unchanged, snapshot, target_scalar, traced

import vitcam_nb as vc
from vitcam_nb.adapters import find_adapter

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

from unit.model.test_yolos import redraw  # noqa: E402  (after the importorskip)

TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64,
            max_position_embeddings=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
              patch_size=8)
FAMILIES = {"hf_owlvit": ("OwlViTConfig", "OwlViTForObjectDetection", "owlvit"),
            "hf_owlv2": ("Owlv2Config", "Owlv2ForObjectDetection", "owlv2")}
SITES = {"F1": ("layer_norm1", "output"), "F2": ("self_attn", "weights"), "F3": ("self_attn.out_proj", "input"),
         "F4": ("layer_norm2", "output"), "F5": ("mlp", "output"), "F6": ("", "output"), "resid_pre": ("", "input"),
         "attn_out": ("self_attn", "output"), "resid_mid": ("layer_norm2", "input"),
         "q": ("self_attn.q_proj", "output"), "k": ("self_attn.k_proj", "output"),
         "v": ("self_attn.v_proj", "output"), "q_out": ("self_attn.q_proj", "projected"),
         "k_out": ("self_attn.k_proj", "projected")}
TEXTS = ["a cat", "a red dog", "an owl"]
QUERIES, TEXT_QUERY = [5, 10], 1


class HandTokenizer:
    """Hand-made ids as a Hugging Face tokenizer returns them: BOS, one id per letter, EOS, padded to 16."""

    def __call__(self, texts, padding="max_length", return_tensors="pt"):
        rows = [[1] + [3 + (ord(c) % 50) for c in t.replace(" ", "")][:12] + [2] for t in texts]
        ids = torch.tensor([r + [0] * (16 - len(r)) for r in rows])
        return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def build_owl(label: str, seed: int = 0) -> nn.Module:
    config_cls, model_cls, _ = FAMILIES[label]
    cfg = getattr(transformers, config_cls)(text_config=TEXT, vision_config=VISION, projection_dim=32)
    torch.manual_seed(seed)
    return redraw(getattr(transformers, model_cls)(cfg), seed)


def owl_input(seed: int = 0) -> torch.Tensor:
    return torch.randn((1, 3, 32, 32), generator=torch.Generator().manual_seed(2000 + seed))


def owl_logits(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(patches, text queries) logits of the detector, from the same ids the target feeds."""
    enc = HandTokenizer()(TEXTS)
    return m(pixel_values=x, **enc).logits[0]


def reference(label: str, model: nn.Module, x: torch.Tensor, scalar):
    m = copy.deepcopy(model).eval()
    m.set_attn_implementation("eager")
    layers = m.get_submodule(f"{FAMILIES[label][2]}.vision_model.encoder.layers")
    store: dict[tuple[int, str], torch.Tensor] = {}

    def keep(key, t):
        assert key not in store, f"{key} fired twice"
        t.retain_grad()
        store[key] = t

    for layer, blk in enumerate(layers):
        for site, (path, io) in SITES.items():
            mod = blk.get_submodule(path) if path else blk
            if io == "input":
                mod.register_forward_pre_hook(lambda _m, args, key=(layer, site): keep(key, args[0]))
            elif io == "projected":
                out_proj = blk.self_attn.out_proj
                mod.register_forward_hook(lambda _m, _i, out, key=(layer, site), p=out_proj:
                                          keep(key, nn.functional.linear(out, p.weight, p.bias)))
            else:
                index = 1 if io == "weights" else 0
                mod.register_forward_hook(lambda _m, _i, out, key=(layer, site), index=index:
                                          keep(key, out[index] if isinstance(out, tuple) else out))
    with torch.enable_grad():
        logits = owl_logits(m, x.detach().clone().requires_grad_(True))
        scalar(logits).backward()
    out = {k: (t.detach()[0].double().numpy(),
               t.grad[0].double().numpy() if t.grad is not None else np.zeros(t.shape[1:]))
           for k, t in store.items()}
    return out, logits.detach().double().numpy()


def scalar_for(target_class: int):
    return target_scalar(target_class, lambda logits: logits[QUERIES, TEXT_QUERY])


@functools.cache
def owl_run(label: str):
    model, x = build_owl(label), owl_input()
    before = snapshot(model)
    target = vc.targets.detection(query=QUERIES, text=TEXTS, class_=TEXT_QUERY, tokenizer=HandTokenizer())
    tr = vc.trace(model, x, targets=target, sites=list(SITES))
    assert_unchanged(before, model)
    refs, logits = {}, None
    for name, c in zip(tr["target"].values, tr["target_class"].values, strict=True):
        refs[str(name)], logits = reference(label, model, x, scalar_for(int(c)))
    return model, x, tr, refs, logits


@pytest.mark.parametrize(("label", "site"), [pytest.param(f, s, id=f"{f}-{s}") for f in FAMILIES for s in SITES])
def test_site_reference(label, site):
    _, _, tr, refs, logits = owl_run(label)
    assert tr.attrs["model_family"] == label and list(tr["layer"].values) == [0, 1]
    assert_rel_close(tr["logits"].values, logits[QUERIES, TEXT_QUERY], "text-query logits")
    for target, ref in refs.items():
        for layer in (0, 1):
            act, grad = ref[(layer, site)]
            assert_rel_close(traced(tr, site, layer), act, f"act {site}@{layer}")
            assert_rel_close(traced(tr, site, layer, target), grad, f"grad {site}@{layer} {target}")
    if site not in ("q_out", "k_out"):  # the side computations have no gradient
        assert any(np.abs(ref[(0, site)][1]).max() > 0 for ref in refs.values())


@pytest.mark.parametrize("label", list(FAMILIES))
def test_tokens_checklist_and_attention_restored(label):
    model, _, tr, _, _ = owl_run(label)
    assert find_adapter(model).family == label
    assert list(tr["token_kind"].values) == ["cls"] + ["patch"] * 16
    assert (tr.attrs["grid_h"], tr.attrs["grid_w"]) == (4, 4)
    assert model.config.vision_config._attn_implementation == "sdpa"
    assert list(tr["class_label"].values) == ["detection 5: a red dog", "detection 10: a red dog"]
    checklist = vc.cam(tr, vc.Recipe(site="F1", layer=-1, class_=1)).attrs["checklist"]
    assert f'"module": "{FAMILIES[label][2]}.vision_model.encoder.layers.1.layer_norm1"' in checklist
    # detection 10 of a 4x4 grid is the patch at row 2, column 2: token 11 of the trace (after the class token)
    assert "detection 10, patch token 10 at grid row 2, column 2 (trace token 11)" in checklist
    assert tr["token_kind"].values[11] == "patch" and (tr["patch_row"].values[11], tr["patch_col"].values[11]) == (2, 2)


@pytest.mark.parametrize("label", list(FAMILIES))
def test_an_image_query_scores_as_image_guided_detection(label):
    """OWL's image-guided detection: the trace's scores are its logits, and the gradient at F6 of the last layer
    is the autograd gradient through the traced image's pass (the query image's pass has no gradient to x)."""
    model, x = build_owl(label), owl_input()
    q = owl_input(seed=9)
    tr = vc.trace(model, x, targets=vc.targets.detection(query=[2, 13], image_query=q), sites=["F6"], layers=[-1])
    m = copy.deepcopy(model).eval()
    m.set_attn_implementation("eager")
    seen = []
    last = m.get_submodule(f"{FAMILIES[label][2]}.vision_model.encoder.layers")[-1]
    last.register_forward_hook(lambda _m, _i, out: seen.append(out[0] if isinstance(out, tuple) else out))
    with torch.enable_grad():
        logits = m.image_guided_detection(pixel_values=x.clone().requires_grad_(True), query_pixel_values=q).logits
        (g,) = torch.autograd.grad(logits[0, 2, 0], seen[-1])  # the query image is embedded first, x second
    assert_rel_close(tr["logits"].values, logits[0, [2, 13], 0].detach().double().numpy(), "image-query logits")
    stored = tr["grad"].sel(site="F6", target=str(tr["target"].values[0])).values[0]
    assert_rel_close(stored, g[0].double().numpy(), "gradient of the image-query logit at F6")
    assert list(tr["class_label"].values) == ["detection 2: image query", "detection 13: image query"]
    # one image query leaves no class to choose: a batch (vc.score's perturbed inputs) is scored as the model does
    target = vc.targets.detection(query=[2, 13], image_query=q)
    target.check(model)
    xs = torch.cat([x, owl_input(seed=3)])
    with torch.no_grad():
        want = model.image_guided_detection(pixel_values=xs, query_pixel_values=q).logits[:, [2, 13], 0]
        assert_rel_close(target.batch_scores(model, xs).numpy(), want.numpy(), "batched image-query logits")
    assert "the query embedding is the class embedding of the query image's box" in tr.attrs["target_checklist"]
    with pytest.raises(vc.TraceError, match="image_query: give text queries or an image query, not both"):
        vc.targets.detection(query=0, image_query=q, text=TEXTS, tokenizer=HandTokenizer())
    with pytest.raises(TypeError, match=r"image_query: expected a finite \(1, 3, H, W\) float tensor"):
        vc.targets.detection(query=0, image_query=q[0])
    with pytest.raises(vc.TraceError, match="image_query: the model embeds 32x32 query images, got 16x16"):
        vc.trace(model, x, targets=vc.targets.detection(query=0, image_query=q[..., :16, :16]), sites=["F6"])
