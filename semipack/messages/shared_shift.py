"""Both products of a bilinear op from one exponentiation, for the sum-like log-space semirings.

A linear layer's backward contracts the same output message ``m`` [..., N, O] twice: along O
with |W| (to the input) and along N with |x| (to the weight), and sums it along N (to the bias).
Attention does the same with (Vᵀ, weights) and (K, Q), and a convolution with its kernel and its
input (``shared_shift_conv``, through PyTorch's own convolution backward on the non-negative
operands, so no im2col copy is built). The semirings' own ``matmul`` shifts by
the maximum along the reduced dimension, a different shift (and one more ``exp`` over ``m``)
for each product. When every finite entry of ``m`` lies within ``SHARED_SHIFT_SPAN`` nats of its
global maximum ``M``, a single ``e = exp(m - M)`` serves every product: each term stays a normal
float (``e >= exp(-SHARED_SHIFT_SPAN)``), so the sums keep full relative precision, and the
elementwise work around the BLAS calls halves. Messages with a wider spread get None back and
the caller uses the per-product shifts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..semirings import Entropy, LogCount, LogSum, Semiring, State
from ..semirings._log import finite_or_zero
from ..semirings.base import repair_underflow
from ..semirings.log_sum import column_scaled

if TYPE_CHECKING:
    from .windows import ConvGeometry

#: Largest spread (nats) of finite message entries for which one shift serves every product.
#: exp(-40) ~ 4e-18 keeps each product e |w| a normal float32 for |w| down to ~1e-20.
SHARED_SHIFT_SPAN = 40.0

Products = tuple[State | None, State | None, State | None]


def global_shift(log_values: Tensor) -> Tensor | None:
    """The maximum of ``log_values`` if all its finite entries lie within the span, else None
    (also for an empty message: the per-product path handles empty sums)."""
    if log_values.numel() == 0:
        return None
    low, high = torch.aminmax(log_values)
    if low.item() == float("-inf"):  # entries without any path do not count
        finite = torch.isfinite(log_values)
        if not finite.any():
            return None
        low = log_values[finite].amin()
    if not torch.isfinite(high) or (high - low).item() > SHARED_SHIFT_SPAN:
        return None
    return high


def _t(t: Tensor) -> Tensor:
    return t.transpose(-1, -2)


def _log_sum(
    sr: LogSum,
    m: State,
    right: Tensor | None,
    left: Tensor | None,
    want_sum: bool,
    left_log: Tensor | None = None,
) -> Products | None:
    shift = global_shift(m[0])
    if shift is None:
        return None
    e = (m[0] - shift).exp_()
    by_right = by_left = total = None
    if right is not None:
        by_right = (torch.matmul(e, sr.magnitude(right)).log_().add_(shift),)
    if left is not None:
        by_left = (torch.matmul(_t(e), sr.magnitude(left)).log_().add_(shift),)
    if left_log is not None:
        scaled, c = column_scaled(sr.log_magnitude(left_log))
        by_left = (torch.matmul(_t(e), scaled).log_().add_(shift).add_(c),)
    if want_sum:
        total = (e.sum(-2).log_().add_(shift),)
    return by_right, by_left, total


def _entropy_pair(total: Tensor, weighted: Tensor, shift: Tensor) -> State:
    """(log Z, mean surprisal) from the shifted sums Σ e w and Σ e w (R - log w), in place."""
    mean = weighted.div_(total).masked_fill_(~(total > 0), 0.0)
    return (total.log_().add_(shift), mean)


def _entropy_product(
    e: Tensor,
    e_r: Tensor,
    w: Tensor,
    shift: Tensor,
    contract: Callable[[Tensor, Tensor], Tensor] = torch.matmul,
) -> State:
    """(log Z, mean surprisal) of ``e ⊗ w`` with ``e_r = e * R``: three products ``contract``
    (a matmul, or a convolution's sums) of the shifted message with |w| and |w| log|w|.

    Elementwise steps run in place on fresh tensors (same values as the out-of-place
    expressions): the temporaries beside the products are one |w| and one |w| log|w|.
    """
    mag = w.abs()
    total, weighted = contract(e, mag), contract(e_r, mag)
    mag_log_mag = mag.log().mul_(mag).masked_fill_(~(mag > 0), 0.0)  # 0 log 0 = 0
    del mag
    return _entropy_pair(total, weighted.sub_(contract(e, mag_log_mag)), shift)


def _entropy_product_log(e: Tensor, e_r: Tensor, log_w: Tensor, shift: Tensor) -> State:
    """``_entropy_product`` for non-negative weights given as logarithms [..., k, j]: each
    column is scaled to a maximum of 1 first (``|w| = e^c w'``; e^c cancels in the mean)."""
    scaled, c = column_scaled(log_w)
    total, weighted = torch.matmul(e, scaled), torch.matmul(e_r, scaled)
    scaled_log = torch.where(scaled > 0, scaled * log_w, 0.0)
    return _entropy_pair(total, weighted.sub_(torch.matmul(e, scaled_log)), shift + c)


def _entropy(
    sr: Entropy,
    m: State,
    right: Tensor | None,
    left: Tensor | None,
    want_sum: bool,
    left_log: Tensor | None = None,
) -> Products | None:
    log_z, surprisal = m
    shift = global_shift(log_z)
    if shift is None:
        return None
    e = (log_z - shift).exp_()
    e_r = e * surprisal
    by_right = by_left = total = None
    if right is not None:
        by_right = _entropy_product(e, e_r, right, shift)
    if left is not None:
        by_left = _entropy_product(_t(e), _t(e_r), left, shift)
    if left_log is not None:
        by_left = _entropy_product_log(_t(e), _t(e_r), left_log, shift)
    if want_sum:
        total = _entropy_pair(e.sum(-2), e_r.sum(-2), shift)
    return by_right, by_left, total


#: Shared-shift products, by exact semiring class (a subclass may change lift or plus).
SHARED_SHIFT_KERNELS: dict[type[Semiring], Callable[..., Products | None]] = {
    LogSum: _log_sum,
    LogCount: _log_sum,
    Entropy: _entropy,
}


def shared_shift_products(
    sr: Semiring,
    m: State,
    right: Tensor | None = None,
    left: Tensor | None = None,
    want_sum: bool = False,
    left_log: Tensor | None = None,
) -> Products | None:
    """``(m ⊗ right, mᵀ ⊗ left, ⊕ of m over dim -2)``, or None where this form does not apply.

    ``m`` [..., N, O]; ``right`` [..., O, J] (contracts m's last dim); ``left`` [..., N, J]
    (contracts m's rows, giving [..., O, J]); all in the state dtype. A None operand (or
    ``want_sum=False``) skips that result. ``left_log`` replaces ``left`` by the logarithms of
    a non-negative left operand (attention weights: a probability that underflows float32 keeps
    its edge; each column is scaled to a maximum of 1 before the product). None when the
    semiring has no shared-shift form or the message spans more than ``SHARED_SHIFT_SPAN`` nats.
    """
    kernel = SHARED_SHIFT_KERNELS.get(type(sr))
    if kernel is None or m[0].dim() < 2:
        return None
    with torch.no_grad():
        found = kernel(sr, m, right, left, want_sum, left_log)
        if found is None:
            return None
        by_right, by_left, total = found
        # A product far below the shift underflows: recompute those entries in the log domain.
        shift = global_shift(m[0])
        if by_right is not None:
            by_right = repair_underflow(sr, m, lambda: sr.lift(right), by_right, shift)
        if by_left is not None:
            lifted = sr.lift(left) if left_log is None else sr.lift_log(left_log)
            left_shift = shift
            if left_log is not None:  # the columns were scaled to a maximum of 1 as well
                left_shift = shift + finite_or_zero(lifted[0].amax(-2, keepdim=True))
            by_left = repair_underflow(sr, tuple(_t(p) for p in m), lifted, by_left, left_shift)
        return by_right, by_left, total


# --- convolutions --------------------------------------------------------------------------------


class _ConvSums:
    """Sums over a convolution's edges with non-negative operands: ``to_input(g, w)`` is
    Σ g·w over the edges of an input entry (the input gradient of ``conv(·, w)`` for output
    gradient g), ``to_weight(g, x)`` is Σ g·x over batch and positions (the weight gradient);
    for a transposed convolution the same sums run through its own backward. PyTorch's
    convolution backward computes them as plain sums of products: direct kernels on CPU and, on
    CUDA, the cuDNN-free native kernels (cuDNN may choose Winograd or FFT algorithms, whose
    transforms subtract and could turn an exact zero, "no path", into noise).
    """

    def __init__(self, x: Tensor, w: Tensor, geometry: ConvGeometry) -> None:
        self.x, self.w = x, w
        self.args = (
            None,
            list(geometry.stride),
            list(geometry.padding),
            list(geometry.dilation),
            geometry.transposed,
            list(geometry.output_padding) or [0] * (x.dim() - 2),
            geometry.groups,
        )

    def _run(self, g: Tensor, x: Tensor, w: Tensor, mask: list[bool]) -> tuple:
        guard = torch.backends.cudnn.flags(enabled=False) if g.is_cuda else nullcontext()
        with guard:
            return torch.ops.aten.convolution_backward(g, x, w, *self.args, mask)

    def to_input(self, g: Tensor, w: Tensor) -> Tensor:
        return self._run(g, self.x, w, [True, False, False])[0]

    def to_weight(self, g: Tensor, x: Tensor) -> Tensor:
        return self._run(g, x, self.w, [False, True, False])[1]


def _log_sum_conv(sr: LogSum, m: State, sums: _ConvSums, mask: Sequence[bool]) -> Products | None:
    shift = global_shift(m[0])
    if shift is None:
        return None
    e = (m[0] - shift).exp_()
    to_in = to_w = bias = None
    if mask[0]:
        to_in = (sums.to_input(e, sr.magnitude(sums.w)).log_().add_(shift),)
    if mask[1]:
        to_w = (sums.to_weight(e, sr.magnitude(sums.x)).log_().add_(shift),)
    if mask[2]:
        bias = (e.sum([d for d in range(e.dim()) if d != 1]).log_().add_(shift),)
    return to_in, to_w, bias


def _entropy_conv(sr: Entropy, m: State, sums: _ConvSums, mask: Sequence[bool]) -> Products | None:
    log_z, surprisal = m
    shift = global_shift(log_z)
    if shift is None:
        return None
    e = (log_z - shift).exp_()
    e_r = e * surprisal
    to_in = _entropy_product(e, e_r, sums.w, shift, sums.to_input) if mask[0] else None
    to_w = _entropy_product(e, e_r, sums.x, shift, sums.to_weight) if mask[1] else None
    bias = None
    if mask[2]:
        dims = [d for d in range(e.dim()) if d != 1]
        bias = _entropy_pair(e.sum(dims), e_r.sum(dims), shift)
    return to_in, to_w, bias


#: Shared-shift convolution messages, by exact semiring class.
SHARED_SHIFT_CONV: dict[type[Semiring], Callable[..., Products | None]] = {
    LogSum: _log_sum_conv,
    LogCount: _log_sum_conv,
    Entropy: _entropy_conv,
}


def shared_shift_conv(
    sr: Semiring, m: State, x: Tensor, w: Tensor, geometry: ConvGeometry, mask: Sequence[bool]
) -> Products | None:
    """(input, weight, bias) messages of ``conv(x, w)`` (zero padding; transposed or not, as
    ``geometry`` says) from the output message ``m``, or None where this form does not apply
    (another semiring, or a message spanning more than ``SHARED_SHIFT_SPAN`` nats). ``x`` and
    ``w`` in the state dtype.
    """
    kernel = SHARED_SHIFT_CONV.get(type(sr))
    if kernel is None:
        return None
    with torch.no_grad():
        return kernel(sr, m, _ConvSums(x, w, geometry), mask)
