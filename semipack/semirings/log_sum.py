"""LogSum and LogCount: sums over paths, kept in log space and computed with BLAS."""

from __future__ import annotations

import torch
from torch import Tensor

from ._log import add_log_abs_, can_overwrite, finite_or_zero, shifted_exp
from .base import Semiring, Sign, State, index_reduce, repair_underflow


class LogSum(Semiring):
    """log of the sum over paths of the product of |local derivatives| ("total gradient flow").

    ``readout`` returns the log value (``-inf`` = no path); pass ``log=False`` for the linear sum.
    """

    zero = (float("-inf"),)
    one = (0.0,)

    def __init__(self, log: bool = True) -> None:
        self.log = log

    def __repr__(self) -> str:
        return f"{self.name}(log={self.log})"

    def magnitude(self, w: Tensor) -> Tensor:
        """The edge weight this semiring sums: |w| for LogSum."""
        return w.abs()

    def lift(self, w: Tensor) -> State:
        w = w.to(self.state_dtype(w.dtype))
        mag = self.magnitude(w)
        return (mag.log() if mag is w else mag.log_(),)  # in place on a fresh magnitude

    def log_magnitude(self, log_abs: Tensor) -> Tensor:
        """``log(magnitude(w))`` from ``log|w|`` (``log_abs`` itself for LogSum). A subclass
        that redefines ``magnitude`` must redefine this too, else the log forms fall back to
        the linear defaults."""
        return log_abs

    def scale_owned(self, a: State, w: Tensor) -> State:
        own = self.keeps_primitives_of(LogSum, "magnitude", "lift", "times", "scale")
        if not own or not can_overwrite(w, a[0]):
            return self.scale(a, w)
        return (add_log_abs_(a[0], w),)

    def lift_log(self, log_abs: Tensor, sign: Sign = 1.0) -> State:
        if not self._log_form_is_own():
            return Semiring.lift_log(self, log_abs, sign)
        return (self.log_magnitude(log_abs.to(self.state_dtype(log_abs.dtype))),)

    def scale_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        if not self._log_form_is_own():
            return Semiring.scale_log(self, a, log_abs, sign)
        return (a[0] + self.log_magnitude(log_abs),)

    def scale_log_owned(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        own = self.keeps_primitives_of(LogSum, "scale_log") and self._log_form_is_own()
        if not own or not can_overwrite(log_abs, a[0]):
            return self.scale_log(a, log_abs, sign)
        return (self.log_magnitude(log_abs).add_(a[0]),)  # log_abs itself or a fresh tensor

    def matmul_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        """Both operands shifted: ``a`` by its row maxima, the weights by their column maxima
        ``c`` (``w = e^c w'`` with ``w' <= 1``), so a column of weights far below 1 (attention
        probabilities of 1e-50) keeps full precision instead of underflowing to "no edge"."""
        if not self._log_form_is_own() or not self.keeps_primitives_of(LogSum, "plus", "sum"):
            return Semiring.matmul_log(self, a, log_abs, sign)
        e, m = shifted_exp(a[0], -1)
        log_w = self.log_magnitude(log_abs.to(e.dtype))
        scaled, c = column_scaled(log_w)
        out = (torch.matmul(e, scaled).log_().add_(m).add_(c),)
        return repair_underflow(self, a, (log_w,), out, shift=m + c)

    def uses_edge_signs(self) -> bool:
        log_ops = ("lift_log", "scale_log", "scale_log_owned", "matmul_log")
        own = self.keeps_primitives_of(LogSum, *log_ops, "plus", "sum")
        return not (own and self._log_form_is_own())

    def _log_form_is_own(self) -> bool:
        """The log forms hold while ``lift`` and ``times`` are LogSum's and the class that
        defines ``magnitude`` also defines ``log_magnitude``."""
        if not self.keeps_primitives_of(LogSum, "lift", "times"):
            return False
        owner = next(c for c in type(self).__mro__ if "magnitude" in vars(c))
        return "log_magnitude" in vars(owner)

    def plus(self, a: State, b: State) -> State:
        return (torch.logaddexp(a[0], b[0]),)

    def times(self, a: State, b: State) -> State:
        return (a[0] + b[0],)

    def sum(self, a: State, dims: list[int], keepdim: bool = False) -> State:
        return (torch.logsumexp(a[0], dims, keepdim=keepdim),)

    def readout(self, a: State) -> Tensor:
        return a[0] if self.log else a[0].exp()

    def matmul(self, a: State, w: Tensor) -> State:
        # log Σ_k exp(a_k) |w_kj|  =  m + log( exp(a - m) @ |w| ), with m the row max of a.
        e, m = shifted_exp(a[0], -1)
        mag = self.magnitude(w.to(e.dtype))
        out = (torch.matmul(e, mag).log_().add_(m),)
        return repair_underflow(self, a, lambda: (mag.log(),), out, shift=m)

    def index_plus(self, dest: State, dim: int, index: Tensor, src: State) -> State:
        peak = index_reduce(dest[0], dim, index, src[0], "amax")
        peak = finite_or_zero(peak)
        e_dest = (dest[0] - peak).exp()
        e_src = (src[0] - peak.index_select(dim, index)).exp()
        return (e_dest.index_add(dim, index, e_src).log() + peak,)


class LogCount(LogSum):
    """log of the number of paths whose every local derivative is non-zero."""

    def magnitude(self, w: Tensor) -> Tensor:
        return (w != 0).to(w.dtype if w.dtype.is_floating_point else torch.float32)

    def log_magnitude(self, log_abs: Tensor) -> Tensor:
        # An edge counts once, whatever its weight (NaN included, as in ``magnitude``).
        return torch.where(log_abs == float("-inf"), float("-inf"), 0.0).to(log_abs.dtype)


def column_scaled(log_w: Tensor) -> tuple[Tensor, Tensor]:
    """``(exp(log_w - c), c)`` with ``c`` the finite maximum of each column of ``log_w``
    ([..., k, j] -> c [..., 1, j]): the largest weight of a column becomes 1."""
    c = finite_or_zero(log_w.amax(-2, keepdim=True))
    return (log_w - c).exp_(), c
