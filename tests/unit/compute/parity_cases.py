"""The parity cases of issue #53: each runs a preset of the kit and its authors' own code (or a package that
implements it) on the same weights and input and returns both maps. The parity tests
(``tests/unit/compute/test_parity_*.py``) assert on them; ``python -m benchmarks --items parity`` computes the
figures of ``docs/presets.md``'s "How each preset was checked" table from the same functions.

Every case raises ``pytest.skip.Exception`` (via ``pytest.importorskip``) where the reference package is not
installed. Models are tiny and random (no download): a timm ViT, an open_clip CLIP, a torchvision ViT.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import io
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
import timm
import torch

import vitcam_nb as vc


@dataclass
class Case:
    """One comparison: the kit's map and the reference's, on the same model and input."""

    kit: np.ndarray
    ref: np.ndarray
    reference: str
    model: str
    input: str
    notes: dict = field(default_factory=dict)

    @property
    def max_abs(self) -> float:
        return float(np.abs(np.asarray(self.kit, np.float64) - np.asarray(self.ref, np.float64)).max())

    @property
    def relative(self) -> float:
        """max |difference| over max |reference|."""
        return self.max_abs / max(float(np.abs(np.asarray(self.ref, np.float64)).max()), 1e-30)

    @property
    def pearson(self) -> float:
        return float(np.corrcoef(np.ravel(self.kit), np.ravel(self.ref))[0, 1])


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def image_tensor(seed: int = 4) -> torch.Tensor:
    return torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


# -- models ---------------------------------------------------------------------------------------------------
def tiny_clip(layers: int = 3) -> torch.nn.Module:
    """A random open_clip CLIP: 32 px, patch 8, width 16, 2 heads, ``layers`` vision blocks, embed dim 8."""
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


def torchvision_and_timm() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A random torchvision ``VisionTransformer`` (32 px, patch 8, 3 blocks, 2 heads, width 32, 5 classes) and a
    timm ViT holding the same weights (the kit traces timm; torchvision has no adapter)."""
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


TV_MODEL = "torchvision VisionTransformer, random (32 px, patch 8, 3 blocks, 2 heads, width 32), weights copied to timm"
CLIP_MODEL = "open_clip CLIP, random (32 px, patch 8, 3 vision blocks, 2 heads, width 16)"
NOISE = "N(0,1) tensor 1x3x32x32"


# -- LeGrad ---------------------------------------------------------------------------------------------------
def legrad_official_clip(model: torch.nn.Module, text: torch.Tensor, x: torch.Tensor, layer_index: int) -> np.ndarray:
    """legrad-torch's ``LeWrapper.compute_legrad`` on a copy of ``model``. The wrapper's forward feeds the blocks
    sequence-first (LND), as open_clip <= 2.23 (which it pins) ran them; open_clip >= 2.24 builds batch-first
    attention, so the blocks the wrapper does not hook get ``batch_first=False`` (its hooked blocks run their own
    sequence-first attention). Nothing else of the official code is changed."""
    legrad = pytest.importorskip("legrad", reason="legrad-torch not installed (CI: pip install --no-deps "
                                                  "legrad-torch==1.1)")
    ref = copy.deepcopy(model)
    for blk in ref.visual.transformer.resblocks:
        blk.attn.batch_first = False
    with contextlib.redirect_stdout(io.StringIO()):  # the wrapper prints its progress
        wrapper = legrad.LeWrapper(ref, layer_index=layer_index)
    return wrapper.compute_legrad(text_embedding=text, image=x).detach().numpy()[0, 0]


def _clip_text() -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(3, 8, generator=torch.Generator().manual_seed(6)), dim=-1)


def legrad_vs_legrad_torch(layer_index: int = -2, layer: object = None, readout: str = "mean") -> Case:
    """The kit's LeGrad (``readout="model"``: legrad_cls) against the official wrapper at ``layer_index``."""
    model, text, x = tiny_clip(), _clip_text(), image_tensor()
    tr = vc.trace(model, x, targets=vc.targets.layerwise(vectors=text, readout=readout), sites=["F2"])
    c = int(tr.attrs["layerwise_class"])
    make = vc.presets.legrad if readout == "mean" else vc.presets.legrad_cls
    recipe = make() if layer is None else make(layer=layer)
    kit = vc.cam(tr, recipe).values
    ref = legrad_official_clip(model, text[c:c + 1], x, layer_index)
    return Case(kit, ref, f"legrad-torch {version('legrad-torch')}, legrad/wrapper.py LeWrapper.compute_legrad "
                f"(layer_index={layer_index})", CLIP_MODEL, NOISE + ", 3 random unit text embeddings",
                {"recipe": recipe, "trace": tr})


def legrad_vs_torchcam(blocks: tuple[int, ...] = (-2, -1), recipe: vc.Recipe | None = None) -> Case:
    methods = pytest.importorskip("torchcam.methods", reason="torchcam not installed (CI: pip install --no-deps "
                                                              "torchcam==0.5.0)")
    tv, tm = torchvision_and_timm()
    x = image_tensor()
    tr = vc.trace(tm, x, targets=vc.targets.layerwise(), sites=["F2"])
    c = int(tr.attrs["layerwise_class"])
    with methods.LeGrad(tv, [tv.encoder.layers[b] for b in blocks]) as extractor:
        ref = extractor(class_idx=c, scores=tv(x))[0][0].numpy()
    recipe = recipe or vc.presets.legrad()
    return Case(vc.cam(tr, recipe, grid=True).values, ref, f"torchcam {version('torchcam')}, torchcam.methods.LeGrad "
                f"(blocks {list(blocks)})", TV_MODEL, NOISE, {"tv": tv, "timm": tm, "x": x, "trace": tr, "class": c})


# -- exact Shapley values ---------------------------------------------------------------------------------------
def shapley_vs_shapiq(grid: tuple[int, int] = (2, 4), target: int = 2) -> Case:
    shapiq = pytest.importorskip("shapiq", reason="shapiq not installed (pip install shapiq; in the [test] extra)")
    import vitcam_nb.evaluate as ev

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                              embed_dim=32, num_heads=2, num_classes=3)
    with torch.no_grad():  # logits of order 1, so 1e-6 is a real tolerance
        model.head.weight.normal_(0.0, 1.0)
    model = model.double().eval()
    torch.manual_seed(1)
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    base = torch.randn(1, 3, 32, 32, dtype=torch.float64) * 0.3
    phi = ev.shapley_patches(model, x, grid=grid, baseline=base, target=target, batch_size=64, progress=False)
    gy, gx = grid
    h, w = 32 // gy, 32 // gx

    def game(coalitions: np.ndarray) -> np.ndarray:  # the coalition's input built by slicing, here
        out = []
        for row in coalitions:
            inp = base.clone()
            for k in np.flatnonzero(row):
                r, c = divmod(int(k), gx)
                inp[..., r * h:(r + 1) * h, c * w:(c + 1) * w] = x[..., r * h:(r + 1) * h, c * w:(c + 1) * w]
            with torch.no_grad():
                out.append(float(model(inp)[0, target]))
        return np.array(out)

    values = shapiq.ExactComputer(game, n_players=gy * gx)("SV", order=1)
    ref = np.array([values[(k,)] for k in range(gy * gx)]).reshape(grid)
    return Case(phi.values, ref, f"shapiq {version('shapiq')}, ExactComputer(...)('SV')",
                "timm ViT, random, float64 (32 px, patch 8, 1 block)",
                f"N(0,1) image, baseline 0.3 N(0,1), {gy}x{gx} groups, logit {target}")


# -- CP-LRP (lxt) ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def lxt_cp_lrp_patched() -> Iterator[None]:
    """lxt's CP-LRP patch for torchvision ViTs (``lxt.efficient.monkey_patch(vision_transformer)``) applied, and
    undone on exit: it replaces ``forward`` on the CLASSES ``nn.GELU``, ``nn.LayerNorm`` and
    ``nn.MultiheadAttention`` for the whole process. lxt 2.1's ``lxt.efficient`` imports every model file it
    patches, and its BERT file imports names transformers 5 removed (``modeling_attn_mask_utils``,
    ``find_pruneable_heads_and_indices``); that file is stubbed in ``sys.modules`` (the ViT patch does not use it).
    zennit is not needed: only lxt's optional Gamma rules import it (a warning without it)."""
    pytest.importorskip("lxt", reason="lxt not installed (CI: pip install --no-deps lxt==2.1)")
    bert = types.ModuleType("lxt.efficient.models.bert")
    bert.modeling_bert, bert.attnLRP = types.ModuleType("stub_modeling_bert"), {}
    classes = (torch.nn.GELU, torch.nn.LayerNorm, torch.nn.MultiheadAttention)
    saved = [{k: c.__dict__[k] for k in ("forward", "original_forward") if k in c.__dict__} for c in classes]
    stubbed = "lxt.efficient.models.bert" not in sys.modules
    if stubbed:
        sys.modules["lxt.efficient.models.bert"] = bert
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from lxt.efficient import monkey_patch
            from torchvision.models import vision_transformer
            monkey_patch(vision_transformer)
        yield
    finally:
        for cls, attrs in zip(classes, saved, strict=True):
            for k in ("forward", "original_forward"):
                if k in attrs:
                    setattr(cls, k, attrs[k])
                elif k in cls.__dict__:
                    delattr(cls, k)


def cp_lrp_vs_lxt() -> Case:
    """The kit's cp_lrp (input x modified gradient at block 0's input, per patch, raw) against lxt's CP-LRP patch
    on the torchvision ViT, read at the same place (block 0's input) as x * x.grad summed over channels."""
    tv, tm = torchvision_and_timm()
    x = image_tensor()
    tr = vc.trace(tm, x, targets="top1", sites=["resid_pre", "F2"], rule="cp_lrp")
    c = int(np.argmax(tr["logits"].values))
    kit = vc.cam(tr, vc.presets.cp_lrp().replace(upsample="none", normalize="none")).values
    held: list[torch.Tensor] = []

    def keep(_m: torch.nn.Module, args: tuple) -> None:
        args[0].retain_grad()
        held.append(args[0])

    with lxt_cp_lrp_patched():
        handle = tv.encoder.layers[0].register_forward_pre_hook(keep)
        try:
            tv(x.clone().requires_grad_(True))[0, c].backward()
        finally:
            handle.remove()
    h = held[0]
    ref = (h * h.grad)[0, 1:].sum(-1).detach().numpy().reshape(4, 4)
    return Case(kit, ref, f"lxt {version('lxt')}, lxt/efficient/models/vit_torch.py cp_LRP patch (no zennit Gamma)",
                TV_MODEL, NOISE)


# -- pytorch-grad-cam --------------------------------------------------------------------------------------------
PGC_METHODS = ("gradcam", "hirescam", "gradcam_elementwise", "gradcampp", "xgradcam", "layercam", "eigencam",
               "eigengradcam")


def pgc_vs_kit(method: str) -> Case:
    """pytorch-grad-cam's ``<method>`` on the last block's ``norm1`` (its ViT tutorial) against the kit's preset of
    the same name, both upsampled to 32x32 and min-max normalised. EigenCAM's sign is LAPACK's in
    pytorch-grad-cam; the kit fixes it, so the closer of the two signs is compared."""
    pgc = pytest.importorskip("pytorch_grad_cam")
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    classes = {"gradcam": "GradCAM", "hirescam": "HiResCAM", "gradcam_elementwise": "GradCAMElementWise",
               "gradcampp": "GradCAMPlusPlus", "xgradcam": "XGradCAM", "layercam": "LayerCAM",
               "eigencam": "EigenCAM", "eigengradcam": "EigenGradCAM"}
    _, model = torchvision_and_timm()
    x = image_tensor()
    tr = vc.trace(model, x, targets="top1", sites=["F1"])
    top = int(np.argmax(tr["logits"].values))
    kit = vc.cam(tr, getattr(vc.presets, method)()).values

    def reshape(t: torch.Tensor) -> torch.Tensor:
        return t[:, 1:, :].reshape(t.size(0), 4, 4, t.size(2)).permute(0, 3, 1, 2)

    base = getattr(pgc, classes[method])

    class Flipped(base):  # the other sign of the singular vector, pytorch-grad-cam's own computation otherwise
        def get_cam_image(self, *args: object, **kwargs: object) -> np.ndarray:
            return -super().get_cam_image(*args, **kwargs)

    refs = []
    for cls in (base, Flipped) if method.startswith("eigen") else (base,):
        with cls(model=model, target_layers=[model.blocks[-1].norm1], reshape_transform=reshape) as cam:
            refs.append(cam(input_tensor=x, targets=[ClassifierOutputTarget(top)])[0].astype(np.float64))
    ref = min(refs, key=lambda r: float(np.abs(kit - r).max()))
    return Case(kit, ref, f"grad-cam {version('grad-cam')}, pytorch_grad_cam.{classes[method]} "
                "(blocks[-1].norm1, reshape_transform)", "timm ViT, random (32 px, patch 8, 3 blocks, width 32)",
                NOISE)


# -- presets whose code does not install: the tests' own re-implementations, measured ---------------------------
def published_vs_test_reference(method: str) -> Case:
    """grad_sam, attcat or agcam against the reference ``test_published.py`` writes from the official code (its own
    hooks on a copy of the model, torch autograd), on that test's tiny ViT: maps on the patch grid, raw."""
    import test_published as tp

    model, image = tp._vit(), tp._image()
    tr = vc.trace(model, image, targets="top1", sites=["F2", "attn_scores", "resid_pre"])
    _, logits, rec = tp._run(model, tp._input(model, image))
    logits[0, int(logits[0].argmax())].backward()
    A, h = rec["A"], rec["h"]
    if method == "agcam":
        ref = sum((torch.relu(a.grad[0, :, 0]) * torch.sigmoid(s[0, :, 0])).sum(0) for a, s in zip(A, rec["S"],
                                                                                               strict=True))
    elif method == "grad_sam":
        ref = sum((a[0, :, 0] * torch.relu(a.grad[0, :, 0])).mean(0) for a in A) / len(A)
    else:
        ref = sum((x.grad[0] * x[0]).sum(-1) * a[0].mean(0).mean(0) for x, a in zip(h, A, strict=True))
    kit = vc.cam(tr, getattr(vc.presets, method)().replace(**tp.RAW)).values
    source = {"agcam": "LeemSaebom/Attention-Guided-CAM-Visual-Explanations-of-Vision-Transformer-Guided-by-Self-"
                       "Attention AGCAM.py (commit not recorded)",
              "attcat": "qiangyao1988/AttCAT BERT_explainability/modules/BERT/ExplanationGenerator.py @6a2e38f",
              "grad_sam": "no official code: the formula the AttCAT/Contrast-CAT comparisons run"}[method]
    return Case(kit, tp._grid(ref.detach().numpy()), f"{source}, re-implemented in tests/unit/compute/"
                "test_published.py (own hooks, autograd)", "timm ViT, random (32 px, patch 8, 3 blocks, 2 heads, "
                "width 16)", "random uint8 image 32x32 (raw maps)")


def tokentm_vs_test_reference() -> Case:
    """tokentm against ``test_tokentm.py``'s NumPy float64 re-implementation of LibraGrad's transform_TokenTM."""
    import test_tokentm as tt

    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                          num_classes=5, embed_dim=48, num_heads=3).eval()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    tr = vc.trace(m, x, targets=[1, 3], sites=tt.SITES)
    kit = vc.cam(tr, vc.presets.tokentm().replace(class_=3, upsample="none", normalize="none")).values
    return Case(kit, tt._reference(tr, 3), "NightMachinery/decompv-libragrad-v1 decompv/x/ds/utils.py "
                "transform_TokenTM @9db0df4, re-implemented in tests/unit/compute/test_tokentm.py (NumPy float64)",
                "timm ViT, random (32 px, patch 8, 2 blocks, 3 heads, width 48)", NOISE + " (raw map)")


# -- attention presets on test_published.py's tiny ViT: own hooks and autograd, the papers' equations ------------
def _minmax(v: np.ndarray) -> np.ndarray:
    return (v - v.min()) / (v.max() - v.min())


def flat_vs_equations(method: str) -> Case:
    """chefer_attention_gradcam, attention_rollout, gradient_rollout or legrad_style against the equations
    ``test_flat_formulas.py`` asserts (there on hand-made traces), here on the attention and its autograd gradient
    that ``test_published.py``'s own hooks keep on a copy of its tiny ViT; maps on the patch grid."""
    import test_published as tp

    model, image = tp._vit(), tp._image()
    tr = vc.trace(model, image, targets="top1", sites=["F2"])
    _, logits, rec = tp._run(model, tp._input(model, image))
    logits[0, int(logits[0].argmax())].backward()
    A = [a.detach()[0].double().numpy() for a in rec["A"]]           # (head, query, key) per block
    G = [a.grad[0].double().numpy() for a in rec["A"]]
    n = A[0].shape[-1]
    raw = {"upsample": "none", "relu": "none", "normalize": "none"}
    if method == "chefer_attention_gradcam":  # Chefer's baseline: last block, CLS row, head weights mean_k grad
        ref = (A[-1][:, 0, 1:] * G[-1][:, 0, 1:].mean(-1, keepdims=True)).mean(0)
    elif method in ("attention_rollout", "gradient_rollout"):
        R = np.eye(n)
        for a, g in zip(A, G, strict=True):  # Abnar & Zuidema: 0.5 mean_h A + 0.5 I; gradient: I + mean_h relu(GA)
            R = (0.5 * a.mean(0) + 0.5 * np.eye(n)) @ R if method == "attention_rollout" else (
                R + np.maximum(g * a, 0).mean(0) @ R)
        ref = R[0, 1:]
    else:  # legrad_style: per block mean over query rows, ReLU, mean over heads, min-max; summed, min-max
        ref = _minmax(sum(_minmax(np.maximum(g.mean(-2), 0).mean(0)[1:]) for g in G))
        raw = {"upsample": "none"}
    kit = vc.cam(tr, getattr(vc.presets, method)().replace(**raw)).values
    refs = {"chefer_attention_gradcam": "hila-chefer/Transformer-Explainability baselines/ViT/"
                                        "ViT_explanation_generator.py @7cf1edb (Baselines.generate_cam_attn)",
            "attention_rollout": "Abnar & Zuidema 2020 (samiraabnar/attention_flow): "
                                 "R = prod_l (0.5 mean_h A_l + 0.5 I)",
            "gradient_rollout": "hila-chefer/Transformer-MM-Explainability lxmert/lxmert/src/ExplanationGenerator.py "
                                "@14e55ee: R += mean_h relu(grad * A) @ R",
            "legrad_style": "the kit's own LeGrad-style equation (no published code)"}
    return Case(kit, ref.reshape(4, 4), refs[method] + ", written out on test_published.py's own hooks "
                "(autograd)", "timm ViT, random (32 px, patch 8, 3 blocks, 2 heads, width 16)",
                "random uint8 image 32x32 (" + ("min-max maps)" if method == "legrad_style" else "raw maps)"))


# -- presets of test_presets_published.py, test_published.py and the backward rules: their tests' references ----
def _test_module(name: str, folder: str = "compute") -> types.ModuleType:
    """A test module of ``tests/unit/<folder>`` (on the path as pytest puts it there)."""
    import importlib
    from pathlib import Path

    path = str(Path(__file__).resolve().parents[1] / folder)
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)


_PUBLISHED = {
    "transition_attention_maps": ("tam_maps", (), "XianrenYty/Transition_Attention_Maps baselines/ViT/"
                                  "ViT_explanation_generator.py @cb3d263 (start_layer=1, 5 integration steps)"),
    "beyond_intuition_head": ("bt_head_maps", (), "jiaminchen-1031/transformerinterp ViT/baselines/ViT/"
                              "ViT_explanation_generator.py @7545da5, head-wise (5 steps)"),
    "beyond_intuition_token": ("bt_token_maps", (), "jiaminchen-1031/transformerinterp ViT/baselines/ViT/"
                               "ViT_explanation_generator.py @7545da5, token-wise (5 steps)"),
    "vit_cx": ("vit_cx_maps", (0.1,), "vaynexie/CausalX-ViT ViT_CX/ViT_CX.py @1ea3140 (noise 0.1, seeded)"),
    "albef_itm_gradcam": ("albef_maps", (), "salesforce/ALBEF visualization.ipynb @91de3c1 (its Grad-CAM equation on "
                          "the trace's cross-attention and gradient)"),
}


def presets_published_vs_test_reference(preset: str) -> Case:
    """TAM, BT-H, BT-T, ViT-CX or the ALBEF ITM Grad-CAM against ``test_presets_published.py``'s reference (its
    own hooks, ``backward()`` per step, AgglomerativeClustering as the official code): raw maps."""
    fn, args, source = _PUBLISHED[preset]
    kit, ref = getattr(_test_module("test_presets_published"), fn)(*args)
    model = ("BLIP ITM (transformers), random (32 px, patch 8, 2+2 layers, width 32)" if preset == "albef_itm_gradcam"
             else f"vitcam_testing make_model('vit'), random ({2 if preset == 'vit_cx' else 4} blocks)")
    return Case(kit, ref, source + ", re-implemented in tests/unit/compute/test_presets_published.py", model,
                "make_input('vit') (raw maps)" if preset != "albef_itm_gradcam" else
                "N(0,1) tensor 1x3x32x32, 5 text ids (raw map)")


def grad_eclip_vs_test_reference(preset: str = "grad_eclip") -> Case:
    """grad_eclip (single-head trace) or grad_eclip_paper against ``test_published.py``'s ``_eclip_reference``
    (generate_emap.py's equations, its own forward of the last block and autograd) on a tiny open_clip CLIP."""
    tp = _test_module("test_published")
    single = preset == "grad_eclip"
    model = tp._clip()
    text = torch.randn(8, generator=torch.Generator().manual_seed(5))
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    target = vc.targets.similarity(text[None])
    sites = ["F3", "q_out", "k_out", "v"] if single else ["F3", "q", "k", "v"]
    with vc.adapters.single_head_attention(model) if single else contextlib.nullcontext():
        tr = vc.trace(model, x, targets=target, sites=sites, layers=[-1])
    kit = vc.cam(tr, vc.presets.get(preset).replace(**tp.RAW)).values
    return Case(kit, tp._eclip_reference(model, x, text, 1 if single else 2),
                "Cyang-Zhao/Grad-Eclip generate_emap.py @6ffae66, re-implemented in tests/unit/compute/"
                "test_published.py", "open_clip CLIP, random (32 px, patch 8, 2 vision blocks, 2 heads, width 16)",
                NOISE + ", a random text embedding (raw map)")


def chefer_lrp_vs_test_reference() -> Case:
    """transformer_attribution (rule chefer_lrp) against ``test_chefer.py``'s NumPy float64 relprop of ViT_LRP.py and
    its ``transformer_attribution`` rollout, top-1 class, raw map on the patch grid."""
    tc = _test_module("test_chefer", "capture")
    model, img = tc._model(), tc._image()
    tr = tc._rule_trace(model, img)
    plain = vc.trace(model, img, targets="top2", sites=["F2"])
    h0 = tr["act"].sel(site="resid_pre").isel(layer=0).values.astype(np.float64)
    _, R_attn = tc.chefer_reference(model, h0, int(tr["target_class"].values[0]))
    grads = [plain["attn_grad"].isel(target=0, layer=i).values.astype(np.float64) for i in range(2)]
    kit = vc.cam(tr, vc.presets.transformer_attribution().replace(class_="top1", normalize="none"), grid=True).values
    return Case(kit, tc._official_map(R_attn, grads).reshape(4, 4),
                "hila-chefer/Transformer-Explainability baselines/ViT/ViT_LRP.py @f9cdd27 + layers_ours.py relprop, "
                "re-implemented in NumPy float64 in tests/unit/capture/test_chefer.py",
                "timm ViT, random (32 px, patch 8, 2 blocks, 2 heads, width 32)", "random uint8 image 32x32 (raw map)")


RULES = ("attnlrp", "cp_lrp", "libragrad")
TIMM_FAMILIES = ("vit", "deit_distilled_layerscale", "dinov2_registers", "beit")


def _family_setup(family: str) -> tuple[torch.nn.Module, object, list[str], Callable, str]:
    """(model, targets, sites, reference(model, h0, rule), description) of ``test_rules.py`` (timm ViT, DeiT
    distilled with layer scale, DINOv2-style registers, BEiT) or ``test_rules_families.py`` (the others)."""
    if family in TIMM_FAMILIES:
        tm = _test_module("test_rules", "capture")
        sites = tm.SITES if family != "beit" else [s for s in tm.SITES if s != "attn_scores"]
        return (tm._model(family), "top1", sites, tm.reference,
                f"timm {family}, random (32 px, patch 8, 2 blocks, 2 heads, width 32) in "
                "tests/unit/capture/test_rules.py")
    tf = _test_module("test_rules_families", "capture")
    model, targets, sites, reference = tf._family(family)
    return (model, targets, sites, reference,
            f"{family}, random (32 px, patch 8, 2 blocks, width 32) in tests/unit/capture/test_rules_families.py")


def rule_vs_test_reference(rules: str | tuple[str, ...] = RULES, family: str = "vit") -> Case:
    """Backward rules' stored gradients (every site of every block, first target) against the tests' hand-written
    forward with the rule spelled out (LayerNorm std, softmax and GELU as each rule says), differentiated by
    autograd; several rules: their gradients side by side."""
    rules = (rules,) if isinstance(rules, str) else tuple(rules)
    model, targets, sites, reference, description = _family_setup(family)
    image = _test_module("test_rules", "capture")._image()
    for p in model.parameters():
        p.requires_grad_(False)
    kit, ref = [], []
    for rule in rules:
        tr = vc.trace(model, image, targets=targets, sites=sites, rule=rule)
        h0 = torch.tensor(tr["act"].sel(site="resid_pre").isel(layer=0).values[None], requires_grad=True)
        logits, kept = reference(model, h0, rule)
        keys = [k for k in kept if k[1] in sites]
        grads = torch.autograd.grad(logits[int(tr["target_class"].values[0])], [kept[k] for k in keys],
                                    allow_unused=True)
        for (layer, site), g in zip(keys, grads, strict=True):
            ref.append(np.zeros(kept[(layer, site)].shape[1:], np.float32) if g is None else g[0].numpy())
            name = {"F2": "attn_grad", "attn_scores": "attn_scores_grad"}.get(site)
            kit.append((tr[name] if name else tr["grad"].sel(site=site)).isel(target=0, layer=layer).values)
    kit_all, ref_all = (np.concatenate([np.ravel(v) for v in vs]) for vs in (kit, ref))
    source = {"attnlrp": f"lxt {version('lxt')} efficient rules (AttnLRP)",
              "cp_lrp": f"lxt {version('lxt')} lxt/efficient/models/vit_torch.py (CP-LRP)",
              "libragrad": "LibraGrad's equations (NightMachinery/pytorch-image-models-libragrad-v1, commit not "
                           "recorded)"}
    return Case(kit_all, ref_all, "; ".join(source[r] for r in rules) + ", written out by hand on the model's "
                "forward in the test (autograd)", description,
                f"random uint8 image 32x32; every stored gradient ({', '.join(sites)}) of every block")


def scored_vs_pgc(weighting: str) -> Case:
    """scorecam (F1 of the last block) or ablationcam (F1 of block 1, with ``test_scored_parity.py``'s norm made
    non-negative so pytorch-grad-cam's ViT ablation layer zeroes the channel) against pytorch-grad-cam's ScoreCAM /
    AblationCAM + AblationLayerVit, as ``test_scored_parity.py`` runs them: min-max maps at 32x32."""
    pytest.importorskip("pytorch_grad_cam")
    from vitcam_testing import make_input, make_model

    ts = _test_module("test_scored_parity")
    model, x = make_model("vit"), make_input("vit")
    layer = -1 if weighting == "scorecam" else 1
    module = model.blocks[layer].norm1 if weighting == "scorecam" else ts._positive_norm1(model, layer)
    tr = vc.trace(model, x, targets="top1", sites=["F1"])
    recipe = vc.Recipe(site="F1", layer=layer, weighting=weighting)
    tr = vc.score(tr, model, recipe, x, batch_size=6, progress=False)
    cls, kw = ((ts.ScoreCAM, {}) if weighting == "scorecam" else
               (ts.AblationCAM, {"ablation_layer": ts.AblationLayerVit(), "batch_size": 6}))
    ref = ts._pgc(cls, model, module, x, tr, int(tr["target_class"].values[0]), **kw)
    return Case(ts._vc_map(tr, recipe), ref, f"grad-cam {version('grad-cam')}, pytorch_grad_cam.{cls.__name__}"
                + (" + AblationLayerVit" if kw else "") + f" (blocks[{layer}].norm1)",
                "vitcam_testing make_model('vit'), random", "make_input('vit') (min-max maps, 32x32)")
