"""Softmax and log-softmax messages in O(n) per row, from the structure of their Jacobians.

Both Jacobians are a diagonal plus a rank-one off-diagonal part whose edge weights factor:

* softmax, y = softmax(x):  J_ij = y_i (δ_ij - y_j), so J_jj = y_j (1 - y_j) >= 0 and, for
  i != j, J_ij = y_i * (-y_j): a positive factor of the output entry i times a negative one of
  the input entry j.
* log_softmax, p = exp(y):  J_ij = δ_ij - p_j, so J_jj = 1 - p_j >= 0 and J_ij = 1 * (-p_j).

Every built-in semiring lifts products to products (lift(ab) = lift(a) ⊗ lift(b), with exact
zeros lifting to the semiring zero), so by distributivity

    out_j = (m_j ⊗ lift(D_j))  ⊕  (X_j ⊗ lift(C_j)),    X_j = ⊕_{i != j} m_i ⊗ lift(A_i)

with (D, A, C) = (y(1 - y), y, -y) for softmax and (1 - p, 1, -p) for log_softmax. The only
semiring-specific piece is the *exclusive* row reduction X (everything but entry j),
``Semiring.exclusive_plus``, which each built-in semiring computes in O(n) without subtracting
its own term from a total (that would cancel catastrophically for max-like semirings and for a
dominant term in sums): from the top two entries of the row (``kernels.exclusive``). A semiring
without one, or whose lift is not multiplicative (``Semiring.lift_is_multiplicative``), gets
``None`` and the caller uses the dense Jacobian. A semiring may also answer the whole row with
its own formula or kernel (``softmax_closed_form``: Real's is autograd's own formula, LogSum's
a hand-written float32 kernel).

The weights enter in log form (``Semiring.scale_log``) from the *log*-probabilities: a
probability of 1e-50 underflows float32 but its log does not, and 1 - p_j is never formed (it
is 0 in float32 as soon as p_j > 1 - 6e-8): log(1 - p_j) = log Σ_{i != j} p_i, the exclusive
log-sum-exp of the log-probabilities. Callers pass exact log-probabilities where they know them
(log_softmax's output, attention scores, a recorded softmax input), else the log of the
probabilities.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from ..kernels.compiled import compile_enabled, compiled
from ..kernels.exclusive import (
    exclusive_logsumexp,
    exclusive_max,
    exclusive_min,
    log_complement,
    top_two,
)
from ..semirings import Semiring, State
from ..semirings.base import kernel_owner

__all__ = [
    "COMPILE_MIN_ENTRIES",
    "exclusive_logsumexp",
    "exclusive_max",
    "exclusive_min",
    "has_fast_rowwise",
    "log_complement",
    "log_softmax_messages",
    "softmax_from_log_probs",
    "softmax_messages",
    "top_two",
]

#: Use the compiled softmax kernel from this many entries up (below, eager is fast enough and
#: compiling would not pay off).
COMPILE_MIN_ENTRIES = 1 << 18


def has_fast_rowwise(sr: Semiring) -> bool:
    """True when the diagonal-plus-rank-one form applies to ``sr``: an O(n) exclusive row
    reduction and a multiplicative lift."""
    overridden = type(sr).exclusive_plus is not Semiring.exclusive_plus
    return overridden and sr.lift_is_multiplicative()


# --- softmax and log_softmax ---------------------------------------------------------------------
def _diag_plus_rank_one(
    sr: Semiring,
    m: State,
    log_diag: Tensor,
    log_out_factor: Tensor | None,
    log_in_factor: Tensor,
) -> State | None:
    """``out_j = m_j ⊗ D_j ⊕ (⊕_{i != j} m_i ⊗ A_i) ⊗ C_j`` with log D = ``log_diag`` (D >= 0),
    log A = ``log_out_factor`` (None for all ones, A >= 0) and log|C| = ``log_in_factor`` with
    C <= 0; None where ``sr.exclusive_plus`` has no answer."""
    through = m if log_out_factor is None else sr.scale_log(m, log_out_factor)
    others = sr.exclusive_plus(through)
    if others is None:
        return None
    return sr.plus(sr.scale_log(m, log_diag), sr.scale_log(others, log_in_factor, -1.0))


def softmax_from_log_probs(sr: Semiring, m: State, log_probs: Tensor) -> State | None:
    """Softmax messages of a semiring with ``exclusive_plus`` from the rows' log-probabilities
    ([rows, n]): log J_jj = lp_j + log(1 - p_j);  J_ij = p_i * (-p_j) for i != j."""
    log_diag = log_probs + log_complement(log_probs)
    return _diag_plus_rank_one(sr, m, log_diag, log_probs, log_probs)


@functools.cache
def compiled_softmax(owner: type[Semiring]) -> Callable[..., State]:
    """``softmax_from_log_probs`` as one compiled kernel (inductor fuses the ~20 elementwise
    passes and row reductions of the eager form into a few loops), for the semirings whose
    ``compiles_rowwise`` says so; built once per built-in class (``kernel_owner``), from a
    fresh instance."""
    sr = owner()
    name = owner.__name__

    def kernel(*args: Tensor) -> State:
        *m, log_probs = args
        return softmax_from_log_probs(sr, tuple(m), log_probs)

    kernel.__name__ = kernel.__qualname__ = f"softmax_{name}"
    return compiled(kernel)


def softmax_messages(
    sr: Semiring, m: State, probs: Tensor, log_probs: Tensor | None = None
) -> State | None:
    """Messages through softmax rows (``m``, ``probs``, ``log_probs``: [rows, n]); None without
    a fast path. ``log_probs`` are the exact log-probabilities where the caller knows them (else
    ``log(probs)``, which is -inf where a probability underflowed)."""
    probs = probs.to(m[0].dtype) if m[0].is_floating_point() else probs
    own = sr.softmax_closed_form(m, probs, log_probs)
    if own is not None:
        return own
    if not has_fast_rowwise(sr) or probs.shape[-1] == 0:
        return None
    log_probs = probs.log() if log_probs is None else log_probs.to(probs.dtype)
    big = log_probs.numel() >= COMPILE_MIN_ENTRIES
    owner = kernel_owner(sr, "compiles_rowwise") if sr.compiles_rowwise() else None
    if isinstance(owner, type) and compile_enabled() and big:  # none kept for an instance
        kernel = compiled_softmax(owner)
        with torch.no_grad():
            return tuple(kernel(*(c.contiguous() for c in m), log_probs.contiguous()))
    return softmax_from_log_probs(sr, m, log_probs)


def log_softmax_messages(sr: Semiring, m: State, log_probs: Tensor) -> State | None:
    """Messages through log_softmax rows (``m``, ``log_probs``: [rows, n]); None without a fast
    path."""
    if m[0].is_floating_point():
        log_probs = log_probs.to(m[0].dtype)
    own = sr.log_softmax_closed_form(m, log_probs)
    if own is not None:
        return own
    if not has_fast_rowwise(sr) or log_probs.shape[-1] == 0:
        return None
    # J_jj = 1 - p_j = Σ_{i != j} p_i;  J_ij = 1 * (-p_j) for i != j.
    return _diag_plus_rank_one(sr, m, log_complement(log_probs), None, log_probs)
