"""Fused scaled-dot-product attention, drawn as its reference decomposition.

Whatever kernel PyTorch picked (CPU flash, CUDA flash / memory-efficient / cuDNN), the graph is
the one of ``S = Q Kᵀ * scale (+ mask); P = softmax(S); O = P V``, so a model gives the same
semiring values with ``attn_implementation="sdpa"`` and ``"eager"``.

The attention weights enter the log-space semirings as exact log-probabilities (``S - logsumexp
S``, recomputed from Q and K): a probability of 1e-50 underflows float32 but is an edge. A query
row whose every key is masked (PyTorch returns 0 for it, with a finite gradient) is drawn as
``P = where(all masked, 0, softmax(S))``: its weights are structural zeros, so no path runs
through it.
"""

from __future__ import annotations

import functools
import math

import torch
from einops import rearrange, repeat
from torch import Tensor

from ..graph.provenance import current_site
from ..graph.sites import Site
from ..messages import OpCall, register_rule
from ..messages.shared_shift import shared_shift_products
from ..semirings.base import Semiring, State
from .softmax import exact_log_softmax, softmax_contract

aten = torch.ops.aten


def attention_scores(
    q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, scale: float
) -> Tensor:
    """``S = Q Kᵀ * scale`` with the masks applied (``-inf`` where a key is masked)."""
    return masked_scores(torch.matmul(q, k.transpose(-1, -2)) * scale, mask, causal)


def masked_scores(scores: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """Raw scores ``Q Kᵀ * scale`` with the masks applied (``-inf`` where a key is masked)."""
    if causal:
        lq, lk = scores.shape[-2:]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    return scores


def attention_log_probs(
    q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, scale: float
) -> Tensor:
    """``log P`` per query row (``exact_log_softmax`` of the scores): exact where P underflows,
    ``-log n`` on a row of equal masked scores (uniform, as the forward's softmax gives it),
    ``-inf`` on every key of a row where every key is masked with ``-inf`` (P = 0 there, as
    PyTorch's attention returns). NaN stays NaN. For the semiring messages."""
    return exact_log_softmax(attention_scores(q, k, mask, causal, scale), -1)


def attention_probs(
    q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, scale: float
) -> Tensor:
    """The attention weights ``P = where(all masked, 0, softmax(S))``, differentiable with a
    finite gradient (the softmax of a fully masked row runs on zeros and is not used)."""
    return probs_of_scores(attention_scores(q, k, mask, causal, scale))


def probs_of_scores(scores: Tensor) -> Tensor:
    """``attention_probs`` from the masked scores ``S``."""
    with torch.no_grad():
        masked_rows = (scores == float("-inf")).all(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(masked_rows, 0.0), -1)
    return probs.masked_fill(masked_rows, 0.0)


def _t(parts: State) -> State:
    return tuple(p.transpose(-1, -2) for p in parts)


def attention_contract(
    sr: Semiring,
    m_out: State,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor,
    scale: float,
    keep: Tensor | None = None,
    m_weights: State | None = None,
    log_probs: Tensor | None = None,
) -> tuple[State, State, State]:
    """Messages to (Q, K, V) from the message on O, batched over leading dims.

    The graph: S = Q Kᵀ * scale (+ mask), P = softmax(S), W = P * keep (dropout, optional),
    O = W V. ``m_weights`` is an extra message arriving on W (when the attention weights are
    themselves used downstream). ``log_probs`` are the exact log P where the caller has them
    (``attention_log_probs``); else ``log(probs)``.
    """
    if probs.numel() == 0:  # no query or no key: no score, so no edge from Q, K or V to O
        return tuple(sr.zeros(t.shape, t.dtype, t.device) for t in (q, k, v))
    if log_probs is None:
        log_probs = probs.log()
    weights = probs if keep is None else probs * keep
    # ∂O[i,d]/∂W[i,j] = V[j,d];  ∂O[i,d]/∂V[j,d] = W[i,j]
    m_w, m_v_t = _value_products(sr, m_out, v.transpose(-1, -2), weights, log_probs, keep)
    if m_weights is not None:
        m_w = sr.plus(m_w, m_weights)
    m_w = record_internal(sr, m_w, "attention weights")
    m_v = _t(m_v_t)
    m_probs = m_w if keep is None else sr.scale(m_w, keep)  # ∂W/∂P = keep
    del m_w, weights
    rows = probs.shape[-1]
    flat = tuple(p.reshape(-1, rows) for p in m_probs)
    del m_probs
    m_scores = softmax_contract(
        sr, flat, probs.reshape(-1, rows), log_probs.reshape(-1, rows).contiguous()
    )
    del flat
    m_scores = tuple(p.reshape(probs.shape) for p in m_scores)
    m_scores = record_internal(sr, m_scores, "attention scores")
    # ∂S[i,j]/∂Q[i,d] = K[j,d] * scale;  ∂S[i,j]/∂K[j,d] = Q[i,d] * scale
    shared = shared_shift_products(sr, m_scores, k * scale, q * scale)
    if shared is not None:
        m_q, m_k, _ = shared
    else:
        m_q, m_k = sr.matmul(m_scores, k * scale), sr.matmul(_t(m_scores), q * scale)
    return m_q, m_k, m_v


def _value_products(
    sr: Semiring,
    m_out: State,
    v_t: Tensor,
    weights: Tensor,
    log_probs: Tensor,
    keep: Tensor | None,
) -> tuple[State, State]:
    """``(m_out ⊗ Vᵀ, m_outᵀ ⊗ W)``: the messages to the weights W and (transposed) to V.

    Real takes W itself; the log-space semirings take log W = log P (+ log keep), so a weight
    below float32's range is still an edge of the right size."""
    if sr.linear_weights:
        shared = shared_shift_products(sr, m_out, v_t, weights)
        if shared is not None:
            return shared[0], shared[1]
        return sr.matmul(m_out, v_t), sr.matmul(_t(m_out), weights)
    log_w = log_probs if keep is None else log_probs + keep.log()
    shared = shared_shift_products(sr, m_out, v_t, left_log=log_w)
    if shared is not None:
        return shared[0], shared[1]
    return sr.matmul(m_out, v_t), sr.matmul_log(_t(m_out), log_w)


#: Largest number of attention-weight entries whose messages are built at once. The batch is
#: split into chunks of about this size, so the temporaries of a semiring attention backward (the
#: weights, their messages and the softmax kernel's buffers) stay small next to its outputs.
ATTENTION_CHUNK_ELEMENTS = 1 << 20


def _batch_slice(t, start: int, stop: int, batch: int):
    """``t`` (a tensor, a state or None) restricted to batch entries [start, stop) when its
    leading dimension is the batch of a 4-d attention tensor, else ``t`` itself (broadcast)."""
    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(_batch_slice(c, start, stop, batch) for c in t)
    if t.dim() == 4 and t.shape[0] == batch and batch > 1:
        return t[start:stop]
    return t


def attention_messages(
    sr: Semiring,
    m_out: State,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    causal: bool,
    scale: float,
    keep: Tensor | None = None,
    m_weights: State | None = None,
) -> tuple[State, State, State]:
    """``attention_contract`` with the attention weights recomputed from Q and K, over chunks
    of the batch (``ATTENTION_CHUNK_ELEMENTS``). Q, K, V are [batch, heads, tokens, dim] with K
    and V already repeated to the query heads. Each chunk is exactly the unchunked computation
    restricted to its batch entries; path-recording semirings run in one piece (their trace
    names the weights by their index in the whole tensor)."""
    batch = q.shape[0]
    per_entry = math.prod(q.shape[1:-1]) * k.shape[-2]
    step = max(1, ATTENTION_CHUNK_ELEMENTS // max(per_entry, 1))
    if q.dim() != 4 or step >= batch or sr.trace is not None:
        log_probs = attention_log_probs(q, k, mask, causal, scale)
        probs = log_probs.exp()
        return attention_contract(sr, m_out, q, k, v, probs, scale, keep, m_weights, log_probs)
    outputs: list[State] | None = None
    for start in range(0, batch, step):
        stop = min(start + step, batch)
        piece = functools.partial(_batch_slice, start=start, stop=stop, batch=batch)
        q_c = piece(q)
        log_probs = attention_log_probs(q_c, piece(k), piece(mask), causal, scale)
        probs = log_probs.exp()
        got = attention_contract(
            sr,
            piece(m_out),
            q_c,
            piece(k),
            piece(v),
            probs,
            scale,
            piece(keep),
            piece(m_weights),
            log_probs,
        )
        del probs, log_probs
        if outputs is None:
            outputs = [tuple(c.new_empty((batch, *c.shape[1:])) for c in state) for state in got]
        for whole, part in zip(outputs, got, strict=True):
            for w, c in zip(whole, part, strict=True):
                w[start:stop].copy_(c)
        del got
    return tuple(outputs)


def record_internal(sr: Semiring, m: State, tensor: str) -> State:
    """Let path readouts see a tensor internal to the fused op (weights, scores) as the nodes of
    the reference decomposition, named by head and token."""
    trace = sr.trace  # set on the semiring of a path-recording pass (Semiring.bound_to)
    if trace is None:
        return m
    _node, module = current_site()
    dims = ("batch", "head", "query", "key")[-m[0].dim() :]
    site = Site(module if module is not None else "<unnamed>", tensor, dims)
    return trace.relabel_state(sr, m, tensor, module, site)


def repeat_heads(t: Tensor, groups: int) -> Tensor:
    """Grouped-query attention: each key/value head serves ``groups`` query heads."""
    if groups == 1:
        return t
    return repeat(t, "b h n d -> b (h g) n d", g=groups)


def fold_heads(sr: Semiring, m: State, groups: int) -> State:
    """Inverse of ``repeat_heads`` for messages: the repeated uses meet in a plus."""
    if groups == 1:
        return m
    split = tuple(rearrange(p, "b (h g) n d -> b h g n d", g=groups) for p in m)
    return sr.sum(split, [2])


def _sdpa_backward(call: OpCall, grad_name: str, mask_name: str | None, n_outputs: int):
    if call["dropout_p"]:
        raise call.error("attention dropout inside a fused kernel cannot be replayed")
    msg = call[grad_name]
    q, k, v = call["query"], call["key"], call["value"]
    groups = q.shape[-3] // k.shape[-3]
    dtype = call.weight_dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scale = call["scale"]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = call[mask_name] if mask_name else None
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    k, v = repeat_heads(k, groups), repeat_heads(v, groups)
    sr = call.semiring
    m_q, m_k, m_v = attention_messages(sr, msg.parts, q, k, v, mask, bool(call["is_causal"]), scale)
    m_k, m_v = fold_heads(sr, m_k, groups), fold_heads(sr, m_v, groups)
    regular = call.run_regular()
    reals = list(regular) if regular is not None else [None] * n_outputs
    outs = [call.wrap(r, parts) for r, parts in zip(reals[:3], (m_q, m_k, m_v), strict=True)]
    return tuple(outs + reals[3:])


@register_rule(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def sdpa_cpu_flash_backward(call: OpCall):
    """CPU flash attention, drawn as its reference decomposition."""
    return _sdpa_backward(call, "grad_out", "attn_mask", 3)


@register_rule(aten._scaled_dot_product_flash_attention_backward.default)
def sdpa_cuda_flash_backward(call: OpCall):
    """CUDA flash attention, drawn as its reference decomposition."""
    return _sdpa_backward(call, "grad_out", None, 3)


@register_rule(aten._scaled_dot_product_efficient_attention_backward.default)
def sdpa_efficient_backward(call: OpCall):
    """Memory-efficient attention, drawn as its reference decomposition; a call that asks
    the kernel for the gradient of a learnable bias is refused (``UnsupportedOpError``)."""
    if call["grad_input_mask"][3]:
        raise call.error("a gradient for the attention bias is not supported")
    return _sdpa_backward(call, "grad_out_", "attn_bias", 4)


@register_rule(aten._scaled_dot_product_cudnn_attention_backward.default)
def sdpa_cudnn_backward(call: OpCall):
    """cuDNN attention, drawn as its reference decomposition."""
    return _sdpa_backward(call, "grad_out", "attn_bias", 3)
