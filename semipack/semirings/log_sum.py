"""LogSum and LogCount: sums over paths, kept in log space and computed with BLAS."""

from __future__ import annotations

import torch
from torch import Tensor

from ._log import add_log_abs_, can_overwrite, finite_or_zero, shifted_exp
from .base import Semiring, State, index_reduce


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

    def scale_owned(self, a: State, w: Tensor) -> State:
        own = self.keeps_primitives_of(LogSum, "magnitude", "lift", "times", "scale")
        if not own or not can_overwrite(w, a[0]):
            return self.scale(a, w)
        return (add_log_abs_(a[0], w),)

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
        s = torch.matmul(e, self.magnitude(w.to(e.dtype)))
        return (s.log_().add_(m),)

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
