"""nn.MultiheadAttention: projections, per-head attention and output projection in one backward.

The inner graph is the module's own ``forward`` run on aliases of its parameters, so regular
gradients are exactly a plain backward's. The semiring messages follow the reference
decomposition: in-projections (linear), S = Q Kᵀ / √d + mask, P = softmax(S), O = P V, heads
concatenated, out-projection; the returned attention weights (if used) are P, averaged over heads
when ``average_attn_weights``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from einops import rearrange, repeat
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module

from ..readout.sites import Site, stamp
from ..rules.attention import attention_contract, attention_log_probs
from ..semirings.base import State
from ..transport.provenance import current_module
from .base import (
    ModuleExtension,
    frees_context,
    inner_inputs,
    messages,
    record_inner,
    register_extension,
    split_message,
    wanted_inputs,
)
from .linear import linear_messages

PARAMS = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")


def additive_mask(
    attn_mask: Tensor | None, key_padding_mask: Tensor | None, batch: int, heads: int, dtype
) -> Tensor | None:
    """nn.MultiheadAttention's masks (bool True = masked out, or additive) as one additive mask
    broadcastable to [batch, heads, queries, keys]."""

    def additive(m: Tensor) -> Tensor:
        if m.dtype == torch.bool:
            return torch.zeros(m.shape, dtype=dtype).masked_fill(m, float("-inf"))
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


class MultiheadAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, w_in, b_in, w_out, b_out, module, options):
        ctx.set_materialize_grads(False)

        def run(q, k, v, wi, bi, wo, bo):
            params = dict(zip(PARAMS, (wi, bi, wo, bo), strict=True))
            params = {n: t for n, t in params.items() if t is not None}
            with _reparametrize_module(module, params):
                return type(module).forward(module, q, k, v, **options)

        ctx.module, ctx.options = module, options
        return record_inner(ctx, run, [query, key, value, w_in, b_in, w_out, b_out])

    @staticmethod
    @frees_context
    def backward(ctx, grad_out, grad_weights):
        reg_out, m_out, sr = split_message(grad_out)
        reg_w, m_w, sr_w = split_message(grad_weights)
        sr = sr or sr_w
        reg = ctx.inner.regular_grads([reg_out, reg_w])
        if sr is None:
            return (*reg, None, None)
        states = _semiring_messages(ctx, sr, m_out, m_w)
        return (*messages(reg, states, sr, wanted_inputs(ctx)), None, None)


def _semiring_messages(ctx, sr, m_out: State | None, m_weights: State | None) -> list:
    module, options = ctx.module, ctx.options
    query, key, value, w_in, b_in, w_out, b_out = inner_inputs(ctx)
    dtype = sr.state_dtype(query.dtype)
    batch_first = module.batch_first

    def to_bf(t: Tensor) -> Tensor:  # [batch, tokens, embed]
        return (t if batch_first else t.transpose(0, 1)).to(dtype)

    xq, xk, xv = to_bf(query), to_bf(key), to_bf(value)
    b, t_q, e = xq.shape
    h = module.num_heads
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
    mask = additive_mask(options["attn_mask"], options["key_padding_mask"], b, h, dtype)
    scale = 1.0 / math.sqrt(d)
    log_probs = attention_log_probs(q, k, mask, False, scale)
    probs = log_probs.exp()
    concat = merged(probs @ v)

    if m_out is None:
        m_out = sr.zeros((b, t_q, e), dtype, query.device)
    else:
        m_out = tuple(p if batch_first else p.transpose(0, 1) for p in m_out)
    need = ctx.needs_input_grad
    m_concat, m_wo, m_bo = linear_messages(
        sr, m_out, concat, w_out.to(dtype), True, need[5], need[6] and b_out is not None
    )
    m_heads = tuple(heads(p) for p in m_concat)
    m_p = None
    if m_weights is not None:
        if options["average_attn_weights"]:  # mean over heads: an edge of weight 1/h per head
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
    for m_y, x, w in ((m_q, xq, w_q), (m_k, xk, w_k), (m_v, xv, w_v)):
        m_x, m_w, m_b = linear_messages(
            sr, merge(m_y), x, w, True, need[3], need[4] and b_in is not None
        )
        per_input.append(tuple(p if batch_first else p.transpose(0, 1) for p in m_x))
        weight_parts.append(m_w)
        bias_parts.append(m_b)
    m_win = tuple(torch.cat(p, 0) for p in zip(*weight_parts, strict=True)) if need[3] else None
    m_bin = (
        tuple(torch.cat(p, 0) for p in zip(*bias_parts, strict=True))
        if need[4] and b_in is not None
        else None
    )
    return [*per_input, m_win, m_bin, m_wo, m_bo]


class MultiheadAttentionExtension(ModuleExtension):
    module_class = nn.MultiheadAttention

    def applies_to(self, module: nn.Module) -> bool:
        return (
            super().applies_to(module)
            and module._qkv_same_embed_dim
            and module.bias_k is None
            and module.bias_v is None
            and not module.add_zero_attn
        )

    def forward(
        self,
        module: nn.MultiheadAttention,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Any:
        options = dict(
            key_padding_mask=key_padding_mask,
            need_weights=need_weights,
            attn_mask=attn_mask,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
        )
        dropout_active = module.dropout > 0.0 and module.training
        if query.dim() != 3 or dropout_active:  # unbatched or random: the generic path
            return type(module).forward(module, query, key, value, **options)
        out, weights = MultiheadAttentionFunction.apply(
            query,
            key,
            value,
            module.in_proj_weight,
            module.in_proj_bias,
            module.out_proj.weight,
            module.out_proj.bias,
            module,
            options,
        )
        where = current_module()
        stamp(
            out,
            (
                Site(where, "attention output", ("batch", "token", "feature")),
                Site(where, "attention weights", ("batch", "query", "key")),
            ),
        )
        return out, weights


register_extension(MultiheadAttentionExtension())
