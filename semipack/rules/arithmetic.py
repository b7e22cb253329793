"""Arithmetic on messages: the engine's accumulation, scaling by edge weights, reductions."""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.reuse import held_only_by
from ..kernels.shapes import broadcast_shapes
from ..messages import OpCall, register_rule
from ..messages.message import Message, register_regular
from ..semirings.base import normalize_dims
from .exact_products import exact_product, exact_quotient
from .structural import inplace_from

aten = torch.ops.aten


@register_rule(aten.add.Tensor, aten.add.Scalar)
def add(call: OpCall):
    """Two messages meeting is the semiring plus; a zero plain operand changes nothing."""
    a, b = call["self"], call["other"]
    if call["alpha"] != 1 and isinstance(b, Message):
        raise call.error("add with alpha != 1 on a message")
    shape = broadcast_shapes(*(x.shape for x in (a, b) if isinstance(x, Tensor)))
    parts = call.semiring.plus(call.state(a, shape), call.state(b, shape))
    return call.wrap(_regular_sum(call, a, b), parts)


def _regular_sum_of(call: OpCall) -> Tensor | None:
    return _regular_sum(call, call["self"], call["other"])


def _regular_sum(call: OpCall, a, b) -> Tensor | None:
    """The regular gradients' sum, laid out as PyTorch's engine lays it out. Accumulating a
    second gradient, the engine adds it into the first one's buffer (``add_``, the first
    one's layout) where it holds the only reference to that gradient and its memory, and
    otherwise builds ``old + new`` (TensorIterator's layout). Where the two layouts differ only
    in size-1 dims (a channels_last map of 1 x 1) the next kernel chooses by the strides:
    BatchNorm's backward rounded otherwise. Same values either way.

    The first gradient counts as held elsewhere when anything but its message refers to it
    (a hook that kept it, ``kernels.reuse``) or when its message does: the engine hands both
    messages to this call the same way, and the new one is held by nothing but the engine, so
    a first message with a higher use count also waits in another node's buffer (a sum's
    gradient passed to both summands)."""
    if (
        call.func is not aten.add.Tensor
        or not isinstance(a, Message)
        or not isinstance(b, Message)
        or a._use_count() > b._use_count()
        or not held_only_by(a, "regular_grad")
        or b.regular_grad is None
    ):
        return call.run_regular()
    first, second = a.regular_grad, b.regular_grad
    if first.shape != second.shape or first.dtype != second.dtype or first.device != second.device:
        return call.run_regular()
    out = torch.empty_like(first)  # the first one's strides where dense and non-overlapping
    if out.stride() != first.stride():
        return call.run_regular()
    return torch.add(first, second, out=out)


register_regular(add, _regular_sum_of)


@register_rule(aten.sub.Tensor, aten.sub.Scalar)
def sub(call: OpCall):
    """``message - plain`` where the plain operand is zero (as backward formulas subtract a
    zero correction term): the message passes unchanged. Subtracting a message (a negative
    sum of paths) or a non-zero tensor has no semiring meaning and is refused."""
    _a, b = call["self"], call["other"]
    if isinstance(b, Message):
        raise call.error("subtracting a message has no semiring meaning")
    call.state(b)  # checks that the plain operand is zero
    return call.wrap(call.run_regular(), call["self"].parts)


def _scale(call: OpCall, weight) -> Message:
    """Edge weights are taken in the state's precision, whatever dtype the formula used."""
    msg = call["self"] if isinstance(call["self"], Message) else call["other"]
    dtype = call.weight_dtype
    if isinstance(weight, Tensor):
        weight = weight.to(dtype)
    else:
        weight = torch.tensor(weight, dtype=dtype, device=msg.device)
    return call.wrap(call.run_regular(), call.semiring.scale(msg.parts, weight))


@register_rule(aten.mul.Tensor, aten.mul.Scalar)
def mul(call: OpCall):
    """Multiplying a message by a plain tensor multiplies it by edge weights (in log form where
    the factor is a known saturating derivative, see ``exact_products``)."""
    a, b = call["self"], call["other"]
    if isinstance(a, Message) and isinstance(b, Message):
        raise call.error("the product of two messages has no semiring meaning")
    exact = exact_product(call)
    if exact is not None:
        return exact
    return _scale(call, b if isinstance(a, Message) else a)


@register_rule(aten.div.Tensor, aten.div.Scalar)
def div(call: OpCall):
    """A message divided by a plain tensor or number: edges of weight 1/b (IEEE, so 1/0 is inf)."""
    a, b = call["self"], call["other"]
    if not isinstance(a, Message) or isinstance(b, Message):
        raise call.error("only a message divided by a plain tensor has a semiring meaning")
    exact = exact_quotient(call)
    if exact is not None:
        return exact
    # IEEE division even for a Python scalar: ``x / 0`` has the edge weight inf, as in PyTorch
    divisor = b if isinstance(b, Tensor) else torch.tensor(b, dtype=torch.float64)
    return _scale(call, torch.reciprocal(divisor.to(call.weight_dtype)))


@register_rule(aten.neg.default)
def neg(call: OpCall):
    """Negation: every edge has weight -1."""
    return _scale(call, -1.0)


@register_rule(aten.sum.dim_IntList, aten.sum.default)
def sum_(call: OpCall):
    """``sum`` of a message (a backward formula reducing a broadcast): paths that meet in the
    summed entries combine with the semiring's plus."""
    msg = call["self"]
    dims = normalize_dims(call.bound.get("dim"), msg.dim())
    keepdim = bool(call.bound.get("keepdim") or False)
    parts = msg.parts if msg.dim() == 0 else call.semiring.sum(msg.parts, dims, keepdim)
    return call.wrap(call.run_regular(), parts)


for _inplace, _rule in [
    (aten.add_.Tensor, add),
    (aten.mul_.Tensor, mul),
    (aten.mul_.Scalar, mul),
    (aten.div_.Tensor, div),
    (aten.div_.Scalar, div),
    (aten.neg_.default, neg),
]:
    register_rule(_inplace)(inplace_from(_rule))
