"""The built-in channel weightings, one module each: its NumPy kernel, its torch kernel and its reference formula,
registered by a :func:`~vitcam_nb.core.weighting.register_weighting` call at the module's bottom.

Adding a weighting is adding one module here (and its test): the modules are found by walking this package when it
is first imported (which happens before any registry is first read: ``import vitcam_nb`` names
:mod:`vitcam_nb.compute` as the layer that fills them), not listed anywhere. A module's optional integer ``ORDER``
places its weighting in menus and sweeps (the built-ins keep the order they always had); modules without one come
after, by module name. Names starting with ``_`` are not walked. A module may register several weightings.

A kernel is written with the public helpers of :mod:`vitcam_nb.compute.channel_maps` (``weighted_channels`` for
``map[t] = sum_k alpha_k A[t,k]``, bit for bit the maps every such weighting shares) and their torch twins in
:mod:`vitcam_nb.compute.torch_kernels`; without a torch kernel (``torch_kernel=None``) the weighting is computed
in NumPy only and the device path refuses it by name. The ``reference`` is the formula written plainly for one site
and one channel group: tests/unit/compute/test_weighting_registry.py checks every registered kernel against it.

Example:
    >>> from vitcam_nb.core.weighting import WEIGHTINGS
    >>> discovered()[:3], WEIGHTINGS.get("gradcam").reference is not None
    (('gradcam', 'hirescam', 'gradcam_elementwise'), True)
"""

from __future__ import annotations

import importlib
import pkgutil

from vitcam_nb.core.weighting import WEIGHTINGS

__all__ = ["discover", "discovered"]

# ORDER of a module that names none: after every built-in.
_LAST = 1 << 30


def discover(package: str) -> tuple[str, ...]:
    """Import every module of ``package`` (a dotted name; names starting with ``_`` skipped) and return the
    weightings they registered, put in the order of their modules' ``ORDER`` (then module name). Used for the
    built-ins here; a package of your own weightings can be found the same way.

    Example:
        >>> discover("vitcam_nb.compute.weightings")  # imported already: nothing new registers
        ()
    """
    before = set(WEIGHTINGS.names())
    rank: dict[str, tuple[int, str]] = {}
    path = importlib.import_module(package).__path__
    for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        for name in WEIGHTINGS.names():
            if name not in before and name not in rank:
                rank[name] = (getattr(module, "ORDER", _LAST), info.name)
    # Registered in module-name order; put back in ORDER (an entry registered again keeps its place, so
    # taking each one out and registering it again moves it to the end, in turn).
    ordered = sorted(rank, key=rank.__getitem__)
    for name in ordered:
        WEIGHTINGS.register(name, WEIGHTINGS.unregister(name))
    return tuple(ordered)


_FOUND = discover(__name__)


def discovered() -> tuple[str, ...]:
    """The built-in weightings this package's modules registered, in their order.

    Example:
        >>> "eigencam" in discovered()
        True
    """
    return _FOUND
