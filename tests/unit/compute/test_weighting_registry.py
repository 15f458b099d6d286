"""Every registered weighting against its own ``reference`` formula, iterated from the registry, so that a weighting
added as one module of vitcam_nb/compute/weightings/ is tested by its registration alone (its torch kernel against
its NumPy kernel: test_torch_kernels.py; its zero-gradient claim: test_zero_gradient.py). And the discovery that
finds those modules: a package of weighting modules registers every one of them, in their ORDER, listed nowhere."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

from vitcam_nb.compute.kernels import token_maps
from vitcam_nb.compute.weightings import discover, discovered
from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.core.weighting import WEIGHTINGS, weighting_names

WITH_REFERENCE = [n for n in WEIGHTINGS.names() if WEIGHTINGS.get(n).reference is not None]
T, K = 17, 8
PATCH = np.arange(1, T)
WMASKS = {"patch": PATCH, "all": np.arange(T), "cls": np.array([0])}


def _data(name: str, seed: int, lead: tuple = ()) -> tuple[np.ndarray, np.ndarray, dict]:
    """Activations off the integers by 0.3 (so channel sums S rarely make Grad-CAM++'s 2 + S G vanish) with a few
    fivefold spikes (outliers, which weightings that threshold activations respond to), integer gradients, and
    stored scores if the weighting reads any."""
    rng = np.random.default_rng(seed)
    A = (rng.integers(-3, 4, (*lead, T, K)) + 0.3) * np.where(rng.random((*lead, T, K)) < 0.05, 5, 1)
    A = A.astype(np.float32)
    G = rng.integers(-3, 4, (*lead, T, K)).astype(np.float32)
    stored = {}
    if WEIGHTINGS.get(name).scores:
        stored = {"scores": rng.normal(size=(*lead, K)).astype(np.float32),
                  "base": rng.uniform(1, 2, lead).astype(np.float32), "k": 3}
    return A, G, stored


def _reference(name: str, A: np.ndarray, G: np.ndarray, wmask: np.ndarray, stored: dict) -> np.ndarray:
    stored = {k: v.astype(np.float64) if isinstance(v, np.ndarray) else v for k, v in stored.items()}
    return WEIGHTINGS.get(name).reference(A.astype(np.float64), G.astype(np.float64), wmask, PATCH, **stored)


def test_every_discovered_weighting_has_a_reference_and_the_registry_holds_them_first():
    names = weighting_names()
    assert discovered() and names[:len(discovered())] == discovered()
    assert names[0] == "gradcam"  # the default recipe's weighting leads every menu
    assert set(discovered()) <= set(WITH_REFERENCE)


@pytest.mark.parametrize("wtok", sorted(WMASKS))
@pytest.mark.parametrize("name", WITH_REFERENCE)
def test_every_kernel_equals_its_reference_formula(name, wtok):
    w = WEIGHTINGS.get(name)
    if wtok != "patch" and not w.pools_tokens:
        pytest.skip("weight tokens only change weightings that pool over tokens")
    checked = 0
    for seed in range(30):
        A, G, stored = _data(name, seed)
        try:
            want = _reference(name, A, G, WMASKS[wtok], stored)
        except ArgumentError:  # ill-conditioned for this formula (a pole, a tie): another seed
            continue
        maps, scale = token_maps(A, G, name, WMASKS[wtok], PATCH, 1, **stored)
        assert maps.shape == scale.shape == (T - 1, 1)
        np.testing.assert_allclose(maps[:, 0], want, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(want).max()))
        assert np.all(scale[:, 0] >= np.abs(maps[:, 0]) * (1 - 1e-5))  # the scale bounds the map's magnitude
        checked += np.ptp(want) > 0  # a constant expected map would let a wrong kernel pass: not counted
    assert checked >= 10


@pytest.mark.parametrize("name", [n for n in WITH_REFERENCE if not WEIGHTINGS.get(n).all_channels])
def test_every_grouped_kernel_is_its_reference_per_group_and_per_leading_slice(name):
    A, G, stored = _data(name, 1, lead=(2,))
    maps, _ = token_maps(A, G, name, PATCH, PATCH, 2, **stored)
    assert maps.shape == (2, T - 1, 2)
    d = K // 2
    for i in range(2):
        for g in range(2):
            part = {k: v[i, g * d:(g + 1) * d] if k == "scores" else v[i] if isinstance(v, np.ndarray) else v
                    for k, v in stored.items()}
            want = _reference(name, A[i][:, g * d:(g + 1) * d], G[i][:, g * d:(g + 1) * d], PATCH, part)
            np.testing.assert_allclose(maps[i, :, g], want, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(want).max()))


def test_a_package_of_weighting_modules_is_found_and_ordered_without_a_list(tmp_path, monkeypatch):
    pkg = tmp_path / "my_weightings_demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    body = """
        import numpy as np
        from vitcam_nb.compute.channel_maps import summed_channels
        from vitcam_nb.core.weighting import Weighting, register_weighting
        {order}
        def kernel(A, G, wmask, patch, groups):
            return summed_channels({expr}, groups)

        register_weighting(Weighting("{name}", "map[t] = sum_k {expr}", kernel))
    """
    (pkg / "a_demo.py").write_text(textwrap.dedent(body.format(order="", name="abs_g_demo",
                                                                expr="np.abs(G[..., patch, :])")))
    (pkg / "b_demo.py").write_text(textwrap.dedent(body.format(order="ORDER = 5", name="sq_g_demo",
                                                                expr="G[..., patch, :] ** 2")))
    (pkg / "_private.py").write_text("raise RuntimeError('a module starting with _ is not walked')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert discover("my_weightings_demo") == ("sq_g_demo", "abs_g_demo")  # ORDER first, then the others
        assert weighting_names()[-2:] == ("sq_g_demo", "abs_g_demo")
        G = np.array([[1.0, -2.0]], np.float32)
        assert token_maps(G, G, "abs_g_demo", None, np.arange(1))[0][0, 0] == 3.0
        assert token_maps(G, G, "sq_g_demo", None, np.arange(1))[0][0, 0] == 5.0
    finally:
        for name in ("abs_g_demo", "sq_g_demo"):
            if name in WEIGHTINGS:
                WEIGHTINGS.unregister(name)
        for mod in [m for m in sys.modules if m.startswith("my_weightings_demo")]:
            del sys.modules[mod]


def test_a_reference_that_is_not_callable_is_refused_by_name():
    from vitcam_nb.core.errors import ArgumentTypeError
    from vitcam_nb.core.weighting import Weighting, register_weighting

    with pytest.raises(ArgumentTypeError, match="the reference of 'bad_ref_demo' is not callable"):
        register_weighting(Weighting("bad_ref_demo", "x", lambda *a: a, reference="A @ G"))
    assert "bad_ref_demo" not in WEIGHTINGS


def test_the_old_private_helpers_and_kernel_names_still_resolve():
    from vitcam_nb.compute import channel_maps, kernels, torch_kernels

    assert kernels._weighted is channel_maps.weighted_channels and kernels._summed is channel_maps.summed_channels
    assert torch_kernels._weighted is torch_kernels.weighted_channels
    assert kernels.gradcam is WEIGHTINGS.get("gradcam").kernel
    assert torch_kernels.layercam is WEIGHTINGS.get("layercam").torch_kernel
    with pytest.raises(AttributeError):
        kernels.no_such_kernel  # noqa: B018
