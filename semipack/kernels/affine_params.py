"""The gain's and bias's messages of a normalisation's per-channel affine map, one fused
reduction per semiring algebra.

A batch norm (eval or train), a layer norm or a group norm ends in ``y = g_c x̂ + b_c``: each
output entry has one edge to its channel's gain, weighted x̂, and one to its bias, weighted 1.
Their messages are ``⊕ over the channel's entries of m ⊗ lift(x̂)`` and ``⊕ of m``. Written
with the semiring's ``scale`` and ``sum`` that is about a dozen passes over message-sized
tensors for Entropy (x̂, log|x̂|, the surprisal, two sums of components, logsumexp, its
exponential, the weighted mean; twice); ResNet-18's batch norms spent 17 ms per pass on the
stem's alone (1.6 million entries, one core). Each expression below reads the message and the
input once per reduction and writes only per-channel results, which inductor compiles into one
kernel.

Layout: every tensor is ``[A, C, B]`` and the reductions run over dims 0 and 2, so one kernel
serves an image batch norm (``[N, C, H*W]``), a train-mode one's channel rows (``[1, C,
N*H*W]``) and a layer norm's features (``[rows, n, 1]``). ``mean`` and ``invstd`` broadcast
against ``x`` (``[1, C, 1]`` or ``[A, C, 1]``); the kernels compute x̂ = (x - mean) * invstd
themselves, so no x̂ is written either. Results are ``[C]``.

The log-space algebras shift each channel by its largest message M_c first (``e = exp(m -
M_c) <= 1``, as their matmuls do) and return M_c as the third value: a gain's sum far below it
may have underflowed, and ``messages.normalization.affine_param_messages`` recomputes those
channels with the generic ops (the test of ``semirings.base.repair_underflow``). A bias's sum
holds the term 1 of its largest entry, so it never does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .logspace import finite_or_zero

#: The dims the per-channel reductions run over in the [A, C, B] layout.
CHANNEL_REDUCE = (0, 2)

#: (gain state, bias state, shift per channel or None).
AffineParams = tuple[tuple[Tensor, ...], tuple[Tensor, ...], Tensor | None]


def _x_hat(x: Tensor, mean: Tensor, invstd: Tensor) -> Tensor:
    return (x - mean) * invstd


def _shifted(m: Tensor) -> tuple[Tensor, Tensor]:
    """``(exp(m - M), M)`` with M the finite maximum of each channel, kept as [1, C, 1]."""
    shift = finite_or_zero(m.amax(CHANNEL_REDUCE, keepdim=True))
    return torch.exp(m - shift), shift


def max_plus(m: Tensor, x: Tensor, mean: Tensor, invstd: Tensor) -> AffineParams:
    """MaxProd: ``max (m + log|x̂|)`` and ``max m`` per channel (no shift: a max is exact)."""
    gain = (m + _x_hat(x, mean, invstd).abs().log()).amax(CHANNEL_REDUCE)
    return (gain,), (m.amax(CHANNEL_REDUCE),), None


def _log_sums(m: Tensor, edge: Tensor) -> AffineParams:
    e, shift = _shifted(m)
    gain = (e * edge).sum(CHANNEL_REDUCE)
    bias = e.sum(CHANNEL_REDUCE)
    shift = shift.reshape(-1)
    return (torch.log(gain) + shift,), (torch.log(bias) + shift,), shift


def log_sum(m: Tensor, x: Tensor, mean: Tensor, invstd: Tensor) -> AffineParams:
    """LogSum: ``log Σ e^m |x̂|`` and ``log Σ e^m`` per channel."""
    return _log_sums(m, _x_hat(x, mean, invstd).abs())


def log_count(m: Tensor, x: Tensor, mean: Tensor, invstd: Tensor) -> AffineParams:
    """LogCount: ``log Σ e^m [x̂ != 0]`` and ``log Σ e^m`` per channel (a NaN x̂ counts as an
    edge, as ``LogCount.magnitude`` has it)."""
    return _log_sums(m, (_x_hat(x, mean, invstd) != 0).to(m.dtype))


def entropy(
    log_mass: Tensor, surprisal: Tensor, x: Tensor, mean: Tensor, invstd: Tensor
) -> AffineParams:
    """Entropy's (log mass, mean surprisal) states. An entry's gain edge multiplies its mass
    by |x̂| and adds ``-log|x̂|`` to its surprisal; the channel's mean is weighted by the
    masses: ``Σ e|x̂| (R - log|x̂|) / Σ e|x̂|``, each term formed before summing (no difference
    of two large sums). A channel without mass gets the mean 0, as ``Entropy.sum`` gives."""
    e, shift = _shifted(log_mass)
    mag = _x_hat(x, mean, invstd).abs()
    weighted = e * mag
    gain_mass = weighted.sum(CHANNEL_REDUCE)
    # an entry without an edge (x̂ = 0) adds nothing; 0 * (R - log 0) would be NaN
    gain_r = torch.where(mag > 0, weighted * (surprisal - torch.log(mag)), 0.0)
    gain_r = gain_r.sum(CHANNEL_REDUCE)
    bias_mass = e.sum(CHANNEL_REDUCE)
    bias_r = (e * surprisal).sum(CHANNEL_REDUCE)
    shift = shift.reshape(-1)
    gain = (
        torch.log(gain_mass) + shift,
        torch.where(gain_mass > 0, gain_r / gain_mass, 0.0),
    )
    bias = (
        torch.log(bias_mass) + shift,
        torch.where(bias_mass > 0, bias_r / bias_mass, 0.0),
    )
    return gain, bias, shift
