"""Boolean: reachability through edges of non-zero weight."""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.exclusive import exclusive_any
from ..kernels.normalization import BOOLEAN, CentredPairsKernel
from ..kernels.weight_cache import WEIGHTS
from .base import Semiring, Sign, State


class Boolean(Semiring):
    """True where at least one path with all local derivatives non-zero exists."""

    zero = (False,)
    one = (True,)

    def component_dtypes(self, grad_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return (torch.bool,)

    def lift(self, w: Tensor) -> State:
        return (w != 0,)

    def lift_log(self, log_abs: Tensor, sign: Sign = 1.0) -> State:
        return (log_abs != float("-inf"),)  # a NaN weight is an edge, as in ``lift``

    def scale_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        return (a[0] & (log_abs != float("-inf")),)

    def matmul_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        return self.matmul(a, log_abs != float("-inf"))

    def uses_edge_signs(self) -> bool:
        return False

    def plus(self, a: State, b: State) -> State:
        return (a[0] | b[0],)

    def times(self, a: State, b: State) -> State:
        return (a[0] & b[0],)

    def sum(self, a: State, dims: list[int], keepdim: bool = False) -> State:
        out = a[0]
        for d in sorted(dims, reverse=True):
            out = out.any(d, keepdim=keepdim)
        return (out,)

    def matmul(self, a: State, w: Tensor) -> State:
        # Counting reachable predecessors with a float matmul is exact: the counts are sums of
        # 0s and 1s, so a count is > 0 exactly when one term is. A model weight's 0/1 matrix
        # is kept across passes (``kernels.weight_cache``).
        dtype = self.state_dtype(w.dtype)
        edges = WEIGHTS.derived(w, ("edges", dtype), lambda: (w != 0).to(dtype))
        return (torch.matmul(a[0].to(dtype), edges) > 0,)

    def index_plus(self, dest: State, dim: int, index: Tensor, src: State) -> State:
        hits = dest[0].to(torch.float32).index_add(dim, index, src[0].to(torch.float32))
        return (hits > 0,)

    # --- fast paths of the message math -------------------------------------------------------
    def lift_is_multiplicative(self) -> bool:
        return True

    def prefix_plus(self, a: State, dim: int) -> State:
        return (a[0].to(torch.uint8).cummax(dim).values.bool(),)

    def exclusive_plus(self, a: State) -> State | None:
        return (exclusive_any(a[0]),)

    def normalization_kernel(self) -> CentredPairsKernel | None:
        return BOOLEAN
