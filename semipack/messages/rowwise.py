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
semiring-specific piece is the *exclusive* row reduction X (everything but entry j), which each
built-in semiring computes in O(n) without subtracting its own term from a total (that would
cancel catastrophically for max-like semirings and for a dominant term in sums): from the top
two entries of the row. A semiring class not in ``EXCLUSIVE_REDUCTIONS`` (user-defined ones,
whose lift need not be multiplicative) gets ``None`` and the caller uses the dense Jacobian.

The weights enter in log form (``Semiring.scale_log``) from the *log*-probabilities: a
probability of 1e-50 underflows float32 but its log does not, and 1 - p_j is never formed (it
is 0 in float32 as soon as p_j > 1 - 6e-8): log(1 - p_j) = log Σ_{i != j} p_i, the exclusive
log-sum-exp of the log-probabilities. Callers pass exact log-probabilities where they know them
(log_softmax's output, attention scores, a recorded softmax input), else the log of the
probabilities.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..kernels.compiled import compile_enabled, compiled
from ..kernels.native import native_available, softmax_log_sum_f32
from ..semirings import (
    Boolean,
    Entropy,
    LogCount,
    LogSum,
    MaxProd,
    Real,
    Semiring,
    SignedMaxProd,
    State,
)
from ..semirings._log import finite_or_zero

INF = float("inf")

#: ``X_j = ⊕_{i != j} a_i`` along the last dim of every component of a [rows, n] state.
ExclusiveReduce = Callable[[State], State]


# --- exclusive reductions ------------------------------------------------------------------------
def top_two(a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per row: the largest value, its index and the largest value of the *other* entries.

    Returns ``(first, index, second)``, each [rows, 1]; ``second`` is ``-inf`` for rows of one
    entry. Ties keep both: the second of two equal maxima equals the first.
    """
    first, index = a.max(-1, keepdim=True)
    second = torch.where(_is_top(a, index), -INF, a).amax(-1, keepdim=True)
    return first, index, second


def _is_top(a: Tensor, index: Tensor) -> Tensor:
    """Boolean [rows, n] mask of the entry ``index`` of each row (a comparison, not a scatter,
    so that inductor fuses it into the surrounding loops)."""
    return torch.arange(a.shape[-1], device=a.device) == index


def exclusive_max(a: Tensor) -> Tensor:
    """``out_j = max_{i != j} a_i``: the row max, except at the argmax, where it is the second."""
    first, index, second = top_two(a)
    return torch.where(_is_top(a, index), second, first)


def exclusive_min(a: Tensor) -> Tensor:
    """``out_j = min_{i != j} a_i`` (``+inf`` for rows of one entry)."""
    return -exclusive_max(-a)


def exclusive_logsumexp(a: Tensor, b: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """``L_j = log Σ_{i != j} exp(a_i)`` and, given ``b``, the weighted mean
    ``B_j = Σ_{i != j} exp(a_i) b_i / Σ_{i != j} exp(a_i)`` (0 where the sum is empty).

    Let k be the argmax of a row, ``first = a_k`` and ``second`` the max over i != k. Shifting
    by ``second``, e_i = exp(a_i - second) <= 1 for i != k (e_k := 0), S = Σ e_i, T = Σ e_i b_i:

    * j == k: L_k = second + log S and B_k = T / S (the sum simply leaves out the top entry);
    * j != k: with r = exp(second - first) <= 1,
      L_j = first + log1p(r (S - e_j)),  B_j = (b_k + r (T - e_j b_j)) / (1 + r (S - e_j)).

    The only subtraction, S - e_j, is taken with the top entry's own 1 in the denominator next
    to it and e_j <= 1, so its rounding error is O(eps) relative to the result: no cancellation
    even when one entry dominates the row (where ``log(total - own)`` would lose everything).
    """
    first, index, second = top_two(a)
    top = _is_top(a, index)
    shift = finite_or_zero(second)
    e = torch.where(top, 0.0, (a - shift).exp())
    s = e.sum(-1, keepdim=True)
    rest = (s - e).clamp_min(0.0)
    ratio = torch.where(torch.isfinite(second), (second - finite_or_zero(first)).exp(), 0.0)
    ratio_rest = ratio * rest
    lse = torch.where(top, shift + s.log(), first + ratio_rest.log1p())
    if b is None:
        return lse, None
    eb = torch.where(e > 0, e * b, 0.0)
    t = eb.sum(-1, keepdim=True)
    b_top = torch.where(torch.isfinite(first), b.gather(-1, index), 0.0)
    mean_top = torch.where(s > 0, t / torch.where(s > 0, s, 1.0), 0.0)
    mean_other = (b_top + ratio * (t - eb)) / (1.0 + ratio_rest)
    return lse, torch.where(top, mean_top, mean_other)


def log_complement(log_probs: Tensor) -> Tensor:
    """``log(1 - p_j) = log Σ_{i != j} p_i`` per row of log-probabilities ([rows, n]): ``-inf``
    exactly where every other probability is 0 (the only entry of a row)."""
    return exclusive_logsumexp(log_probs)[0]


def _exclusive_max_prod(a: State) -> State:
    return (exclusive_max(a[0]),)


def _exclusive_signed(a: State) -> State:
    # Largest magnitudes are maxima, smallest magnitudes minima, separately for each sign.
    return (exclusive_max(a[0]), exclusive_max(a[1]), exclusive_min(a[2]), exclusive_min(a[3]))


def _exclusive_log_sum(a: State) -> State:
    return (exclusive_logsumexp(a[0])[0],)


def _exclusive_entropy(a: State) -> State:
    # ⊕ of (L_i, R_i): L = log Σ exp(L_i), R = Σ exp(L_i) R_i / Σ exp(L_i).
    lse, mean = exclusive_logsumexp(a[0], a[1])
    return (lse, mean)


def _exclusive_boolean(a: State) -> State:
    # Exact integer counts: some other entry is true iff the row count exceeds this entry's own.
    own = a[0].to(torch.int32)
    return (own.sum(-1, keepdim=True) - own > 0,)


#: Exclusive row reductions by exact semiring class (subclasses may change lift or plus).
EXCLUSIVE_REDUCTIONS: dict[type[Semiring], ExclusiveReduce] = {
    MaxProd: _exclusive_max_prod,
    SignedMaxProd: _exclusive_signed,
    LogSum: _exclusive_log_sum,
    LogCount: _exclusive_log_sum,
    Entropy: _exclusive_entropy,
    Boolean: _exclusive_boolean,
}


def has_fast_rowwise(sr: Semiring) -> bool:
    """True when softmax / log_softmax messages of ``sr`` have an O(n) kernel here."""
    return type(sr) is Real or type(sr) in EXCLUSIVE_REDUCTIONS


# --- softmax and log_softmax ---------------------------------------------------------------------
def _diag_plus_rank_one(
    sr: Semiring,
    exclusive: ExclusiveReduce,
    m: State,
    log_diag: Tensor,
    log_out_factor: Tensor | None,
    log_in_factor: Tensor,
) -> State:
    """``out_j = m_j ⊗ D_j ⊕ (⊕_{i != j} m_i ⊗ A_i) ⊗ C_j`` with log D = ``log_diag`` (D >= 0),
    log A = ``log_out_factor`` (None for all ones, A >= 0) and log|C| = ``log_in_factor`` with
    C <= 0."""
    through = m if log_out_factor is None else sr.scale_log(m, log_out_factor)
    return sr.plus(sr.scale_log(m, log_diag), sr.scale_log(exclusive(through), log_in_factor, -1.0))


def softmax_from_log_probs(sr: Semiring, m: State, log_probs: Tensor) -> State:
    """Softmax messages of a built-in semiring from the rows' log-probabilities ([rows, n]):
    log J_jj = lp_j + log(1 - p_j);  J_ij = p_i * (-p_j) for i != j."""
    exclusive = EXCLUSIVE_REDUCTIONS[type(sr)]
    log_diag = log_probs + log_complement(log_probs)
    return _diag_plus_rank_one(sr, exclusive, m, log_diag, log_probs, log_probs)


def _compiled_softmax(semiring_class: type[Semiring]) -> Callable[..., State]:
    sr = semiring_class()

    def kernel(*args: Tensor) -> State:
        *m, log_probs = args
        return softmax_from_log_probs(sr, tuple(m), log_probs)

    kernel.__name__ = kernel.__qualname__ = f"softmax_{semiring_class.__name__}"
    return compiled(kernel)


#: Softmax messages as one compiled kernel (inductor fuses the ~20 elementwise passes and row
#: reductions of the eager form into a few loops), for the semirings whose messages are floats.
COMPILED_SOFTMAX: dict[type[Semiring], Callable[..., State]] = {
    cls: _compiled_softmax(cls) for cls in (MaxProd, LogSum, LogCount, Entropy)
}

#: Use the compiled softmax kernel from this many entries up (below, eager is fast enough and
#: compiling would not pay off).
COMPILE_MIN_ENTRIES = 1 << 18


def softmax_messages(
    sr: Semiring, m: State, probs: Tensor, log_probs: Tensor | None = None
) -> State | None:
    """Messages through softmax rows (``m``, ``probs``, ``log_probs``: [rows, n]); None without
    a fast path. ``log_probs`` are the exact log-probabilities where the caller knows them (else
    ``log(probs)``, which is -inf where a probability underflowed)."""
    probs = probs.to(m[0].dtype) if m[0].is_floating_point() else probs
    if type(sr) is Real:
        # Σ_i m_i y_i (δ_ij - y_j) = y_j (m_j - Σ_i m_i y_i): autograd's own formula.
        return (probs * (m[0] - (m[0] * probs).sum(-1, keepdim=True)),)
    if type(sr) not in EXCLUSIVE_REDUCTIONS or probs.shape[-1] == 0:
        return None
    log_probs = probs.log() if log_probs is None else log_probs.to(probs.dtype)
    if _native_softmax(sr, m, log_probs):
        return (softmax_log_sum_f32(m[0], log_probs),)
    kernel = COMPILED_SOFTMAX.get(type(sr))
    if kernel is not None and compile_enabled() and log_probs.numel() >= COMPILE_MIN_ENTRIES:
        with torch.no_grad():
            return tuple(kernel(*(c.contiguous() for c in m), log_probs.contiguous()))
    return softmax_from_log_probs(sr, m, log_probs)


#: Use the native LogSum softmax kernel from this many entries up.
NATIVE_MIN_ENTRIES = 1 << 12


def _native_softmax(sr: Semiring, m: State, log_probs: Tensor) -> bool:
    """LogSum on float32 CPU rows without NaN takes the hand-written kernel (native/softmax.c)."""
    return (
        type(sr) is LogSum
        and m[0].dtype == log_probs.dtype == torch.float32
        and m[0].device.type == "cpu"
        and log_probs.numel() >= NATIVE_MIN_ENTRIES
        and native_available()
        and not bool(torch.isnan(m[0]).any() or torch.isnan(log_probs).any())
    )


def log_softmax_messages(sr: Semiring, m: State, log_probs: Tensor) -> State | None:
    """Messages through log_softmax rows (``m``, ``log_probs``: [rows, n]); None without a fast
    path."""
    if m[0].is_floating_point():
        log_probs = log_probs.to(m[0].dtype)
    if type(sr) is Real:
        # Σ_i m_i (δ_ij - p_j) = m_j - p_j Σ_i m_i: autograd's own formula.
        return (m[0] - log_probs.exp() * m[0].sum(-1, keepdim=True),)
    exclusive = EXCLUSIVE_REDUCTIONS.get(type(sr))
    if exclusive is None or log_probs.shape[-1] == 0:
        return None
    # J_jj = 1 - p_j = Σ_{i != j} p_i;  J_ij = 1 * (-p_j) for i != j.
    return _diag_plus_rank_one(sr, exclusive, m, log_complement(log_probs), None, log_probs)
