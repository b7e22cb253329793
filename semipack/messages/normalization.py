"""Fused layer_norm / batch_norm (train) messages: the Jacobian is built inside the reduction.

With x̂ = (x - mean) * rstd over the n entries of a row and y_i = g_i x̂_i + b_i,

    J_ij = g_i * rstd * J'_ij,    J'_ij = δ_ij - (1 + x̂_i x̂_j) / n,

where g is per entry (layer_norm) or one value per row (batch_norm's channel). Every built-in
semiring lifts products to products, so the gain is applied to the messages first
(m'_i = m_i ⊗ lift(g_i)), the rstd (and a per-row gain) to the result last, and only

    out'_rj = ⊕_i m'_ri ⊗ lift(J'_rij)

needs the O(n^2) pairs. Each kernel below writes it as a broadcast over [rows, j, i] reduced
over the contiguous last index i; inductor fuses the broadcast into its reduction loop, so no
[rows, n, n] tensor exists. The log-space semirings work in the linear domain after shifting
each row by its largest message M_r: a_ri = exp(m'_ri - M_r) <= 1 and

    MaxProd  out'_rj = M_r + log max_i a_ri |J'_rij|
    LogSum   out'_rj = M_r + log Σ_i a_ri |J'_rij|
    LogCount out'_rj = M_r + log Σ_i a_ri [J'_rij != 0]

(the same shift the semirings' own BLAS matmuls use; for MaxProd an entry more than ~87 nats
(float32) below its row max underflows to "no path", which changes the result only if every
entry within that range has J'_rij exactly 0). Below ``COMPILE_MIN_PAIRS`` pairs, with
compilation switched off, or for other semirings, ``normalized_messages`` returns None and the
caller contracts the dense Jacobian (``contract_rows``), which is also each kernel's eager
fallback.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..kernels.compiled import compile_enabled, compiled
from ..kernels.native import native_available, norm_abs_reduce_f32, norm_entropy_sums_f32
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
from ..semirings._log import finite_or_zero, shifted_exp
from .jacobian import contract_rows, identity_block

INF = float("inf")

#: Use the compiled kernels from this many (row, i, j) pairs up: below it the dense contraction
#: is fast enough, and compiling (seconds, once per semiring and dtype) would not pay off.
COMPILE_MIN_PAIRS = 1 << 24


# --- the fused expressions (handed to inductor) --------------------------------------------------
def centred_pairs(x_hat: Tensor) -> Tensor:
    """``J'[r, j, i] = δ_ij - (1 + x̂_ri x̂_rj) / n`` as a broadcast expression (symmetric in i, j).

    Inside a compiled kernel this is never materialised; the diagonal is a ``where`` on indices.
    """
    n = x_hat.shape[-1]
    idx = torch.arange(n, device=x_hat.device)
    eye = (idx[:, None] == idx[None, :]).to(x_hat.dtype)
    return eye - (1.0 + x_hat[:, :, None] * x_hat[:, None, :]) / n


def pair_magnitudes(x_hat: Tensor) -> Tensor:
    """``|1 + x̂_ri x̂_rj|`` for every pair, the diagonal included (no index test in the loop:
    a ``where`` on indices keeps inductor from vectorising the reduction, ~4x slower)."""
    return (1.0 + x_hat[:, None, :] * x_hat[:, :, None]).abs()


def _diagonal_terms(a: Tensor, x_hat: Tensor) -> tuple[Tensor, Tensor]:
    """(wrong, right) i = j terms: what the off-diagonal formula puts there, |1 + x̂_j²| / n, and
    the true |J'_jj| = |1 - (1 + x̂_j²) / n|, both times a_j.

    For every column with x̂_j² <= (n - 2) / 2 the wrong term is at most the right one, so a max
    over all i already gives the exact answer and a sum corrected by (right - wrong) loses no
    precision; the (at most two per row) other columns are recomputed by ``_fix_outliers``.
    """
    n = x_hat.shape[-1]
    off = (1.0 + x_hat * x_hat) / n
    return a * off, a * (1.0 - off).abs()


def _max_prod_fused(m: Tensor, x_hat: Tensor) -> tuple[Tensor]:
    a, shift = shifted_exp(m, -1)
    return _max_prod_from_best(a, shift, x_hat, (a[:, None, :] * pair_magnitudes(x_hat)).amax(-1))


def _max_prod_native(m: Tensor, x_hat: Tensor) -> tuple[Tensor]:
    a, shift = shifted_exp(m, -1)
    return _max_prod_from_best(a, shift, x_hat, norm_abs_reduce_f32(a, x_hat, reduce_max=True))


def _max_prod_from_best(a: Tensor, shift: Tensor, x_hat: Tensor, best: Tensor) -> tuple[Tensor]:
    """``best`` = max_i a_i |1 + x̂_i x̂_j|; the true diagonal term is never below the one it
    holds (outside the outlier columns), so one more maximum makes it exact."""
    _, right = _diagonal_terms(a, x_hat)
    return (torch.maximum(best / x_hat.shape[-1], right).log() + shift,)


def _log_sum_fused(m: Tensor, x_hat: Tensor) -> tuple[Tensor]:
    a, shift = shifted_exp(m, -1)
    return _log_sum_from_total(a, shift, x_hat, (a[:, None, :] * pair_magnitudes(x_hat)).sum(-1))


def _log_sum_native(m: Tensor, x_hat: Tensor) -> tuple[Tensor]:
    a, shift = shifted_exp(m, -1)
    return _log_sum_from_total(a, shift, x_hat, norm_abs_reduce_f32(a, x_hat, reduce_max=False))


def _log_sum_from_total(a: Tensor, shift: Tensor, x_hat: Tensor, total: Tensor) -> tuple[Tensor]:
    """``total`` = Σ_i a_i |1 + x̂_i x̂_j|, the diagonal included with the off-diagonal formula."""
    wrong, right = _diagonal_terms(a, x_hat)
    return ((total / x_hat.shape[-1] - wrong + right).clamp_min(0.0).log() + shift,)


def _log_count_fused(m: Tensor, x_hat: Tensor) -> tuple[Tensor]:
    a, shift = shifted_exp(m, -1)
    live = (a[:, None, :] * (pair_magnitudes(x_hat) != 0).to(a.dtype)).sum(-1)
    wrong, right = _diagonal_terms(a, x_hat)
    total = live - (wrong != 0).to(a.dtype) * a + (right != 0).to(a.dtype) * a
    return (total.clamp_min(0.0).log() + shift,)


def _entropy_fused(log_z: Tensor, surprisal: Tensor, x_hat: Tensor) -> tuple[Tensor, Tensor]:
    """Entropy ⊕ over i of (L_i + log|J'|, R_i - log|J'|), with w_i = a_i |J'| (shifted):

    L_j = M + log S_j,  R_j = (T_j - U_j) / S_j,  where S = Σ w, T = Σ w R, U = Σ w log|J'|,
    three sums fused in one loop over all i, then the i = j terms corrected.
    """
    n = x_hat.shape[-1]
    a, shift = shifted_exp(log_z, -1)
    r = torch.where(a > 0, surprisal, 0.0)
    mag = pair_magnitudes(x_hat) / n
    w = a[:, None, :] * mag
    s = w.sum(-1)
    t = (w * r[:, None, :]).sum(-1)
    u = (w * torch.where(mag > 0, mag.log(), 0.0)).sum(-1)
    return _entropy_from_sums(a, r, shift, x_hat, s, t, u)


def _entropy_native(log_z: Tensor, surprisal: Tensor, x_hat: Tensor) -> tuple[Tensor, Tensor]:
    """``_entropy_fused`` with the three sums from the hand-written kernel, which works with
    c = |1 + x̂_i x̂_j| = n |J'|: S = S_c / n, T = T_c / n, U = (U_c - log(n) S_c) / n."""
    n = x_hat.shape[-1]
    a, shift = shifted_exp(log_z, -1)
    r = torch.where(a > 0, surprisal, 0.0)
    s_c, t_c, u_c = norm_entropy_sums_f32(a, r, x_hat)
    u = (u_c - math.log(n) * s_c) / n
    return _entropy_from_sums(a, r, shift, x_hat, s_c / n, t_c / n, u)


def _entropy_from_sums(
    a: Tensor, r: Tensor, shift: Tensor, x_hat: Tensor, s: Tensor, t: Tensor, u: Tensor
) -> tuple[Tensor, Tensor]:
    """Correct the i = j terms of the all-pairs sums and read out (log Z, mean surprisal)."""
    n = x_hat.shape[-1]
    wrong, right = _diagonal_terms(a, x_hat)
    wrong_mag, right_mag = (1.0 + x_hat * x_hat) / n, (1.0 - (1.0 + x_hat * x_hat) / n).abs()
    s = s - wrong + right
    t = t + (right - wrong) * r
    u = u - wrong * torch.where(wrong_mag > 0, wrong_mag.log(), 0.0)
    u = u + right * torch.where(right_mag > 0, right_mag.log(), 0.0)
    s = s.clamp_min(0.0)
    mean = torch.where(s > 0, (t - u) / torch.where(s > 0, s, 1.0), 0.0)
    return (s.log() + shift, mean)


def _boolean_fused(reach: Tensor, x_hat: Tensor) -> tuple[Tensor]:
    # ``reach`` is the boolean message as 0/1 floats (converted before the kernel: a bool load
    # in the inner loop is not vectorised). For non-outlier columns the i = j term of the
    # off-diagonal formula is non-zero exactly when the true diagonal is, so "any" is exact.
    return ((reach[:, None, :] * pair_magnitudes(x_hat)).amax(-1) > 0,)


def _signed_fused(
    pos_max: Tensor, neg_max: Tensor, pos_min: Tensor, neg_min: Tensor, x_hat: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sign routing: J' > 0 keeps the sign of a path, J' < 0 swaps positive and negative.

    Maxima shift by the row's largest max-component (a <= 1; far-below entries underflow to 0,
    i.e. no path); minima by the row's smallest min-component (b >= 1; far-above entries
    overflow to inf, i.e. no path), so each of the four results is one fused max or min.
    """
    top = finite_or_zero(torch.maximum(pos_max, neg_max).amax(-1, keepdim=True))
    low = finite_or_zero(torch.minimum(pos_min, neg_min).amin(-1, keepdim=True))
    a_pos, a_neg = (pos_max - top).exp(), (neg_max - top).exp()
    b_pos, b_neg = (pos_min - low).exp(), (neg_min - low).exp()
    jp = centred_pairs(x_hat)
    mag, plus, minus = jp.abs(), jp > 0, jp < 0

    def pick(same: Tensor, swapped: Tensor, absent: float) -> Tensor:
        chosen = torch.where(plus, same[:, None, :], swapped[:, None, :])
        return torch.where(plus | minus, chosen * mag, absent)

    return (
        pick(a_pos, a_neg, 0.0).amax(-1).log() + top,
        pick(a_neg, a_pos, 0.0).amax(-1).log() + top,
        pick(b_pos, b_neg, INF).amin(-1).log() + low,
        pick(b_neg, b_pos, INF).amin(-1).log() + low,
    )


# --- eager fallbacks: the dense contraction of J' ------------------------------------------------
def centred_block(x_hat: Tensor) -> Callable[[slice, slice], Tensor]:
    """Jacobian blocks of J' for ``contract_rows``: [rows, n (output i), cols (input j)]."""
    n = x_hat.shape[-1]

    def jac(rows: slice, cols: slice) -> Tensor:
        xh = x_hat[rows]
        eye = identity_block(n, cols, xh.dtype, xh.device)
        return eye[None] - (1.0 + xh[:, :, None] * xh[:, None, cols]) / n

    return jac


def _dense(semiring_class: type[Semiring]) -> Callable[..., State]:
    def eager(*args: Tensor) -> State:
        *m, x_hat = args
        if semiring_class is Boolean:
            m = [m[0] != 0]  # the fused kernel's 0/1 float form back to booleans
        return contract_rows(semiring_class(), tuple(m), centred_block(x_hat), x_hat.shape[-1])

    eager.__name__ = eager.__qualname__ = f"dense_{semiring_class.__name__}"
    return eager


#: Fused kernels of out'_rj = ⊕_i m'_ri ⊗ lift(J'_rij), by exact semiring class.
FUSED_KERNELS: dict[type[Semiring], Callable[..., State]] = {
    cls: compiled(_dense(cls), fused)
    for cls, fused in [
        (MaxProd, _max_prod_fused),
        (SignedMaxProd, _signed_fused),
        (LogSum, _log_sum_fused),
        (LogCount, _log_count_fused),
        (Entropy, _entropy_fused),
        (Boolean, _boolean_fused),
    ]
}


#: Hand-written float32 kernels (:mod:`.native`), used in place of the compiled ones where the
#: native library is available; they need no compiler warm-up.
NATIVE_KERNELS: dict[type[Semiring], Callable[..., State]] = {
    MaxProd: _max_prod_native,
    LogSum: _log_sum_native,
    Entropy: _entropy_native,
}


def has_fused_normalization(sr: Semiring) -> bool:
    """True when ``normalized_messages`` has a closed form or a fused kernel for ``sr``."""
    return type(sr) is Real or type(sr) in FUSED_KERNELS


# --- dispatch ------------------------------------------------------------------------------------
def _real_closed_form(
    m: Tensor, x_hat: Tensor, rstd: Tensor, gain: Tensor, gain_per_row: bool
) -> tuple[Tensor]:
    # With u_i = m_i g_i:  Σ_i u_i rstd (δ_ij - 1/n - x̂_i x̂_j / n)
    #                    = rstd (u_j - mean_i(u) - x̂_j mean_i(u x̂)).
    u = m * _entry_gains(gain, gain_per_row)
    centred = u - u.mean(-1, keepdim=True) - x_hat * (u * x_hat).mean(-1, keepdim=True)
    return (rstd[:, None] * centred,)


def _entry_gains(gain: Tensor, gain_per_row: bool) -> Tensor:
    """``gain`` shaped to broadcast over [rows, n]: [rows, 1] per row, [1, n] per entry, or
    [rows, n] as given (a gain per row and entry, group_norm's channels)."""
    if gain_per_row:
        return gain[:, None]
    return gain if gain.dim() == 2 else gain[None, :]


def normalized_messages(
    sr: Semiring,
    m: State,
    x_hat: Tensor,
    rstd: Tensor,
    gain: Tensor,
    gain_per_row: bool,
    mode: str = "auto",
) -> State | None:
    """Messages through normalisation rows, or None where the caller should use the dense path.

    ``m``, ``x_hat``: [rows, n]; ``rstd``: [rows]; ``gain``: [n] (per entry), [rows]
    (``gain_per_row``) or [rows, n] (per row and entry). ``mode``: ``"auto"`` (compiled
    kernel from ``COMPILE_MIN_PAIRS`` pairs up when compilation is on, else None),
    ``"compiled"`` (always the fused kernel, which falls back to its eager form if compiling
    fails) or ``"eager"`` (the kernel's dense fallback).
    On float32, MaxProd, LogSum and Entropy use the hand-written kernels of :mod:`.native`
    (``NATIVE_KERNELS``) where they are available, with or without compilation.
    """
    if type(sr) is Real:
        return _real_closed_form(m[0], x_hat.to(m[0].dtype), rstd, gain, gain_per_row)
    kernel = FUSED_KERNELS.get(type(sr))
    if kernel is None:
        return None
    rows, n = x_hat.shape
    native = NATIVE_KERNELS.get(type(sr)) if x_hat.dtype == torch.float32 else None
    native = native if native is not None and native_available() else None
    if mode == "auto":
        if not (compile_enabled() or native is not None) or rows * n * n < COMPILE_MIN_PAIRS:
            return None
        mode = "compiled"
    if mode not in ("compiled", "eager"):
        raise ValueError(f"mode must be 'auto', 'compiled' or 'eager', got {mode!r}")
    if gain_per_row:
        row_weight = rstd * gain
    else:
        m = sr.scale(m, _entry_gains(gain, False))
        row_weight = rstd
    if type(sr) is Boolean:
        m = (m[0].to(x_hat.dtype),)
    args = (*(c.contiguous() for c in m), x_hat.contiguous())
    # Messages are never differentiated: without grad mode, the compiled kernel has one guard
    # state whether it is called inside a backward or not (no recompilation).
    with torch.no_grad():
        if mode == "eager":
            out = kernel.eager(*args)  # type: ignore[attr-defined]
        else:
            out = native(*args) if native is not None else kernel(*args)
        if mode == "compiled" and type(sr) in ALL_PAIRS_KERNELS:
            out = _fix_outliers(sr, m, x_hat, tuple(out))
    return sr.scale(tuple(out), row_weight[:, None])


#: Kernels that reduce over all i and correct the diagonal (see ``_diagonal_terms``).
ALL_PAIRS_KERNELS = (MaxProd, LogSum, LogCount, Entropy, Boolean)


def _fix_outliers(sr: Semiring, m: State, x_hat: Tensor, out: State) -> State:
    """Recompute, exactly and with the semiring's own ops, the columns j with
    x̂_j² > (n - 2) / 2, where the all-pairs kernels' diagonal correction does not apply."""
    n = x_hat.shape[-1]
    rows, cols = torch.nonzero(x_hat * x_hat > (n - 2) / 2, as_tuple=True)
    if rows.numel() == 0:
        return out
    xh = x_hat[rows]  # [k, n]: the outlier's row, entries i
    t = xh.gather(1, cols[:, None])  # [k, 1]: x̂_j
    jac = -(1.0 + xh * t) / n
    jac[torch.arange(rows.numel()), cols] += 1.0  # δ_ij
    state = tuple(p[rows] for p in m)
    if type(sr) is Boolean:
        state = (state[0] != 0,)
    fixed = sr.sum(sr.scale(state, jac.to(x_hat.dtype)), [1])
    out = tuple(o.clone() for o in out)
    for o, f in zip(out, fixed, strict=True):
        o[rows, cols] = f.to(o.dtype)
    return out
