"""Whether an attention call's own code is the decomposition the fused backward draws.

A Hugging Face eager attention function lives in the model's file: it may add a term of its own
to the scores (a relative position bias, a cap, a bias read from the module) or change only the
backward (a straight-through term, a detached key). ``AttentionFunction`` draws such a call only
when its recorded graph has the decomposition's structure (``reference_structure``), its
outputs are the decomposition's values up to rounding (``Reference.matches``) and so is its
backward, probed once with random output gradients (``same_backward``); any other call runs
through the generic rules, which draw what it computes. 16-bit calls are checked through a
float32 run of the same code, and held to it at their own rounding (``checks_as_reference``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..rules.attention import masked_scores, probs_of_scores, repeat_heads

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
    reached: a quick first filter, before any arithmetic. A straight-through
    ``s + c (s - s.detach())`` uses a result twice, a detached key leaves an input unreached and
    another op is another node; forms that pass it (``2s - s.detach()``) change the backward,
    which ``same_backward`` probes."""
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


class Reference:
    """The decomposition softmax(Q Kᵀ·scale + mask) V of a call, computed once on leaves that
    copy its Q, K, V (at least float32): its raw scores give the bounds (``reach``), its values
    the forward check (``matches``) and its graph the backward probe (``grads``)."""

    def __init__(self, spec: Any, inputs: list[Tensor]) -> None:
        dtype = torch.promote_types(inputs[0].dtype, torch.float32)
        self.leaves = [t.detach().to(dtype).requires_grad_(t.requires_grad) for t in inputs]
        q, k, v = self.leaves
        self.k_all = repeat_heads(k, spec.kv_groups)
        self.v_all = repeat_heads(v, spec.kv_groups)
        mask = spec.mask
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(dtype)
        with torch.enable_grad():
            raw = torch.matmul(q, self.k_all.transpose(-1, -2)) * spec.scale
            self.probs = probs_of_scores(masked_scores(raw, mask, spec.causal))
            self.out = torch.matmul(self.probs, self.v_all)
        self.reach = _reach(raw.detach(), mask)

    def matches(self, out: Tensor, weights: Tensor) -> bool:
        """Whether ``out`` ([batch, heads, queries, dim]) and ``weights`` ([batch, heads,
        queries, keys]) are this decomposition's, up to rounding.

        Rounding moves a score by a few ulps of the largest score a row can reach
        (``reach``: the largest raw score plus the largest entry of the mask that keeps a key
        in play; a padding mask's -3.4e38 takes it out), hence a probability by about as many
        ulps of itself (plus about sqrt(keys) from the row's sum); it moves an output entry, a
        weighted mean of V, by a few ulps of V's largest entry per sqrt(keys). The bounds allow
        64 times that, in ulps of the outputs' dtype (float32's at least, see ``_ulp``),
        relative to each weight: a relative position bias, a soft cap, or a term that scales
        one small weight is found. Inputs that are not finite prove nothing: False.
        """
        probs, v_all = self.probs.detach(), self.v_all.detach()
        if weights is None or weights.shape != probs.shape:
            return False
        largest_v = float(v_all.abs().amax()) if v_all.numel() else 0.0
        if not (math.isfinite(self.reach) and math.isfinite(largest_v)):
            return False
        keys = math.sqrt(probs.shape[-1])  # a row's sums round by about sqrt(keys) ulps
        # relative per weight: a term that multiplies a small weight by 10 is no rounding
        relative = 64 * _ulp(weights.dtype) * (max(1.0, self.reach) + keys)
        floor = 64 * torch.finfo(torch.float32).tiny  # below it float32 weights are subnormal
        weights = weights.detach().to(probs.dtype)
        if not _within(weights, probs, relative * probs.abs() + floor):
            return False
        tolerance = 64 * _ulp(out.dtype) * max(1.0, largest_v) * (1.0 + keys)
        return _within(out.detach().to(probs.dtype), torch.matmul(weights, v_all), tolerance)

    def grads(self, probes: list[Tensor]) -> list[Tensor | None]:
        """The decomposition's gradients at Q, K, V (those that require grad) for ``probes``."""
        dtype = self.probs.dtype
        return _grads((self.out, self.probs), self.leaves, [p.to(dtype) for p in probes])


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


def checks_as_reference(spec: Any, outputs: tuple, inputs: list[Tensor | None]) -> bool:
    """Whether the recorded call (``outputs`` [batch, heads, queries, dim] and weights, from the
    aliases ``inputs`` Q, K, V) is the decomposition in values and in its backward. A 16-bit
    call runs again in float32 (``spec.own_code``), which is checked; the 16-bit outputs and
    backward are then held to the float32 ones at 16-bit rounding (a term the code adds only in
    16 bits is found where it exceeds that rounding). Empty calls are not drawn."""
    out, weights = outputs
    if weights is None or any(t is None or t.numel() == 0 for t in inputs):
        return False
    reference = Reference(spec, inputs)
    if not math.isfinite(reference.reach):
        return False
    probes = _probes(outputs, spec.mask)
    keys = inputs[1].shape[-2]
    if out.dtype not in (torch.bfloat16, torch.float16):
        return reference.matches(out, weights) and same_backward(
            _grads(outputs, inputs, probes), reference.grads(probes), reference.reach, keys
        )
    leaves = reference.leaves  # float32 copies: the same code runs on them
    try:
        with torch.enable_grad():
            wide = spec.own_code(*leaves)
    except (RuntimeError, TypeError):  # code bound to its dtype: unchecked, not drawn
        return False
    if wide[1] is None:
        return False
    wide_grads = _grads(wide, leaves, [p.float() for p in probes])
    if not (
        reference.matches(*wide)
        and same_backward(wide_grads, reference.grads(probes), reference.reach, keys)
    ):
        return False
    rough = 8 * torch.finfo(out.dtype).eps * (1.0 + reference.reach)
    live = _rows_in_play(spec.mask, wide[1].shape)
    narrow, wide_w = weights.float(), wide[1].detach()
    if live is not None:
        narrow, wide_w = narrow * live, wide_w * live
    if not _within(narrow, wide_w, rough * wide_w.abs() + rough * 1e-3):
        return False
    # the 16-bit backward against the float32 one: by the norm of the difference, where
    # rounding averages out and a changed gradient does not (within 2 16-bit ulps per nat)
    narrow_grads = _grads(outputs, inputs, probes)
    bound = 2 * torch.finfo(out.dtype).eps * (1.0 + reference.reach)
    for g, w in zip(narrow_grads, wide_grads, strict=True):
        if (g is None) != (w is None):
            return False
        if g is not None and not bool(
            torch.linalg.vector_norm(g.float() - w) <= bound * torch.linalg.vector_norm(w)
        ):
            return False
    return True


def same_backward(
    got: list[Tensor | None],
    want: list[Tensor | None],
    reach: float,
    keys: int,
    relative: float | None = None,
) -> bool:
    """Whether the recorded call's gradients ``got`` at Q, K, V (for the random output
    gradients of ``_probes``) are ``want``, the decomposition's, within ``relative`` of the
    largest entry of each (by default 64 float32 ulps times the largest score a row reaches
    plus sqrt(keys), as for the weights)."""
    if relative is None:
        relative = 64 * _ulp(torch.float32) * (max(1.0, reach) + math.sqrt(keys))
    for g, w in zip(got, want, strict=True):
        if (g is None) != (w is None):
            return False
        if g is not None:
            scale = float(w.abs().amax()) if w.numel() else 0.0
            if not math.isfinite(scale) or not _within(
                g.to(w.dtype), w, relative * max(scale, 1e-30)
            ):
                return False
    return True


def _rows_in_play(mask: Tensor | None, shape: torch.Size) -> Tensor | None:
    """1.0 on the query rows that keep some key in play, 0.0 on rows masked everywhere (in
    16 bits Hugging Face's -65504 swamps the scores and the row comes out uniform, in float32
    not: such rows are no paths the model uses), broadcast to ``shape``; None without a mask."""
    if mask is None:
        return None
    keeps = mask if mask.dtype == torch.bool else mask > -1e4
    return keeps.any(-1, keepdim=True).to(torch.float32).expand(shape)


def _probes(outputs: tuple, mask: Tensor | None) -> list[Tensor]:
    """Random output gradients, the same for every call of a given shape (a fixed seed), zero
    on query rows the mask takes out entirely (``_rows_in_play``)."""
    generator = torch.Generator().manual_seed(0)
    probes = []
    for o in outputs:
        if isinstance(o, Tensor):
            probe = torch.randn(o.shape, generator=generator, dtype=torch.float64).to(o.device)
            live = _rows_in_play(mask, (*o.shape[:-1], 1))
            probes.append((probe if live is None else probe * live).to(o.dtype))
    return probes


def _grads(
    outputs: tuple, inputs: list[Tensor | None], probes: list[Tensor]
) -> list[Tensor | None]:
    """The gradients of ``outputs`` for ``probes`` at each input that requires grad (None for
    the others), keeping the graph: the call's backward runs it again."""
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    outs = [o for o in outputs if isinstance(o, Tensor) and o.requires_grad]
    tensors = [o for o in outputs if isinstance(o, Tensor)]
    used = [p for o, p in zip(tensors, probes, strict=True) if o.requires_grad]
    got = iter(torch.autograd.grad(outs, wanted, used, retain_graph=True, allow_unused=True))
    return [next(got) if t is not None and t.requires_grad else None for t in inputs]


def _reach(raw: Tensor, mask: Tensor | None) -> float:
    """The largest score a row can reach: the largest finite raw score ``Q Kᵀ * scale`` (not a
    bound from norms: an outlier dimension would make that loose enough to hide a term) plus
    the mask's largest entry that keeps a key in play."""
    finite = torch.where(raw.isfinite(), raw.abs(), 0.0)
    largest = float(finite.amax()) if finite.numel() else 0.0
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(raw.dtype)
    return largest + _largest_bias(mask)
