"""F.linear (hence nn.Linear): messages to input, weight and bias in one fused backward."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor

from ..messages.shared_shift import shared_shift_products
from ..semirings.base import Semiring, State
from .base import (
    BackwardCall,
    ExtensionFunction,
    Sites,
    bilinear_reads,
    extends,
    per_sample_rule,
    unbatched,
)


def linear_messages(
    sr: Semiring, m: State, x: Tensor, weight: Tensor, want_x: bool, want_w: bool, want_b: bool
) -> tuple[State | None, State | None, State | None]:
    """(input, weight, bias) states of ``x @ weight.T + bias`` from the output state ``m``.

    x: [..., I], weight: [O, I], each part of m: [..., O]; the states come shaped like x,
    weight and bias [O].
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


def linear_per_sample(
    sr: Semiring, m: State, x: Tensor, want_w: bool, want_b: bool, examples: int | None = None
) -> tuple[State | None, State | None]:
    """Per-sample (weight, bias) states of ``x @ weight.T + bias``: ``[N, O, I]`` and ``[N, O]``.

    x: [N, ..., I], each part of m: [N, ..., O]; the token axes are contracted inside one
    batched semiring product per example block, so nothing larger than the output is built.
    With ``examples`` (a batch merged with the tokens, ``x`` [N * T, ..., I]) dim 0 holds
    that many examples, each a block of consecutive entries.
    """
    n, i = examples or x.shape[0], x.shape[-1]
    # explicit: an empty batch has no size to infer from
    tokens = math.prod(x.shape[1:-1]) * (x.shape[0] // n if examples else 1)
    rows = tuple(p.reshape(n, tokens, p.shape[-1]) for p in m)
    m_w = m_b = None
    if want_w:
        x3 = x.reshape(n, tokens, i).to(sr.state_dtype(x.dtype))
        if x3.shape[1] == 1:  # one token: an outer product, elementwise
            m_w = sr.times(tuple(p.transpose(1, 2) for p in rows), sr.lift(x3))
        else:
            m_w = sr.matmul(tuple(p.transpose(1, 2) for p in rows), x3)
    if want_b:
        m_b = sr.sum(rows, [1])
    return m_w, m_b


@per_sample_rule
class LinearFunction(ExtensionFunction):
    """(x, W, b) -> x Wᵀ + b."""

    direct_regular_grads = True

    reads = (0, 1)
    read_for = staticmethod(bilinear_reads)
    edge_order = (0, 2, 1)  # x, bias, weight: the order of a plain backward's hooks

    @staticmethod
    def messages(call: BackwardCall) -> tuple[State | None, ...]:
        x, weight, _ = call.inputs
        return linear_messages(call.semiring, call.incoming[0], x, weight, *call.needs)

    @classmethod
    def per_sample(cls, call: BackwardCall) -> list[State | None]:
        x = call.inputs[0]
        if x.dim() < 2 or call.incoming[0] is None:
            raise unbatched(cls, x.shape)
        m_w, m_b = linear_per_sample(
            call.semiring, call.incoming[0], x, *call.needs[1:], call.examples
        )
        return [None, m_w, m_b]

    @staticmethod
    def sites(out: Tensor) -> Sites:
        dims = {3: ("batch", "token"), 2: ("batch",)}.get(out.dim())
        if dims is None:
            dims = tuple(f"dim{i}" for i in range(out.dim() - 1))
        return (("output", (*dims, "neuron")),)


@extends(F.linear)
def linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` inside ``extend``: one fused semiring backward, sites named by neuron.
    Shapes F.linear also takes but the fused messages do not (a 1-D weight, an empty one, a
    bias that broadcasts over the outputs) go through the per-op rules."""
    fused = (
        weight.dim() == 2
        and weight.numel() > 0  # a zero-width layer (AdaptiveLogSoftmaxWithLoss makes them)
        and (bias is None or tuple(bias.shape) == (weight.shape[0],))
    )
    if not fused:
        return F.linear(input, weight, bias)
    return LinearFunction.run(F.linear, [input, weight, bias])
