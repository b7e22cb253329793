"""MaxProd: the best single path, kept in log space so long paths never under- or overflow."""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.tropical import maxplus
from ._log import add_log_abs_, can_overwrite, log_abs
from .base import Semiring, Sign, State, index_reduce


class MaxProd(Semiring):
    """Max over paths of the product of |local derivatives|.

    The state is ``log max|path product|`` (``-inf`` = no path). ``readout`` returns the linear
    value ``exp(state)``; pass ``log=True`` to read the log directly (finite where linear would
    overflow or underflow).
    """

    zero = (float("-inf"),)
    one = (0.0,)
    max_like = True

    def __init__(self, log: bool = False) -> None:
        self.log = log

    def __repr__(self) -> str:
        return f"MaxProd(log={self.log})"

    def lift(self, w: Tensor) -> State:
        return (log_abs(w, self.state_dtype(w.dtype)),)

    def scale_owned(self, a: State, w: Tensor) -> State:
        own = self.keeps_primitives_of(MaxProd, "lift", "times", "scale")
        if not own or not can_overwrite(w, a[0]):
            return self.scale(a, w)
        return (add_log_abs_(a[0], w),)

    def lift_log(self, log_abs: Tensor, sign: Sign = 1.0) -> State:
        if not self._log_form_is_own():
            return Semiring.lift_log(self, log_abs, sign)
        return (log_abs.to(self.state_dtype(log_abs.dtype)),)

    def scale_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        if not self._log_form_is_own():
            return Semiring.scale_log(self, a, log_abs, sign)
        return (a[0] + log_abs,)

    def scale_log_owned(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        own = self.keeps_primitives_of(MaxProd, "scale_log") and self._log_form_is_own()
        if not own or not can_overwrite(log_abs, a[0]):
            return self.scale_log(a, log_abs, sign)
        return (log_abs.add_(a[0]),)

    def matmul_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        if not self._log_form_is_own() or not self.keeps_primitives_of(MaxProd, "plus", "sum"):
            return Semiring.matmul_log(self, a, log_abs, sign)
        return (maxplus(a[0], log_abs),)

    def uses_edge_signs(self) -> bool:
        log_ops = ("lift_log", "scale_log", "scale_log_owned", "matmul_log")
        return not self.keeps_primitives_of(MaxProd, *log_ops, "lift", "times", "plus", "sum")

    def _log_form_is_own(self) -> bool:
        """The state is log|product| only while ``lift`` and ``times`` are MaxProd's."""
        return self.keeps_primitives_of(MaxProd, "lift", "times")

    def plus(self, a: State, b: State) -> State:
        return (torch.maximum(a[0], b[0]),)

    def times(self, a: State, b: State) -> State:
        return (a[0] + b[0],)

    def sum(self, a: State, dims: list[int], keepdim: bool = False) -> State:
        return (a[0].amax(dims, keepdim=keepdim),)

    def matmul(self, a: State, w: Tensor) -> State:
        # A compiled max-plus kernel instead of the generic broadcast-and-reduce blocks.
        return (maxplus(a[0], self.lift(w)[0]),)

    def has_lifted_matmul(self) -> bool:
        return self.keeps_primitives_of(MaxProd, "lift", "matmul", "matmul_lifted")

    def matmul_lifted(self, a: State, lifted: State) -> State:
        return (maxplus(a[0], lifted[0]),)

    def readout(self, a: State) -> Tensor:
        return a[0] if self.log else a[0].exp()

    def index_plus(self, dest: State, dim: int, index: Tensor, src: State) -> State:
        return (index_reduce(dest[0], dim, index, src[0], "amax"),)
