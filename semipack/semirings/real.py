"""Real: the ordinary (+, x) semiring. Its messages are gradients, so it must match autograd."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Semiring, State


class Real(Semiring):
    """Signed sum over paths of the product of local derivatives: the gradient itself."""

    zero = (0.0,)
    one = (1.0,)
    #: Rules give Real the op's own linear derivatives, so its values equal autograd's.
    linear_weights = True

    def lift(self, w: Tensor) -> State:
        return (w.to(self.state_dtype(w.dtype)),)

    def plus(self, a: State, b: State) -> State:
        return (a[0] + b[0],)

    def times(self, a: State, b: State) -> State:
        return (a[0] * b[0],)

    def sum(self, a: State, dims: list[int], keepdim: bool = False) -> State:
        return (a[0].sum(dims, keepdim=keepdim),)

    def scale(self, a: State, w: Tensor) -> State:
        return (a[0] * w,)

    def matmul(self, a: State, w: Tensor) -> State:
        return (torch.matmul(a[0], w.to(a[0].dtype)),)

    def index_plus(self, dest: State, dim: int, index: Tensor, src: State) -> State:
        return (dest[0].index_add(dim, index, src[0]),)
