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
the caller uses the per-product shifts. The products themselves are the semiring's own
(``Semiring.shared_shift_products`` / ``shared_shift_conv``: LogSum, LogCount and Entropy have
them); this module builds the convolution sums and repairs entries that underflowed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..kernels import log_space_native
from ..kernels.compiled import FUSED_MIN_ELEMENTS, compiled
from ..kernels.logspace import flat_views
from ..kernels.shared_shift import SHARED_SHIFT_SPAN, global_shift
from ..kernels.weight_cache import WEIGHTS
from ..semirings import Semiring, State
from ..semirings._log import finite_or_zero
from ..semirings.base import Products, kept_edge_columns, repair_underflow

if TYPE_CHECKING:
    from .windows import ConvGeometry

__all__ = [
    "SHARED_SHIFT_SPAN",
    "Products",
    "global_shift",
    "shared_shift_conv",
    "shared_shift_products",
]


def _t(t: Tensor) -> Tensor:
    return t.transpose(-1, -2)


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
    if m[0].dim() < 2:
        return None
    with torch.no_grad():
        found = sr.shared_shift_products(m, right, left, want_sum, left_log)
        if found is None:
            return None
        by_right, by_left, total = found
        # A product far below the shift underflows: recompute those entries in the log domain.
        shift = global_shift(m[0])
        if by_right is not None:
            by_right = repair_underflow(
                sr,
                m,
                lambda: sr.kept_lift(right),
                by_right,
                shift,
                edges=lambda: kept_edge_columns(sr, right),
            )
        if by_left is not None:
            left_shift = shift
            if left_log is None:  # lifted only where an entry needs the check
                lifted = lambda: sr.lift(left)  # noqa: E731
            else:  # the columns were scaled to a maximum of 1 as well
                lifted = sr.lift_log(left_log)
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


def shared_shift_conv(
    sr: Semiring,
    m: State,
    x: Tensor,
    w: Tensor,
    geometry: ConvGeometry,
    mask: Sequence[bool],
) -> Products | None:
    """(input, weight, bias) messages of ``conv(x, w)`` (zero padding; transposed or not, as
    ``geometry`` says) from the output message ``m``, or None where this form does not apply
    (a semiring without ``shared_shift_conv``, or a message spanning more than
    ``SHARED_SHIFT_SPAN`` nats). ``x`` and ``w`` in the state dtype. Shapes as PyTorch's
    convolution: x ``[N, C_in, *spatial]``, w ``[C_out, C_in / groups, *kernel]`` (transposed:
    ``[C_in, C_out / groups, *kernel]``), each part of m ``[N, C_out, *out_spatial]``; the
    messages come shaped like x, w and the bias ``[C_out]``, None where ``mask`` is False.
    """
    if type(sr).shared_shift_conv is Semiring.shared_shift_conv:
        return None
    operands = [t for t, wanted in ((w, mask[0]), (x, mask[1])) if wanted]
    if not all(_products_stay_normal(t) for t in operands):
        return None
    with torch.no_grad():
        return sr.shared_shift_conv(m, _ConvSums(x, w, geometry), mask)


def _products_stay_normal(operand: Tensor) -> bool:
    """Whether every product of a shifted message entry (at least ``exp(-SHARED_SHIFT_SPAN)``)
    with a non-zero ``|operand|`` is a normal float: a smaller one is subnormal or 0, and a
    convolution's sums (unlike a matmul's, ``repair_underflow``) are not repaired, so a
    weight near the smallest subnormal lost precision (Entropy off by up to half a nat) or
    a path outright (LogSum: 0.3 x 1.4e-45 is 0 in float32). Kept per weight version."""
    floor = torch.finfo(operand.dtype).tiny * math.exp(SHARED_SHIFT_SPAN)
    smallest = WEIGHTS.derived(
        operand, ("smallest magnitude", operand.dtype), lambda: _smallest_magnitude(operand)
    )
    return smallest >= floor


def _nonzero_magnitude_min(t: Tensor) -> Tensor:
    return torch.where(t == 0, math.inf, t.abs()).amin()


#: One pass over an activation (compiled), not three: every convolution's weight message asks.
_nonzero_magnitude_min_fused = compiled(
    _nonzero_magnitude_min,
    min_elements=FUSED_MIN_ELEMENTS,
    native=log_space_native.nonzero_magnitude_min,
)


def _smallest_magnitude(t: Tensor) -> float:
    """The smallest non-zero ``|t|`` (``inf`` where none; NaN where ``t`` holds one)."""
    if t.numel() == 0:
        return math.inf
    flat = flat_views(t)  # no base to guard on: compiled once for every shape
    return float(_nonzero_magnitude_min_fused(flat[0] if flat else t.detach().reshape(-1)))
