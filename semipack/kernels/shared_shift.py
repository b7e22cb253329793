"""One shift for every product of a message: the numerics behind the shared-shift BLAS forms.

A bilinear op's backward contracts the same message ``m`` several times (a linear layer: with
|W| to the input, with |x| to the weight, summed to the bias). The sum-like log-space semirings
compute each product in the linear domain after subtracting a shift. When every finite entry of
``m`` lies within ``SHARED_SHIFT_SPAN`` nats of its global maximum ``M``, a single
``e = exp(m - M)`` serves every product: each term stays a normal float
(``e >= exp(-SHARED_SHIFT_SPAN)``), so the sums keep full relative precision. The semirings'
``shared_shift_products`` / ``shared_shift_conv`` use it; ``messages.shared_shift`` dispatches.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

from . import logspace

#: Largest spread (nats) of finite message entries for which one shift serves every product.
#: exp(-40) ~ 4e-18 keeps each product e |w| a normal float32 for |w| down to ~1e-20.
SHARED_SHIFT_SPAN = 40.0


def global_shift(log_values: Tensor) -> Tensor | None:
    """The maximum of ``log_values`` if all its finite entries lie within the span, else None
    (also for an empty message: the per-product path handles empty sums)."""
    if log_values.numel() == 0:
        return None
    if not logspace.checks_on_host(log_values):
        return _global_shift_one_read(log_values)
    low, high = torch.aminmax(log_values)
    if low.item() == float("-inf"):  # entries without any path do not count
        # (no NaN here: it would have been the minimum) the smallest finite entry, by float ops
        # only: a boolean index ran a nonzero and a gather over the whole message
        low = torch.nan_to_num(log_values, posinf=float("inf"), neginf=float("inf")).amin()
        if low.item() == float("inf"):  # no finite entry
            return None
    if not torch.isfinite(high) or (high - low).item() > SHARED_SHIFT_SPAN:
        return None
    return high


def _global_shift_one_read(log_values: Tensor) -> Tensor | None:
    """``global_shift`` with one value read back instead of up to four (on a GPU each read
    waits for the queued kernels): both reductions run, and the span is subtracted in the
    tensor's dtype as above, so every decision is the same."""
    high = log_values.amax()  # NaN if there is one
    low = torch.nan_to_num(log_values, posinf=float("inf"), neginf=float("inf")).amin()
    top, span = torch.stack([high, high - low]).tolist()  # low = inf: no finite entry
    if not math.isfinite(top) or span > SHARED_SHIFT_SPAN:
        return None
    return high


class ConvolutionSums(Protocol):
    """Sums over a convolution's edges with non-negative operands (``messages.shared_shift``
    builds one from the convolution's geometry). ``x`` [B, C_in, ...] and ``w`` are the
    convolution's input and weight in the state dtype."""

    x: Tensor
    w: Tensor

    def to_input(self, g: Tensor, w: Tensor) -> Tensor:
        """Σ g·w over the edges of each input entry (output gradient ``g``, weights ``w``)."""
        ...

    def to_weight(self, g: Tensor, x: Tensor) -> Tensor:
        """Σ g·x over batch and positions for each weight entry (``g`` and ``x`` of one
        batch, which may be longer than ``B``: several sums added in one)."""
        ...
