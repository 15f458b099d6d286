"""check_traced_source: the one refusal of a model or input other than a trace's (vc.score, integrated gradients)."""

from __future__ import annotations

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
