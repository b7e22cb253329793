"""F.layer_norm (hence nn.LayerNorm): the dense per-row Jacobian in a fused kernel."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..messages.normalization import affine_param_messages
from ..rules import normalization as norm_rules
from ..semirings.base import Semiring, State
from .base import (
    BackwardCall,
    ExtensionFunction,
    Sites,
    extends,
    per_sample_rule,
    unbatched,
    wants_graph,
)


def layer_norm_messages(
    sr: Semiring,
    m: State,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    shape: tuple[int, ...],
    need: Sequence[bool],
) -> tuple[State | None, State | None, State | None]:
    """(input, weight, bias) states of layer_norm from the output state ``m``.

    x and m's parts: [..., *shape]; mean, rstd: [..., 1 per normalized dim]; weight, bias:
    shape. The states come shaped like x, weight and bias.
    """
    n = math.prod(shape)
    rows = x.numel() // n
    dtype = sr.state_dtype(x.dtype)
    x_hat = ((x - mean) * rstd).to(dtype).reshape(rows, n)
    m_rows = tuple(p.reshape(rows, n) for p in m)
    m_x = m_w = m_b = None
    if need[0]:
        gain = norm_rules.gains(weight, n, dtype, x.device)
        flat = norm_rules.normalized_contract(
            sr, m_rows, x_hat, rstd.to(dtype).reshape(rows), gain, False
        )
        m_x = tuple(p.reshape(x.shape) for p in flat)
    if need[1] or need[2]:
        w, b = affine_param_messages(sr, tuple(p[..., None] for p in m_rows), x_hat[..., None])
        if need[1] and weight is not None:
            m_w = tuple(p.reshape(shape) for p in w)
        if need[2] and bias is not None:
            m_b = tuple(p.reshape(shape) for p in b)
    return m_x, m_w, m_b


@per_sample_rule
class LayerNormFunction(ExtensionFunction):
    """(x, γ, β) -> layer_norm(x); options: the normalized shape. The inner call is
    ``native_layer_norm``, whose mean and rstd the messages reuse."""

    direct_regular_grads = True

    reads = (0, 1)

    @staticmethod
    def read_for(needs: tuple[bool, ...]) -> tuple[int, ...]:
        """The input always (every message reads its normalised values), the gain only for
        the input's message."""
        return (0, 1) if needs[0] else (0,)

    @staticmethod
    def keep(outputs: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        out, mean, rstd = outputs
        return out, (mean, rstd)

    @classmethod
    def per_sample(cls, call: BackwardCall) -> list[State | None]:
        """Rows ``[N, *shape]`` of γ and β: the normalised rows contracted per example."""
        x, weight, bias = call.inputs
        (mean, rstd), (m,), shape = call.kept, call.incoming, call.options
        sr, need = call.semiring, call.needs
        if x.dim() <= len(shape) or m is None:
            raise unbatched(cls, x.shape)
        n, width = call.examples or x.shape[0], math.prod(shape)
        dtype = sr.state_dtype(x.dtype)
        x_hat = ((x - mean) * rstd).to(dtype).reshape(n, -1, width)
        m_rows = tuple(p.reshape(n, -1, width) for p in m)
        m_w = m_b = None
        if need[1] and weight is not None:
            m_w = tuple(p.reshape(n, *shape) for p in sr.sum(sr.scale(m_rows, x_hat), [1]))
        if need[2] and bias is not None:
            m_b = tuple(p.reshape(n, *shape) for p in sr.sum(m_rows, [1]))
        return [None, m_w, m_b]

    @staticmethod
    def messages(call: BackwardCall) -> tuple[State | None, ...]:
        x, weight, bias = call.inputs
        (mean, rstd), (m,) = call.kept, call.incoming
        sr, shape = call.semiring, call.options
        return layer_norm_messages(sr, m, x, mean, rstd, weight, bias, shape, call.needs)

    @staticmethod
    def sites(out: Tensor) -> Sites:
        dims = ("batch", "token", "feature") if out.dim() == 3 else ("batch", "feature")
        return (("output", dims[-out.dim() :]),)


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

    return LayerNormFunction.run(run, [input, weight, bias], shape)
