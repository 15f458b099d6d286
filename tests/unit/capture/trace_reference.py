"""The independent reference of the tracer tests (``test_trace_*.py``).

It never calls vitcam_nb: it registers its own hooks, keeps the hooked tensors with ``retain_grad()`` and runs
one fresh forward + ``backward()`` per target scalar.
"""

from __future__ import annotations

import contextlib

import torch

CORE = ["F1", "F2", "F3", "F4", "F5", "F6"]
EXTENDED = ["resid_pre", "attn_out", "resid_mid"]
ALL_SITES = CORE + EXTENDED


@contextlib.contextmanager
def reference_hooks(model: torch.nn.Module):
    """Hook every site of every block with my own hooks; yields {(layer, site): tensor}.

    Sets ``fused_attn = False`` and eval mode for the duration and restores both afterwards.
    """
    store: dict[tuple[int, str], torch.Tensor] = {}
    handles = []
    fused = [(blk.attn, blk.attn.fused_attn) for blk in model.blocks]
    modes = [(m, m.training) for m in model.modules()]

    def keep(key, t):
        assert key not in store, f"{key} fired twice"
        t.retain_grad()
        store[key] = t

    def out_hook(key):
        return lambda _m, _i, out: keep(key, out)

    def in_hook(key):
        return lambda _m, args: keep(key, args[0])

    try:
        for layer, blk in enumerate(model.blocks):
            handles += [
                blk.norm1.register_forward_hook(out_hook((layer, "F1"))),
                blk.attn.attn_drop.register_forward_hook(out_hook((layer, "F2"))),
                blk.attn.proj.register_forward_pre_hook(in_hook((layer, "F3"))),
                blk.norm2.register_forward_hook(out_hook((layer, "F4"))),
                blk.mlp.register_forward_hook(out_hook((layer, "F5"))),
                blk.register_forward_hook(out_hook((layer, "F6"))),
                blk.register_forward_pre_hook(in_hook((layer, "resid_pre"))),
                blk.attn.register_forward_hook(out_hook((layer, "attn_out"))),
                blk.norm2.register_forward_pre_hook(in_hook((layer, "resid_mid"))),
            ]
            blk.attn.fused_attn = False
        model.eval()
        yield store
    finally:
        for h in handles:
            h.remove()
        for m, flag in fused:
            m.fused_attn = flag
        for m, mode in modes:
            m.training = mode


def expected_logit(z: torch.Tensor) -> torch.Tensor:
    return (torch.softmax(z.detach(), dim=0) * z).sum()


def reference(model, x, scalar):
    """Fresh forward + backward of ``scalar(logits[0])``; returns ({(layer, site): (act, grad)}, logits)."""
    saved_grads = [(p, p.grad) for p in model.parameters()]
    with reference_hooks(model) as store, torch.enable_grad():
        xx = x.detach().clone().requires_grad_(True)
        z = model(xx)[0]
        scalar(z).backward()
        out = {k: (t.detach()[0].double().numpy().copy(), t.grad[0].double().numpy().copy())
               for k, t in store.items()}
    for p, g in saved_grads:  # leave the model's .grad as it was
        p.grad = g
    return out, z.detach().double().numpy()


def scalar_for(target_class: int):
    if target_class < 0:
        return expected_logit
    return lambda z: z[target_class]


def depth(model) -> int:
    return len(model.blocks)
