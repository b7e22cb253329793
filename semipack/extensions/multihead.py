"""F.multi_head_attention_forward (hence nn.MultiheadAttention) in one fused backward:
projections, per-head attention and output projection.

The inner graph is the function itself run on aliases of its tensors, so regular gradients are
exactly a plain backward's. The semiring messages follow the reference
decomposition: in-projections (linear), S = Q Kᵀ / √d + mask, P = softmax(S), O = P V, heads
concatenated, out-projection; the returned attention weights (if used) are P, averaged over heads
when ``average_attn_weights``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import Tensor

from ..rules.attention import attention_contract, attention_log_probs
from ..semirings.base import State
from .base import (
    BackwardCall,
    ExtensionFunction,
    InnerGraph,
    Sites,
    extends,
    per_sample_rule,
    wants_graph,
)
from .linear import linear_messages, linear_per_sample


def additive_mask(
    attn_mask: Tensor | None, key_padding_mask: Tensor | None, batch: int, heads: int, dtype
) -> Tensor | None:
    """nn.MultiheadAttention's masks (bool True = masked out, or additive) as one additive mask
    broadcastable to [batch, heads, queries, keys]."""

    def additive(m: Tensor) -> Tensor:
        if m.dtype == torch.bool:
            return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, -torch.inf)
        return m.to(dtype)

    total = None
    if attn_mask is not None:
        m = additive(attn_mask)
        if m.dim() == 3:  # [batch * heads, queries, keys]
            m = m.reshape(batch, heads, *m.shape[1:])
        total = m
    if key_padding_mask is not None:
        m = additive(key_padding_mask)[:, None, None, :]
        total = m if total is None else total + m
    return total


@dataclass(frozen=True)
class MultiheadOptions:
    """The arguments of ``F.multi_head_attention_forward`` besides the differentiable tensors."""

    num_heads: int
    attn_mask: Tensor | None
    key_padding_mask: Tensor | None
    average_attn_weights: bool


@per_sample_rule
class MultiheadAttentionFunction(ExtensionFunction):
    """(query, key, value, W_in, b_in, W_out, b_out) -> (output, attention weights or None),
    inputs sequence-first [tokens, batch, embed] as ``F.multi_head_attention_forward`` has
    them; options: ``MultiheadOptions``."""

    direct_regular_grads = True

    reads = tuple(range(7))
    # a plain backward's parameter hooks fire b_out, W_out, b_in, W_in; the four gradient nodes
    # this node makes ready at once run in the engine's heap order, which this edge order
    # turns into that one (tests/test_hook_order.py checks it in several graphs)
    edge_order = (1, 2, 6, 4, 5, 3, 0)
    batched_inputs = (0, 1, 2)
    input_batch_dim = 1  # sequence-first
    output_batch_dims = (1, 0)

    @staticmethod
    def example_options(options: MultiheadOptions, i: int) -> MultiheadOptions:
        mask, padding = options.attn_mask, options.key_padding_mask
        if mask is not None and mask.dim() == 3:  # [batch * heads, queries, keys]
            h = options.num_heads
            mask = mask[i * h : (i + 1) * h]
        if padding is not None:
            padding = padding.narrow(0, i, 1)
        return replace(options, attn_mask=mask, key_padding_mask=padding)

    @staticmethod
    def draws(inner: InnerGraph, options: MultiheadOptions) -> bool:
        """A query row whose every key is masked: PyTorch's softmax of an all ``-inf`` row
        gives NaN there (with ``need_weights=True``; the fused path gives 0), and its
        gradients are NaN; the messages would draw it as a row without paths, finite. With a
        mask, an output holding NaN runs the call plainly, through the generic rules."""
        if options.attn_mask is None and options.key_padding_mask is None:
            return True
        return not bool(torch.isnan(inner.outputs[0]).any())

    @staticmethod
    def messages(call: BackwardCall) -> list[State | None]:
        return _semiring_messages(call)

    @classmethod
    def per_sample(cls, call: BackwardCall) -> list[State | None]:
        """Rows of the projections' weights and biases: the same messages, with each
        projection's weight contracted per example (``linear_per_sample``)."""
        return _semiring_messages(call, per_sample=True)

    @staticmethod
    def sites(out: tuple[Tensor, Tensor | None]) -> Sites:
        weights = out[1] if isinstance(out, tuple) else None
        per_head = weights is not None and weights.dim() == 4  # average_attn_weights=False
        return (
            ("attention output", ("token", "batch", "feature")),
            ("attention weights", ("batch", "head", "query", "key") if per_head else
             ("batch", "query", "key")),
        )  # fmt: skip


def _semiring_messages(call: BackwardCall, per_sample: bool = False) -> list[State | None]:
    """Messages along the reference decomposition (see the module docstring); with
    ``per_sample`` the parameters' states keep the batch axis ([batch, *shape]) and the inputs
    get none."""
    options: MultiheadOptions = call.options
    sr, (m_out, m_weights), need = call.semiring, call.incoming, call.needs
    query, key, value, w_in, b_in, w_out, b_out = call.inputs
    dtype = sr.state_dtype(query.dtype)

    def to_bf(t: Tensor) -> Tensor:  # [batch, tokens, embed]
        return t.transpose(0, 1).to(dtype)

    xq, xk, xv = to_bf(query), to_bf(key), to_bf(value)
    b, t_q, e = xq.shape
    h = options.num_heads
    d = e // h
    w_q, w_k, w_v = w_in.to(dtype).chunk(3)
    b_q, b_k, b_v = b_in.to(dtype).chunk(3) if b_in is not None else (None, None, None)

    def project(x, w, bias):
        y = x @ w.t()
        return y + bias if bias is not None else y

    def heads(y: Tensor) -> Tensor:
        return rearrange(y, "b t (h d) -> b h t d", h=h)

    def merged(y: Tensor) -> Tensor:
        return rearrange(y, "b h t d -> b t (h d)")

    q = heads(project(xq, w_q, b_q))
    k = heads(project(xk, w_k, b_k))
    v = heads(project(xv, w_v, b_v))
    mask = additive_mask(options.attn_mask, options.key_padding_mask, b, h, dtype)
    scale = 1.0 / math.sqrt(d)
    log_probs = attention_log_probs(q, k, mask, False, scale)
    probs = log_probs.exp()
    concat = merged(probs @ v)

    if m_out is None:
        m_out = sr.zeros((b, t_q, e), dtype, query.device)
    else:
        m_out = tuple(p.transpose(0, 1) for p in m_out)
    want_wo, want_bo = need[5], need[6] and b_out is not None
    if per_sample:
        m_concat, _, _ = linear_messages(sr, m_out, concat, w_out.to(dtype), True, False, False)
        m_wo, m_bo = linear_per_sample(sr, m_out, concat, want_wo, want_bo)
    else:
        m_concat, m_wo, m_bo = linear_messages(
            sr, m_out, concat, w_out.to(dtype), True, want_wo, want_bo
        )
    m_heads = tuple(heads(p) for p in m_concat)
    m_p = None
    if m_weights is not None:
        if options.average_attn_weights:  # mean over heads: an edge of weight 1/h per head
            m_p = sr.scale(
                tuple(repeat(p, "b q k -> b h q k", h=h) for p in m_weights),
                torch.tensor(1.0 / h, dtype=dtype),
            )
        else:
            m_p = m_weights
    m_q, m_k, m_v = attention_contract(sr, m_heads, q, k, v, probs, scale, None, m_p, log_probs)

    def merge(m: State) -> State:
        return tuple(merged(p) for p in m)

    per_input = []
    weight_parts, bias_parts = [], []
    want_w, want_b = need[3], need[4] and b_in is not None
    for m_y, x, w in ((m_q, xq, w_q), (m_k, xk, w_k), (m_v, xv, w_v)):
        if per_sample:
            m_x = None
            m_w, m_b = linear_per_sample(sr, merge(m_y), x, want_w, want_b)
        else:
            m_x, m_w, m_b = linear_messages(sr, merge(m_y), x, w, True, want_w, want_b)
            m_x = tuple(p.transpose(0, 1) for p in m_x)
        per_input.append(m_x)
        weight_parts.append(m_w)
        bias_parts.append(m_b)
    dim = 1 if per_sample else 0  # the rows stack the three projections after the batch
    m_win = tuple(torch.cat(p, dim) for p in zip(*weight_parts, strict=True)) if want_w else None
    m_bin = tuple(torch.cat(p, dim) for p in zip(*bias_parts, strict=True)) if want_b else None
    return [*per_input, m_win, m_bin, m_wo, m_bo]


_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


@extends(F.multi_head_attention_forward)
def multi_head_attention_forward(*args: Any, **kwargs: Any) -> Any:
    """``F.multi_head_attention_forward`` (hence nn.MultiheadAttention) inside ``extend``.

    Covers packed in-projections without bias_k/bias_v, zero-attention or static keys, on
    batched inputs, without active dropout; anything else runs the plain function (generic path).
    """
    call = _MHA_SIGNATURE.bind(*args, **kwargs)
    call.apply_defaults()
    a = call.arguments
    tensors = (a["query"], a["key"], a["value"], a["in_proj_weight"], a["in_proj_bias"])
    covered = (
        a["query"].dim() == 3
        and not a["use_separate_proj_weight"]
        and a["in_proj_weight"] is not None
        and a["bias_k"] is None
        and a["bias_v"] is None
        and not a["add_zero_attn"]
        and a["static_k"] is None
        and a["static_v"] is None
        and not (a["dropout_p"] > 0.0 and a["training"])
    )
    if not covered or not wants_graph(*tensors, a["out_proj_weight"], a["out_proj_bias"]):
        return F.multi_head_attention_forward(*args, **kwargs)

    def run(q, k, v, wi, bi, wo, bo):
        named = dict(a)
        named.update(
            query=q,
            key=k,
            value=v,
            in_proj_weight=wi,
            in_proj_bias=bi,
            out_proj_weight=wo,
            out_proj_bias=bo,
        )
        return F.multi_head_attention_forward(**named)

    options = MultiheadOptions(
        a["num_heads"], a["attn_mask"], a["key_padding_mask"], a["average_attn_weights"]
    )
    inputs = [*tensors, a["out_proj_weight"], a["out_proj_bias"]]
    return MultiheadAttentionFunction.run(run, inputs, options)
