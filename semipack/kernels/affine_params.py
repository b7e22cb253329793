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
M_c) <= 1``, as their matmuls do) and scale the gain's edges by the channel's largest |x̂|
(A_c, so ``|x̂| / A_c <= 1``: a sum of huge activations times e would overflow float32 where the
log-domain definition is finite), and return, as the third value, which channels need the
generic ops instead (``messages.normalization.affine_param_messages`` recomputes them): those
whose shifted gain sum fell below ``precise_log_floor`` (its terms may have underflowed: x̂
tiny where the messages are large), and those with a non-finite x̂ or a NaN or ``+inf``
message, where the generic ops' conventions for infinite weights apply. A bias's sum holds the
term 1 of its largest entry, so it never underflows.

A fused kernel may have a native form (``NATIVE_FORMS``: MaxProd's maxima by a C loop, no
compiled call's guards), which ``messages.normalization.affine_param_messages`` tries first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .compiled import FUSED_MIN_ELEMENTS
from .logspace import finite_or_zero, precise_log_floor
from .native import affine_log_sums_f32, max_affine_f32, native_available

#: The dims the per-channel reductions run over in the [A, C, B] layout.
CHANNEL_REDUCE = (0, 2)

#: (gain state, bias state, which channels to recompute with the generic ops, or None).
AffineParams = tuple[tuple[Tensor, ...], tuple[Tensor, ...], Tensor | None]


def _x_hat(x: Tensor, mean: Tensor, invstd: Tensor) -> Tensor:
    return (x - mean) * invstd


def _reduced(t: Tensor) -> Tensor:
    return t.sum(CHANNEL_REDUCE)


class _Shifted:
    """The shifted messages ``e`` and the scaled edges of the log-space kernels, [A, C, B]
    each, with the per-channel shifts of the bias's and the gain's sums ([C]: M_c, and M_c +
    log A_c) and the channels the generic ops must recompute (``unusual``: a NaN or +inf
    message, a non-finite x̂)."""

    def __init__(self, m: Tensor, x_hat: Tensor) -> None:
        top = m.amax(CHANNEL_REDUCE, keepdim=True)
        shift = finite_or_zero(top)
        self.e = torch.exp(m - shift)
        mag = x_hat.abs()
        widest = mag.amax(CHANNEL_REDUCE, keepdim=True)
        scale = torch.where((widest > 0) & (widest < float("inf")), widest, 1.0)
        self.mag, self.scaled = mag, mag / scale
        self.bias_shift = shift.reshape(-1)
        self.gain_shift = (shift + torch.log(scale)).reshape(-1)
        finite = torch.isfinite(x_hat).to(m.dtype).amin(CHANNEL_REDUCE)
        self.unusual = (~(top < float("inf"))).reshape(-1) | (finite < 1)

    def recompute(self, gain_log: Tensor, gain_shift: Tensor, bias_log: Tensor) -> Tensor:
        """Which channels the generic ops recompute: the unusual ones, and those with a path
        (a bias sum) whose gain sum lies below the floor under its shift (the floor of
        ``logspace.precise_log_floor``: log(tiny / eps) of the dtype)."""
        floor = precise_log_floor(gain_log.dtype)
        low = (gain_log - gain_shift < floor) & (bias_log > float("-inf"))
        return self.unusual | low


def max_plus(m: Tensor, x: Tensor, mean: Tensor, invstd: Tensor) -> AffineParams:
    """MaxProd: ``max (m + log|x̂|)`` and ``max m`` per channel (a max is exact: nothing to
    recompute)."""
    gain = (m + _x_hat(x, mean, invstd).abs().log()).amax(CHANNEL_REDUCE)
    return (gain,), (m.amax(CHANNEL_REDUCE),), None


def _log_sums(m: Tensor, x_hat: Tensor, count: bool) -> AffineParams:
    s = _Shifted(m, x_hat)
    if count:  # an edge counts 1: nothing to scale
        edge, gain_shift = (s.mag != 0).to(m.dtype), s.bias_shift
    else:
        edge, gain_shift = s.scaled, s.gain_shift
    gain = torch.log(_reduced(s.e * edge)) + gain_shift
    bias = torch.log(_reduced(s.e)) + s.bias_shift
    return (gain,), (bias,), s.recompute(gain, gain_shift, bias)


def log_sum(m: Tensor, x: Tensor, mean: Tensor, invstd: Tensor) -> AffineParams:
    """LogSum: ``log Σ e^m |x̂|`` and ``log Σ e^m`` per channel."""
    return _log_sums(m, _x_hat(x, mean, invstd), count=False)


def log_count(m: Tensor, x: Tensor, mean: Tensor, invstd: Tensor) -> AffineParams:
    """LogCount: ``log Σ e^m [x̂ != 0]`` and ``log Σ e^m`` per channel (a NaN x̂ counts as an
    edge, as ``LogCount.magnitude`` has it; it sends the channel to the generic ops)."""
    return _log_sums(m, _x_hat(x, mean, invstd), count=True)


def entropy(
    log_mass: Tensor, surprisal: Tensor, x: Tensor, mean: Tensor, invstd: Tensor
) -> AffineParams:
    """Entropy's (log mass, mean surprisal) states. An entry's gain edge multiplies its mass
    by |x̂| and adds ``-log|x̂|`` to its surprisal; the channel's mean is weighted by the
    masses: ``Σ e|x̂| (R - log|x̂|) / Σ e|x̂|``, each term formed before summing (no difference
    of two large sums). A channel without mass gets the mean 0, as ``Entropy.sum`` gives; a NaN
    sum stays NaN."""
    s = _Shifted(log_mass, _x_hat(x, mean, invstd))
    weighted = s.e * s.scaled
    gain_mass = _reduced(weighted)
    # an entry without an edge (x̂ = 0) adds nothing; 0 * (R - log 0) would be NaN
    gain_r = _reduced(torch.where(s.mag > 0, weighted * (surprisal - torch.log(s.mag)), 0.0))
    bias_mass = _reduced(s.e)
    bias_r = _reduced(s.e * surprisal)
    gain = (
        torch.log(gain_mass) + s.gain_shift,
        torch.where(gain_mass == 0, 0.0, gain_r / gain_mass),
    )
    bias = (
        torch.log(bias_mass) + s.bias_shift,
        torch.where(bias_mass == 0, 0.0, bias_r / bias_mass),
    )
    return gain, bias, s.recompute(gain[0], s.gain_shift, bias[0])


def _native_layout(
    tensors: tuple[Tensor, ...], x: Tensor, mean: Tensor | None, invstd: Tensor | None
) -> tuple[Tensor, Tensor] | None:
    """(mean, invstd) as [C] entries where the native loops take these operands: contiguous
    float32 CPU tensors of ``x``'s shape [A, C, B] whose reduced inner dim holds at least 8
    entries (the loops' vectors run along it: a layer norm's [rows, n, 1] stays compiled),
    statistics per channel only (``[1, C, 1]``: a batch norm) or none (``x`` is x̂); else
    None."""
    if not (
        native_available()
        and x.dim() == 3
        and x.shape[2] >= 8
        and all(
            t.dtype == torch.float32
            and t.device.type == "cpu"
            and t.shape == x.shape
            and t.is_contiguous()
            for t in (*tensors, x)
        )
    ):
        return None
    channels = x.shape[1]
    if mean is None or invstd is None:
        return x.new_zeros(channels), x.new_ones(channels)
    if any(t.dim() != 3 or t.numel() != channels or t.shape[1] != channels for t in (mean, invstd)):
        return None
    return mean, invstd


def max_plus_native(
    m: Tensor, x: Tensor, mean: Tensor | None, invstd: Tensor | None
) -> AffineParams | None:
    """``max_plus`` by the native loop (``native.max_affine_f32``: one pass, no compiled call's
    guards) where ``_native_layout`` takes the operands; None elsewhere."""
    stats = _native_layout((m,), x, mean, invstd)
    if stats is None:
        return None
    gain, bias = max_affine_f32(m, x, *stats)
    return (gain,), (bias,), None


#: The floor of ``_Shifted.recompute`` for float32.
_FLOAT32_FLOOR = precise_log_floor(torch.float32)


def log_sum_native(
    m: Tensor, x: Tensor, mean: Tensor | None, invstd: Tensor | None
) -> AffineParams | None:
    """``log_sum`` by the native loop (``native.affine_log_sums_f32``: two passes per channel,
    sums in double, no compiled call) where ``_native_layout`` takes the operands and the
    compiled form would run (``FUSED_MIN_ELEMENTS`` entries: below, the generic ops); with
    the channels to recompute, as ``log_sum``'s."""
    stats = _native_layout((m,), x, mean, invstd) if x.numel() >= FUSED_MIN_ELEMENTS else None
    if stats is None:
        return None
    return affine_log_sums_f32(m, None, x, *stats, _FLOAT32_FLOOR)


def entropy_native(
    log_mass: Tensor, surprisal: Tensor, x: Tensor, mean: Tensor | None, invstd: Tensor | None
) -> AffineParams | None:
    """``entropy`` by the native loop, as ``log_sum_native``."""
    stats = (
        _native_layout((log_mass, surprisal), x, mean, invstd)
        if x.numel() >= FUSED_MIN_ELEMENTS
        else None
    )
    if stats is None:
        return None
    return affine_log_sums_f32(log_mass, surprisal, x, *stats, _FLOAT32_FLOOR)


#: Native forms of fused kernels, tried first on the inputs they take (each returns None
#: elsewhere): the same values to rounding, NaN and infinities where the fused form has them
#: (or the channel flagged for the generic ops, as the fused form flags it).
NATIVE_FORMS: dict[Callable[..., AffineParams], Callable[..., AffineParams | None]] = {
    max_plus: max_plus_native,
    log_sum: log_sum_native,
    entropy: entropy_native,
}
