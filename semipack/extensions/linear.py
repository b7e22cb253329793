"""F.linear (hence nn.Linear): messages to input, weight and bias in one fused backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..graph.provenance import current_module
from ..graph.sites import Site, stamp
from ..messages.shared_shift import shared_shift_products
from .base import InnerGraph, extends, frees_context, messages, split_message, wants_graph


def linear_messages(sr, m, x, weight, want_x: bool, want_w: bool, want_b: bool):
    """(input, weight, bias) states of ``x @ weight.T + bias`` from the output state ``m``.

    ∂out[n, o]/∂x[n, i] = W[o, i];  ∂out[n, o]/∂W[o, i] = x[n, i];  ∂out[n, o]/∂b[o] = 1.
    """
    rows = tuple(p.reshape(-1, p.shape[-1]) for p in m)
    dtype = sr.state_dtype(x.dtype)
    x2 = x.reshape(-1, x.shape[-1]).to(dtype)
    shared = shared_shift_products(
        sr, rows, weight.to(dtype) if want_x else None, x2 if want_w else None, want_b
    )
    if shared is not None:
        m_x, m_w, m_b = shared
        if m_x is not None:
            m_x = tuple(p.reshape(x.shape) for p in m_x)
        return m_x, m_w, m_b
    m_x = m_w = m_b = None
    if want_x:
        m_x = tuple(p.reshape(x.shape) for p in sr.matmul(rows, weight.to(dtype)))
    if want_w:
        m_w = sr.matmul(tuple(p.t() for p in rows), x2)
    if want_b:
        m_b = sr.sum(rows, [0])
    return m_x, m_w, m_b


class LinearFunction(torch.autograd.Function):
    """(x, W, b) -> x Wᵀ + b, with the call's inner graph recorded beforehand."""

    @staticmethod
    def forward(ctx, inner: InnerGraph, x, weight, bias):
        ctx.inner = inner
        return inner.take_outputs()

    @staticmethod
    @frees_context
    def backward(ctx, grad):
        regular, parts, sr = split_message(grad)
        if parts is None:
            return (None, *ctx.inner.regular_grads([regular]))
        ctx.inner.check_unmodified((0, 1))
        x, weight, bias = ctx.inner.values()
        need = ctx.needs_input_grad[1:]
        # Messages first: their temporaries are gone before the regular gradients exist.
        states = linear_messages(
            sr, parts, x, weight, need[0], need[1], need[2] and bias is not None
        )
        reg = ctx.inner.regular_grads([regular])
        return (None, *messages(reg, states, sr, (x, weight, bias)))


@extends(F.linear)
def linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` inside ``extend``: one fused semiring backward, sites named by neuron."""
    if not wants_graph(input, weight, bias):
        return F.linear(input, weight, bias)
    inner = InnerGraph(F.linear, [input, weight, bias])
    if inner.escapes:
        return inner.plain_outputs()
    out = LinearFunction.apply(inner, input, weight, bias)
    dims = (*(f"dim{i}" for i in range(out.dim() - 1)), "neuron")
    if out.dim() == 3:
        dims = ("batch", "token", "neuron")
    elif out.dim() == 2:
        dims = ("batch", "neuron")
    stamp(out, (Site(current_module(), "output", dims),))
    return out
