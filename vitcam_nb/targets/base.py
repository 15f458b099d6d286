"""What a trace differentiates: the :class:`Target` interface — a vector of scores computed from the model's
output, and which of them to trace.

The trace stores that vector as ``logits`` (one entry per "class") and the gradients of the chosen entries
plus the expected score ``E = sum_j p_j s_j`` (``p = softmax(s)`` detached), exactly as for a classifier, so
every recipe (logit, prob, logprob, topN) works unchanged whatever the target.

Example:
    >>> import torch
    >>> class FirstTwo(Target):
    ...     kind = "first_two"
    ...     def scores(self, model, x): return model(x)[0, :2]
    >>> FirstTwo().batch_scores(lambda x: torch.ones(1, 5), torch.zeros(1, 3, 2, 2)).shape
    torch.Size([1, 2])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from vitcam_nb.core.errors import ArgumentError, TraceError

__all__ = ["TARGETS", "Target", "register_target", "unregister_target"]

C = TypeVar("C", bound=Callable[..., object])

#: The public target constructors (``vc.targets.<name>``), each registered by its module (:func:`register_target`).
TARGETS: dict[str, Callable[..., object]] = {}


def register_target(make: C) -> C:
    """Decorator: register a target constructor under its function name; the :mod:`vitcam_nb.targets` package
    walks its modules and offers every registered constructor as ``vc.targets.<name>`` (no import line to add).

    Example:
        >>> @register_target
        ... def demo_target() -> Target:
        ...     return Target()
        >>> TARGETS["demo_target"] is demo_target
        True
        >>> del TARGETS["demo_target"]
    """
    name = getattr(make, "__name__", "")
    if not callable(make) or not name.isidentifier():
        raise ArgumentError(f"make: expected a function named by an identifier, got {make!r}")
    if name in TARGETS and TARGETS[name] is not make and TARGETS[name].__module__ != make.__module__:
        raise ArgumentError(f"make: a target constructor named {name!r} is registered already (from "
                            f"{TARGETS[name].__module__})")
    TARGETS[name] = make
    return make


def unregister_target(name: str) -> None:
    """Remove the target constructor ``name`` (one registered at run time: examples and tests undo theirs); an
    unknown name is refused by name. Its ``vc.targets.<name>`` attribute, if the package gave it one, stays.

    Example:
        >>> @register_target
        ... def demo_target() -> Target:
        ...     return Target()
        >>> unregister_target("demo_target"); "demo_target" in TARGETS
        False
    """
    if not isinstance(name, str) or name not in TARGETS:
        raise ArgumentError(f"name: no target constructor named {name!r} is registered; registered: "
                            f"{sorted(TARGETS)}")
    del TARGETS[name]


class Target:
    """Base class: ``scores(model, x)`` returns a 1-D tensor of scores for a batch of one image,
    ``choose(scores)`` the indices to trace. Subclasses fill in ``labels`` and ``description``.

    Example:
        >>> class Mean(Target):
        ...     kind = "mean"
        ...     def scores(self, model, x): return model(x)[0]
    """

    kind: str = "custom"
    description: str = "custom scores"

    def check(self, model: torch.nn.Module) -> None:
        """Refuse a model this target cannot use, before the forward pass."""

    def scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The 1-D score vector of the one image in ``x`` (1, 3, H, W)."""
        raise NotImplementedError

    def batch_scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Scores of every image in ``x`` (B, 3, H, W) as a (B, N) tensor. A target that can only score one
        image at a time (the default, :meth:`scores`) refuses a larger batch."""
        if x.shape[0] != 1:
            raise TraceError(f"targets: a {self.kind} target scores one image at a time; trace images one by one "
                             "with vitcam_nb.trace()")
        z = self.scores(model, x)
        if not isinstance(z, torch.Tensor) or z.ndim != 1 or not z.is_floating_point() or z.numel() == 0:
            shape = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
            raise TraceError(f"targets: the target's scores() must return a non-empty 1-D float tensor, got {shape}")
        return z[None]

    def choose(self, scores: torch.Tensor) -> list[int]:
        """The indices of one image's scores to differentiate (default: all)."""
        return list(range(int(scores.shape[0])))

    def class_labels(self, model: torch.nn.Module, n: int) -> list[str]:
        """Names of the ``n`` scores (default: ``labels`` when it has ``n`` entries, else "class i")."""
        labels = getattr(self, "labels", None)
        return list(labels) if labels is not None and len(labels) == n else [f"class {i}" for i in range(n)]

    def settings(self) -> dict:
        """What, besides the chosen indices, makes two traces with this target differ (for the trace id)."""
        return {"kind": self.kind}

    def attrs(self) -> dict[str, object]:
        """Flat trace attributes describing the scores (read by the checklist)."""
        return {"target_kind": self.kind, "target_scores": self.description}
