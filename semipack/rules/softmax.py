"""softmax and log_softmax: dense per-row Jacobians with a closed form.

Built-in semirings take the O(n)-per-row kernels of ``kernels.rowwise`` (diagonal plus rank-one
structure); other semirings contract the dense Jacobian block by block. Both take the Jacobian
in log form from log-probabilities (see ``kernels.rowwise``): exact for log_softmax (its output
is the log-probabilities) and for a softmax whose input was recorded during the forward
(``transport.saved_inputs``); otherwise the log of the softmax output.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..graph.saved_inputs import recorded_input
from ..messages import OpCall, register_rule
from ..messages.jacobian import contract_rows, identity_block, rows_last, unrows
from ..messages.rowwise import (
    log_complement,
    log_softmax_messages,
    softmax_messages,
)
from ..semirings.base import NO_EDGE_LOG, Semiring, State, cut_vanishing

aten = torch.ops.aten


def softmax_contract(
    sr: Semiring, m: State, probs: Tensor, log_probs: Tensor | None = None
) -> State:
    """Messages through softmax rows: ∂y_i/∂x_j = y_i (δ_ij - y_j); ``m``, ``probs`` and the
    exact ``log_probs`` where known: [rows, n].

    The O(n) forms multiply each ``y_j`` by a sum over the row's other entries, which cannot cut
    a single pair: an off-diagonal edge ``y_i y_j`` below any float (``NO_EDGE_LOG``: two
    probabilities under e^-372, from scores hundreds of nats apart) is no edge, but its two
    factors each are one. The rows that hold such a pair (found from their two smallest
    log-probabilities; rare) take the dense Jacobian, which cuts each pair (trial 63: LogSum,
    Boolean and Entropy gave a key an edge of e^-1118)."""
    fast = softmax_messages(sr, m, probs, log_probs)
    if fast is None:
        return softmax_contract_dense(sr, m, probs, log_probs)
    rows = None if sr.linear_weights else _rows_with_vanishing_pairs(probs, log_probs)
    if rows is None:
        return fast
    dense = softmax_contract_dense(
        sr,
        tuple(p[rows] for p in m),
        probs[rows],
        None if log_probs is None else log_probs[rows],
    )
    return tuple(f.index_put((rows,), d) for f, d in zip(fast, dense, strict=True))


def _rows_with_vanishing_pairs(probs: Tensor, log_probs: Tensor | None) -> Tensor | None:
    """The indices of the rows ([rows, n]) in which two entries' log-probabilities sum below
    ``NO_EDGE_LOG`` (their off-diagonal edge is no edge), or None if there is none. Entries
    already without an edge (``-inf``) do not count."""
    if probs.shape[-1] < 2 or probs.numel() == 0:
        return None
    lp = probs.log() if log_probs is None else log_probs.to(probs.dtype)
    # entries without an edge (-inf) and NaN entries (another row's NaN must not switch the
    # check off for every row: amin would be NaN) do not count: one pass sets both to +inf
    finite = lp.nan_to_num(nan=math.inf, neginf=math.inf)
    if not bool(2 * finite.amin() < NO_EDGE_LOG):  # every pair far above: nothing to cut
        return None
    smallest = finite.topk(2, dim=-1, largest=False).values.sum(-1)
    rows = (smallest < NO_EDGE_LOG).nonzero()[:, 0]
    return rows if rows.numel() else None


def log_softmax_contract(sr: Semiring, m: State, log_probs: Tensor) -> State:
    """Messages through log_softmax rows: ∂y_i/∂x_j = δ_ij - p_j."""
    fast = log_softmax_messages(sr, m, log_probs)
    return fast if fast is not None else log_softmax_contract_dense(sr, m, log_probs)


def _signed_diagonal(lp_rows: Tensor, diag: Tensor, off: Tensor, cols: slice) -> tuple:
    """(log|J|, sign J) of a block whose diagonal is ``diag`` (>= 0) and whose off-diagonal
    entries are ``-exp(off)``; [rows, n, cols]."""
    n = lp_rows.shape[-1]
    eye = identity_block(n, cols, torch.bool, lp_rows.device)[None]
    log = torch.where(eye, diag, off)
    return log, torch.where(eye, 1.0, -1.0).to(log.dtype).expand(log.shape)


def softmax_contract_dense(
    sr: Semiring, m: State, probs: Tensor, log_probs: Tensor | None = None
) -> State:
    """``softmax_contract`` through the dense Jacobian: correct for every semiring, O(n^2).
    Real takes the linear Jacobian, the others its log form (through ``matmul_log``)."""
    n = probs.shape[-1]
    if sr.linear_weights:

        def jac(rows: slice, cols: slice) -> Tensor:
            y = probs[rows]
            eye = identity_block(n, cols, y.dtype, y.device)
            return y[:, :, None] * (eye[None] - y[:, None, cols])

        return contract_rows(sr, m, jac, n)
    lp = probs.log() if log_probs is None else log_probs.to(probs.dtype)
    complement = log_complement(lp)

    def log_jac(rows: slice, cols: slice) -> tuple[Tensor, Tensor]:
        # log J_ij = lp_i + (log(1 - p_j) if i == j else lp_j)
        lp_r = lp[rows]
        diag = cut_vanishing(lp_r[:, :, None] + complement[rows, None, cols], in_place=True)
        off = cut_vanishing(lp_r[:, :, None] + lp_r[:, None, cols], in_place=True)
        return _signed_diagonal(lp_r, diag, off, cols)

    return contract_rows(sr, m, log_jac, n, log_form=True)


def log_softmax_contract_dense(sr: Semiring, m: State, log_probs: Tensor) -> State:
    """``log_softmax_contract`` through the dense Jacobian: correct for every semiring."""
    n = log_probs.shape[-1]
    if sr.linear_weights:
        probs = log_probs.exp()

        def jac(rows: slice, cols: slice) -> Tensor:
            eye = identity_block(n, cols, probs.dtype, probs.device)
            return (eye[None] - probs[rows, None, cols]).expand(probs[rows].shape[0], n, -1)

        return contract_rows(sr, m, jac, n)
    complement = log_complement(log_probs)

    def log_jac(rows: slice, cols: slice) -> tuple[Tensor, Tensor]:
        # log|J_ij| = log(1 - p_j) if i == j else lp_j
        lp_r = log_probs[rows]
        shape = (lp_r.shape[0], n, cols.stop - cols.start)
        diag = complement[rows, None, cols].expand(shape)
        off = lp_r[:, None, cols].expand(shape)
        return _signed_diagonal(lp_r, diag, off, cols)

    return contract_rows(sr, m, log_jac, n, log_form=True)


def exact_log_softmax(x: Tensor, dim: int) -> Tensor:
    """log_softmax along ``dim`` for the edge weights, as the forward's softmax sees the row.

    PyTorch's own ``log_softmax`` shifts by the row maximum first, so a row of equal scores
    (a query whose every key carries the same huge negative mask value, which the forward's
    softmax turns into uniform weights) gets exactly ``-log n``, never ``0``. A row whose every
    input is ``-inf`` (fully masked: the probabilities are structurally 0, not undefined) gets
    ``-inf`` (no edges) instead of NaN; a NaN input stays NaN. Log-weights too small for any
    float (a mask value of -1e4 or ``finfo.min``, see ``semirings.base.NO_EDGE_LOG``) are cut
    here to ``-inf``, so the attention kernels see a masked key exactly as a ``-inf`` mask.
    """
    out = torch.log_softmax(x, dim)
    masked = (x == float("-inf")).all(dim, keepdim=True)
    return cut_vanishing(out.masked_fill_(masked, float("-inf")), in_place=True)


def _rowwise(
    call: OpCall, contract, log_probs: Tensor | None = None, output: Tensor | None = None
) -> object:
    """Run ``contract`` on rows along ``dim`` of the op's output (or the given ``output``)."""
    msg, out, dim = call["grad_output"], call["output"], call["dim"] % call["output"].dim()
    if out.numel() == 0:  # empty rows (attention over no key): no entry, no edge
        return call.wrap(call.run_regular(), call.zeros(tuple(out.shape)))
    out = out.to(call.weight_dtype) if output is None else output
    m = tuple(rows_last(p, dim) for p in msg.parts)
    extra = () if log_probs is None else (rows_last(log_probs, dim),)
    parts = contract(call.semiring, m, rows_last(out, dim), *extra)
    parts = tuple(unrows(p, out.shape, dim) for p in parts)
    return call.wrap(call.run_regular(), parts)


@register_rule(aten._softmax_backward_data.default)
def softmax_backward(call: OpCall):
    """Softmax's backward: the row's Jacobian ``p_i (δ_ij - p_j)`` in its structured form
    (never built densely for the built-in semirings), exact in log space from the recorded input."""
    log_probs = None
    if not call.semiring.linear_weights:
        x = recorded_input("SoftmaxBackward0", call["output"])
        if x is not None:
            log_probs = exact_log_softmax(x.to(call.weight_dtype), call["dim"])
    return _rowwise(call, softmax_contract, log_probs)


@register_rule(aten._log_softmax_backward_data.default)
def log_softmax_backward(call: OpCall):
    """Log-softmax's backward: the Jacobian ``δ_ij - p_j`` in its structured form."""
    if call.semiring.linear_weights:
        return _rowwise(call, log_softmax_contract)
    # The output is the exact log-probabilities (vanishing ones are cut by the semiring).
    return _rowwise(call, log_softmax_contract, output=call["output"].to(call.weight_dtype))
