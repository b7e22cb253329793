"""Matrix products: the '+' hidden inside a matmul's backward becomes the semiring's plus."""

from __future__ import annotations

import torch

from ..kernels.shared_shift import shared_shift_products
from ..semirings.base import State
from ..transport.message import Message
from .registry import OpCall, register_rule

aten = torch.ops.aten


def _t(parts: State) -> State:
    return tuple(p.transpose(-1, -2) for p in parts)


@register_rule(aten.mm.default, aten.bmm.default)
def matmul(call: OpCall):
    """out[i, j] = ⊕_k a[i, k] ⊗ b[k, j], with exactly one of a, b a message."""
    a, b = call["self"], call["mat2"]
    sr = call.semiring
    if isinstance(a, Message) and isinstance(b, Message):
        raise call.error("the product of two messages has no semiring meaning")
    # Edge weights in the state's precision (a bfloat16 weight meets a float32 state).
    if isinstance(a, Message):
        b = b.to(call.weight_dtype)
    else:
        a = a.to(call.weight_dtype)
    if isinstance(a, Message):
        shared = shared_shift_products(sr, a.parts, right=b)
        parts = shared[0] if shared is not None else sr.matmul(a.parts, b)
    else:  # (a @ m) = (mᵀ @ aᵀ)ᵀ
        shared = shared_shift_products(sr, b.parts, left=a.transpose(-1, -2))
        parts = shared[1] if shared is not None else sr.matmul(_t(b.parts), a.transpose(-1, -2))
        parts = _t(parts)
    return call.wrap(call.run_real(), parts)


@register_rule(aten.mv.default)
def mv(call: OpCall):
    a, v = call["self"], call["vec"]
    sr = call.semiring
    if isinstance(a, Message) and isinstance(v, Message):
        raise call.error("the product of two messages has no semiring meaning")
    if isinstance(v, Message):  # out[i] = ⊕_j a[i, j] ⊗ v[j]
        weights = a.t().to(call.weight_dtype)
        parts = tuple(p[0] for p in sr.matmul(tuple(p[None] for p in v.parts), weights))
    else:
        parts = tuple(p[:, 0] for p in sr.matmul(a.parts, v[:, None].to(call.weight_dtype)))
    return call.wrap(call.run_real(), parts)


@register_rule(aten.dot.default)
def dot(call: OpCall):
    a, b = call["self"], call["tensor"]
    if isinstance(a, Message) and isinstance(b, Message):
        raise call.error("the product of two messages has no semiring meaning")
    msg, w = (a, b) if isinstance(a, Message) else (b, a)
    weights = w[:, None].to(call.weight_dtype)
    parts = tuple(p[0, 0] for p in call.semiring.matmul(tuple(p[None] for p in msg.parts), weights))
    return call.wrap(call.run_real(), parts)
