"""The independent reference of the adapter tests (``test_adapters*.py``).

It never calls vitcam_nb: it deep-copies the model, hooks the modules the family's site table names, keeps the
hooked tensors with ``retain_grad()`` and runs one fresh forward + ``backward()`` per target scalar.
``family_run`` traces each family once per process and runs the reference for every traced target.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch
from flat_families import FAMILIES, Family, make_input, model_order, vc_trace
from torch import nn
from vitcam_testing import snapshot


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
