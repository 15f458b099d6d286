"""``vc.presets.legrad`` against LeGrad's authors' code and torchcam's LeGrad, run unchanged on the same weights and
input (issue #53): the official ``legrad/wrapper.py`` (pip ``legrad-torch`` 1.1, installed ``--no-deps`` in CI
because it pins open-clip-torch<=2.23) on a tiny random open_clip CLIP built in code, and torchcam 0.5's
``LeGrad`` on a tiny random torchvision ``VisionTransformer`` whose weights are copied into a timm ViT for the kit.
Maps agree to 1e-5 (min-max normalised, the official 32x32 upsampled map; torchcam's patch grid). The kit's
class-token variant ``legrad_cls`` is shown NOT to be the official map (its correlation stays below 0.999).
"""

from __future__ import annotations

import contextlib
import copy
import io

import numpy as np
import pytest
import timm
import torch

import vitcam_nb as vc
from vitcam_nb.core.errors import RecipeError

TOL = 1e-5


def _clip(layers=3):
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    model = open_clip.model.CLIP(
        embed_dim=8, vision_cfg=open_clip.model.CLIPVisionCfg(layers=layers, width=16, head_width=8, patch_size=8,
                                                              image_size=32),
        text_cfg=open_clip.model.CLIPTextCfg(context_length=8, vocab_size=49408, width=16, heads=2, layers=1))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # unit-scale weights: attention and its gradients far from uniform
        for name, p in model.visual.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[0] if name == "proj" else p[0].numel()))
    return model.eval()


def _official_clip(model, text, x, layer_index):
    """legrad-torch's LeWrapper.compute_legrad on a copy of ``model``. The wrapper's forward feeds the blocks
    sequence-first (LND), as open_clip <= 2.23 (which it pins) ran them; open_clip >= 2.24 builds batch-first
    attention, so the blocks the wrapper does not hook get ``batch_first=False`` (its hooked blocks run their
    own sequence-first attention). Nothing else of the official code is changed."""
    legrad = pytest.importorskip("legrad", reason="legrad-torch not installed (CI: pip install --no-deps "
                                                  "legrad-torch==1.1)")
    ref = copy.deepcopy(model)
    for blk in ref.visual.transformer.resblocks:
        blk.attn.batch_first = False
    with contextlib.redirect_stdout(io.StringIO()):  # the wrapper prints its progress
        wrapper = legrad.LeWrapper(ref, layer_index=layer_index)
    return wrapper.compute_legrad(text_embedding=text, image=x).detach().numpy()[0, 0]


def _check(kit, ref):
    assert kit.shape == ref.shape
    assert float(np.abs(kit - ref).max()) <= TOL


@pytest.mark.parametrize(("layer_index", "layer"), [(-2, None), (0, "all"), (1, (1, 2))])
def test_legrad_equals_legrad_torch_on_open_clip(layer_index, layer):
    model = _clip()
    text = torch.nn.functional.normalize(torch.randn(3, 8, generator=torch.Generator().manual_seed(6)), dim=-1)
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    tr = vc.trace(model, x, targets=vc.targets.layerwise(vectors=text), sites=["F2"])
    c = int(tr.attrs["layerwise_class"])
    recipe = vc.presets.legrad() if layer is None else vc.presets.legrad(layer=layer)
    kit = vc.cam(tr, recipe).values
    ref = _official_clip(model, text[c:c + 1], x, layer_index)
    _check(kit, ref)
    if layer is None:  # the preset's default blocks are the official default's (layer_index=-2: the last two)
        assert vc.presets.legrad().layer == (-2, -1)
        cls = vc.trace(model, x, targets=vc.targets.layerwise(vectors=text, readout="model"), sites=["F2"])
        other = vc.cam(cls, vc.presets.legrad_cls(layer=(-2, -1))).values
        assert np.corrcoef(other.ravel(), ref.ravel())[0, 1] < 0.999  # the kit's variant is another map


def _torchvision_and_timm():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    tv = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=3, num_heads=2, hidden_dim=32,
                                              mlp_dim=64, num_classes=5)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # unit-scale weights, non-zero biases, norm weights near one
        for name, p in tv.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise / np.sqrt(p[0].numel()) if p.ndim >= 2 else
                    noise / 4 + float(name.endswith("weight") and ".ln" in f".{name}"))
    tv.eval()
    tm = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=3,
                           num_heads=2, embed_dim=32, mlp_ratio=2, num_classes=5).eval()
    sd = {"cls_token": tv.class_token, "pos_embed": tv.encoder.pos_embedding,
          "patch_embed.proj.weight": tv.conv_proj.weight, "patch_embed.proj.bias": tv.conv_proj.bias,
          "norm.weight": tv.encoder.ln.weight, "norm.bias": tv.encoder.ln.bias,
          "head.weight": tv.heads.head.weight, "head.bias": tv.heads.head.bias}
    for i, layer in enumerate(tv.encoder.layers):
        names = {"norm1": layer.ln_1, "norm2": layer.ln_2, "attn.proj": layer.self_attention.out_proj,
                 "mlp.fc1": layer.mlp[0], "mlp.fc2": layer.mlp[3]}
        for key, mod in names.items():
            sd[f"blocks.{i}.{key}.weight"], sd[f"blocks.{i}.{key}.bias"] = mod.weight, mod.bias
        sd[f"blocks.{i}.attn.qkv.weight"] = layer.self_attention.in_proj_weight
        sd[f"blocks.{i}.attn.qkv.bias"] = layer.self_attention.in_proj_bias
    tm.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=True)
    return tv, tm


def test_legrad_equals_torchcam_legrad_on_torchvision_vit():
    methods = pytest.importorskip("torchcam.methods", reason="torchcam not installed (CI: pip install --no-deps "
                                                              "torchcam==0.5.0)")
    tv, tm = _torchvision_and_timm()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():  # the copy is the same network
        assert float((tv(x) - tm(x)).abs().max()) <= 1e-5
    tr = vc.trace(tm, x, targets=vc.targets.layerwise(), sites=["F2"])
    c = int(tr.attrs["layerwise_class"])
    for blocks, recipe in (([-2, -1], vc.presets.legrad()), ([0, 1, 2], vc.presets.legrad(layer="all"))):
        with methods.LeGrad(tv, [tv.encoder.layers[b] for b in blocks]) as extractor:
            ref = extractor(class_idx=c, scores=tv(x))[0][0].numpy()
        _check(vc.cam(tr, recipe, grid=True).values, ref)
    # torchcam's per-block scores are the kit's: heads(ln(mean over all tokens)) of each block's output
    outs = []
    hooks = [blk.register_forward_hook(lambda _m, _i, o: outs.append(o)) for blk in tv.encoder.layers]
    with torch.no_grad():
        tv(x)
        scores = [float(tv.heads(tv.encoder.ln(o.mean(1)))[0, c]) for o in outs]
    for h in hooks:
        h.remove()
    np.testing.assert_allclose(tr["logits"].values, scores, rtol=1e-5, atol=1e-6)


def test_legrad_presets_refuse_the_other_readout():
    _, tm = _torchvision_and_timm()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    official = vc.trace(tm, x, targets=vc.targets.layerwise(), sites=["F2"])
    kits = vc.trace(tm, x, targets=vc.targets.layerwise(readout="model"), sites=["F2"])
    with pytest.raises(RecipeError, match="read out by 'model'; trace with .*readout='mean'.*legrad_cls"):
        vc.cam(kits, vc.presets.legrad())
    with pytest.raises(RecipeError, match="read out by 'mean'; trace with .*readout='model'.*legrad\\(\\)"):
        vc.cam(official, vc.presets.legrad_cls())
    # the read-out is part of the trace id; a trace of the earlier read-out keeps the id it had (no "readout" key)
    assert official.attrs["trace_id"] != kits.attrs["trace_id"]
    assert "readout" not in vc.targets.layerwise(readout="model").settings()
    # the old preset's recipe id is legrad_cls's: a stored id keeps meaning the class-token read-out
    assert vc.presets.legrad_cls().id == "3dbb53ddae17" and vc.presets.legrad().id != "3dbb53ddae17"
    assert vc.presets.preset_name(vc.Recipe.from_json(vc.presets.legrad_cls().to_json())) == "legrad_cls"
