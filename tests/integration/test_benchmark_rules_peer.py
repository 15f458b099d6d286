"""The rules benchmark's lxt peer runs torchvision's ViT with the timm model's weights: the name mapping it relies on
gives the same logits (so the two sides explain the same function), and without a peer interpreter the peer is
recorded as not measured, naming how to give one."""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer

from benchmarks.items.rules import PEER_ENV, lxt_peer
from benchmarks.rules_peer import torchvision_state


def test_torchvision_vit_with_the_mapped_weights_computes_the_timm_logits():
    from torchvision.models.vision_transformer import VisionTransformer as TorchvisionViT

    torch.manual_seed(0)
    timm_vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    for p in timm_vit.parameters():  # O(1) weights: a wrong mapping shows in every logit
        torch.nn.init.normal_(p, std=0.3)
    tv = TorchvisionViT(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=128,
                        num_classes=5)
    tv.load_state_dict(torchvision_state(timm_vit.state_dict(), 2), strict=True)
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = timm_vit.eval()(x), tv.eval()(x)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_without_a_peer_interpreter_the_peer_is_not_measured():
    out = lxt_peer(None, None, 1)
    assert out["measured"] is False and "--peer-python" in out["why"] and PEER_ENV in out["why"]
