"""softmax and log_softmax: dense per-row Jacobians with a closed form.

Built-in semirings take the O(n)-per-row kernels of ``kernels.rowwise`` (diagonal plus rank-one
structure); other semirings contract the dense Jacobian block by block.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.rowwise import log_softmax_messages, softmax_messages
from ..semirings.base import Semiring, State
from .jacobian import contract_rows, identity_block, rows_last, unrows
from .registry import OpCall, register_rule

aten = torch.ops.aten


def softmax_contract(sr: Semiring, m: State, probs: Tensor) -> State:
    """Messages through softmax rows: ∂y_i/∂x_j = y_i (δ_ij - y_j); ``m``, ``probs``: [rows, n]."""
    fast = softmax_messages(sr, m, probs)
    return fast if fast is not None else softmax_contract_dense(sr, m, probs)


def log_softmax_contract(sr: Semiring, m: State, log_probs: Tensor) -> State:
    """Messages through log_softmax rows: ∂y_i/∂x_j = δ_ij - p_j."""
    fast = log_softmax_messages(sr, m, log_probs)
    return fast if fast is not None else log_softmax_contract_dense(sr, m, log_probs)


def softmax_contract_dense(sr: Semiring, m: State, probs: Tensor) -> State:
    """``softmax_contract`` through the dense Jacobian: correct for every semiring, O(n^2)."""
    n = probs.shape[-1]

    def jac(rows: slice, cols: slice) -> Tensor:
        y = probs[rows]
        eye = identity_block(n, cols, y.dtype, y.device)
        return y[:, :, None] * (eye[None] - y[:, None, cols])

    return contract_rows(sr, m, jac, n)


def log_softmax_contract_dense(sr: Semiring, m: State, log_probs: Tensor) -> State:
    """``log_softmax_contract`` through the dense Jacobian: correct for every semiring."""
    n = log_probs.shape[-1]
    probs = log_probs.exp()

    def jac(rows: slice, cols: slice) -> Tensor:
        eye = identity_block(n, cols, probs.dtype, probs.device)
        return (eye[None] - probs[rows, None, cols]).expand(probs[rows].shape[0], n, -1)

    return contract_rows(sr, m, jac, n)


def _rowwise(call: OpCall, contract) -> object:
    msg, out, dim = call["grad_output"], call["output"], call["dim"] % call["output"].dim()
    dtype = call.weight_dtype
    m = tuple(rows_last(p, dim) for p in msg.parts)
    parts = contract(call.semiring, m, rows_last(out.to(dtype), dim))
    parts = tuple(unrows(p, out.shape, dim) for p in parts)
    return call.wrap(call.run_real(), parts)


@register_rule(aten._softmax_backward_data.default)
def softmax_backward(call: OpCall):
    return _rowwise(call, softmax_contract)


@register_rule(aten._log_softmax_backward_data.default)
def log_softmax_backward(call: OpCall):
    return _rowwise(call, log_softmax_contract)
