"""Real: the ordinary (+, x) semiring. Its messages are gradients, so it must match autograd."""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.normalization import entry_gains
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

    # --- fast paths of the message math -------------------------------------------------------
    def lift_is_multiplicative(self) -> bool:
        return True

    def prefix_plus(self, a: State, dim: int) -> State:
        return (a[0].cumsum(dim),)

    def softmax_closed_form(
        self, m: State, probs: Tensor, log_probs: Tensor | None
    ) -> State | None:
        # Σ_i m_i y_i (δ_ij - y_j) = y_j (m_j - Σ_i m_i y_i): autograd's own formula.
        return (probs * (m[0] - (m[0] * probs).sum(-1, keepdim=True)),)

    def log_softmax_closed_form(self, m: State, log_probs: Tensor) -> State | None:
        # Σ_i m_i (δ_ij - p_j) = m_j - p_j Σ_i m_i: autograd's own formula.
        return (m[0] - log_probs.exp() * m[0].sum(-1, keepdim=True),)

    def normalization_closed_form(
        self, m: State, x_hat: Tensor, rstd: Tensor, gain: Tensor, gain_per_row: bool
    ) -> State | None:
        # With u_i = m_i g_i:  Σ_i u_i rstd (δ_ij - 1/n - x̂_i x̂_j / n)
        #                    = rstd (u_j - mean_i(u) - x̂_j mean_i(u x̂)).
        x_hat = x_hat.to(m[0].dtype)
        u = m[0] * entry_gains(gain, gain_per_row)
        centred = u - u.mean(-1, keepdim=True) - x_hat * (u * x_hat).mean(-1, keepdim=True)
        return (rstd[:, None] * centred,)
