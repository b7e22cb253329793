"""Shifts for log-space numerics: exponentiate without overflow, whatever the semiring."""

from __future__ import annotations

import torch
from torch import Tensor


def finite_or_zero(x: Tensor) -> Tensor:
    """Replace non-finite shifts (rows with no path) by 0 so that ``x - shift`` stays defined."""
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def shifted_exp(a: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """Return ``(exp(a - m), m)`` with ``m`` the finite max of ``a`` along ``dim`` (kept)."""
    m = finite_or_zero(a.amax(dim, keepdim=True))
    return (a - m).exp(), m
