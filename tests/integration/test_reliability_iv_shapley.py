"""Issue #52, finding 9: ``shapley_patches`` guards time and determinism, not only memory: a grid of more than 2^20
passes is refused unless ``max_passes`` allows it (whatever the free memory), and a model random in eval mode is
refused instead of getting "exact" values that change from run to run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vitcam_nb.evaluate as ev
from vitcam_nb.capture import budget


class _Counting(torch.nn.Module):
    """A linear classifier on 28x28 inputs that counts its forward calls."""

    def __init__(self, noise: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3 * 28 * 28, 3)
        self.noise, self.calls = noise, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = self.lin(x.flatten(1))
        # random in eval mode: functional dropout with training=True, as a model with a hard-wired dropout has
        return torch.nn.functional.dropout(out, self.noise, training=True) if self.noise else out


X = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(1))


def test_a_grid_of_2_to_the_28_passes_is_refused_by_time_before_any_pass(monkeypatch):
    model = _Counting()
    model.lin.register_forward_pre_hook(lambda *_: pytest.fail("the model was called: the grid was not refused"))
    # The memory budget would take it (2^28 scores in 10 GB): the refusal must not depend on free RAM.
    monkeypatch.setattr(budget, "available_bytes", lambda: 1e15)
    with pytest.raises(ValueError, match=r"^grid: 28 groups take 2\^28 = 268,435,456 forward passes, over the "
                                         r"default cap of 2\^20 = 1,048,576 \(pass max_passes= to allow more\); use "
                                         "fewer groups"):
        ev.shapley_patches(model, X, grid=(4, 7), target=0, max_bytes=1e12)
    with pytest.raises(ValueError, match=r"^grid: 28 groups take .* over max_passes=1,000; use fewer groups"):
        ev.shapley_patches(model, X, grid=(4, 7), target=0, max_passes=1000)
    for bad in (0, -1, 1.5, True, "many"):
        with pytest.raises(ValueError, match=r"^max_passes: expected a positive int number of forward passes"):
            ev.shapley_patches(model, X, grid=(2, 2), target=0, max_passes=bad)
    assert model.calls == 0
    model = _Counting()
    with pytest.raises(ValueError, match=r"^grid: 4 groups take 2\^4 = 16 forward passes, over max_passes=15"):
        ev.shapley_patches(model, X, grid=(2, 2), target=0, max_passes=15)
    phi = ev.shapley_patches(model, X, grid=(2, 2), target=0, max_passes=16, batch_size=16)
    # the additive model's known answer: each group's share of the linear score against the zero baseline
    w = model.lin.weight[0].detach().reshape(3, 28, 28) * X[0]
    expected = w.reshape(3, 2, 14, 2, 14).sum(dim=(0, 2, 4)).double().numpy()
    np.testing.assert_allclose(phi.values, expected, rtol=1e-4, atol=1e-5)
    assert phi.attrs["repeat_check"].startswith("the last batch (16 inputs, the intact image among them) scored twice")


def test_a_model_random_in_eval_mode_is_refused():
    model = _Counting(noise=0.5)
    with pytest.raises(ValueError, match=r"^model: the model is not deterministic in eval mode: the same 4 masked "
                                         r"inputs \(the intact image among them\) scored twice differ by up to"):
        ev.shapley_patches(model, X, grid=(2, 2), target=0, batch_size=4)
