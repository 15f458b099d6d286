"""Hugging Face vision transformers (issue #18): ViT, DeiT (distilled), DINOv2 (+ registers), BEiT.

Every family is a tiny random config with redrawn O(1) weights. The reference never calls vitcam_nb: it deep-copies
the model, sets the eager attention with transformers' own ``set_attn_implementation``, hooks the modules named
below (read from transformers' source: ``ViTLayer.forward`` and friends) with ``retain_grad()`` and runs one fresh
forward + ``backward()`` per target scalar. Values are compared by coordinate label.

Naming convention (scripts/support_matrix.py measures the support matrix from it): ``test_site_reference``
ids are ``"<family>-<site>"``.
"""

from __future__ import annotations

import copy
import functools
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn
from vitcam_testing import assert_rel_close, assert_unchanged, hooked_eager_copy, snapshot, target_scalar, traced

import vitcam_nb as vc
from vitcam_nb.adapters import find_adapter

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

CORE = ("F1", "F2", "F3", "F4", "F5", "F6")
EXTENDED = ("resid_pre", "attn_out", "resid_mid")


def redraw(model: nn.Module, seed: int = 0) -> nn.Module:
    """O(1) weights: Hugging Face's init (and layer scales of 1e-5 or 0.1) would hide a wrong hook."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("cls_token", "distillation_token", "register_tokens", "position_embeddings", "class_embedding",
                        "relative_position_bias_table", "mask_token"):
                p.copy_(0.5 * noise)
            elif leaf in ("lambda1", "lambda_1", "lambda_2") or (leaf == "weight" and p.ndim == 1):
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim >= 2:
                p.copy_(noise / math.sqrt(p[0].numel()))
            else:
                p.copy_(0.1 * noise)
    return model.eval()


def build(config_cls: str, model_cls: str, seed: int = 0, **kwargs) -> nn.Module:
    base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_labels=5,
                patch_size=8)
    cfg = getattr(transformers, config_cls)(**{**base, **kwargs})
    torch.manual_seed(seed)
    return redraw(getattr(transformers, model_cls)(cfg), seed)


# (module path relative to the layer, "input" / "output" / "weights" = element 1 of the attention's output)
VIT_LAYER = {"F1": ("layernorm_before", "output"), "F2": ("attention", "weights"), "F3": ("attention.o_proj", "input"),
             "F4": ("layernorm_after", "output"), "F5": ("mlp", "output"), "F6": ("", "output"),
             "resid_pre": ("", "input"), "attn_out": ("attention", "output"), "resid_mid": ("layernorm_after", "input")}
DINO_LAYER = {**VIT_LAYER, "F1": ("norm1", "output"), "F4": ("norm2", "output"), "resid_mid": ("norm2", "input")}
CLIP_LAYER = {"F1": ("layer_norm1", "output"), "F2": ("self_attn", "weights"), "F3": ("self_attn.out_proj", "input"),
              "F4": ("layer_norm2", "output"), "F5": ("mlp", "output"), "F6": ("", "output"),
              "resid_pre": ("", "input"), "attn_out": ("self_attn", "output"), "resid_mid": ("layer_norm2", "input")}
VECTORS = torch.from_numpy(np.random.default_rng(7).normal(size=(3, 16)).astype(np.float32))  # CLIP: projection 16
SIGLIP_VECTORS = torch.from_numpy(np.random.default_rng(8).normal(size=(3, 32)).astype(np.float32))  # SigLIP: 32
TOWER = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=64)
TEXT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, vocab_size=64,
            max_position_embeddings=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def logits_of(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(pixel_values=x).logits[0]


def clip_similarity(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """10 * cos(projected class-token embedding, v_i), from the model's own modules."""
    emb = m.visual_projection(m.vision_model(pixel_values=x).pooler_output)[0]
    return 10.0 * torch.nn.functional.cosine_similarity(emb[None], VECTORS, dim=1)


def siglip_similarity(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """10 * cos(attention-pooled embedding, v_i)."""
    emb = m.vision_model(pixel_values=x).pooler_output[0]
    return 10.0 * torch.nn.functional.cosine_similarity(emb[None], SIGLIP_VECTORS, dim=1)


def two_tower(config_cls: str, model_cls: str, seed: int = 0, **kwargs) -> nn.Module:
    cfg = getattr(transformers, config_cls)(vision_config=TOWER, text_config=TEXT, **kwargs)
    torch.manual_seed(seed)
    return redraw(getattr(transformers, model_cls)(cfg), seed)


@dataclass(frozen=True)
class Family:
    label: str
    build: Callable[[], nn.Module]
    input_hw: tuple[int, int]
    grid: tuple[int, int]
    prefix: tuple[str, ...]
    layers: str  # path of the layer list
    sites: dict
    prefix_params: tuple[tuple[str, str], ...] = ()  # (parameter path, kind) in sequence order
    scores: Callable[[nn.Module, torch.Tensor], torch.Tensor] = logits_of
    targets: Callable[[], object] = lambda: [1, 3]


FAMILIES: dict[str, Family] = {f.label: f for f in [
    Family("hf_vit", lambda: build("ViTConfig", "ViTForImageClassification", image_size=32), (32, 32), (4, 4),
           ("cls",), "vit.layers", VIT_LAYER, (("vit.embeddings.cls_token", "cls"),)),
    Family("hf_deit_distilled", lambda: build("DeiTConfig", "DeiTForImageClassificationWithTeacher",
                                              image_size=(24, 40)),
           (24, 40), (3, 5), ("cls", "dist"), "deit.layers", VIT_LAYER,
           (("deit.embeddings.cls_token", "cls"), ("deit.embeddings.distillation_token", "dist"))),
    Family("hf_dinov2", lambda: build("Dinov2Config", "Dinov2ForImageClassification", image_size=32, mlp_ratio=2),
           (24, 40), (3, 5), ("cls",), "dinov2.encoder.layer", DINO_LAYER,
           (("dinov2.embeddings.cls_token", "cls"),)),
    Family("hf_dinov2_registers", lambda: build("Dinov2WithRegistersConfig",
                                                "Dinov2WithRegistersForImageClassification", image_size=32,
                                                mlp_ratio=2, num_register_tokens=3),
           (32, 32), (4, 4), ("cls", "reg", "reg", "reg"), "dinov2_with_registers.encoder.layer", DINO_LAYER,
           (("dinov2_with_registers.embeddings.cls_token", "cls"),
            ("dinov2_with_registers.embeddings.register_tokens", "reg"))),
    Family("hf_beit", lambda: build("BeitConfig", "BeitForImageClassification", image_size=32,
                                    use_relative_position_bias=True, layer_scale_init_value=0.1,
                                    use_mean_pooling=True), (32, 32), (4, 4), ("cls",), "beit.layers", VIT_LAYER,
           (("beit.embeddings.cls_token", "cls"),)),
    Family("hf_clip", lambda: two_tower("CLIPConfig", "CLIPModel", projection_dim=16), (32, 32), (4, 4), ("cls",),
           "vision_model.encoder.layers", CLIP_LAYER, (("vision_model.embeddings.class_embedding", "cls"),),
           scores=clip_similarity, targets=lambda: vc.targets.similarity(VECTORS, scale=10.0)),
    Family("hf_siglip", lambda: two_tower("SiglipConfig", "SiglipModel"), (32, 32), (4, 4), (),
           "vision_model.encoder.layers", CLIP_LAYER, scores=siglip_similarity,
           targets=lambda: vc.targets.similarity(SIGLIP_VECTORS, scale=10.0)),
]}


def make_input(fam: Family, seed: int = 0) -> torch.Tensor:
    return torch.randn((1, 3, *fam.input_hw), generator=torch.Generator().manual_seed(1000 + seed))


def reference(fam: Family, model: nn.Module, x: torch.Tensor, scalar: Callable[[torch.Tensor], torch.Tensor]):
    """({(layer, site): (act, grad)} float64, scores) from my own hooks on an eager deep copy."""
    m, store = hooked_eager_copy(model, fam.layers, fam.sites)
    with torch.enable_grad():
        scores = fam.scores(m, x.detach().clone().requires_grad_(True))
        scalar(scores).backward()
    out = {k: (t.detach()[0].double().numpy(), t.grad[0].double().numpy()) for k, t in store.items()}
    return out, scores.detach().double().numpy()


@functools.cache
def family_run(label: str):
    fam = FAMILIES[label]
    model, x = fam.build(), make_input(fam)
    before = snapshot(model)
    tr = vc.trace(model, x, targets=fam.targets(), sites=list(fam.sites))
    assert_unchanged(before, model)
    refs, ref_scores = {}, None
    for target, c in zip(tr["target"].values, tr["target_class"].values, strict=True):
        refs[str(target)], ref_scores = reference(fam, model, x, target_scalar(int(c)))
    return model, x, tr, refs, ref_scores


@pytest.mark.parametrize(("label", "site"), [pytest.param(f, s, id=f"{f}-{s}") for f in FAMILIES
                                             for s in CORE + EXTENDED])
def test_site_reference(label, site):
    fam = FAMILIES[label]
    model, _, tr, refs, ref_scores = family_run(label)
    assert tr.attrs["model_family"] == label
    assert list(tr["layer"].values) == list(range(len(model.get_submodule(fam.layers))))
    assert_rel_close(tr["logits"].values, ref_scores, f"{label} logits")
    for target, ref in refs.items():
        for layer in tr["layer"].values:
            act, grad = ref[(int(layer), site)]
            assert_rel_close(traced(tr, site, int(layer)), act, f"{label} act {site}@{layer}")
            assert_rel_close(traced(tr, site, int(layer), target), grad, f"{label} grad {site}@{layer} {target}")
    assert any(np.abs(ref[(0, site)][1]).max() > 0 for ref in refs.values())


@pytest.mark.parametrize("label", list(FAMILIES))
def test_tokens_grid_and_prefix_order(label):
    """Grid and prefix kinds from the model's own sequence: perturbing one prefix parameter changes exactly the
    first layer's input at the trace token of that kind."""
    fam = FAMILIES[label]
    model, x, tr, _, _ = family_run(label)
    n_prefix = len(fam.prefix)
    assert (tr.attrs["grid_h"], tr.attrs["grid_w"]) == fam.grid
    assert tuple(tr["token_kind"].values[:n_prefix]) == fam.prefix
    rows, cols = tr["patch_row"].values[n_prefix:], tr["patch_col"].values[n_prefix:]
    assert list(zip(rows, cols)) == [(r, c) for r in range(fam.grid[0]) for c in range(fam.grid[1])]

    def layer0_input(m):
        seen = {}
        m.get_submodule(fam.layers)[0].register_forward_pre_hook(lambda _m, a: seen.update(x=a[0]))
        with torch.no_grad():
            fam.scores(m, x)
        return seen["x"][0]

    base, found = layer0_input(copy.deepcopy(model)), []
    for path, kind in fam.prefix_params:
        param = model.get_parameter(path)
        for j in range(param.shape[1] if param.ndim == 3 else 1):
            m = copy.deepcopy(model)
            with torch.no_grad():
                if param.ndim == 3:
                    m.get_parameter(path)[0, j] += 1.0
                else:  # CLIP's class_embedding is one (D,) vector
                    m.get_parameter(path).add_(1.0)
            changed = np.flatnonzero((layer0_input(m) - base).abs().sum(-1).numpy() > 0)
            assert len(changed) == 1 and tr["token_kind"].values[changed[0]] == kind, (path, j, changed)
            found.append(int(changed[0]))
    assert sorted(found) == list(range(n_prefix))
    # the first patch token's layer-0 input depends on the pixels of its own cell only
    xx = x.clone().requires_grad_(True)
    seen = {}
    m = copy.deepcopy(model)
    m.get_submodule(fam.layers)[0].register_forward_pre_hook(lambda _m, a: seen.update(x=a[0]))
    with torch.enable_grad():
        fam.scores(m, xx)
        (g,) = torch.autograd.grad(seen["x"][0, n_prefix].sum(), xx)
    support = g[0].abs().sum(0).numpy() > 0
    p = int(getattr(model.config, "vision_config", model.config).patch_size)
    assert support[:p, :p].all() and not support[p:, :].any() and not support[:, p:].any()


@pytest.mark.parametrize("label", list(FAMILIES))
def test_checklist_names_the_exact_module_and_attention_is_restored(label):
    fam = FAMILIES[label]
    model, _, tr, _, _ = family_run(label)
    assert model.config._attn_implementation == "sdpa"  # switched to eager only during the trace
    f1 = fam.sites["F1"][0]
    checklist = vc.cam(tr, vc.Recipe(site="F1", layer=-1, class_=1)).attrs["checklist"]
    assert f'"module": "{fam.layers}.1.{f1}"' in checklist
    rows = "cls" if fam.prefix else "mean"
    checklist = vc.cam(tr, vc.Recipe(site="F2", layer=0, class_=1, relu="none", attn_rows=rows)).attrs["checklist"]
    assert f'"module": "{fam.layers}.0.{fam.sites["F2"][0]}"' in checklist
    assert '"input or output": "output[1]"' in checklist
    assert "sdpa implementation switched to eager for the trace" in checklist


def test_class_names_from_id2label_never_imagenet():
    model = build("ViTConfig", "ViTForImageClassification", image_size=32, num_labels=1000)
    x = make_input(FAMILIES["hf_vit"])
    tr = vc.trace(model, x, targets=[0, 1], sites=["F1"], layers=[0])
    assert list(tr["class_label"].values[:2]) == ["LABEL_0", "LABEL_1"]  # timm's ImageNet name would be "tench"
    named = build("ViTConfig", "ViTForImageClassification", image_size=32, num_labels=3,
                  id2label={0: "cat", 1: "dog", 2: "owl"}, label2id={"cat": 0, "dog": 1, "owl": 2})
    tr = vc.trace(named, x, targets="top3", sites=["F1"], layers=[0])
    assert list(tr["class_label"].values) == ["cat", "dog", "owl"]


def test_fixed_size_checkpoint_at_another_size_is_refused_with_the_sizes_and_the_flag():
    model = FAMILIES["hf_vit"].build()
    before = snapshot(model)
    with pytest.raises(vc.TraceError, match=r"32x32 input .* got 24x40.*interpolate_pos_encoding=True"):
        vc.trace(model, torch.randn(1, 3, 24, 40), sites=["F1"])
    assert_unchanged(before, model)
    assert model.config._attn_implementation == "sdpa"


def test_backbone_without_head_takes_a_similarity_target():
    model = redraw(transformers.ViTModel(transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64)))
    assert find_adapter(model).family == "hf_vit"
    vectors = torch.randn(2, 32, generator=torch.Generator().manual_seed(3))
    tr = vc.trace(model, make_input(FAMILIES["hf_vit"]), targets=vc.targets.similarity(vectors, ["a", "b"]),
                  sites=["F1"])
    with torch.no_grad():
        pooled = model(pixel_values=make_input(FAMILIES["hf_vit"])).pooler_output[0]
    expected = torch.nn.functional.cosine_similarity(pooled[None], vectors, dim=1).double().numpy()
    assert_rel_close(tr["logits"].values, expected, "similarity of the pooled output")
    with pytest.raises(vc.TraceError, match="no classifier head"):
        vc.trace(model, make_input(FAMILIES["hf_vit"]), sites=["F1"])


def test_import_vitcam_nb_does_not_import_transformers():
    code = ("import sys, vitcam_nb\nfrom vitcam_nb.adapters import supported_families\n"
            "fams = supported_families()\nassert 'hf_vit' in fams and 'hf_beit' in fams, fams\n"
            "assert 'transformers' not in sys.modules, 'importing vitcam_nb imported transformers'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_processor_preprocesses_and_a_differing_normalisation_is_warned_and_recorded():
    import json
    import warnings

    model = FAMILIES["hf_vit"].build()
    image = np.random.default_rng(0).integers(0, 256, size=(40, 50, 3), dtype=np.uint8)
    same = transformers.ViTImageProcessor(size={"height": 32, "width": 32})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the processor's normalisation is the model's: no warning
        tr = vc.trace(model, image, targets=[1], sites=["F1"], processor=same)
    given = same(images=image, return_tensors="pt")["pixel_values"]
    direct = vc.trace(model, given, targets=[1], sites=["F1"])
    assert tr.attrs["input_sha256"] == direct.attrs["input_sha256"]
    np.testing.assert_array_equal(tr["act"].values, direct["act"].values)
    facts = json.loads(tr.attrs["preprocessing"])
    assert facts["processor"] == "ViTImageProcessor" and facts["mean"] == [0.5, 0.5, 0.5]

    other = transformers.ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.485, 0.456, 0.406],
                                           image_std=[0.229, 0.224, 0.225])
    with pytest.warns(UserWarning, match=r"processor: ViTImageProcessor normalises with mean=\[0.485.*"
                                         r"model's configuration with mean=\[0.5"):
        tr = vc.trace(model, image, targets=[1], sites=["F1"], processor=other)
    facts = json.loads(tr.attrs["preprocessing"])
    assert facts["mean"] == [0.485, 0.456, 0.406] and facts["model_config_mean"] == [0.5, 0.5, 0.5]
    expected = other(images=image, return_tensors="pt")["pixel_values"]
    assert tr.attrs["input_sha256"] == vc.trace(model, expected, targets=[1], sites=["F1"]).attrs["input_sha256"]
    with pytest.raises(vc.TraceError, match="processor: given with a float tensor image"):
        vc.trace(model, expected, processor=other)


def test_without_a_processor_the_family_defaults_are_used_and_stated():
    import json

    model = FAMILIES["hf_deit_distilled"].build()
    image = np.random.default_rng(1).integers(0, 256, size=(60, 90, 3), dtype=np.uint8)
    tr = vc.trace(model, image, targets=[1], sites=["F1"], layers=[0])
    facts = json.loads(tr.attrs["preprocessing"])
    assert facts["mean"] == [0.485, 0.456, 0.406] and "no processor given" in facts["source"]
    assert (tr.attrs["img_height"], tr.attrs["img_width"]) == (24, 40)


def test_siglip_states_its_sites_and_refuses_what_needs_a_class_token():
    _, _, tr, _, _ = family_run("hf_siglip")
    assert tr.attrs["model_sites"].split(",") == [*CORE, *EXTENDED]
    assert tr.attrs["num_prefix_tokens"] == 0 and "attention pooling head" in tr.attrs["global_pool"]
    with pytest.raises(vc.RecipeError, match="attn_rows='cls': needs a cls token.*use attn_rows='mean'"):
        vc.cam(tr, vc.Recipe(site="F2", attn_rows="cls"))
    with pytest.raises(vc.RecipeError, match="weight_tokens='cls': needs a cls token"):
        vc.cam(tr, vc.Recipe(site="F1", weight_tokens="cls"))


class FakeTokenizer:
    """Just what vitcam_nb calls on a Hugging Face tokenizer: ids and attention mask, padded to the longest."""

    def __call__(self, texts, padding=True, return_tensors="pt"):
        rows = [[1] + [3 + (ord(c) % 50) for c in t.replace(" ", "")][:10] + [2] for t in texts]
        n = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (n - len(r)) for r in rows])
        return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def test_prompts_take_a_hugging_face_tokenizer_and_text_model():
    fam = FAMILIES["hf_clip"]
    model, x = fam.build(), make_input(fam)
    texts = ["a dog", "a cat on a mat", "an owl"]
    target = vc.targets.prompts(texts, tokenizer=FakeTokenizer(), text_model=model)
    before = snapshot(model)
    tr = vc.trace(model, x, targets=target, sites=["F1", "F2"])
    assert_unchanged(before, model)
    assert list(tr["class_label"].values) == texts and "transformers text embeddings" in tr.attrs["target_scores"]
    enc = FakeTokenizer()(texts)

    def zero_shot(m, pixels):  # CLIP's own zero-shot logits: logit_scale.exp() * cos(image, text)
        return m(pixel_values=pixels, **enc).logits_per_image[0]

    prompt_fam = Family("hf_clip", fam.build, fam.input_hw, fam.grid, fam.prefix, fam.layers, fam.sites,
                        scores=zero_shot)
    for target_name, c in zip(tr["target"].values, tr["target_class"].values, strict=True):
        ref, scores = reference(prompt_fam, model, x, target_scalar(int(c)))
        assert_rel_close(tr["logits"].values, scores, "zero-shot logits")
        for site in ("F1", "F2"):
            for layer in (0, 1):
                assert_rel_close(traced(tr, site, layer, str(target_name)), ref[(layer, site)][1],
                                 f"prompt grad {site}@{layer} {target_name}")
