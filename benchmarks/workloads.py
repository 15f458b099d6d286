"""The models and inputs the benchmarks run on, rebuilt identically in the memory-probe subprocess."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TINY = "tiny_vit"
VIT_BASE = "vit_base_patch16_224"
BUNDLED = "shapes-vit"
FULL_MODELS = (VIT_BASE, BUNDLED)
QUICK_MODELS = (TINY, BUNDLED)


class Unavailable(RuntimeError):
    """A workload that cannot be built on this checkout (e.g. the bundled weights are not there yet)."""


@dataclass
class Workload:
    """A model in eval mode on its device, its normalised input (1, 3, H, W) and a one-line description."""

    name: str
    model: torch.nn.Module
    x: torch.Tensor
    description: str


def _tiny() -> torch.nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=4, mlp_ratio=2.0,
                             num_classes=10)


def build(name: str, device: str = "cpu") -> Workload:
    """Build workload ``name`` (``tiny_vit``, ``vit_base_patch16_224``, ``shapes-vit`` or any timm name).

    Random-init models are seeded, so the parent process and the memory probe get the same weights and
    input. Raises :class:`Unavailable` when the bundled model cannot be loaded.

    Example:
        >>> w = build("tiny_vit")
        >>> tuple(w.x.shape)
        (1, 3, 32, 32)
    """
    if name == TINY:
        model = _tiny()
        description = "tiny random-init ViT (32x32 input, patch 8, 3 blocks, dim 32, 4 heads, 10 classes)"
    elif name.startswith("shapes-"):
        try:
            from vitcam_nb.models import load_model, sample_image
            from vitcam_nb.preprocess import prepare_input

            model = load_model(name)
            image = sample_image("shapes", 0)
        except Exception as exc:  # missing module, weights or samples: report, never fail the whole run
            raise Unavailable(f"{name}: the bundled model could not be loaded ({type(exc).__name__}: {exc})") from exc
        model = model.eval().to(device)
        x = prepare_input(model, image).tensor.to(device)
        return Workload(name, model, x, _describe(name, model, "bundled known-answer model, sample image 0"))
    else:
        import timm

        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False)
        description = f"timm {name}, random init (timing does not depend on the weights)"
    model = model.eval().to(device)
    g = torch.Generator().manual_seed(1)
    h, w = (int(v) for v in model.patch_embed.img_size)
    x = torch.randn((1, 3, h, w), generator=g).to(device)
    return Workload(name, model, x, _describe(name, model, description))


def _describe(name: str, model: torch.nn.Module, what: str) -> str:
    n_params = sum(p.numel() for p in model.parameters())
    h, w = (int(v) for v in model.patch_embed.img_size)
    return (f"{what}; {len(model.blocks)} blocks, embed {model.embed_dim}, {model.blocks[0].attn.num_heads} heads, "
            f"{h}x{w} input, {model.patch_embed.num_patches} patches + {model.num_prefix_tokens} prefix tokens, "
            f"{n_params / 1e6:.2f} M parameters")
