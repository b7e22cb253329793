"""Exclusive row reductions: ``out_j`` = the reduction of every entry of the row but ``j``.

They are what makes softmax and log_softmax messages O(n) per row (``messages.rowwise``): each
is computed from the top two entries of a row, never by subtracting an entry's own term from the
row total, which would cancel catastrophically for max-like reductions and for a dominant term
in sums. All take and return [rows, n] tensors and reduce along the last dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .logspace import finite_or_zero

INF = float("inf")


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


def exclusive_argmax(a: Tensor) -> tuple[Tensor, Tensor]:
    """``out_j = max_{i != j} a_i`` and the first i attaining it: the row's first maximum,
    except at that entry, where it is the first maximum of the others (TopPath's successors)."""
    first, index = a.max(-1, keepdim=True)
    is_top = _is_top(a, index)
    second, runner_up = torch.where(is_top, -INF, a).max(-1, keepdim=True)
    return torch.where(is_top, second, first), torch.where(is_top, runner_up, index)


def exclusive_min(a: Tensor) -> Tensor:
    """``out_j = min_{i != j} a_i`` (``+inf`` for rows of one entry)."""
    return -exclusive_max(-a)


def exclusive_any(a: Tensor) -> Tensor:
    """``out_j = any_{i != j} a_i`` for a boolean ``a``, from exact integer counts: some other
    entry is true iff the row count exceeds this entry's own."""
    own = a.to(torch.int32)
    return own.sum(-1, keepdim=True) - own > 0


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
