"""LogSum and LogCount: sums over paths, kept in log space and computed with BLAS."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..kernels import affine_params, blas
from ..kernels.affine_params import AffineParams
from ..kernels.exclusive import exclusive_logsumexp
from ..kernels.logspace import exp, exp_, log_add_exp, log_magnitude_plus_
from ..kernels.native import native_available, softmax_log_sum_f32
from ..kernels.normalization import LOG_COUNT, LOG_SUM, CentredPairsKernel
from ..kernels.shared_shift import ConvolutionSums, global_shift
from ..kernels.weight_cache import WEIGHTS
from ._log import (
    add_log_abs_,
    can_overwrite,
    exp_readout_into,
    finite_or_zero,
    log_magnitude_,
    shifted_exp,
)
from .base import (
    Products,
    Semiring,
    Sign,
    State,
    checked_flag,
    index_reduce,
    repair_underflow,
    use_generic,
    uses_methods_of,
)

#: Use the native LogSum softmax kernel from this many entries up.
NATIVE_MIN_ENTRIES = 1 << 12

#: Fast paths written for LogSum's magnitude |w| itself (not through ``magnitude``).
MAGNITUDE_KERNELS = (
    "scale_owned",
    "lift_is_multiplicative",
    "softmax_closed_form",
    "normalization_kernel",
    "affine_params_kernel",
)

#: The log-form operations, which go through ``log_magnitude``.
LOG_FORMS = ("lift_log", "scale_log", "scale_log_owned", "matmul_log", "shared_shift_products")


class LogSum(Semiring):
    """log of the sum over paths of the product of |local derivatives| ("total gradient flow").

    ``readout`` returns the log value (``-inf`` = no path); pass ``log=False`` for the linear sum.
    """

    zero = (float("-inf"),)
    one = (0.0,)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Beyond the primitives, LogSum's fast paths rely on its edge weight ``magnitude``
        (|w|) and its log form ``log_magnitude``: a subclass that redefines ``magnitude`` loses
        the kernels written for |w| (``MAGNITUDE_KERNELS``), and one that does so without a
        matching ``log_magnitude`` also loses every log-form operation (``LOG_FORMS``)."""
        super().__init_subclass__(**kwargs)
        # the nearest LogSum class above: a mixin listed before it may bring the new magnitude
        parent = next(c for c in cls.__mro__[1:] if issubclass(c, LogSum))
        if cls.magnitude is not parent.magnitude:
            use_generic(cls, MAGNITUDE_KERNELS)
            if cls.log_magnitude is parent.log_magnitude:
                use_generic(cls, LOG_FORMS)

    def __init__(self, log: bool = True) -> None:
        self.log = checked_flag(log, type(self).__name__, "log")

    def __repr__(self) -> str:
        return f"{self.name}(log={self.log})"

    def magnitude(self, w: Tensor) -> Tensor:
        """The edge weight this semiring sums: |w| for LogSum."""
        return w.abs()

    def kept_magnitude(self, w: Tensor) -> Tensor:
        """``magnitude(w)`` of a model weight, kept across passes (``kernels.weight_cache``)
        where the lift reads no settings of the instance: a pass over the whole weight at
        every product otherwise. The result is shared: read it only."""
        key = self.lift_cache_key()
        if key is None:
            return self.magnitude(w)
        return WEIGHTS.derived(w, ("magnitude", *key), lambda: self.magnitude(w))

    def lift_cache_key(self) -> tuple | None:
        base = LogCount if isinstance(self, LogCount) else LogSum
        if uses_methods_of(self, base, "lift", "magnitude", "log_magnitude"):
            return (base,)  # LogSum's and LogCount's lifts read no settings of the instance
        return None

    def lift(self, w: Tensor) -> State:
        w = w.to(self.state_dtype(w.dtype))
        mag = self.magnitude(w)
        return (mag.log() if mag is w else log_magnitude_(mag),)  # in place on a fresh one

    def log_magnitude(self, log_abs: Tensor) -> Tensor:
        """``log(magnitude(w))`` from ``log|w|`` (``log_abs`` itself for LogSum). A subclass
        that redefines ``magnitude`` must redefine this too, else the log forms fall back to
        the linear defaults."""
        return log_abs

    def scale_owned(self, a: State, w: Tensor) -> State:
        if not can_overwrite(w, a[0]):
            return self.scale(a, w)
        return (add_log_abs_(a[0], w),)

    def lift_log(self, log_abs: Tensor, sign: Sign = 1.0) -> State:
        return (self.log_magnitude(log_abs.to(self.state_dtype(log_abs.dtype))),)

    def scale_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        return (a[0] + self.log_magnitude(log_abs),)

    def scale_log_owned(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        if not can_overwrite(log_abs, a[0]):
            return self.scale_log(a, log_abs, sign)
        return (self.log_magnitude(log_abs).add_(a[0]),)  # log_abs itself or a fresh tensor

    def matmul_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        """Both operands shifted: ``a`` by its row maxima, the weights by their column maxima
        ``c`` (``w = e^c w'`` with ``w' <= 1``), so a column of weights far below 1 (attention
        probabilities of 1e-50) keeps full precision instead of underflowing to "no edge"."""
        e, m = shifted_exp(a[0], -1)
        log_w = self.log_magnitude(log_abs.to(e.dtype))
        scaled, c = column_scaled(log_w)
        out = (blas.matmul(e, scaled).log_().add_(m).add_(c),)
        return repair_underflow(self, a, (log_w,), out, shift=m + c)

    def uses_edge_signs(self) -> bool:
        return False

    def plus(self, a: State, b: State) -> State:
        return (log_add_exp(a[0], b[0]),)

    def times(self, a: State, b: State) -> State:
        return (a[0] + b[0],)

    def sum(self, a: State, dims: list[int], keepdim: bool = False) -> State:
        return (torch.logsumexp(a[0], dims, keepdim=keepdim),)

    def readout(self, a: State) -> Tensor:
        return a[0] if self.log else exp(a[0])

    def readout_into(self, a: State, into: Any) -> Any:
        return exp_readout_into(self, LogSum, a, into)

    def matmul(self, a: State, w: Tensor) -> State:
        # log Σ_k exp(a_k) |w_kj|  =  m + log( exp(a - m) @ |w| ), with m the row max of a.
        e, m = shifted_exp(a[0], -1)
        mag = self.kept_magnitude(w.to(e.dtype))  # a model weight's |W| is kept across passes
        out = (log_magnitude_plus_(blas.matmul(e, mag), m),)
        return repair_underflow(self, a, lambda: (mag.log(),), out, shift=m)

    def index_plus(self, dest: State, dim: int, index: Tensor, src: State) -> State:
        peak = index_reduce(dest[0], dim, index, src[0], "amax")
        peak = finite_or_zero(peak)
        e_dest = exp_(dest[0] - peak)  # fresh: the sources are added into it in place
        e_src = exp_(src[0] - peak.index_select(dim, index))
        return (log_magnitude_plus_(e_dest.index_add_(dim, index, e_src), peak),)

    # --- fast paths of the message math -------------------------------------------------------
    def lift_is_multiplicative(self) -> bool:
        return True

    def prefix_plus(self, a: State, dim: int) -> State:
        return (torch.logcumsumexp(a[0], dim),)

    def exclusive_plus(self, a: State) -> State | None:
        return (exclusive_logsumexp(a[0])[0],)

    def softmax_closed_form(
        self, m: State, probs: Tensor, log_probs: Tensor | None
    ) -> State | None:
        """The hand-written kernel (native/softmax.c) on float32 CPU rows of at least
        ``NATIVE_MIN_ENTRIES`` entries without NaN; None (the generic form) otherwise."""
        if not (
            m[0].dtype == probs.dtype == torch.float32
            and m[0].device.type == "cpu"
            and probs.numel() >= NATIVE_MIN_ENTRIES
            and probs.shape[-1] > 0
            and native_available()
        ):
            return None
        log_probs = probs.log() if log_probs is None else log_probs.to(probs.dtype)
        if bool(torch.isnan(m[0]).any() or torch.isnan(log_probs).any()):
            return None
        return (softmax_log_sum_f32(m[0], log_probs),)

    def compiles_rowwise(self) -> bool:
        return True

    def normalization_kernel(self) -> CentredPairsKernel | None:
        return LOG_SUM

    def affine_params_kernel(self) -> Callable[..., AffineParams] | None:
        return affine_params.log_sum

    def shared_shift_products(
        self,
        m: State,
        right: Tensor | None = None,
        left: Tensor | None = None,
        want_sum: bool = False,
        left_log: Tensor | None = None,
    ) -> Products | None:
        shift = global_shift(m[0])
        if shift is None:
            return None
        e = exp_(m[0] - shift)
        by_right = by_left = total = None
        # ``left`` first: its |x| (a layer's input, made here) is gone before the other
        # product's state exists (see ``Entropy.shared_shift_products``)
        if left is not None:
            by_left = blas.matmul(e.transpose(-1, -2), self.magnitude(left))
            by_left = (log_magnitude_plus_(by_left, shift),)
        if left_log is not None:
            scaled, c = column_scaled(self.log_magnitude(left_log))
            by_left = (blas.matmul(e.transpose(-1, -2), scaled).log_().add_(shift).add_(c),)
        if right is not None:
            by_right = (log_magnitude_plus_(blas.matmul(e, self.kept_magnitude(right)), shift),)
        if want_sum:
            total = (log_magnitude_plus_(e.sum(-2), shift),)
        return by_right, by_left, total

    def shared_shift_conv(
        self, m: State, sums: ConvolutionSums, mask: Sequence[bool]
    ) -> Products | None:
        shift = global_shift(m[0])
        if shift is None:
            return None
        e = exp_(m[0] - shift)
        to_in = to_w = bias = None
        if mask[0]:
            to_in = (log_magnitude_plus_(sums.to_input(e, self.kept_magnitude(sums.w)), shift),)
        if mask[1]:
            to_w = (log_magnitude_plus_(sums.to_weight(e, self.magnitude(sums.x)), shift),)
        if mask[2]:
            bias = (log_magnitude_plus_(e.sum([d for d in range(e.dim()) if d != 1]), shift),)
        return to_in, to_w, bias


class LogCount(LogSum):
    """log of the number of paths whose every local derivative is non-zero."""

    def magnitude(self, w: Tensor) -> Tensor:
        return (w != 0).to(w.dtype if w.dtype.is_floating_point else torch.float32)

    def log_magnitude(self, log_abs: Tensor) -> Tensor:
        # An edge counts once, whatever its weight (NaN included, as in ``magnitude``).
        return torch.where(log_abs == float("-inf"), float("-inf"), 0.0).to(log_abs.dtype)

    def lift_is_multiplicative(self) -> bool:
        return True  # [ab != 0] = [a != 0] [b != 0]

    def normalization_kernel(self) -> CentredPairsKernel | None:
        return LOG_COUNT

    def affine_params_kernel(self) -> Callable[..., AffineParams] | None:
        return affine_params.log_count


def column_scaled(log_w: Tensor) -> tuple[Tensor, Tensor]:
    """``(exp(log_w - c), c)`` with ``c`` the finite maximum of each column of ``log_w``
    ([..., k, j] -> c [..., 1, j]): the largest weight of a column becomes 1."""
    c = finite_or_zero(log_w.amax(-2, keepdim=True))
    return exp_(log_w - c), c
