"""Small numerics shared by the log-space semirings."""

from __future__ import annotations

import torch
from torch import Tensor


def log_abs(w: Tensor, dtype: torch.dtype) -> Tensor:
    """``log|w|`` in ``dtype``, with exact zeros mapped to ``-inf`` (the semiring zero)."""
    return w.to(dtype).abs().log_()  # abs() is a fresh tensor: log in place


def can_overwrite(w: Tensor, state: Tensor) -> bool:
    """Whether ``state ⊗ lift(w)`` can be written into ``w``: same dtype, and ``w`` already has
    the broadcast shape of the result."""
    return w.dtype == state.dtype and w.shape == torch.broadcast_shapes(w.shape, state.shape)


def add_log_abs_(state: Tensor, w: Tensor) -> Tensor:
    """``state + log|w|`` in the memory of ``w`` (see ``can_overwrite``); bitwise the same as
    ``state + log_abs(w)``."""
    return w.abs_().log_().add_(state)


def finite_or_zero(x: Tensor) -> Tensor:
    """Replace non-finite shifts (rows with no path) by 0 so that ``x - shift`` stays defined."""
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def shifted_exp(a: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """Return ``(exp(a - m), m)`` with ``m`` the finite max of ``a`` along ``dim`` (kept)."""
    m = finite_or_zero(a.amax(dim, keepdim=True))
    return (a - m).exp(), m
