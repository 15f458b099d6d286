"""Channel weightings (the recipe field ``weighting``): what a weighting is, and the table of them.

A :class:`Weighting` names a formula, states it for the checklist, and carries the kernel that computes
it; :data:`WEIGHTINGS` holds every weighting a recipe may name. The built-in channel weightings are one module
each in :mod:`vitcam_nb.compute.weightings` (found by walking that package, not listed); :func:`register_weighting`
adds your own without editing the package.

Example:
    >>> import vitcam_nb  # registers the built-in kernels
    >>> WEIGHTINGS.get("gradcam").pools_tokens, WEIGHTINGS.get("eigencam").uses_gradient
    (True, False)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vitcam_nb.core.errors import ArgumentTypeError
from vitcam_nb.core.registry import Registry

__all__ = ["WEIGHTINGS", "Kernel", "ScoredKernel", "Weighting", "channel_weighting_names", "register_weighting",
           "weighting_names"]

#: ``kernel(A, G, wmask, patch, groups) -> (maps, scale)``: A and G are (..., token, channel) float32;
#: ``wmask`` selects the tokens that form channel weights, ``patch`` the patch tokens, ``groups`` splits
#: channels into heads. ``maps`` and ``scale`` are (..., patch, groups); ``scale`` sums the absolute terms
#: of the same formula, so a map within rounding of zero can be told from a real one.
Kernel = Callable[[np.ndarray, np.ndarray, object, object, int], "tuple[np.ndarray, np.ndarray]"]
#: A weighting with ``scores`` set is called ``kernel(A, G, wmask, patch, groups, scores=S, base=s0, k=k)``: ``S``
#: (..., channel) the stored model outputs for the recipe's target (NaN where not scored), ``s0`` (...,) the
#: unperturbed target score, ``k`` the recipe's ``k``. A map that needs an unscored channel comes out NaN.
ScoredKernel = Callable[..., "tuple[np.ndarray, np.ndarray]"]


@dataclass(frozen=True)
class Weighting:
    """One weighting: its recipe name, the formula the checklist states, and its kernel.

    ``pools_tokens``: channel weights are pooled over tokens, so the recipe's ``weight_tokens`` applies.
    ``uses_gradient``: False for gradient-free formulas (no target is differentiated).
    ``all_channels``: the formula projects all channels at once, so heads must stay ``"channels"``.
    ``title``: how the checklist names the method in prose (default: the name).
    ``scores``: the trace variable of model outputs the weighting reads (``"score"`` or ``"ablation"``, written by
    ``vc.score``); its kernel is then a :data:`ScoredKernel`. Empty for weightings computed from A and G alone.
    ``method``: a whole published method computed by a trace kind of its own from several sites (e.g. AG-CAM), not
    a channel weighting of one site; sweeps over weightings (:func:`channel_weighting_names`) leave it out.
    ``scored_target``: the target the stored outputs are scores of: "logit" (stored with their logsumexp, so
    prob and logprob follow too) or one target only (ViT-CX stores "prob").
    ``channel_weights``: for a map of the form ``sum_k alpha_k A[t,k]``, the function ``alpha(A, G, wmask, patch,
    **stored) -> (..., channel)`` its kernel applies. Given it, a map on a trace can bound its magnitude scale
    from activation norms cached per trace instead of summing ``|alpha_k| |A[t,k]|`` again, and asks the kernel
    for the exact scale only where the bound cannot tell a real map from rounding noise.
    ``torch_kernel``: the same formula on torch tensors (same signature, tensors in and out, on any device), used
    where maps are computed on the trace's device (:mod:`vitcam_nb.compute.torch_maps`); None: NumPy only.
    ``reference``: the formula written plainly, for tests: ``reference(A, G, wmask, patch, **stored) -> (patch,)``
    for one site and one channel group, ``A`` and ``G`` (token, channel) float64, ``wmask`` and ``patch`` integer
    token indices, ``stored`` as the kernel's (``scores`` (channel,), ``base`` a float, ``k``). The tests check every
    registered kernel against it (and the torch kernel against the kernel); None: no reference written.
    ``zero_from_zero_gradient``: the kernel's map is zero wherever the gradients it reads are zero (each term has a
    gradient factor), so a nonzero map proves them nonzero and no scan of the gradients is needed for it.

    Example:
        >>> Weighting("w", "map = 0", lambda *a: a).all_channels
        False
    """

    name: str
    formula: str
    kernel: Kernel
    pools_tokens: bool = False
    uses_gradient: bool = True
    all_channels: bool = False
    title: str = ""
    scores: str = ""
    method: bool = False
    scored_target: str = "logit"
    channel_weights: Callable[..., np.ndarray] | None = None
    torch_kernel: Callable[..., tuple] | None = None
    reference: Callable[..., np.ndarray] | None = None
    zero_from_zero_gradient: bool = False


WEIGHTINGS: Registry[Weighting] = Registry("weighting")


def register_weighting(weighting: Weighting, *, replace: bool = False) -> None:
    """Make ``weighting.name`` a valid ``Recipe.weighting``, computed by its kernel on every trace kind.

    Example:
        >>> import numpy as np
        >>> def grad_abs(A, G, wmask, patch, groups):
        ...     t = np.abs(G[..., patch, :]).reshape(*G.shape[:-2], -1, groups, G.shape[-1] // groups)
        ...     return t.sum(-1), t.sum(-1)
        >>> register_weighting(Weighting("grad_abs_demo", "map[t] = sum_k |G[t,k]|", grad_abs))
        >>> "grad_abs_demo" in weighting_names()
        True
        >>> _ = WEIGHTINGS.unregister("grad_abs_demo")
    """
    if not isinstance(weighting, Weighting):
        raise ArgumentTypeError(f"weighting: expected a vitcam_nb.core.weighting.Weighting, got "
                                f"{type(weighting).__name__}")
    if not callable(weighting.kernel):
        raise ArgumentTypeError(f"weighting: the kernel of {weighting.name!r} is not callable")
    for part in ("channel_weights", "torch_kernel", "reference"):
        if getattr(weighting, part) is not None and not callable(getattr(weighting, part)):
            raise ArgumentTypeError(f"weighting: the {part} of {weighting.name!r} is not callable")
    WEIGHTINGS.register(weighting.name, weighting, replace=replace)


def weighting_names() -> tuple[str, ...]:
    """Every registered weighting name, built-ins first.

    Example:
        >>> weighting_names()[0]
        'gradcam'
    """
    return tuple(WEIGHTINGS.names())


def channel_weighting_names() -> tuple[str, ...]:
    """The registered channel weightings of one site: every name but the published methods (``method=True``),
    which read several sites and are what galleries, menus and reports sweeping over weightings leave out.

    Example:
        >>> import vitcam_nb
        >>> "gradcam" in channel_weighting_names(), "agcam" in channel_weighting_names()
        (True, False)
    """
    return tuple(n for n in WEIGHTINGS.names() if not WEIGHTINGS.get(n).method)
