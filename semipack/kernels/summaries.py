"""Whole-tensor summaries a training monitor takes of every layer's values on a sampled step:
the best entry, the log of the total flow, and count, sum and maximum of the entries that are
numbers.

Each returns Python numbers where the native loops (``native/summaries.c``) read the tensor
(float32 on the CPU, its entries one block of memory), else 0-d tensors from torch's
reductions, left on the tensor's device so that a caller reads many of them back at once (on a
GPU one read per value waits on the device each time). Both give the same maxima, indices and
counts, and sums in float64 in another order (the log flow's float32 exponentials within one
ulp of torch's, the entropies' sum of the same terms).

Why native: on ResNet-18's 11 million entries the torch forms made about a dozen passes, several
writing a temporary as large, and took 100-160 ms per sampled step, about half a plain
training step (``benchmarks/bench_monitor.py --model resnet18``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .native import best_entries_f32, log_sum_exp_f32, native_available, number_stats_f32
from .shapes import dense_block


def _native(t: Tensor) -> bool:
    return (
        t.dtype == torch.float32
        and t.device.type == "cpu"
        and t.numel() > 0
        and not torch.compiler.is_compiling()
        and native_available()
        and dense_block(t)
    )


def best_entry(units: Tensor) -> tuple[Any, Any, Any]:
    """Of ``units`` [U, S] (U, S > 0): the largest entry (NaN where one is NaN), the fraction of
    units whose entries are all ``-inf``, and the flat index of the first largest entry
    (``torch.argmax``'s: the first NaN where there is one, 0 where every entry is ``-inf``)."""
    if _native(units) and units.is_contiguous():
        at, top, dead = best_entries_f32(units)
        return top, dead / units.shape[0], at
    best = units.reshape(-1).argmax()
    dead = (units.amax(1) == -math.inf).double().mean()
    return units.reshape(-1)[best], dead, best


def log_sum_exp(log_values: Tensor) -> Any:
    """``log Σ exp`` over all entries, shifted by the largest (``logsumexp``'s own method,
    without its temporaries; the sum in float64); the largest itself where it is infinite
    (every entry -inf, or an entry +inf), NaN where an entry is NaN."""
    if _native(log_values):
        return log_sum_exp_f32(log_values)
    top = log_values.amax()
    shifted = log_values.sub(top).exp_().sum(dtype=torch.float64).log_().add_(top)
    return torch.where(top.isinf(), top.double(), shifted)


def count_sum_max_of_numbers(t: Tensor) -> list[Any]:
    """[count, sum, max] of the entries of ``t`` that are not NaN, without gathering them
    (``masked_select`` cost five times more on millions of entries); the sum in float64 (a
    16-bit sum of many entries overflows), infinities kept; the max ``-inf`` where none."""
    if _native(t):
        return list(number_stats_f32(t))
    numbers = torch.count_nonzero(t == t)
    inf = math.inf  # nan_to_num replaces the infinities too unless told to keep them
    total = t.nan_to_num(nan=0.0, posinf=inf, neginf=-inf).sum(dtype=torch.float64)
    return [numbers, total, t.nan_to_num(nan=-inf, posinf=inf, neginf=-inf).amax()]
