"""F.layer_norm (hence nn.LayerNorm): the dense per-row Jacobian in a fused kernel."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..graph.provenance import current_module
from ..graph.sites import Site, stamp
from ..rules import normalization as norm_rules
from .base import InnerGraph, extends, frees_context, messages, split_message, wants_graph


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
    """(x, γ, β) -> layer_norm(x), with the call's inner graph recorded beforehand."""

    @staticmethod
    def forward(ctx, inner: InnerGraph, x, weight, bias, shape):
        ctx.inner, ctx.shape = inner, tuple(shape)
        out, mean, rstd = inner.take_outputs()
        ctx.stats = (mean, rstd)
        return out

    @staticmethod
    @frees_context
    def backward(ctx, grad):
        regular, parts, sr = split_message(grad)
        mean, rstd = ctx.stats
        reg = ctx.inner.regular_grads([regular])
        if parts is None:
            return (None, *reg, None)
        ctx.inner.check_unmodified((0, 1))
        x, weight, bias = ctx.inner.values()
        need = ctx.needs_input_grad[1:4]
        states = layer_norm_messages(sr, parts, x, mean, rstd, weight, bias, ctx.shape, need)
        return (None, *messages(reg, states, sr, (x, weight, bias)), None)


@extends(F.layer_norm)
def layer_norm(
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """``F.layer_norm`` inside ``extend``: the fused normalisation kernel, sites by feature."""
    if not wants_graph(input, weight, bias):
        return F.layer_norm(input, normalized_shape, weight, bias, eps)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)

    def run(x: Tensor, w: Tensor | None, b: Tensor | None):
        return torch.native_layer_norm(x, shape, w, b, eps)

    inner = InnerGraph(run, [input, weight, bias])
    if inner.escapes:
        return inner.plain_outputs()[0]
    out = LayerNormFunction.apply(inner, input, weight, bias, shape)
    dims = ("batch", "token", "feature") if out.dim() == 3 else ("batch", "feature")
    stamp(out, (Site(current_module(), "output", dims[-out.dim() :]),))
    return out
