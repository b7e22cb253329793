"""Attention: one fused backward per attention call, drawn as its reference decomposition.

Two entry points route attention through ``AttentionFunction``:

- ``scaled_dot_product_attention`` calls made inside ``semipack.extend`` (any module that calls
  ``F.scaled_dot_product_attention``: Hugging Face models in "sdpa" mode,
  ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` on their fast path, user blocks);
- Hugging Face "eager" attention (QKᵀ / softmax / V written by hand), see ``hf.py``.

The forward runs the original computation as the inner graph (so regular gradients are exactly
those of a plain backward); the backward computes the semiring messages to Q, K and V per head
with batched semiring matmuls and the O(n) softmax kernel, never building a
[batch, heads, queries, keys, dim] tensor, and names the sites (head, query token, key token).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend

from ..kernels.shapes import broadcast_shapes
from ..rules.attention import (
    attention_messages,
    attention_probs,
    fold_heads,
    repeat_heads,
)
from ..semirings.base import State
from .base import BackwardCall, ExtensionFunction, InnerGraph, Sites, extends, wants_graph
from .reference_check import checks_as_reference, reference_structure

_sdpa = F.scaled_dot_product_attention


@dataclass(frozen=True)
class AttentionSpec:
    """Everything the reference decomposition needs besides Q, K and V."""

    scale: float
    mask: Tensor | None = None  # bool (True = attend) or additive float
    causal: bool = False
    keep: Tensor | None = None  # dropout multipliers (mask / (1 - p)), or None
    kv_groups: int = 1  # query heads per key/value head
    #: For a call whose own code may compute something else (Hugging Face eager functions, see
    #: ``hf.py``): that code, ``(q, k, v) -> (output [batch, heads, queries, dim], weights)``.
    #: The call's outputs are compared with the decomposition before it is drawn; outputs in a
    #: 16-bit dtype are computed again in float32 for the comparison (their rounding, 0.4% of
    #: a weight, would hide a bias of that size).
    own_code: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor | None]] | None = None


class AttentionFunction(ExtensionFunction):
    """(Q, K, V) -> (O, W): O = W V with W = dropout(softmax(Q Kᵀ scale + mask)); Q: [batch,
    heads, queries, dim], K and V: [batch, heads / kv_groups, keys, dim]; options: the spec.

    ``AttentionFunction.run(inner_fn, [q, k, v], spec)`` with ``inner_fn(q, k, v) -> (O, W or
    None)``; when ``inner_fn`` reaches a tensor that requires grad besides Q, K and V (a
    learnable attention bias in its mask, say), its plain outputs are returned: the generic
    per-op path then carries that tensor's messages too.
    """

    reads = (0, 1, 2)

    @staticmethod
    def messages(call: BackwardCall) -> tuple[State, State, State]:
        spec: AttentionSpec = call.options
        sr, (m_out, m_w) = call.semiring, call.incoming
        dtype = sr.state_dtype(call.inputs[0].dtype)
        q, k, v = (t.to(dtype) for t in call.inputs)
        k_all, v_all = repeat_heads(k, spec.kv_groups), repeat_heads(v, spec.kv_groups)
        mask = spec.mask
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(dtype)
        if m_out is None:
            m_out = sr.zeros((*q.shape[:-1], v.shape[-1]), dtype, q.device)
        # Chunked over the batch, never a [batch, heads, queries, keys, dim] tensor.
        m_q, m_k, m_v = attention_messages(
            sr, m_out, q, k_all, v_all, mask, spec.causal, spec.scale, spec.keep, m_w
        )
        return m_q, fold_heads(sr, m_k, spec.kv_groups), fold_heads(sr, m_v, spec.kv_groups)

    @staticmethod
    def sites(out: tuple[Tensor, Tensor | None]) -> Sites:
        return (
            ("attention output", ("batch", "head", "query", "dim")),
            ("attention weights", ("batch", "head", "query", "key")),
        )

    @staticmethod
    def draws(inner: InnerGraph, spec: Any) -> bool:
        if spec.own_code is None:
            return True
        if not reference_structure(inner.outputs, inner.inputs):
            return False
        with torch._C.DisableTorchFunction():  # plain autograd: no semiring pass, no reroutes
            return checks_as_reference(spec, inner.outputs, inner.inputs)


def _runs_math_kernel(q, k, v, mask, dropout_p: float, causal: bool, scale, gqa: bool) -> bool:
    """Whether PyTorch would run its decomposed math kernel for this call."""
    choice = torch._fused_sdp_choice(q, k, v, mask, dropout_p, causal, scale=scale, enable_gqa=gqa)
    return choice == int(SDPBackend.MATH)


@extends(F.scaled_dot_product_attention)
def semiring_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Drop-in for ``F.scaled_dot_product_attention`` used while ``extend`` is active."""
    if (
        not wants_graph(query, key, value)
        or query.dim() != 4
        or not query.shape[0] == key.shape[0] == value.shape[0]  # a broadcast batch
        or key.shape[1] != value.shape[1]
        or query.shape[1] % key.shape[1] != 0  # query heads broadcast over key heads
        or (
            dropout_p > 0.0
            and _runs_math_kernel(
                query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
            )
        )
    ):
        # Dropout in PyTorch's math kernel is an ordinary mask multiplication the generic rules
        # replay exactly (with the very mask a plain run samples, so .grad stays bitwise).
        return _sdpa(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    scale_value = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    groups = query.shape[-3] // key.shape[-3]
    keep = None
    if dropout_p > 0.0:
        lq, lk = query.shape[-2], key.shape[-2]
        shape = (*broadcast_shapes(query.shape[:-2], key.shape[:-2]), lq, lk)
        keep = (torch.rand(shape, device=query.device) >= dropout_p).to(query.dtype)
        keep = keep / (1.0 - dropout_p)
    spec = AttentionSpec(scale_value, attn_mask, is_causal, keep, groups)

    if keep is None:

        def inner(q, k, v):
            out = _sdpa(
                q,
                k,
                v,
                attn_mask=attn_mask,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
            return out, None
    else:

        def inner(q, k, v):
            probs = attention_probs(q, repeat_heads(k, groups), attn_mask, is_causal, scale_value)
            weights = probs * keep
            return torch.matmul(weights, repeat_heads(v, groups)), None

    out, _ = AttentionFunction.run(inner, [query, key, value], spec)
    return out
