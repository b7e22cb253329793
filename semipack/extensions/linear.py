"""nn.Linear: messages to input, weight and bias in one fused backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.shared_shift import shared_shift_products
from ..readout.sites import Site, stamp
from ..transport.provenance import current_module
from .base import (
    ModuleExtension,
    frees_context,
    inner_inputs,
    messages,
    record_inner,
    register_extension,
    split_message,
)


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
    @staticmethod
    def forward(ctx, x, weight, bias):
        return record_inner(ctx, F.linear, [x, weight, bias])

    @staticmethod
    @frees_context
    def backward(ctx, grad):
        regular, parts, sr = split_message(grad)
        if parts is None:
            return tuple(ctx.inner.regular_grads([regular]))
        x, weight, bias = inner_inputs(ctx)
        need = ctx.needs_input_grad
        # Messages first: their temporaries are gone before the regular gradients exist.
        states = linear_messages(
            sr, parts, x, weight, need[0], need[1], need[2] and bias is not None
        )
        reg = ctx.inner.regular_grads([regular])
        return messages(reg, states, sr, (x, weight, bias))


class LinearExtension(ModuleExtension):
    module_class = nn.Linear

    def forward(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        out = LinearFunction.apply(x, module.weight, module.bias)
        dims = (*(f"dim{i}" for i in range(out.dim() - 1)), "neuron")
        if out.dim() == 3:
            dims = ("batch", "token", "neuron")
        elif out.dim() == 2:
            dims = ("batch", "neuron")
        stamp(out, (Site(current_module(), "output", dims),))
        return out


register_extension(LinearExtension())
