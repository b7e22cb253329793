"""MaxProd: the best single path, kept in log space so long paths never under- or overflow."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..kernels import affine_params
from ..kernels.affine_params import AffineParams
from ..kernels.exclusive import exclusive_max
from ..kernels.logspace import exp
from ..kernels.normalization import MAX_PROD, CentredPairsKernel
from ..kernels.tropical import maxplus
from ._log import add_log_abs_, can_overwrite, exp_readout_into, kept_log_abs, log_abs
from .base import Semiring, Sign, State, checked_flag, index_reduce, uses_methods_of


class MaxProd(Semiring):
    """Max over paths of the product of |local derivatives|.

    The state is ``log max|path product|`` (``-inf`` = no path). ``readout`` returns the linear
    value ``exp(state)``; pass ``log=True`` to read the log directly (finite where linear would
    overflow or underflow).
    """

    zero = (float("-inf"),)
    one = (0.0,)

    def __init__(self, log: bool = False) -> None:
        self.log = checked_flag(log, type(self).__name__, "log")

    def __repr__(self) -> str:
        return f"MaxProd(log={self.log})"

    def lift(self, w: Tensor) -> State:
        return (log_abs(w, self.state_dtype(w.dtype)),)

    def kept_lift(self, w: Tensor) -> State:
        if not uses_methods_of(self, MaxProd, "lift"):
            return self.lift(w)
        return (kept_log_abs(w, self.state_dtype(w.dtype)),)

    def scale_owned(self, a: State, w: Tensor) -> State:
        if not can_overwrite(w, a[0]):
            return self.scale(a, w)
        return (add_log_abs_(a[0], w),)

    def lift_log(self, log_abs: Tensor, sign: Sign = 1.0) -> State:
        return (log_abs.to(self.state_dtype(log_abs.dtype)),)

    def scale_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        return (a[0] + log_abs,)

    def scale_log_owned(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        if not can_overwrite(log_abs, a[0]):
            return self.scale_log(a, log_abs, sign)
        return (log_abs.add_(a[0]),)

    def matmul_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        return (maxplus(a[0], log_abs),)

    def uses_edge_signs(self) -> bool:
        return False

    def plus(self, a: State, b: State) -> State:
        return (torch.maximum(a[0], b[0]),)

    def times(self, a: State, b: State) -> State:
        return (a[0] + b[0],)

    def sum(self, a: State, dims: list[int], keepdim: bool = False) -> State:
        return (a[0].amax(dims, keepdim=keepdim),)

    def matmul(self, a: State, w: Tensor) -> State:
        # A compiled max-plus kernel instead of the generic broadcast-and-reduce blocks.
        return (maxplus(a[0], self.kept_lift(w)[0]),)

    def has_lifted_matmul(self) -> bool:
        return True

    def is_max_plus(self) -> bool:
        return uses_methods_of(self, MaxProd, "lift", "plus", "times", "sum", "zero", "one")

    def affine_params_kernel(self) -> Callable[..., AffineParams] | None:
        return affine_params.max_plus if self.is_max_plus() else None

    def matmul_lifted(self, a: State, lifted: State) -> State:
        return (maxplus(a[0], lifted[0]),)

    def readout(self, a: State) -> Tensor:
        return a[0] if self.log else exp(a[0])

    def readout_into(self, a: State, into: Any) -> Any:
        return exp_readout_into(self, MaxProd, a, into)

    def index_plus(self, dest: State, dim: int, index: Tensor, src: State) -> State:
        return (index_reduce(dest[0], dim, index, src[0], "amax"),)

    # --- fast paths of the message math -------------------------------------------------------
    def lift_is_multiplicative(self) -> bool:
        return True

    def prefix_plus(self, a: State, dim: int) -> State:
        return (a[0].cummax(dim).values,)

    def exclusive_plus(self, a: State) -> State | None:
        return (exclusive_max(a[0]),)

    def compiles_rowwise(self) -> bool:
        return True

    def normalization_kernel(self) -> CentredPairsKernel | None:
        return MAX_PROD
