"""Native forms of Entropy's and LogSum's compiled elementwise kernels (``native/log_space.c``),
each the ``native=`` of its ``compiled`` kernel: tried first where the compiled form would run.

Why: those kernels were the compiled calls of a first Entropy backward (and of a first LogSum
backward of a CNN); the first compiled call of a process pays inductor's start-up, seconds on
a CPU (``benchmarks/bench_first_call.py``). The loops compute the fused expressions in their
order with an exp and a log within one ulp (see ``log_space.c``), so values agree with the
compiled forms to an ulp or two and the arithmetic ones (mean, readout) are their bits.

Each form takes the kernel's arguments and returns ``NotImplemented`` unless every tensor is
float32 on the CPU, of one shape and strides, its entries one dense block, and the native
library is available (and not while torch.compile traces: a fused normalisation may call these
kernels inside its own graph). Shapes: whatever the kernel is called with, elementwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .native import (
    abs_xlogx_block_f32,
    entropy_mean_block_f32,
    entropy_plus_block_f32,
    entropy_readout_block_f32,
    entropy_readout_of_sums_block_f32,
    entropy_rows_block_f32,
    log_add_exp_block_f32,
    native_available,
    nonzero_abs_min_block_f32,
    norm_readout_block_f32,
)
from .shapes import dense_block


def _takes(*tensors: Tensor) -> bool:
    """Whether the native loops run over these tensors' memory, entry by entry alike."""
    first = tensors[0]
    return (
        not torch.compiler.is_compiling()
        and first.numel() > 0
        and all(
            isinstance(t, Tensor)
            and t.dtype == torch.float32
            and t.device.type == "cpu"
            and t.shape == first.shape
            and t.stride() == first.stride()
            for t in tensors
        )
        and native_available()
        and dense_block(first)
    )


def _like(t: Tensor) -> Tensor | None:
    """An empty tensor with ``t``'s strides (for a dense ``t``, ``empty_like``'s), or None."""
    out = torch.empty_like(t)
    return out if out.stride() == t.stride() else None


def xlogx(mag: Tensor) -> Any:
    """``xlogx(mag)`` of magnitudes in a new tensor (``logspace._xlogx``): the same loop as
    ``abs_xlogx``, so a product's ``|w| log|w|`` has one set of bits whichever asks."""
    return _into_new(lambda m, out: abs_xlogx_block_f32(m, None, out, negate=False), mag)


def abs_xlogx(w: Tensor) -> Any:
    """``(|w|, xlogx(|w|))`` in new tensors (``logspace._abs_xlogx``)."""
    if not _takes(w):
        return NotImplemented
    mag, out = _like(w), _like(w)
    if mag is None or out is None:
        return NotImplemented
    abs_xlogx_block_f32(w, mag, out, negate=False)
    return mag, out


def abs_neg_xlogx(w: Tensor, mag: Tensor, neg: Tensor) -> Any:
    """``mag = |w|``, ``neg = -xlogx(|w|)`` (``logspace._abs_neg_xlogx``)."""
    if not _takes(w, mag, neg):
        return NotImplemented
    abs_xlogx_block_f32(w, mag, neg, negate=True)
    return None


def entropy_mean(total: Tensor, weighted: Tensor, less: Tensor) -> Any:
    """``weighted = (weighted - less) / total`` where ``total > 0``, else 0, returned
    (``entropy._mean_kernel``); ``less`` 0-d or like ``total``."""
    one_less = isinstance(less, Tensor) and less.dim() == 0
    if one_less:
        if less.dtype != torch.float32 or less.device.type != "cpu" or not _takes(total, weighted):
            return NotImplemented
    elif not _takes(total, weighted, less):
        return NotImplemented
    entropy_mean_block_f32(total, weighted, less, per_entry=not one_less)
    return weighted


def _into_new(loop: Callable[..., None], *inputs: Tensor) -> Any:
    """``loop(*inputs, out)`` into a new tensor laid out as ``inputs[0]``, returned; or
    ``NotImplemented`` where the loops do not take the inputs."""
    if not _takes(*inputs):
        return NotImplemented
    out = _like(inputs[0])
    if out is None:
        return NotImplemented
    loop(*inputs, out)
    return out


def entropy_readout(log_z: Tensor, mean: Tensor) -> Any:
    """``log_z + mean`` where ``log_z`` is finite, else NaN, new (``entropy._entropy_readout``)."""
    return _into_new(entropy_readout_block_f32, log_z, mean)


def entropy_readout_into(log_z: Tensor, mean: Tensor, out: Tensor) -> Any:
    """``entropy_readout`` written into ``out`` (``entropy._entropy_readout_into``)."""
    if not _takes(log_z, mean, out):
        return NotImplemented
    entropy_readout_block_f32(log_z, mean, out)
    return out


def log_add_exp(a: Tensor, b: Tensor) -> Any:
    """``log(e^a + e^b)`` new (``logspace.log_add_exp``, the fused form's expression)."""
    return _into_new(log_add_exp_block_f32, a, b)


def entropy_plus(log_a: Tensor, r_a: Tensor, log_b: Tensor, r_b: Tensor) -> Any:
    """Entropy's plus as new (log Z, mean surprisal) (``entropy._entropy_plus``)."""
    if not _takes(log_a, r_a, log_b, r_b):
        return NotImplemented
    log_z, r = _like(log_a), _like(log_a)
    if log_z is None or r is None:
        return NotImplemented
    entropy_plus_block_f32(log_a, r_a, log_b, r_b, log_z, r)
    return log_z, r


def nonzero_magnitude_min(t: Tensor) -> Any:
    """The smallest non-zero ``|t|`` as a 0-d tensor, ``inf`` where none, NaN where ``t`` holds
    one (``shared_shift._nonzero_magnitude_min``)."""
    if not _takes(t):
        return NotImplemented
    return torch.tensor(nonzero_abs_min_block_f32(t), dtype=torch.float32)


# --- a normalisation's row readouts (kernels/normalization.py): [rows, n] and [rows, 1] shifts
def _rows_take(rows: tuple[Tensor, ...], shifts: tuple[Tensor, ...]) -> bool:
    """Contiguous float32 CPU [rows, n] tensors (n > 0) and contiguous [rows, 1] shifts."""
    first = rows[0]
    if torch.compiler.is_compiling() or first.dim() != 2 or first.shape[1] == 0:
        return False
    return (
        all(
            isinstance(t, Tensor)
            and t.dtype == torch.float32
            and t.device.type == "cpu"
            and t.shape == first.shape
            and t.is_contiguous()
            for t in rows
        )
        and all(
            isinstance(t, Tensor)
            and t.dtype == torch.float32
            and t.device.type == "cpu"
            and tuple(t.shape) == (first.shape[0], 1)
            and t.is_contiguous()
            for t in shifts
        )
        and native_available()
    )


def _norm_readout(kind: int, a: Tensor, shift: Tensor, x_hat: Tensor, total: Tensor) -> Any:
    """(the readout,) of ``norm_readout_block_f32``'s ``kind``, or ``NotImplemented``."""
    if not _rows_take((a, x_hat, total), (shift,)):
        return NotImplemented
    out = torch.empty_like(a)
    norm_readout_block_f32(kind, a, shift, x_hat, total, out)
    return (out,)


def max_prod_from_best(a: Tensor, shift: Tensor, x_hat: Tensor, best: Tensor) -> Any:
    """``normalization._max_prod_from_best``: ``(log max(best / n, a |1 - off|) + shift,)``."""
    return _norm_readout(0, a, shift, x_hat, best)


def log_sum_from_total(a: Tensor, shift: Tensor, x_hat: Tensor, total: Tensor) -> Any:
    """``normalization._log_sum_from_total``: the diagonal-corrected log sums plus the shift."""
    return _norm_readout(1, a, shift, x_hat, total)


def entropy_rows(log_z: Tensor, surprisal: Tensor) -> Any:
    """``normalization._entropy_rows``: (a, shift, r), the shifted masses with the same
    exponential as ``logspace.exp_``'s float32 loop, so the same bits as the eager form."""
    if not _rows_take((log_z, surprisal), ()):
        return NotImplemented
    a, r = torch.empty_like(log_z), torch.empty_like(log_z)
    shift = log_z.new_empty((log_z.shape[0], 1))
    entropy_rows_block_f32(log_z, surprisal, a, shift, r)
    return a, shift, r


def entropy_readout_of_sums(
    a: Tensor,
    r: Tensor,
    shift: Tensor,
    x_hat: Tensor,
    s_c: Tensor,
    t_c: Tensor,
    u_c: Tensor,
    log_n: Tensor,
) -> Any:
    """``normalization._entropy_readout_of_sums``: (log Z, mean surprisal) of the rows."""
    if not (
        _rows_take((a, r, x_hat, s_c, t_c, u_c), (shift,))
        and log_n.dim() == 0
        and log_n.dtype == torch.float32
    ):
        return NotImplemented
    log_z, mean = torch.empty_like(a), torch.empty_like(a)
    entropy_readout_of_sums_block_f32(
        a, r, shift, x_hat, (s_c, t_c, u_c), float(log_n), log_z, mean
    )
    return log_z, mean
