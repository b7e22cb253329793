"""Fused kernels of the normalisation layers' centred Jacobian, one per semiring algebra.

With x̂ = (x - mean) * rstd over the n entries of a row, layer_norm / batch_norm / group_norm
messages need (see ``messages.normalization``)

    out'_rj = ⊕_i m'_ri ⊗ lift(J'_rij),    J'_rij = δ_ij - (1 + x̂_ri x̂_rj) / n.

Each kernel here computes it for one algebra on plain tensors: a broadcast over [rows, j, i]
reduced over the contiguous last index i, which inductor fuses into its reduction loop (no
[rows, n, n] tensor exists), or a hand-written float32 kernel (:mod:`.native`). From
``SORTED_MIN_ENTRIES`` entries per row (a train-mode batch norm channel holds batch x height x
width of them) the hand-written kernels stop visiting pairs: seen from output j every term is a
function of the affine form 1 + x̂_i x̂_j, so with the row sorted the max is an upper envelope
of lines, the sums of |1 + x̂_i t| are prefix sums, and Entropy's Σ c log c is a series tree,
O(n log n) in all (``native/normalization_sorted.c``, with its error bounds). The log-space
algebras work in the linear domain after shifting each row by its largest message M_r:
a_ri = exp(m'_ri - M_r) <= 1 and

    max-product   out'_rj = M_r + log max_i a_ri |J'_rij|
    log-sum       out'_rj = M_r + log Σ_i a_ri |J'_rij|
    log-count     out'_rj = M_r + log Σ_i a_ri [J'_rij != 0]

(the same shift the semirings' own BLAS matmuls use; for max-product an entry more than ~87
nats (float32) below its row max underflows to "no path", which changes the result only if
every entry within that range has J'_rij exactly 0). A semiring declares its kernels with
``Semiring.normalization_kernel`` (a ``CentredPairsKernel``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import log_space_native
from .compiled import FUSED_MIN_ELEMENTS, compiled
from .logspace import finite_or_zero, shifted_exp
from .native import (
    norm_abs_reduce_f32,
    norm_entropy_sums_f32,
    norm_sorted_max_f32,
    norm_sorted_sums_f32,
)

INF = float("inf")
#: TopPath's id of "no successor" (a state without a path); see ``semirings.top_path``.
NO_SUCCESSOR = -1

#: Rows of at least this many entries go to the O(n log n) native kernels (sorted rows:
#: envelopes, prefix sums and a series tree; see native/normalization_sorted.c); shorter rows
#: to the all-pairs ones. The break-even points, single-thread CPU time on the 2-core VM of
#: BENCHMARKS.md: about n = 1000 for MaxProd and LogSum and n = 400 for Entropy (at n = 768,
#: BERT's width, the sorted Entropy kernel is 1.6x faster; at n = 8192, a batch norm channel of
#: 8 x 32 x 32, 16x faster for MaxProd and 35x for Entropy).
SORTED_MIN_ENTRIES = 1024
SORTED_MIN_ENTRIES_ENTROPY = 512
#: MaxProd's rows go to the envelope kernel from this many entries: it first tries a set of
#: candidate lines found by evaluation (no sort; real envelopes hold a few lines), then
#: recomputes directly the rare columns whose maximum is tiny against the row's scale (exact
#: cancellations, where double-precision comparisons can drop a tiny line). It beats the
#: all-pairs kernel from about n = 320: at n = 384 (MiniLM) 5.3 us per row against 6.5, at
#: n = 768 (BERT) 11.2 against 25.4, single-thread on the 2-core VM of BENCHMARKS.md.
SORTED_MIN_ENTRIES_MAX = 320


def _sorted_rows(x_hat: Tensor, min_entries: int) -> bool:
    """Whether the O(n log n) kernels take these rows: long enough. (Rows with a non-finite x̂
    or message never reach a fused kernel: ``messages.normalization`` sends them to the dense
    Jacobian.)"""
    return x_hat.shape[-1] >= min_entries


#: A fused expression: the state components of m' ([rows, n] each), then x̂ [rows, n], to the
#: components of out' ([rows, n] each).
PairsKernel = Callable[..., tuple[Tensor, ...]]


@dataclass(frozen=True)
class CentredPairsKernel:
    """One semiring's kernels for ``out'_rj = ⊕_i m'_ri ⊗ lift(J'_rij)``.

    ``fused`` is the expression handed to inductor; ``native`` a hand-written float32 kernel
    with the same values, used on CPU rows of any size (None: none; LogCount's is torch ops
    over sorted rows, taken on the same terms); ``all_pairs`` says that the kernel reduces over
    all i, the diagonal included, and corrects the i = j terms afterwards (see
    ``_diagonal_terms``), so outlier columns must be recomputed; ``as_floats`` that the
    (boolean) state enters as 0/1 floats (a bool load in the inner loop is not vectorised);
    ``compile_min_pairs`` the size from which the compiled kernel replaces the dense
    contraction where there is no native one (None: the common threshold,
    ``messages.normalization.COMPILE_MIN_PAIRS``).
    """

    fused: PairsKernel
    native: PairsKernel | None = None
    all_pairs: bool = True
    as_floats: bool = False
    compile_min_pairs: int | None = None


def entry_gains(gain: Tensor, gain_per_row: bool) -> Tensor:
    """``gain`` shaped to broadcast over [rows, n]: [rows, 1] per row, [1, n] per entry, or
    [rows, n] as given (a gain per row and entry, group_norm's channels)."""
    if gain_per_row:
        return gain[:, None]
    return gain if gain.dim() == 2 else gain[None, :]


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


def max_prod_fused(m: Tensor, x_hat: Tensor) -> tuple[Tensor]:
    """Max-product messages of the centred Jacobian, as one inductor-fused reduction.
    ``m``: [rows, n] log-messages, ``x_hat``: [rows, n]; returns ([rows, n],)."""
    a, shift = shifted_exp(m, -1)
    return _max_prod_from_best(a, shift, x_hat, (a[:, None, :] * pair_magnitudes(x_hat)).amax(-1))


def max_prod_native(m: Tensor, x_hat: Tensor) -> tuple[Tensor]:
    """``max_prod_fused`` with the max taken by a native kernel (all pairs, or the envelope of
    lines from ``SORTED_MIN_ENTRIES_MAX`` entries per row)."""
    a, shift = shifted_exp(m, -1)
    if _sorted_rows(x_hat, SORTED_MIN_ENTRIES_MAX):
        best = norm_sorted_max_f32(a, x_hat)[0]
    else:
        best = norm_abs_reduce_f32(a, x_hat, reduce_max=True)
    return _max_prod_from_best_compiled(a, shift, x_hat, best)


def _max_prod_from_best(a: Tensor, shift: Tensor, x_hat: Tensor, best: Tensor) -> tuple[Tensor]:
    """``best`` = max_i a_i |1 + x̂_i x̂_j|; the true diagonal term is never below the one it
    holds (outside the outlier columns), so one more maximum makes it exact."""
    _, right = _diagonal_terms(a, x_hat)
    return (torch.maximum(best / x_hat.shape[-1], right).log() + shift,)


#: The native kernels' readouts in one compiled loop over [rows, n] from FUSED_MIN_ELEMENTS
#: entries (eagerly six to eight passes: 64 rows of 8192, 2.5 -> 0.33 ms for MaxProd's and
#: 2.0 -> 0.34 ms for LogSum's on one core).
_max_prod_from_best_compiled = compiled(
    _max_prod_from_best,
    min_elements=FUSED_MIN_ELEMENTS,
    native=log_space_native.max_prod_from_best,
)


def top_path_fused(m: Tensor, ids: Tensor, x_hat: Tensor) -> tuple[Tensor, Tensor]:
    """TopPath messages of the centred Jacobian: MaxProd's value and the successor id of an
    input attaining it, as one inductor-fused max with its index. ``m`` [rows, n] log-messages,
    ``ids`` [rows, n] int64 successor ids, ``x_hat`` [rows, n]; returns ([rows, n], [rows, n])."""
    a, shift = shifted_exp(m, -1)
    best, where = (a[:, None, :] * pair_magnitudes(x_hat)).max(-1)
    return _top_path_from_best(a, shift, ids, x_hat, best, where)


def top_path_native(m: Tensor, ids: Tensor, x_hat: Tensor) -> tuple[Tensor, Tensor]:
    """``top_path_fused`` with the max and an input attaining it from the envelope kernel
    (at most O(n log n) per row, at any n: the dense alternative is an eager argmax over all
    pairs).
    The caller (``messages.normalization``) passes finite x̂ and messages without NaN or +inf
    only; other rows take the dense Jacobian."""
    a, shift = shifted_exp(m, -1)
    best, where = norm_sorted_max_f32(a, x_hat, with_index=True)
    return _top_path_from_best(a, shift, ids, x_hat, best, where)


def _top_path_from_best(
    a: Tensor, shift: Tensor, ids: Tensor, x_hat: Tensor, best: Tensor, where: Tensor
) -> tuple[Tensor, Tensor]:
    """``best`` = max_i a_i |1 + x̂_i x̂_j|, attained at ``where``. The true diagonal term is
    never below the one ``best`` holds (outside the outlier columns): where it is at least
    ``best`` the path goes through entry j itself, else through ``where``. No path: no id."""
    _, right = _diagonal_terms(a, x_hat)
    off = best / x_hat.shape[-1]
    value = torch.maximum(off, right).log() + shift
    chosen = torch.where(right >= off, ids, ids.gather(1, where.clamp_min(0)))
    return value, torch.where(value == -INF, NO_SUCCESSOR, chosen)


def log_sum_fused(m: Tensor, x_hat: Tensor) -> tuple[Tensor]:
    """Log-sum messages of the centred Jacobian, as one inductor-fused reduction.
    ``m``: [rows, n] log-messages, ``x_hat``: [rows, n]; returns ([rows, n],)."""
    a, shift = shifted_exp(m, -1)
    return _log_sum_from_total(a, shift, x_hat, (a[:, None, :] * pair_magnitudes(x_hat)).sum(-1))


def log_sum_native(m: Tensor, x_hat: Tensor) -> tuple[Tensor]:
    """``log_sum_fused`` with the sum taken by a native kernel (all pairs, or prefix sums over
    the sorted row from ``SORTED_MIN_ENTRIES`` entries per row)."""
    a, shift = shifted_exp(m, -1)
    if _sorted_rows(x_hat, SORTED_MIN_ENTRIES):
        total = norm_sorted_sums_f32(a, x_hat)[0]
    else:
        total = norm_abs_reduce_f32(a, x_hat, reduce_max=False)
    return _log_sum_from_total_compiled(a, shift, x_hat, total)


def _log_sum_from_total(a: Tensor, shift: Tensor, x_hat: Tensor, total: Tensor) -> tuple[Tensor]:
    """``total`` = Σ_i a_i |1 + x̂_i x̂_j|, the diagonal included with the off-diagonal formula."""
    wrong, right = _diagonal_terms(a, x_hat)
    return ((total / x_hat.shape[-1] - wrong + right).clamp_min(0.0).log() + shift,)


_log_sum_from_total_compiled = compiled(
    _log_sum_from_total,
    min_elements=FUSED_MIN_ELEMENTS,
    native=log_space_native.log_sum_from_total,
)


def log_count_fused(m: Tensor, x_hat: Tensor) -> tuple[Tensor]:
    """Log-count messages: the shifted sum over the non-zero Jacobian entries, with the
    diagonal term corrected to the true ``1 - (1 + x̂²)/n``. Shapes as ``log_sum_fused``."""
    a, shift = shifted_exp(m, -1)
    live = (a[:, None, :] * (pair_magnitudes(x_hat) != 0).to(a.dtype)).sum(-1)
    wrong, right = _diagonal_terms(a, x_hat)
    total = live - (wrong != 0).to(a.dtype) * a + (right != 0).to(a.dtype) * a
    return (total.clamp_min(0.0).log() + shift,)


def log_count_sorted(m: Tensor, x_hat: Tensor) -> tuple[Tensor]:
    """``log_count_fused`` in O(n log n) per row, with torch ops: every pair counts except those
    with ``1 + x̂_i x̂_j`` exactly 0, which need the rounded product to be exactly -1. For a
    given j those i lie within a few ulps of -1 / x̂_j, so a search of the sorted row finds the
    candidates (almost always none) and each is checked with the kernel's own float ops."""
    a, shift = shifted_exp(m, -1)
    live = a.sum(-1, keepdim=True) - _zero_pair_sums(a, x_hat)
    wrong, right = _diagonal_terms(a, x_hat)
    total = live - (wrong != 0).to(a.dtype) * a + (right != 0).to(a.dtype) * a
    return (total.clamp_min(0.0).log() + shift,)


def _zero_pair_sums(a: Tensor, x_hat: Tensor) -> Tensor:
    """[rows, n]: Σ a_i over the i with ``1 + x̂_i x̂_j == 0`` (as the fused kernel rounds it)."""
    values, order = x_hat.sort(-1)
    target = -1.0 / x_hat  # ±inf at x̂_j = 0: no candidate
    slack = 8 * torch.finfo(x_hat.dtype).eps  # the rounded product is -1 within 1 ulp of target
    ends = torch.stack([target * (1 - slack), target * (1 + slack)])
    low = torch.searchsorted(values, ends.amin(0).contiguous(), side="left")
    high = torch.searchsorted(values, ends.amax(0).contiguous(), side="right")
    width = high - low
    zero = torch.zeros_like(a)
    if not bool((width > 0).any()):
        return zero
    rows, cols = torch.nonzero(width > 0, as_tuple=True)
    for k in range(int(width.max())):
        at = low[rows, cols] + k
        inside = at < high[rows, cols]
        i = order[rows, at.clamp_max(x_hat.shape[-1] - 1)]
        exact = inside & (1.0 + x_hat[rows, i] * x_hat[rows, cols] == 0)
        zero.index_put_((rows, cols), torch.where(exact, a[rows, i], 0.0), accumulate=True)
    return zero


def entropy_fused(log_z: Tensor, surprisal: Tensor, x_hat: Tensor) -> tuple[Tensor, Tensor]:
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


def entropy_native(log_z: Tensor, surprisal: Tensor, x_hat: Tensor) -> tuple[Tensor, Tensor]:
    """``entropy_fused`` with the three sums from a hand-written kernel (all pairs, or the
    sorted row's prefix sums and series tree from ``SORTED_MIN_ENTRIES_ENTROPY`` entries per
    row), which works with c = |1 + x̂_i x̂_j| = n |J'|: S = S_c / n, T = T_c / n,
    U = (U_c - log(n) S_c) / n."""
    n = x_hat.shape[-1]
    a, shift, r = _entropy_rows(log_z, surprisal)
    if _sorted_rows(x_hat, SORTED_MIN_ENTRIES_ENTROPY):
        s_c, t_c, u_c = norm_sorted_sums_f32(a, x_hat, r, with_log=True)
    else:
        s_c, t_c, u_c = norm_entropy_sums_f32(a, r, x_hat)
    log_n = torch.tensor(math.log(n), dtype=a.dtype)
    return _entropy_readout_of_sums(a, r, shift, x_hat, s_c, t_c, u_c, log_n)


def _entropy_rows_eager(log_z: Tensor, surprisal: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    a, shift = shifted_exp(log_z, -1)
    return a, shift, torch.where(a > 0, surprisal, 0.0)


#: The rows' shifted masses and the surprisal where they have mass, in one compiled kernel.
_entropy_rows = compiled(
    _entropy_rows_eager, min_elements=FUSED_MIN_ELEMENTS, native=log_space_native.entropy_rows
)


def _entropy_readout_of_sums_eager(
    a: Tensor,
    r: Tensor,
    shift: Tensor,
    x_hat: Tensor,
    s_c: Tensor,
    t_c: Tensor,
    u_c: Tensor,
    log_n: Tensor,
) -> tuple[Tensor, Tensor]:
    n = x_hat.shape[-1]
    u = (u_c - log_n * s_c) / n
    return _entropy_from_sums(a, r, shift, x_hat, s_c / n, t_c / n, u)


#: The native sums' readout (their scaling by n, the i = j corrections, log Z and the mean):
#: about twenty elementwise ops over [rows, n], one loop compiled (a train-mode batch norm's
#: 64 channels of 8192 entries: 11.9 -> 0.8 ms on one core).
_entropy_readout_of_sums = compiled(
    _entropy_readout_of_sums_eager,
    min_elements=FUSED_MIN_ELEMENTS,
    native=log_space_native.entropy_readout_of_sums,
)


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


def boolean_fused(reach: Tensor, x_hat: Tensor) -> tuple[Tensor]:
    # ``reach`` is the boolean message as 0/1 floats (converted before the kernel: a bool load
    # in the inner loop is not vectorised). For non-outlier columns the i = j term of the
    # off-diagonal formula is non-zero exactly when the true diagonal is, so "any" is exact.
    """Reachability: an entry is reached when some reached input has a non-zero Jacobian
    entry to it. ``reach``: [rows, n] 0/1 floats; returns ([rows, n] bool,)."""
    return ((reach[:, None, :] * pair_magnitudes(x_hat)).amax(-1) > 0,)


def boolean_sorted(reach: Tensor, x_hat: Tensor) -> tuple[Tensor]:
    """``boolean_fused`` in O(n log n) per row (see ``log_count_sorted``): an entry is reached
    when the reached inputs outnumber those whose pair with it is exactly 0 (0/1 sums, exact
    in float32 up to 2^24 entries)."""
    live = reach.sum(-1, keepdim=True) - _zero_pair_sums(reach, x_hat)
    return (live > 0,)


def signed_fused(
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


MAX_PROD = CentredPairsKernel(max_prod_fused, max_prod_native)
TOP_PATH = CentredPairsKernel(top_path_fused, top_path_native)
LOG_SUM = CentredPairsKernel(log_sum_fused, log_sum_native)
LOG_COUNT = CentredPairsKernel(log_count_fused, log_count_sorted)
ENTROPY = CentredPairsKernel(entropy_fused, entropy_native)
BOOLEAN = CentredPairsKernel(boolean_fused, boolean_sorted, as_floats=True)
#: SignedMaxProd's dense contraction routes signs through four state components: 280 ms per
#: layer norm of a 20-token MiniLM sentence (2.9M pairs), so the compiled kernel pays from 1M
#: pairs on, compilation included, from the first pass (MiniLM sentence: 10.0 s -> 6.0 s; later
#: passes 5.0 s -> 1.5 s).
SIGNED = CentredPairsKernel(signed_fused, all_pairs=False, compile_min_pairs=1 << 20)
