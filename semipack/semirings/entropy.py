"""Entropy of the path distribution, via the expectation semiring kept in normalised log form."""

from __future__ import annotations

import torch
from torch import Tensor

from ._log import can_overwrite, finite_or_zero, shifted_exp
from .base import Semiring, Sign, State, index_reduce, repair_underflow
from .log_sum import column_scaled


class Entropy(Semiring):
    """Shannon entropy (nats) of p(path) ∝ product of |local derivatives| along the path.

    The expectation semiring pairs ``<Z, Y>`` (Z = Σ w, Y = Σ w·(-log w) over paths). We store
    ``L = log Z`` and ``R = Y / Z`` (the mean path surprisal), which turns ``times`` into plain
    addition and keeps every number finite on deep graphs. Entropy is ``R + L``; it is NaN where
    no path exists (the distribution is empty).
    """

    components = ("log_normalizer", "mean_surprisal")
    zero = (float("-inf"), 0.0)
    one = (0.0, 0.0)

    def lift(self, w: Tensor) -> State:
        log_w = w.to(self.state_dtype(w.dtype)).abs().log_()
        surprisal = torch.where(torch.isfinite(log_w), -log_w, torch.zeros_like(log_w))
        return (log_w, surprisal)

    def scale_owned(self, a: State, w: Tensor) -> State:
        own = self.keeps_primitives_of(Entropy, "lift", "times", "scale")
        if not own or not can_overwrite(w, a[0]):
            return self.scale(a, w)
        log_w = w.abs_().log_()
        surprisal = log_w.neg().masked_fill_(~torch.isfinite(log_w), 0.0)
        return (log_w.add_(a[0]), surprisal.add_(a[1]))

    def lift_log(self, log_abs: Tensor, sign: Sign = 1.0) -> State:
        if not self._log_form_is_own():
            return Semiring.lift_log(self, log_abs, sign)
        log_w = log_abs.to(self.state_dtype(log_abs.dtype))
        return (log_w, _surprisal(log_w))

    def scale_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        if not self._log_form_is_own():
            return Semiring.scale_log(self, a, log_abs, sign)
        return (a[0] + log_abs, a[1] + _surprisal(log_abs))

    def scale_log_owned(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        own = self.keeps_primitives_of(Entropy, "scale_log") and self._log_form_is_own()
        if not own or not can_overwrite(log_abs, a[0]):
            return self.scale_log(a, log_abs, sign)
        surprisal = _surprisal(log_abs)
        return (log_abs.add_(a[0]), surprisal.add_(a[1]))

    def matmul_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        """``matmul`` with the weights' columns scaled to a maximum of 1 (see LogSum's)."""
        if not self._log_form_is_own() or not self.keeps_primitives_of(Entropy, "plus", "sum"):
            return Semiring.matmul_log(self, a, log_abs, sign)
        e, m = shifted_exp(a[0], -1)
        log_w = log_abs.to(e.dtype)
        scaled, c = column_scaled(log_w)
        # |w| log|w| = e^c w' log|w|: the common factor e^c cancels in the mean surprisal.
        scaled_log = torch.where(scaled > 0, scaled * log_w, 0.0)
        s = torch.matmul(e, scaled)
        t = torch.matmul(e * a[1], scaled) - torch.matmul(e, scaled_log)
        mean = torch.where(s > 0, t / s, torch.zeros_like(s))
        out = (s.log_().add_(m).add_(c), mean)
        return repair_underflow(self, a, lambda: self.lift_log(log_w), out, shift=m + c)

    def uses_edge_signs(self) -> bool:
        log_ops = ("lift_log", "scale_log", "scale_log_owned", "matmul_log")
        own = self.keeps_primitives_of(Entropy, *log_ops, "plus", "sum")
        return not (own and self._log_form_is_own())

    def _log_form_is_own(self) -> bool:
        return self.keeps_primitives_of(Entropy, "lift", "times")

    def plus(self, a: State, b: State) -> State:
        big = torch.logaddexp(a[0], b[0])
        safe = finite_or_zero(big)
        wa = (a[0] - safe).exp()
        wb = (b[0] - safe).exp()
        return (big, wa * a[1] + wb * b[1])

    def times(self, a: State, b: State) -> State:
        return (a[0] + b[0], a[1] + b[1])

    def sum(self, a: State, dims: list[int], keepdim: bool = False) -> State:
        big = torch.logsumexp(a[0], dims, keepdim=True)
        weights = (a[0] - finite_or_zero(big)).exp()
        mean = (weights * a[1]).sum(dims, keepdim=keepdim)
        return (big if keepdim else big.squeeze(dims), mean)

    def is_zero(self, a: State) -> Tensor:
        # Only the normaliser decides: a zero-mass state may carry any mean surprisal.
        return a[0] == float("-inf")

    def readout(self, a: State) -> Tensor:
        h = a[0] + a[1]
        return torch.where(torch.isfinite(a[0]), h, torch.full_like(h, float("nan")))

    def matmul(self, a: State, w: Tensor) -> State:
        # Σ_k e_k|w_kj| (R_k - log|w_kj|) = (e∘R) @ |w| - e @ (|w| log|w|): three BLAS calls.
        e, m = shifted_exp(a[0], -1)
        mag = w.to(e.dtype).abs()
        mag_log_mag = torch.where(mag > 0, mag * mag.log(), 0.0)  # 0 log 0 = 0 (xlogy is slow)
        s = torch.matmul(e, mag)
        t = torch.matmul(e * a[1], mag) - torch.matmul(e, mag_log_mag)
        mean = torch.where(s > 0, t / s, torch.zeros_like(s))
        return repair_underflow(self, a, lambda: self.lift(w), (s.log_().add_(m), mean), shift=m)

    def index_plus(self, dest: State, dim: int, index: Tensor, src: State) -> State:
        peak = finite_or_zero(index_reduce(dest[0], dim, index, src[0], "amax"))
        e_dest = (dest[0] - peak).exp()
        e_src = (src[0] - peak.index_select(dim, index)).exp()
        total = e_dest.index_add(dim, index, e_src)
        weighted = (e_dest * dest[1]).index_add(dim, index, e_src * src[1])
        mean = torch.where(total > 0, weighted / total, torch.zeros_like(total))
        return (total.log() + peak, mean)


def _surprisal(log_w: Tensor) -> Tensor:
    """``-log|w|`` where finite, else 0 (no edge; a NaN weight's NaN lives in ``log_w``), as
    ``lift`` computes it."""
    return log_w.neg().masked_fill_(~torch.isfinite(log_w), 0.0)
