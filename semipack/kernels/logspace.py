"""Shifts for log-space numerics: exponentiate without overflow, whatever the semiring."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .compiled import FUSED_MIN_ELEMENTS, compiled

#: From this many entries a logarithm of magnitudes looks for exact zeros first: torch's
#: vectorised log takes a slow path for each 0 it meets (430k entries, half of them zeros: 3.9 ms
#: against 0.43 ms without zeros, ``benchmarks/bench_kernel_costs.py``), and a ReLU network's
#: activations are half zeros.
ZERO_SAFE_MIN_ELEMENTS = 4096


def checks_on_host(t: Tensor) -> bool:
    """Whether a shortcut decided by reading a value back (``bool(t.any())``) pays on ``t``'s
    device. On the CPU it saves the work it skips. On an accelerator the read waits for every
    queued kernel, so the Python work of the next ops can no longer overlap with the device's:
    there the branch-free form runs, which gives the same values."""
    return t.device.type == "cpu"


def log_magnitude_(mag: Tensor) -> Tensor:
    """``mag.log_()`` for magnitudes (entries >= 0, or NaN), in place, with the same bits: exact
    zeros (``-inf``, no path) never reach torch's log. One reduction finds whether there are
    any; if so each zero is replaced by 1 before the log and the result gets ``-inf`` there.
    (A GPU's log has no slow path for zeros: there it is the plain log.)"""
    if mag.numel() < ZERO_SAFE_MIN_ELEMENTS or not checks_on_host(mag) or not bool(mag.amin() == 0):
        return mag.log_()
    zero = torch.sign(mag).neg_().add_(1.0)  # 1 at a zero, 0 elsewhere, NaN at NaN
    mag.add_(zero).log_()  # log 1 = 0 at the zeros
    # 1 / (1 / z - 1) in place: inf at a zero (z = 1), 0 elsewhere (z = 0), NaN at NaN
    return mag.sub_(zero.reciprocal_().sub_(1.0).reciprocal_())


def _log_plus_eager(mag: Tensor, shift: Tensor) -> Tensor:
    return log_magnitude_(mag).add_(shift)


def _log_plus_fused(mag: Tensor, shift: Tensor) -> Tensor:
    return mag.copy_(torch.log(mag) + shift)  # inductor writes it in place, in one loop


_log_plus = compiled(_log_plus_eager, _log_plus_fused, min_elements=FUSED_MIN_ELEMENTS)


def log_magnitude_plus_(mag: Tensor, shift: Tensor | float) -> Tensor:
    """``log_magnitude_(mag).add_(shift)``, in place: the step that ends every log-space sum
    (a product's ``log(e @ |w|) + shift``). Eagerly that is three passes over ``mag`` (the
    search for zeros, the log, the add); compiled, one, with the same ``-inf`` at zeros and
    NaN at NaN and a log within float rounding of torch's (a MiniLM feed-forward weight's
    LogSum message: 1.1 ms eagerly, 0.4 ms compiled, on one core). A shift that would
    broadcast ``mag`` to another shape or dtype takes the eager form, and so does an
    accelerator's tensor: there the log has no search for zeros, and the compiled call's
    guards cost more host time than the second kernel launch they save."""
    if (
        not checks_on_host(mag)
        or not isinstance(shift, Tensor)
        or shift.dtype != mag.dtype
        or shift.device != mag.device
        or torch.broadcast_shapes(mag.shape, shift.shape) != mag.shape
    ):
        return log_magnitude_(mag).add_(shift)
    if mag.is_contiguous() and (shift.numel() == 1 or shift.shape == mag.shape):
        # flat views: one compiled variant per dtype and kind of shift, whatever the rank
        flat_shift = shift.reshape(()) if shift.numel() == 1 else shift.reshape(-1)
        _log_plus(mag.view(-1), flat_shift)
        return mag
    return _log_plus(mag, shift)


def finite_surprisal(log_w: Tensor) -> Tensor:
    """``-log|w|`` where finite, else 0 (no edge; NaN): the surprisal of an edge, as a float op
    (see ``finite_or_zero``)."""
    return log_w.neg().nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def xlogx(mag: Tensor) -> Tensor:
    """``mag log mag`` for magnitudes (>= 0 or NaN) in one new tensor, with 0 log 0 = 0 and 0 at
    NaN: the same bits as ``mag.log() * mag`` masked where ``mag > 0`` fails, without a zero
    reaching torch's log (see ``log_magnitude_``) or a bool mask."""
    out = torch.sign(mag).neg_().add_(1.0)  # 1 at a zero, 0 elsewhere, NaN at NaN
    out.add_(mag).log_()  # log 1 = 0 at the zeros
    out.mul_(mag).add_(0.0)  # + 0.0: a -0.0 magnitude gives +0.0, as the masked form does
    return out.nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf"))


def finite_or_zero(x: Tensor) -> Tensor:
    """Replace non-finite shifts (rows with no path) by 0 so that ``x - shift`` stays defined."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)  # a float op: torch.where
    # on a random bool mask took 1.5 ms for 430k entries against 0.04 (bench_kernel_costs.py)


def shifted_exp(a: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """Return ``(exp(a - m), m)`` with ``m`` the finite max of ``a`` along ``dim`` (kept)."""
    m = finite_or_zero(a.amax(dim, keepdim=True))
    return (a - m).exp(), m


def _log_add_exp_eager(a: Tensor, b: Tensor) -> Tensor:
    """``log(e^a + e^b)``, entrywise (LogSum's plus; see ``fused_log_add_exp``)."""
    return torch.logaddexp(a, b)


def fused_log_add_exp(a: Tensor, b: Tensor) -> Tensor:
    """``log(e^a + e^b)`` as an expression for inductor (also inside other fused kernels)."""
    big, small = torch.maximum(a, b), torch.minimum(a, b)
    # log(1 + e) with e = e^(small - big) in (0, 1], where logaddexp has log1p: 1 + e rounds by
    # at most half an ulp of 1, an absolute error in log space, which is a relative error of
    # the magnitude e^out at float precision (as log1p's).
    out = big + torch.log(1.0 + torch.exp(small - big))
    # equal arguments, infinite ones included (-inf - -inf is NaN): big + log 2
    return torch.where(small == big, big + math.log(2.0), out)


#: ``log(e^a + e^b)`` (LogSum's and Entropy's plus) in one loop. torch.logaddexp on the CPU
#: evaluates log1p one entry at a time: 7.8-8.3 ms for 786k float32 entries on one core, where
#: inductor's fused form with a vectorised log took 1.3-2.7 ms (``bench_kernel_costs.py``, a
#: shared machine).
log_add_exp = compiled(_log_add_exp_eager, fused_log_add_exp, min_elements=FUSED_MIN_ELEMENTS)
