"""Contraction of messages with dense per-row Jacobians, built block by block.

Softmax, log-softmax and the normalisation layers couple every entry of a row with every other,
so the message to input ``j`` is ``⊕_i m_i ⊗ J_ij``. Their Jacobians have a closed form; we build
it for a bounded block of rows and columns at a time and hand each block to the semiring's
matmul, so no [rows, n, n] tensor is ever held whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..kernels.blocking import BLOCK_ELEMENTS
from ..semirings.base import Semiring, State

# jac(rows, cols) -> J[rows, n_out, cols] for a slice of rows and a slice of input columns, or,
# in log form, (log|J|, sign J) of that block
JacobianBlock = Callable[[slice, slice], Tensor]
LogJacobianBlock = Callable[[slice, slice], tuple[Tensor, Tensor]]


def contract_rows(
    sr: Semiring, m: State, jac: JacobianBlock | LogJacobianBlock, n_in: int, log_form: bool = False
) -> State:
    """``out[r, j] = ⊕_i m[r, i] ⊗ lift(J[r, i, j])`` for messages ``m`` of shape [rows, n_out].

    With ``log_form`` the blocks are ``(log|J|, sign J)`` and go through ``sr.matmul_log``."""
    rows, n_out = m[0].shape
    if rows == 0 or n_in == 0:
        return sr.zeros((rows, n_in), m[0].dtype, m[0].device)
    cols = max(1, min(n_in, BLOCK_ELEMENTS // max(1, n_out)))
    row_block = max(1, BLOCK_ELEMENTS // max(1, n_out * cols))
    out_rows = []
    for r0 in range(0, rows, row_block):
        rs = slice(r0, min(rows, r0 + row_block))
        m_blk = tuple(c[rs].unsqueeze(1) for c in m)
        blocks = (jac(rs, slice(c0, min(n_in, c0 + cols))) for c0 in range(0, n_in, cols))
        if log_form:
            pieces = [sr.matmul_log(m_blk, *block) for block in blocks]
        else:
            pieces = [sr.matmul(m_blk, block) for block in blocks]
        out_rows.append(tuple(torch.cat(p, -1).squeeze(1) for p in zip(*pieces, strict=True)))
    return tuple(torch.cat(p, 0) for p in zip(*out_rows, strict=True))


def identity_block(n: int, cols: slice, dtype: torch.dtype, device) -> Tensor:
    """δ_ij for i in [0, n) and j in ``cols``, as a [n, len(cols)] 0/1 tensor."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(cols.start, cols.stop, device=device)[None, :]
    return (i == j).to(dtype)


def rows_last(x: Tensor, dim: int) -> Tensor:
    """Move ``dim`` last and flatten the rest into rows: [rows, n] (the rows counted, not
    inferred: with n = 0 a -1 would be ambiguous)."""
    rows = math.prod(size for d, size in enumerate(x.shape) if d != dim % x.dim())
    return x.movedim(dim, -1).reshape(rows, x.shape[dim])


def unrows(x: Tensor, like_shape, dim: int) -> Tensor:
    """Inverse of ``rows_last`` for a tensor shaped like the original."""
    moved = list(like_shape)
    n = moved.pop(dim)
    return x.reshape(*moved, n).movedim(-1, dim)
