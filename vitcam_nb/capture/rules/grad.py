"""Forward-neutral gradient substitutions: each returns a tensor whose VALUE is the forward value it is given,
bit for bit, and whose gradient is the one a backward rule prescribes. They are built from ``detach`` alone, so
autograd's batched (vmapped) backward runs through them with no custom function.

The trick: ``value.detach() + (path - path.detach())`` equals ``value`` (``path - path.detach()`` is exactly zero
for finite values) and has the gradient of ``path``.

Example:
    >>> import torch
    >>> x = torch.tensor([2.0, -1.0], requires_grad=True)
    >>> y = scale_gradient(x, 0.5)
    >>> bool(torch.equal(y, x)), torch.autograd.grad(y.sum(), x)[0].tolist()
    (True, [0.5, 0.5])
"""

from __future__ import annotations

import math

import torch

__all__ = ["constant", "gated_gradient", "gelu_gate", "identity_ratio", "layer_norm_constant_std",
           "scale_gradient"]


def _swap(value: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """``value`` forward, the gradient of ``path`` backward."""
    return value.detach() + (path - path.detach())


def scale_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` forward; backward multiplies the incoming gradient by ``factor`` (AttnLRP's uniform rule: 0.5 on
    each operand of a product of two input-dependent tensors).

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> torch.autograd.grad(scale_gradient(x, 0.25).sum(), x)[0].tolist()
        [0.25, 0.25]
    """
    return _swap(x, x * factor)


def constant(x: torch.Tensor) -> torch.Tensor:
    """``x`` forward as a new leaf of the graph: its own gradient exists (a site on it is still differentiated),
    but nothing flows on into what computed it (CP-LRP's and LibraGrad's constant attention).

    Example:
        >>> a = torch.ones(2, requires_grad=True)
        >>> c = constant(a * 2)
        >>> c.requires_grad, c.grad_fn is None
        (True, True)
    """
    return x.detach().requires_grad_(x.requires_grad)


def gated_gradient(x: torch.Tensor, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``out`` (the activation's own output) forward; backward multiplies the incoming gradient by ``gate``
    (held constant): ``x * gate.detach()``'s gradient.

    Example:
        >>> x = torch.tensor([1.0, -2.0], requires_grad=True)
        >>> torch.autograd.grad(gated_gradient(x, x.relu(), torch.tensor([1.0, 0.0])).sum(), x)[0].tolist()
        [1.0, 0.0]
    """
    return _swap(out, x * gate.detach())


def identity_ratio(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out / x`` where ``x != 0`` and 0 where ``x == 0`` (the identity rule's gradient of an element-wise
    activation: relevance ``x * out / x = out`` passes unchanged; at 0 the relevance is 0).

    Example:
        >>> identity_ratio(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])).tolist()
        [0.5, 0.0]
    """
    x, out = x.detach(), out.detach()
    nonzero = x != 0
    return torch.where(nonzero, out / torch.where(nonzero, x, torch.ones_like(x)), torch.zeros_like(x))


def gelu_gate(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU's gate ``Phi(x)`` (``gelu(x) = x * Phi(x)``): the normal CDF, or timm/torch's tanh approximation of it.

    Example:
        >>> gelu_gate(torch.tensor([0.0])).tolist()
        [0.5]
    """
    x = x.detach()
    if approximate == "tanh":
        return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def layer_norm_constant_std(module: torch.nn.LayerNorm, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (the LayerNorm's own output) forward; backward that of ``(x - mean) / std * weight + bias`` with
    ``std`` held constant (lxt's ``layer_norm_forward``: the identity rule on the normalisation).

    Example:
        >>> ln = torch.nn.LayerNorm(3)
        >>> x = torch.tensor([[1.0, 2.0, 4.0]], requires_grad=True)
        >>> y = layer_norm_constant_std(ln, x, ln(x))
        >>> bool(torch.equal(y, ln(x)))
        True
    """
    dims = tuple(range(-len(module.normalized_shape), 0))
    mean = x.mean(dim=dims, keepdim=True)
    std = (x.var(dim=dims, keepdim=True, unbiased=False) + module.eps).sqrt()
    path = (x - mean) / std.detach()
    if module.weight is not None:
        path = path * module.weight
    if module.bias is not None:
        path = path + module.bias
    return _swap(out, path)
