"""Matrix products: the '+' hidden inside a matmul's backward becomes the semiring's plus."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels.blocking import BLOCK_ELEMENTS
from ..messages import OpCall, register_rule
from ..messages.message import Message
from ..messages.shared_shift import shared_shift_products
from ..semirings.base import Semiring, State

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
    constant = b if isinstance(a, Message) else a
    if constant.layout != torch.strided:
        if constant.dim() != 2:
            raise call.error(
                f"a batched product with a {constant.layout} operand has no semiring rule "
                "(2-D sparse matrices do: torch.sparse.mm, S @ x)"
            )
        if isinstance(a, Message):  # (m @ S) = (Sᵀ @ mᵀ)ᵀ
            return call.wrap(call.run_regular(), _t(_sparse_times(sr, b.t(), _t(a.parts))))
        return call.wrap(call.run_regular(), _sparse_times(sr, a, b.parts))
    if isinstance(a, Message):
        shared = shared_shift_products(sr, a.parts, right=b)
        parts = shared[0] if shared is not None else sr.matmul(a.parts, b)
    else:  # (a @ m) = (mᵀ @ aᵀ)ᵀ
        shared = shared_shift_products(sr, b.parts, left=a.transpose(-1, -2))
        parts = shared[1] if shared is not None else sr.matmul(_t(b.parts), a.transpose(-1, -2))
        parts = _t(parts)
    return call.wrap(call.run_regular(), parts)


def _sparse_times(sr: Semiring, a: Tensor, parts: State) -> State:
    """``a ⊗ m`` for a sparse constant ``a`` [n, k] (any sparse layout) and a message ``m``
    [k, d]: row i is the plus over the stored entries (i, j, v) of ``m[j] ⊗ lift(v)``, the
    rows gathered, scaled and added into place with ``index_plus`` (O(nnz * d), as a sparse
    product is: a graph network's adjacency is never densified). Entries the sparse tensor
    does not store are exact zeros, no edge; a stored 0 lifts to the semiring zero, no edge
    either; duplicate entries of an uncoalesced tensor are summed first, the one derivative
    they make."""
    coo = (a if a.layout == torch.sparse_coo else a.to_sparse_coo()).coalesce()
    (rows, cols), values = coo.indices(), coo.values()
    picked = tuple(p.index_select(0, cols) for p in parts)  # [nnz, d]
    scaled = sr.scale(picked, values.reshape(-1, *([1] * (parts[0].dim() - 1))))
    zeros = sr.zeros((a.shape[0], *parts[0].shape[1:]), values.dtype, values.device)
    return sr.index_plus(zeros, 0, rows, scaled)


@register_rule(aten.mv.default)
def mv(call: OpCall):
    """Matrix-vector product: the semiring matmul of the message with the matrix (or the
    vector)."""
    a, v = call["self"], call["vec"]
    sr = call.semiring
    if isinstance(a, Message) and isinstance(v, Message):
        raise call.error("the product of two messages has no semiring meaning")
    if isinstance(v, Message):  # out[i] = ⊕_j a[i, j] ⊗ v[j]
        weights = a.t().to(call.weight_dtype)
        parts = tuple(p[0] for p in sr.matmul(tuple(p[None] for p in v.parts), weights))
    else:
        parts = tuple(p[:, 0] for p in sr.matmul(a.parts, v[:, None].to(call.weight_dtype)))
    return call.wrap(call.run_regular(), parts)


@register_rule(aten.dot.default)
def dot(call: OpCall):
    """Dot product: each entry of one vector has one edge, weighted by the other vector's entry."""
    a, b = call["self"], call["tensor"]
    if isinstance(a, Message) and isinstance(b, Message):
        raise call.error("the product of two messages has no semiring meaning")
    msg, w = (a, b) if isinstance(a, Message) else (b, a)
    weights = w[:, None].to(call.weight_dtype)
    parts = tuple(p[0, 0] for p in call.semiring.matmul(tuple(p[None] for p in msg.parts), weights))
    return call.wrap(call.run_regular(), parts)


# --- _trilinear: torch.bilinear's three-operand product -------------------------------------------
@dataclass(frozen=True)
class TrilinearLayout:
    """How the dims of one ``_trilinear`` call relate to its message operand.

    ``_trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim)`` unsqueezes each operand at its
    ``expand`` dims, multiplies the three and sums over ``sumdim``. With one operand a message
    M and the other two P, Q, every dim d is one of: ``reduced`` (M has it, the result does
    not: the semiring's plus), ``shared`` (M and the result have it: entry to entry),
    ``spread`` (only the result has it) or ``folded`` (neither has it: a real sum inside the
    edge weight). The edge from M[s, k] to the result entry [s, n] has the weight
    E[s, k, n] = Σ over folded dims of P·Q, one edge however many terms it sums.
    """

    sizes: tuple[int, ...]
    reduced: tuple[int, ...]
    shared: tuple[int, ...]
    spread: tuple[int, ...]
    folded: tuple[int, ...]

    @classmethod
    def of(cls, shapes: list[tuple[int, ...]], message: int, sumdim) -> TrilinearLayout:
        """``shapes``: the three operands' shapes with their expand dims as 1 (same rank)."""
        sizes = tuple(max(s[d] for s in shapes) for d in range(len(shapes[0])))
        in_m = [shapes[message][d] == sizes[d] for d in range(len(sizes))]
        summed = set(sumdim)
        pick = [
            tuple(d for d in range(len(sizes)) if in_m[d] == m and (d in summed) == s)
            for m, s in ((True, True), (True, False), (False, False), (False, True))
        ]
        return cls(sizes, *pick)


def _unsqueezed(t: Tensor, expand: list[int]) -> Tensor:
    for d in sorted(expand):
        t = t.unsqueeze(d)
    return t


def trilinear_messages(
    sr: Semiring, m: State, p: Tensor, q: Tensor, layout: TrilinearLayout
) -> State:
    """The result message of ``_trilinear`` with the message ``m`` and real operands ``p``, ``q``
    (all unsqueezed to the full rank), shaped like the op's result (the non-``sumdim`` dims).

    The edge weights E [shared, reduced, spread] are built a bounded block at a time (at most
    ``BLOCK_ELEMENTS``), so a bilinear layer's per-sample [batch, out, in] weights never exist
    whole: blocks along a reduced dim meet in the semiring's plus, others are concatenated.
    """
    sizes = layout.sizes
    live = [d for d in (*layout.shared, *layout.reduced, *layout.spread) if sizes[d] > 1]
    varying = [d for d in live if d not in layout.shared or p.shape[d] > 1 or q.shape[d] > 1]
    edges = math.prod(sizes[d] for d in varying)
    if edges <= BLOCK_ELEMENTS or not live:
        return _trilinear_block(sr, m, p, q, layout)
    dim = max(live, key=lambda d: sizes[d])
    step = max(1, sizes[dim] * BLOCK_ELEMENTS // edges)
    result_dims = [d for d in range(len(sizes)) if d not in layout.reduced + layout.folded]
    pieces: list[State] = []
    for start in range(0, sizes[dim], step):
        length = min(step, sizes[dim] - start)

        def cut(t, start=start, length=length):
            return t.narrow(dim, start, length) if t.shape[dim] > 1 else t

        block = TrilinearLayout(
            tuple(length if d == dim else s for d, s in enumerate(sizes)),
            layout.reduced,
            layout.shared,
            layout.spread,
            layout.folded,
        )
        pieces.append(trilinear_messages(sr, tuple(cut(c) for c in m), cut(p), cut(q), block))
    if dim in layout.reduced:
        total = pieces[0]
        for piece in pieces[1:]:
            total = sr.plus(total, piece)
        return total
    at = result_dims.index(dim)
    return tuple(torch.cat(parts, at) for parts in zip(*pieces, strict=True))


def _trilinear_block(
    sr: Semiring, m: State, p: Tensor, q: Tensor, layout: TrilinearLayout
) -> State:
    """One block of ``trilinear_messages``: E by einsum, then one batched semiring matmul
    [shared in E, shared elsewhere, reduced] ⊗ [shared in E, reduced, spread]."""
    sizes, rank = layout.sizes, len(layout.sizes)
    kept = (*layout.shared, *layout.reduced, *layout.spread)
    weights = torch.einsum(p, list(range(rank)), q, list(range(rank)), list(kept))
    in_e = [d for d in layout.shared if weights.shape[kept.index(d)] > 1]
    rows = [d for d in layout.shared if d not in in_e]
    # E: [*in_e, reduced, spread]; the shared dims of ``rows`` have size 1 in it, and a
    # reduced dim where neither operand varies is broadcast.
    order = (*in_e, *rows, *layout.reduced, *layout.spread)
    weights = weights.permute([kept.index(d) for d in order])
    batch = [sizes[d] for d in in_e]
    k, n = math.prod(sizes[d] for d in layout.reduced), math.prod(sizes[d] for d in layout.spread)
    full = (*batch, *[1] * len(rows), *(sizes[d] for d in (*layout.reduced, *layout.spread)))
    weights = weights.expand(full).reshape(*batch, k, n)
    order = (*in_e, *rows, *layout.reduced, *layout.spread, *layout.folded)
    r = math.prod(sizes[d] for d in rows)
    a = tuple(c.permute(order).reshape(*batch, r, k) for c in m)
    out = sr.matmul(a, weights)  # [*in_e, rows, spread]
    unfolded = (*batch, *(sizes[d] for d in rows), *(sizes[d] for d in layout.spread))
    result_dims = sorted((*layout.shared, *layout.spread))
    position = (*in_e, *rows, *layout.spread)
    back = [position.index(d) for d in result_dims]
    return tuple(c.reshape(unfolded).permute(back) for c in out)


@register_rule(aten._trilinear.default)
def trilinear(call: OpCall):
    """``_trilinear`` with one message operand: torch.bilinear's backward applies it to the
    output message once per input (x1, weight, x2); the bias is a separate add."""
    operands = [call["i1"], call["i2"], call["i3"]]
    expands = [list(call["expand1"]), list(call["expand2"]), list(call["expand3"])]
    which = [j for j, t in enumerate(operands) if isinstance(t, Message)]
    if len(which) != 1:
        raise call.error("the product of two messages has no semiring meaning")
    k = which[0]
    dtype = call.weight_dtype
    full = [
        _unsqueezed(t.parts[0] if j == k else t.to(dtype), e)
        for j, (t, e) in enumerate(zip(operands, expands, strict=True))
    ]
    layout = TrilinearLayout.of([tuple(t.shape) for t in full], k, call["sumdim"])
    m = tuple(_unsqueezed(c, expands[k]) for c in operands[k].parts)
    p, q = (full[j] for j in range(3) if j != k)
    return call.wrap(call.run_regular(), trilinear_messages(call.semiring, m, p, q, layout))


@register_rule(aten._grouped_mm.default)
def grouped_mm(call: OpCall):
    """Grouped matrix products (mixture-of-experts layers), one semiring matmul per group.

    ``offs`` holds the cumulative end offsets of the groups along the grouped dim: the rows of a
    2-d ``self`` against a 3-d ``mat2`` (``out[rows_g] = self[rows_g] @ mat2[g]``), the columns of
    a 2-d ``mat2`` against a 3-d ``self``, or the shared dim of two 2-d operands (``out[g] =
    self[:, k_g] @ mat2[k_g]``); 3-d against 3-d is a batched product. Entries no group covers
    get the semiring zero, as they get no gradient.
    """
    a, b, offs = call["self"], call["mat2"], call["offs"]
    if isinstance(a, Message) and isinstance(b, Message):
        raise call.error("the product of two messages has no semiring meaning")
    if call["bias"] is not None:
        raise call.error("a grouped matmul with a bias")
    sr, dtype = call.semiring, call.weight_dtype
    left = isinstance(a, Message)

    def product(x, y) -> State:
        """x @ y with x or y the message part (a state) and the other a plain tensor."""
        if left:
            return sr.matmul(x, y.to(dtype))
        return _t(sr.matmul(_t(y), x.transpose(-1, -2).to(dtype)))

    part_a = a.parts if left else a
    part_b = b if left else b.parts

    def rows(x, where):  # slice a state or a tensor
        return tuple(p[where] for p in x) if isinstance(x, tuple) else x[where]

    ends = [] if offs is None else [int(e) for e in offs.tolist()]
    starts = [0, *ends[:-1]]
    if a.dim() == 3 and b.dim() == 3:
        parts = product(part_a, part_b)
    elif a.dim() == 2 and b.dim() == 3:
        out = call.zeros((a.shape[0], b.shape[-1]))
        for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
            piece = product(rows(part_a, slice(s, e)), rows(part_b, g))
            for o, p in zip(out, piece, strict=True):
                o[s:e] = p
        parts = out
    elif a.dim() == 3 and b.dim() == 2:
        out = call.zeros((a.shape[1], b.shape[-1]))
        for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
            piece = product(rows(part_a, g), rows(part_b, (slice(None), slice(s, e))))
            for o, p in zip(out, piece, strict=True):
                o[:, s:e] = p
        parts = out
    else:  # 2-d x 2-d: groups along the shared dim
        out = call.zeros((len(ends), a.shape[0], b.shape[-1]))
        for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
            piece = product(rows(part_a, (slice(None), slice(s, e))), rows(part_b, slice(s, e)))
            for o, p in zip(out, piece, strict=True):
                o[g] = p
        parts = out
    return call.wrap(call.run_regular(), parts)
