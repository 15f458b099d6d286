"""What a trace records (issue #2): attention rows and the token layout, the targets, no reference to the model
or to torch tensors, the storage dtype and subsets, determinism and identity."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
import xarray as xr
from trace_reference import depth

import vitcam_nb as vc

# --------------------------------------------------------------------------------------------------
# 3. Attention rows, token layout


def test_attention_rows_sum_to_one(tiny_case):
    tr = vc.trace(tiny_case.model, tiny_case.x, sites=["F2"], targets=0)
    sums = tr["attn"].sum("key").values
    np.testing.assert_allclose(sums, 1.0, atol=1e-5)
    assert (tr["attn"].values >= 0).all()


def test_token_layout(tiny_case):
    spec = tiny_case.spec
    tr = vc.trace(tiny_case.model, tiny_case.x, targets=0)
    gh, gw = spec.grid
    n_prefix = len(spec.prefix)
    kinds = list(spec.prefix) + ["patch"] * (gh * gw)
    rows = [-1] * n_prefix + [p // gw for p in range(gh * gw)]
    cols = [-1] * n_prefix + [p % gw for p in range(gh * gw)]
    assert tr.sizes["token"] == spec.n_tokens
    assert list(tr["token"].values) == list(range(spec.n_tokens))
    assert list(tr["token_kind"].values) == kinds
    assert list(tr["patch_row"].values) == rows
    assert list(tr["patch_col"].values) == cols
    for axis in ("query", "key"):
        assert list(tr[axis].values) == list(range(spec.n_tokens))
        assert list(tr[f"{axis}_kind"].values) == kinds
        assert list(tr[f"{axis}_patch_row"].values) == rows
        assert list(tr[f"{axis}_patch_col"].values) == cols
    assert (tr.attrs["grid_h"], tr.attrs["grid_w"]) == (gh, gw)
    assert tr.attrs["num_prefix_tokens"] == n_prefix
    assert tr["image"].shape == (*spec.input_hw, 3)
    for name in ("token", "query", "key"):  # plain coordinates, never a MultiIndex
        assert not isinstance(tr.indexes.get(name), __import__("pandas").MultiIndex)


def test_patch_coordinates_point_at_the_right_pixels(tiny_case):
    """F1 of block 0 is a per-token function of the patch embedding: perturbing the pixels of patch
    (r, c) must change exactly the token whose patch_row/patch_col say (r, c)."""
    model, x, spec = tiny_case.model, tiny_case.x, tiny_case.spec
    gh, gw = spec.grid
    base = vc.trace(model, x, sites="F1", layers=0, targets=0)["act"].sel(site="F1", layer=0)
    for r, c in [(0, gw - 1), (gh - 1, 0), (1, 2)]:
        x2 = x.clone()
        x2[..., r * 8:(r + 1) * 8, c * 8:(c + 1) * 8] += 1.0
        moved = vc.trace(model, x2, sites="F1", layers=0, targets=0)["act"].sel(site="F1", layer=0)
        changed = (np.abs(moved - base) > 1e-6).any("channel")
        tokens = base["token"].values[changed.values]
        assert len(tokens) == 1, f"patch ({r},{c}) changed tokens {tokens}"
        tok = base.sel(token=tokens[0])
        found = (str(tok["token_kind"].values), int(tok["patch_row"]), int(tok["patch_col"]))
        assert found == ("patch", r, c)


# --------------------------------------------------------------------------------------------------
# 4. Targets


def test_targets_top5_top3_int_list(tiny_vit, model_input):
    x = model_input("vit")
    with torch.no_grad():
        z = tiny_vit(x)[0].numpy()
    order = [int(c) for c in np.argsort(-z, kind="stable")]

    tr = vc.trace(tiny_vit, x)  # default "top5"
    assert list(tr["target"].values) == [f"logit_{c}" for c in order[:5]] + ["expected_logit"]
    assert list(tr["target_class"].values) == order[:5] + [-1]
    assert len(tr["target_label"]) == 6
    assert list(vc.trace(tiny_vit, x, targets="top5")["target"].values) == list(tr["target"].values)

    tr3 = vc.trace(tiny_vit, x, targets="top3")
    assert list(tr3["target_class"].values) == order[:3] + [-1]

    tr_int = vc.trace(tiny_vit, x, targets=order[-1])
    assert list(tr_int["target"].values) == [f"logit_{order[-1]}", "expected_logit"]
    assert list(tr_int["target_class"].values) == [order[-1], -1]

    tr_list = vc.trace(tiny_vit, x, targets=[7, 2])
    assert list(tr_list["target"].values) == ["logit_7", "logit_2", "expected_logit"]
    assert list(tr_list["target_class"].values) == [7, 2, -1]
    # the same class has the same gradient whatever else is traced alongside it
    np.testing.assert_allclose(tr_list["grad"].sel(target="logit_7").values,
                               vc.trace(tiny_vit, x, targets=7)["grad"].sel(target="logit_7").values,
                               rtol=1e-6, atol=1e-9)


def test_labels_are_attached(tiny_vit, model_input):
    labels = [f"thing{i}" for i in range(10)]
    tr = vc.trace(tiny_vit, model_input("vit"), targets=[4], labels=labels)
    assert list(tr["class_label"].values) == labels
    assert list(tr["target_label"].values)[0] == "thing4"
    assert list(tr["class"].values) == list(range(10))


@pytest.mark.parametrize("bad", [10, -1, "top0", "top11", "foo", 2.5, [], [1, 10], [1.0], True, None])
def test_bad_targets_refused(bad, tiny_vit, model_input, model_snapshot, assert_model_unchanged):
    before = model_snapshot(tiny_vit)
    with pytest.raises(ValueError, match="targets"):
        vc.trace(tiny_vit, model_input("vit"), targets=bad)
    assert_model_unchanged(before, tiny_vit)


# --------------------------------------------------------------------------------------------------
# 7. No reference to the model or to torch tensors survives in the trace


def _walk_bases(a):
    while a is not None:
        yield a
        a = getattr(a, "base", None)


def test_trace_holds_no_model_and_no_tensors(model_factory, model_input):
    model = model_factory("vit")
    x = model_input("vit")
    tr = vc.trace(model, x)
    model_ref = weakref.ref(model)
    param_ref = weakref.ref(next(iter(model.parameters())))
    del model
    gc.collect()
    assert model_ref() is None, "the model is still alive after the trace"
    assert param_ref() is None, "a parameter is still alive after the trace"
    for name, var in tr.variables.items():
        assert type(var.data) is np.ndarray, f"{name} holds {type(var.data)}"
        for a in _walk_bases(var.data):
            assert not isinstance(a, torch.Tensor), f"{name}'s numpy array is a view of a torch tensor"
    for k, v in tr.attrs.items():
        assert not isinstance(v, torch.Tensor), k
    assert not x.requires_grad and x.grad is None


# --------------------------------------------------------------------------------------------------
# 8. Storage dtype and subsets


def test_float16_storage(tiny_vit, model_input):
    x = model_input("vit")
    full = vc.trace(tiny_vit, x, targets=[2, 6])
    half = vc.trace(tiny_vit, x, targets=[2, 6], dtype="float16")
    for name in ("act", "grad", "attn", "attn_grad"):
        assert half[name].dtype == np.float16, name
        a, b = half[name].values.astype(np.float64), full[name].values.astype(np.float64)
        assert np.isfinite(a).all()
        assert np.max(np.abs(a - b)) <= 2e-3 * np.max(np.abs(b)) + 1e-6, name
        # every value is the float16 rounding of the float32 one (computation stays float32)
        np.testing.assert_array_equal(half[name].values, full[name].values.astype(np.float16))
    assert half.attrs["dtype"] == "float16" and full.attrs["dtype"] == "float32"
    assert half.attrs["trace_id"] != full.attrs["trace_id"]
    assert half["image"].dtype == np.uint8


def test_subsets_equal_the_full_trace(tiny_vit, model_input):
    x = model_input("vit")
    last = depth(tiny_vit) - 1
    full = vc.trace(tiny_vit, x, targets=[3, 8])
    sub = vc.trace(tiny_vit, x, targets=[3, 8], layers=[-1], sites=["F1", "F2"])
    assert list(sub["layer"].values) == [last]
    assert list(sub["site"].values) == ["F1"]
    for name, sel in (("act", dict(site="F1")), ("grad", dict(site="F1")), ("attn", {}), ("attn_grad", {})):
        np.testing.assert_allclose(sub[name].sel(layer=last, **sel).values,
                                   full[name].sel(layer=last, **sel).values,
                                   rtol=1e-6, atol=1e-9, err_msg=name)
    one = vc.trace(tiny_vit, x, targets=[3, 8], layers=1, sites="F4")
    assert list(one["layer"].values) == [1] and list(one["site"].values) == ["F4"]
    np.testing.assert_allclose(one["grad"].sel(layer=1, site="F4").values,
                               full["grad"].sel(layer=1, site="F4").values, rtol=1e-6, atol=1e-9)
    np.testing.assert_array_equal(sub["logits"].values, full["logits"].values)


# --------------------------------------------------------------------------------------------------
# 9. Determinism and identity


def test_deterministic_and_identified(tiny_vit, model_input):
    x = model_input("vit")
    a = vc.trace(tiny_vit, x)
    b = vc.trace(tiny_vit, x)
    xr.testing.assert_identical(a, b)
    assert a.attrs["trace_id"] == b.attrs["trace_id"]
    c = vc.trace(tiny_vit, model_input("vit", seed=1))
    assert c.attrs["input_sha256"] != a.attrs["input_sha256"]
    assert c.attrs["trace_id"] != a.attrs["trace_id"]
    assert c.attrs["weights_sha256"] == a.attrs["weights_sha256"]
    with torch.no_grad():
        tiny_vit.head.bias[0] += 1.0
    d = vc.trace(tiny_vit, x)
    assert d.attrs["weights_sha256"] != a.attrs["weights_sha256"]
    assert d.attrs["trace_id"] != a.attrs["trace_id"]
