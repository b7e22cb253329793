"""Whether an attention call's own code is the decomposition the fused backward draws.

A Hugging Face eager attention function lives in the model's file: it may add a term of its own
to the scores (a relative position bias, a cap, a bias read from the module) or change only the
backward (a straight-through term, a detached key). ``AttentionFunction`` draws such a call only
when its recorded graph has the decomposition's structure (``reference_structure``) and its
outputs are the decomposition's values up to rounding (``computes_reference``); any other call
runs through the generic rules, which draw what it computes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..rules.attention import attention_scores, repeat_heads

#: The autograd nodes of attention written op by op (Q Kᵀ, scaling, masks, softmax, dtype
#: casts, grouped-query repeats, the product with V, layout changes).
REFERENCE_NODES = frozenset(
    {
        "BmmBackward0",
        "MmBackward0",
        "UnsafeViewBackward0",
        "ViewBackward0",
        "ReshapeAliasBackward0",
        "ExpandBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "CloneBackward0",
        "UnsqueezeBackward0",
        "SqueezeBackward0",
        "AliasBackward0",
        "MulBackward0",
        "DivBackward0",
        "AddBackward0",
        "MaskedFillBackward0",
        "WhereBackward0",
        "SoftmaxBackward0",
        "ToCopyBackward0",
        "AccumulateGrad",
    }
)


def reference_structure(outputs: tuple[Tensor, Tensor | None], inputs: list[Tensor | None]) -> bool:
    """Whether the recorded graph could be attention drawn as its decomposition: only the ops
    of ``REFERENCE_NODES``, each result used once, and each of Q, K, V that requires grad
    reached. The values (``computes_reference``) cannot show a term that changes only the
    backward: a straight-through ``s + c (s - s.detach())`` or a detached key uses a result
    twice or leaves an input unreached; a gradient of another op is another node."""
    # node objects are kept alive (``edges``, ``alive``) so that their ids stay theirs
    edges = [
        torch.autograd.graph.get_gradient_edge(t)
        for t in inputs
        if t is not None and t.requires_grad
    ]
    leaves = {id(e.node): i for i, e in enumerate(edges)}
    reached: set[int] = set()
    uses: dict[int, int] = {}
    alive = []
    stack = [o.grad_fn for o in outputs if isinstance(o, Tensor) and o.grad_fn is not None]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if id(node) in leaves:
            reached.add(leaves[id(node)])
            continue
        if node.name() not in REFERENCE_NODES:
            return False
        for child, _ in node.next_functions:
            if child is None:
                continue
            uses[id(child)] = uses.get(id(child), 0) + 1
            alive.append(child)
            stack.append(child)
    if any(count > 1 for key, count in uses.items() if key not in leaves):
        return False
    return len(reached) == len(leaves)


def computes_reference(
    spec: Any, q: Tensor, k: Tensor, v: Tensor, out: Tensor, weights: Tensor | None
) -> bool:
    """Whether ``out`` ([batch, heads, queries, dim]) and ``weights`` ([batch, heads, queries,
    keys]) are softmax(Q Kᵀ·scale + mask) and its product with V, up to rounding (``spec``: the
    call's ``AttentionSpec``, its scale, mask, causality and key/value groups).

    Rounding moves a score by a few ulps of the largest score a row can reach, at most
    max|q|·max|k|·scale (Cauchy-Schwarz) plus the largest entry of the mask that keeps a key in
    play (a padding mask's -3.4e38 takes it out), hence a probability by about as many ulps of
    itself (plus about sqrt(keys) from the row's sum); it moves an output entry, a weighted
    mean of V, by a few ulps of V's largest entry per sqrt(keys). The bounds allow 64 times
    that, in ulps of the outputs' dtype (float32's at least, see ``_ulp``), relative to each
    weight: a relative position bias, a soft cap, or a term that scales one small weight is
    found. Inputs that are not finite prove nothing: False.
    """
    if weights is None or weights.shape != (*q.shape[:-1], k.shape[-2]):
        return False
    dtype = torch.promote_types(torch.promote_types(q.dtype, weights.dtype), torch.float32)
    with torch.no_grad():
        q, k_all = q.to(dtype), repeat_heads(k, spec.kv_groups).to(dtype)
        v_all = repeat_heads(v, spec.kv_groups).to(dtype)
        mask = spec.mask
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(dtype)
        norms = q.norm(dim=-1).amax() * k_all.norm(dim=-1).amax() * abs(spec.scale)
        reach = float(norms) + _largest_bias(mask)
        largest_v = float(v_all.abs().amax()) if v_all.numel() else 0.0
        if not (math.isfinite(reach) and math.isfinite(largest_v)):
            return False
        scores = attention_scores(q, k_all, mask, spec.causal, spec.scale)
        masked_rows = (scores == float("-inf")).all(-1, keepdim=True)
        probs = torch.softmax(scores.masked_fill_(masked_rows, 0.0), -1)
        probs.masked_fill_(masked_rows, 0.0)
        keys = math.sqrt(k_all.shape[-2])  # a row's sums round by about sqrt(keys) ulps
        # relative per weight: a term that multiplies a small weight by 10 is no rounding
        relative = 64 * _ulp(weights.dtype) * (max(1.0, reach) + keys)
        weights = weights.to(dtype)
        floor = 64 * torch.finfo(torch.float32).tiny  # below it float32 weights are subnormal
        if not _within(weights, probs, relative * probs.abs() + floor):
            return False
        reference = torch.matmul(weights, v_all)
        tolerance = 64 * _ulp(out.dtype) * max(1.0, largest_v) * (1.0 + keys)
        return _within(out.to(dtype), reference, tolerance)


def _within(a: Tensor, b: Tensor, tolerance: Tensor | float) -> bool:
    """Whether every entry of ``a`` is within ``tolerance`` (per entry, or one number) of
    ``b``'s (NaN never is)."""
    return a.numel() == 0 or bool(((a - b).abs_() <= tolerance).all())


def _ulp(dtype: torch.dtype) -> float:
    """The rounding unit the comparison allows: the dtype's, at least float32's (transformers'
    eager functions take the softmax in float32 whatever the model's dtype)."""
    return max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)


def _largest_bias(mask: Tensor | None) -> float:
    """The largest magnitude an additive mask adds to a score that stays in play: entries
    beyond -1e4 below are padding (they take a key out of the softmax), not a bias."""
    if mask is None or mask.dtype == torch.bool or mask.numel() == 0:
        return 0.0
    return float(torch.where(mask > -1e4, mask.abs(), 0.0).amax())
