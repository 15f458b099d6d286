"""The trace-cost work (issue 55, item 7) changes how a trace is built, never what it stores: the Dataset built in one
step (capture/dataset_build.py) is the one ``xr.Dataset(data_vars, coords=..., attrs=...)`` builds from the same pass
(same variables in the same order, dims, dtypes, bytes, indexes, attributes: structural, so compared bitwise), on the
tiny LLaVA, PaliGemma, Qwen2-VL and a timm ViT; the graph search of ``lowest_tensors`` agrees with a brute-force
reachability written here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr
from timm.models.vision_transformer import VisionTransformer

import vitcam_nb as vc
from vitcam_nb.capture import assemble as assemble_mod
from vitcam_nb.capture import dataset_build
from vitcam_nb.capture.dataset_build import dataset
from vitcam_nb.capture.prealloc import lowest_tensors


def _constructor(data_vars, coords, attrs):
    return xr.Dataset(data_vars, coords=coords, attrs=attrs)


def _same(fast: xr.Dataset, slow: xr.Dataset) -> None:
    assert list(fast.variables) == list(slow.variables)
    assert list(fast.data_vars) == list(slow.data_vars) and set(fast.coords) == set(slow.coords)
    assert dict(fast.sizes) == dict(slow.sizes) and list(fast.dims) == list(slow.dims)
    for name, var in slow.variables.items():
        got = fast.variables[name]
        assert got.dims == var.dims and got.dtype == var.dtype, name
        assert got.values.tobytes() == var.values.tobytes(), name  # bitwise: the same pass's arrays
        assert got.attrs == var.attrs and got.encoding == var.encoding, name
    assert list(fast.xindexes) == list(slow.xindexes)
    for name, index in slow.indexes.items():
        assert type(fast.indexes[name]) is type(index) and fast.indexes[name].dtype == index.dtype, name
        assert fast.indexes[name].equals(index) and fast.indexes[name].name == index.name, name
    assert fast.attrs == slow.attrs and list(fast.attrs) == list(slow.attrs)
    assert fast.identical(slow)


def _llava():
    from benchmarks.items.vlm_trace_cost import _llava
    return _llava()[:3]


def _paligemma():
    from benchmarks.items.vlm_trace_cost import _paligemma
    return _paligemma()[:3]


def _qwen2_vl():
    from vlm_qwen_tiny import tiny_qwen
    return tiny_qwen("qwen2")


VIT_SITES = ["F1", "F2", "F3", "F4", "F5", "F6", "attn_scores"]


def _vit():
    torch.manual_seed(0)
    m = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=5).eval()
    return m, torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)), "top2"


@pytest.mark.parametrize("build", [_llava, _paligemma, _qwen2_vl, _vit], ids=["llava", "paligemma", "qwen2_vl", "vit"])
def test_one_step_dataset_equals_the_constructors(build, monkeypatch):
    model, x, target = build()

    def refused(*_):
        raise AssertionError("the trace's Dataset went to the constructor: the direct build was not tested")

    monkeypatch.setattr(dataset_build, "_construct", refused)
    def run():
        return vc.trace(model, x, targets=target, sites=VIT_SITES) if build is _vit else vc.trace(model, x,
                                                                                                 targets=target)

    fast, again = run(), run()  # the second takes its indexes from the cache the first filled
    fast["layer"].attrs["note"] = "mine"  # each Dataset's coordinate variables are its own
    assert "note" not in again["layer"].attrs
    del fast["layer"].attrs["note"]
    monkeypatch.setattr(assemble_mod, "dataset", _constructor)
    slow = vc.trace(model, x, targets=target, sites=VIT_SITES) if build is _vit else vc.trace(model, x, targets=target)
    assert len(fast.xindexes) >= 10
    _same(fast, slow)
    _same(again, slow)


def test_dataset_falls_back_to_the_constructor_and_its_error():
    # sizes that disagree: the constructor's own error, not a Dataset with a wrong size
    with pytest.raises(ValueError):
        dataset({"a": ("x", np.zeros(2))}, {"x": ("x", np.arange(3))}, {})
    # an entry that is not a (dims, values) pair is the constructor's
    ds = dataset({"a": xr.DataArray(np.zeros(2), dims="x")}, {"x": ("x", np.arange(2))}, {"k": 1})
    assert ds.identical(xr.Dataset({"a": ("x", np.zeros(2))}, coords={"x": np.arange(2)}, attrs={"k": 1}))


def test_an_xarray_whose_direct_build_differs_gets_the_public_constructor(monkeypatch):
    """The direct build uses xarray internals: where they give another Dataset than the constructor (another xarray),
    the one-time check sends every build to the constructor."""
    wrong = xr.Dataset({"a": ("x", np.ones(2))}, coords={"x": np.arange(2)})
    monkeypatch.setattr(dataset_build, "_DIRECT_OK", None)
    monkeypatch.setattr(dataset_build, "_direct", lambda *a: wrong)
    assert dataset_build._direct_agrees() is False
    ds = dataset({"a": ("x", np.zeros(2))}, {"x": ("x", np.arange(2))}, {})
    assert ds.identical(xr.Dataset({"a": ("x", np.zeros(2))}, coords={"x": np.arange(2)}))
    monkeypatch.setattr(dataset_build, "_DIRECT_OK", None)  # and on this xarray the check passes
    monkeypatch.undo()
    assert dataset_build._direct_agrees() is True


def _brute_lowest(tensors):
    """Index i is lowest when no other tensor's gradient edge is reachable below tensor i's node."""
    edges = [torch.autograd.graph.get_gradient_edge(t) for t in tensors]
    out = []
    for i, e in enumerate(edges):
        others = {(f.node, f.output_nr) for f in edges}
        seen, stack, hit = set(), [e.node], False
        while stack and not hit:
            for n, nr in stack.pop().next_functions:
                if n is None:
                    continue
                hit = hit or (n, nr) in others
                if n not in seen:
                    seen.add(n)
                    stack.append(n)
        if not hit:
            out.append(i)
    return out


def test_lowest_tensors_matches_brute_force_in_every_order():
    x = torch.ones(3, requires_grad=True)
    a = x * 2
    b = a + 1
    c = torch.sin(x)  # a sibling: nothing traced below it but x
    d = b * c
    q, k = d.split(1, 0)[0], d.split(1, 0)[1]  # two outputs of one node
    ts = [a, b, c, d, q, k, x]
    rng = np.random.default_rng(0)
    for _ in range(20):
        order = [int(i) for i in rng.permutation(len(ts))]
        picked = [ts[i] for i in order[: int(rng.integers(2, len(ts) + 1))]]
        assert lowest_tensors(picked) == _brute_lowest(picked)
    # the lowest tensor searched first, then one above it: found below, though its own search found nothing
    assert lowest_tensors([a, b]) == [0]
