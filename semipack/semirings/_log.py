"""Small numerics shared by the log-space semirings."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..kernels.logspace import exp_into, finite_or_zero, log_magnitude_, shifted_exp
from ..kernels.shapes import broadcast_shapes
from ..kernels.weight_cache import WEIGHTS
from .base import Semiring, State, fits, on_memory_of, uses_methods_of

__all__ = [
    "add_log_abs_",
    "can_overwrite",
    "exp_readout_into",
    "finite_or_zero",
    "kept_log_abs",
    "log_abs",
    "log_magnitude_",
    "shifted_exp",
]


def log_abs(w: Tensor, dtype: torch.dtype) -> Tensor:
    """``log|w|`` in ``dtype``, with exact zeros mapped to ``-inf`` (the semiring zero)."""
    return log_magnitude_(w.to(dtype).abs())  # abs() is a fresh tensor: log in place


def kept_log_abs(w: Tensor, dtype: torch.dtype) -> Tensor:
    """``log_abs(w, dtype)`` for the right operand of a product, kept across passes when ``w``
    is a model weight (``kernels.weight_cache``). The result is shared: read it only."""
    return WEIGHTS.derived(w, ("log_abs", dtype), lambda: log_abs(w, dtype))


def can_overwrite(w: Tensor, state: Tensor) -> bool:
    """Whether ``state ⊗ lift(w)`` can be written into ``w``: same dtype, and ``w`` already has
    the broadcast shape of the result."""
    return w.dtype == state.dtype and w.shape == broadcast_shapes(w.shape, state.shape)


def add_log_abs_(state: Tensor, w: Tensor) -> Tensor:
    """``state + log|w|`` in the memory of ``w`` (see ``can_overwrite``); bitwise the same as
    ``state + log_abs(w)``."""
    return log_magnitude_(w.abs_()).add_(state)


def exp_readout_into(sr: Semiring, owner: type[Semiring], a: State, into: Any) -> Any:
    """``readout_into`` of the log-space semirings whose readout is ``a[0]`` (``log=True``) or
    ``exp(a[0])`` (MaxProd, LogSum): the exponential written straight into ``into``; the
    generic form where ``into`` does not fit, for the log readout (the state itself) and for a
    subclass with a readout of its own (``owner``'s is the one known here)."""
    if sr.log or not fits(into, a[0]) or not uses_methods_of(sr, owner, "readout"):
        return Semiring.readout_into(sr, a, into)
    return exp_into(a[0], on_memory_of(into))
