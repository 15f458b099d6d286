"""check_traced_source: the one refusal of a model or input other than a trace's (vc.score, integrated gradients)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.provenance import array_sha256, check_traced_source, weights_sha256


def test_refuses_other_weights_and_another_input_and_passes_the_traced_pair():
    torch.manual_seed(0)
    model, other = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    x = torch.rand(1, 3)
    attrs = {"weights_sha256": weights_sha256(model), "input_sha256": array_sha256(x)}
    check_traced_source(attrs, model, x)
    with pytest.raises(TraceError, match=r"^model: its weights .* not those the trace was made with .*; the scores "
                                         r"would belong to another model: pass the traced model$"):
        check_traced_source(attrs, other, x, "the scores would belong to another model: ")
    with pytest.raises(TraceError, match=r"^image: its model input .* is not the traced input"):
        check_traced_source(attrs, model, x + 1)


def test_traced_scores_within_float_tolerance_pass_and_others_are_refused_with_both_values():
    from vitcam_nb.core.provenance import check_traced_scores

    traced = np.array([0.5, -20.0, 3.0])
    attrs = {"compute_dtype": "float32", "device": "cpu", "target_kind": "class"}
    check_traced_scores(attrs, traced, traced + 1e-4 * 20 * 0.99, "cpu")  # 1e-4 of max(1, max |score|) = 2e-3
    with pytest.raises(TraceError, match=r"^model: on the traced input its scores are not the trace's logits: class 2 "
                                         r"is 3\.01 here, 3 in the trace \(\|difference\| 0\.01 > tolerance 0\.002; "
                                         r"1 of 3 scores differ\).*; pass the model exactly as traced$"):
        check_traced_scores(attrs, traced, traced + np.array([0, 0, 0.01]), "cpu")
    check_traced_scores({**attrs, "compute_dtype": "float16"}, traced, traced + 0.1, "cpu")  # 1e-2 * 20
    check_traced_scores({**attrs, "device": "cuda:0"}, traced, traced + 0.1, "cpu")  # another device type: 1e-2
    with pytest.raises(TraceError, match=r"tolerance 0\.002"):  # cuda:0 and cuda:1: the same kind of kernels
        check_traced_scores({**attrs, "device": "cuda:0"}, traced, traced + 0.1, "cuda:1")
    with pytest.raises(TraceError, match=r"^model, targets: .*score 0 is nan here, 0\.5 in the trace.*pass the model "
                                         r"and target exactly as traced$"):
        check_traced_scores({**attrs, "target_kind": "region"}, traced, np.array([np.nan, -20.0, 3.0]), "cpu")
    with pytest.raises(TraceError, match=r"^model: on the traced input it gives 2 scores, the trace holds 3 logits"):
        check_traced_scores(attrs, traced, torch.zeros(2), "cpu")
    inf = np.array([np.inf, 1.0])
    check_traced_scores(attrs, inf, inf.copy(), "cpu")  # equal infinities are the same score


def _untrained_per_layer(model: torch.nn.Module) -> bool:
    # the definition, layer by layer: every affine norm's weight is 1 and its bias (if any) 0
    norms = [m for m in model.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.BatchNorm2d,
                                                         torch.nn.BatchNorm1d)) and m.weight is not None]
    return bool(norms) and all(bool((m.weight == 1).all()) and (m.bias is None or bool((m.bias == 0).all()))
                               for m in norms)


def test_untrained_compares_norms_of_every_dtype_as_each_layer_would():
    from vitcam_nb.core.provenance import untrained

    model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.LayerNorm(3, bias=False).double(),
                                torch.nn.BatchNorm1d(2), torch.nn.GroupNorm(1, 2, affine=False),
                                torch.nn.LayerNorm(5).half(), torch.nn.Linear(2, 2))
    assert untrained(model) is True and _untrained_per_layer(model) is True
    tensors = [(n, t) for n, t in model.named_parameters() if not n.startswith("5.")]
    assert len(tensors) == 7
    for name, t in tensors:
        with torch.no_grad():
            old = t[-1].item()
            t[-1] = old + 2 ** -8  # exactly representable in float16 too
            assert untrained(model) is False and _untrained_per_layer(model) is False, name
            t[-1] = old
    assert untrained(model) is True
