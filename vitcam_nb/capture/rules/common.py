"""The hook functions every family's rules are made of, and the activations they know.

Each hook returns a forward-neutral tensor from :mod:`vitcam_nb.capture.rules.grad` (the forward value unchanged,
the rule's gradient backward). The families (:mod:`~vitcam_nb.capture.rules.vit`, ``beit``, ``eva``,
``open_clip``, ``hf``) only say which of their modules each hook goes on.

Example:
    >>> import torch
    >>> gelu_variant(torch.nn.GELU(approximate="tanh")), gelu_variant(torch.nn.ReLU())
    ('tanh', None)
"""

from __future__ import annotations

import torch

from vitcam_nb.capture.rules.grad import (
    constant,
    gated_gradient,
    gelu_gate,
    identity_ratio,
    layer_norm_constant_std,
    scale_gradient,
)

__all__ = ["GELU_KINDS", "GELU_VARIANTS", "activation_hook", "constant_input", "constant_output", "gelu_kind",
           "gelu_variant", "half_input", "half_output", "layer_norm_hook"]

#: (module prefix, class name) -> the GELU variant of that activation class: "none" (the exact GELU, x * Phi(x)),
#: "tanh" (its tanh approximation) or "quick" (x * sigmoid(1.702 x)); torch's nn.GELU reads its own attribute.
GELU_VARIANTS: dict[tuple[str, str], str] = {
    ("timm.", "GELU"): "none", ("timm.", "GELUTanh"): "tanh",
    ("transformers.", "GELUActivation"): "none", ("transformers.", "GELUTanh"): "tanh",
    ("transformers.", "NewGELUActivation"): "tanh", ("transformers.", "FastGELUActivation"): "tanh",
    ("transformers.", "QuickGELUActivation"): "quick", ("open_clip.", "QuickGELU"): "quick",
}


#: The 0.3 name of :data:`GELU_VARIANTS`.
GELU_KINDS = GELU_VARIANTS


def gelu_variant(act: torch.nn.Module) -> str | None:
    """The GELU variant of ``act``: "none", "tanh" or "quick" for the GELU modules of torch, timm, transformers and
    open_clip (see :data:`GELU_VARIANTS`); None for any other activation (a rule is then refused on the model).

    Example:
        >>> gelu_variant(torch.nn.GELU())
        'none'
    """
    if isinstance(act, torch.nn.GELU):
        return str(act.approximate)
    cls = type(act)
    for (prefix, name), variant in GELU_VARIANTS.items():
        if cls.__name__ == name and cls.__module__.startswith(prefix):
            return variant
    return None


#: The 0.3 name of :func:`gelu_variant`.
gelu_kind = gelu_variant


def layer_norm_hook(module: torch.nn.LayerNorm, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """Forward hook: the LayerNorm's gradient with its standard deviation constant.

    Example:
        >>> ln = torch.nn.LayerNorm(2)
        >>> x = torch.tensor([[1.0, 3.0]])
        >>> bool(torch.equal(layer_norm_hook(ln, (x,), ln(x)), ln(x)))
        True
    """
    return layer_norm_constant_std(module, args[0], out)


def activation_hook(mode: str, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """Forward hook on a GELU-type activation: the identity rule (``mode="identity"``: gradient ``act(x) / x``) or
    the gate detached (``mode="gate"``: gradient ``Phi(x)``, or ``sigmoid(1.702 x)`` for the quick GELU).

    Example:
        >>> x = torch.tensor([2.0], requires_grad=True)
        >>> act = torch.nn.GELU()
        >>> y = activation_hook("gate", act, (x,), act(x))
        >>> round(torch.autograd.grad(y.sum(), x)[0].item(), 4)
        0.9772
    """
    x = args[0]
    gate = identity_ratio(x, out) if mode == "identity" else gelu_gate(x, gelu_variant(module) or "none")
    return gated_gradient(x, out, gate)


def constant_input(_module: torch.nn.Module, args: tuple) -> tuple:
    """Forward pre-hook: the first input enters as a new leaf (the softmax attention held constant).

    Example:
        >>> a = torch.ones(2, requires_grad=True)
        >>> constant_input(None, (a * 2,))[0].grad_fn is None
        True
    """
    return (constant(args[0]), *args[1:])


def constant_output(_module: torch.nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
    """Forward hook: the output continues as a new leaf (nothing flows back into what computed it).

    Example:
        >>> a = torch.ones(2, requires_grad=True)
        >>> constant_output(None, (), a * 2).grad_fn is None
        True
    """
    return constant(out)


def half_output(_module: torch.nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
    """Forward hook: half the gradient into the module's output (AttnLRP's uniform rule on one operand).

    Example:
        >>> x = torch.ones(1, requires_grad=True)
        >>> torch.autograd.grad(half_output(None, (), x * 1).sum(), x)[0].tolist()
        [0.5]
    """
    return scale_gradient(out, 0.5)


def half_input(_module: torch.nn.Module, args: tuple) -> tuple:
    """Forward pre-hook: half the gradient of the first input (AttnLRP's uniform rule on both operands of the
    product that computed it).

    Example:
        >>> x = torch.ones(1, requires_grad=True)
        >>> torch.autograd.grad(half_input(None, (x * 1,))[0].sum(), x)[0].tolist()
        [0.5]
    """
    return (scale_gradient(args[0], 0.5), *args[1:])
