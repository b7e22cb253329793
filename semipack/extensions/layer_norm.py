"""nn.LayerNorm: the dense per-row Jacobian handled by the fused normalisation kernel."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..readout.sites import Site, stamp
from ..rules import normalization as norm_rules
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


def layer_norm_messages(sr, m, x, mean, rstd, weight, bias, shape, need):
    """(input, weight, bias) states of layer_norm from the output state ``m``."""
    n = math.prod(shape)
    rows = x.numel() // n
    dtype = sr.state_dtype(x.dtype)
    x_hat = ((x - mean) * rstd).to(dtype).reshape(rows, n)
    m_rows = tuple(p.reshape(rows, n) for p in m)
    m_x = m_w = m_b = None
    if need[0]:
        gain = weight.to(dtype).reshape(n) if weight is not None else torch.ones(n, dtype=dtype)
        flat = norm_rules.normalized_contract(
            sr, m_rows, x_hat, rstd.to(dtype).reshape(rows), gain, False
        )
        m_x = tuple(p.reshape(x.shape) for p in flat)
    if need[1] or need[2]:
        w, b = sr.sum(sr.scale(m_rows, x_hat), [0]), sr.sum(m_rows, [0])
        if need[1] and weight is not None:
            m_w = tuple(p.reshape(shape) for p in w)
        if need[2] and bias is not None:
            m_b = tuple(p.reshape(shape) for p in b)
    return m_x, m_w, m_b


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps):
        def run(x_, w_, b_):
            return torch.native_layer_norm(x_, shape, w_, b_, eps)

        ctx.shape = tuple(shape)
        out, mean, rstd = record_inner(ctx, run, [x, weight, bias])
        ctx.stats = (mean, rstd)
        return out

    @staticmethod
    @frees_context
    def backward(ctx, grad):
        regular, parts, sr = split_message(grad)
        mean, rstd = ctx.stats
        reg = ctx.inner.regular_grads([regular])
        if parts is None:
            return (*reg, None, None)
        x, weight, bias = inner_inputs(ctx)
        need = ctx.needs_input_grad
        states = layer_norm_messages(sr, parts, x, mean, rstd, weight, bias, ctx.shape, need[:3])
        return (*messages(reg, states, sr, (x, weight, bias)), None, None)


class LayerNormExtension(ModuleExtension):
    module_class = nn.LayerNorm

    def forward(self, module: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        out = LayerNormFunction.apply(
            x, module.weight, module.bias, module.normalized_shape, module.eps
        )
        dims = ("batch", "token", "feature") if out.dim() == 3 else ("batch", "feature")
        stamp(out, (Site(current_module(), "output", dims[-out.dim() :]),))
        return out


register_extension(LayerNormExtension())
