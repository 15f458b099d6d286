"""Display traits the widgets share, checked on every assignment (from Python or the browser): an opacity in
[0, 1] and pixel sizes of at least one pixel.

Example:
    >>> import traitlets
    >>> class W(traitlets.HasTraits):
    ...     opacity = Opacity(0.5)
    >>> W().opacity
    0.5
"""

from __future__ import annotations

import math

import traitlets as t

__all__ = ["Opacity", "Pixels"]


class Opacity(t.Float):
    """A float in [0, 1]; NaN and infinities are refused (``traitlets.TraitError`` naming the trait).

    Example:
        >>> Opacity(0.5).default_value
        0.5
    """

    def validate(self, obj: t.HasTraits, value: object) -> float:
        value = super().validate(obj, value)
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise t.TraitError(f"{self.name}: expected a float in [0, 1], got {value!r}")
        return value


class Pixels(t.Int):
    """A size in pixels, at least 1 (``traitlets.TraitError`` naming the trait otherwise).

    Example:
        >>> Pixels(96).default_value
        96
    """

    def validate(self, obj: t.HasTraits, value: object) -> int:
        value = super().validate(obj, value)
        if value < 1:
            raise t.TraitError(f"{self.name}: expected a size of at least 1 pixel, got {value!r}")
        return value
