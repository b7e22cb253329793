"""Fused layer_norm / batch_norm (train) messages: the Jacobian is built inside the reduction.

With x̂ = (x - mean) * rstd over the n entries of a row and y_i = g_i x̂_i + b_i,

    J_ij = g_i * rstd * J'_ij,    J'_ij = δ_ij - (1 + x̂_i x̂_j) / n,

where g is per entry (layer_norm) or one value per row (batch_norm's channel). Every semiring
with a multiplicative lift takes the gain on the messages first (m'_i = m_i ⊗ lift(g_i)), the
rstd (and a per-row gain) on the result last, and only

    out'_rj = ⊕_i m'_ri ⊗ lift(J'_rij)

is left: O(n^2) pairs as written, O(n log n) in the native kernels of long rows (train-mode
batch norm; see ``kernels.normalization``). A semiring declares how:
``Semiring.normalization_closed_form`` (Real: the whole message in closed form) or
``Semiring.normalization_kernel``, its fused kernels of out' (``kernels.normalization``: a
broadcast over [rows, j, i] reduced over i, which inductor fuses so that no [rows, n, n] tensor
exists, and optionally a hand-written float32 kernel).
Without a native kernel below ``COMPILE_MIN_PAIRS`` pairs or with compilation switched off,
or for semirings without either, ``normalized_messages`` returns None and the caller
contracts the dense Jacobian (``contract_rows``), which is also each kernel's eager fallback.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..kernels.affine_params import CHANNEL_REDUCE, NATIVE_FORMS, AffineParams
from ..kernels.compiled import FUSED_MIN_ELEMENTS, compile_enabled, compiled
from ..kernels.logspace import checks_on_host
from ..kernels.native import native_available
from ..kernels.normalization import (
    CentredPairsKernel,
    centred_pairs,
    entry_gains,
    pair_magnitudes,
)
from ..semirings import Semiring, State
from ..semirings.base import kernel_owner
from .jacobian import contract_rows, identity_block

__all__ = [
    "COMPILE_MIN_PAIRS",
    "affine_param_messages",
    "centred_block",
    "centred_pairs",
    "compiled_normalization",
    "native_kernel",
    "normalized_messages",
    "pair_magnitudes",
]

#: Use the compiled kernels from this many (row, i, j) pairs up: below it the dense contraction
#: is fast enough, and compiling (seconds, once per semiring and dtype) would not pay off.
COMPILE_MIN_PAIRS = 1 << 24


# --- eager fallbacks: the dense contraction of J' ------------------------------------------------
def centred_block(x_hat: Tensor) -> Callable[[slice, slice], Tensor]:
    """Jacobian blocks of J' for ``contract_rows``: [rows, n (output i), cols (input j)]."""
    n = x_hat.shape[-1]

    def jac(rows: slice, cols: slice) -> Tensor:
        xh = x_hat[rows]
        eye = identity_block(n, cols, xh.dtype, xh.device)
        return eye[None] - (1.0 + xh[:, :, None] * xh[:, None, cols]) / n

    return jac


def dense_contraction(sr: Semiring) -> Callable[..., State]:
    """``(*m, x_hat) -> state``: the messages through the rows by the dense contraction of J',
    the reference the fused kernels of ``sr.normalization_kernel()`` are held to."""
    spec = sr.normalization_kernel()
    if spec is None:
        raise ValueError(f"{sr.name} has no normalization kernel")

    def eager(*args: Tensor) -> State:
        *m, x_hat = args
        if spec.as_floats:
            m = [m[0] != 0]  # the fused kernel's 0/1 float form back to booleans
        return contract_rows(sr, tuple(m), centred_block(x_hat), x_hat.shape[-1])

    eager.__name__ = eager.__qualname__ = f"dense_{type(sr).__name__}"
    return eager


@functools.cache
def compiled_normalization(owner: type[Semiring]) -> Callable[..., State]:
    """The fused kernel of ``owner().normalization_kernel()`` compiled, with the dense
    contraction of J' as its eager fallback (``kernel.eager``); built once per built-in class
    (``kernel_owner``)."""
    sr = owner()
    return compiled(dense_contraction(sr), sr.normalization_kernel().fused)


# --- dispatch ------------------------------------------------------------------------------------
def normalized_messages(
    sr: Semiring,
    m: State,
    x_hat: Tensor,
    rstd: Tensor,
    gain: Tensor,
    gain_per_row: bool,
    mode: str = "auto",
) -> State | None:
    """Messages through normalisation rows, or None where the caller should use the dense path.

    ``m``, ``x_hat``: [rows, n]; ``rstd``: [rows]; ``gain``: [n] (per entry), [rows]
    (``gain_per_row``) or [rows, n] (per row and entry). ``mode``: ``"auto"`` (the native
    kernel at any size where there is one, else the compiled kernel from
    ``COMPILE_MIN_PAIRS`` pairs up when compilation is on, else None),
    ``"compiled"`` (always the fused kernel, which falls back to its eager form if compiling
    fails) or ``"eager"`` (the kernel's dense fallback).
    On float32, semirings whose kernel has a hand-written form (MaxProd, LogSum, Entropy) use
    it where the native library is available, with or without compilation.
    """
    own = sr.normalization_closed_form(m, x_hat, rstd, gain, gain_per_row)
    if own is not None:
        return own
    spec = sr.normalization_kernel()
    if spec is None or not sr.lift_is_multiplicative() or not _kernel_inputs(sr, m, x_hat):
        return None
    rows, n = x_hat.shape
    native = native_kernel(spec, x_hat)
    if mode == "auto":
        # the hand-written kernel costs nothing to start, so it serves rows of any size; the
        # compiled one pays off from COMPILE_MIN_PAIRS pairs up
        threshold = spec.compile_min_pairs or COMPILE_MIN_PAIRS
        compiled_pays = compile_enabled() and rows * n * n >= threshold
        if native is None and not compiled_pays:
            return None
        mode = "compiled"
    if mode not in ("compiled", "eager"):
        raise ValueError(f"mode must be 'auto', 'compiled' or 'eager', got {mode!r}")
    owner = kernel_owner(sr, "normalization_kernel")
    # a user's instance gets no kernel compiled and kept for it (one per instance): the dense form
    kernel = compiled_normalization(owner) if isinstance(owner, type) else dense_contraction(sr)
    if gain_per_row:
        row_weight = rstd * gain
    else:
        m = sr.scale(m, entry_gains(gain, False))
        row_weight = rstd
    if spec.as_floats:
        m = (m[0].to(x_hat.dtype),)
    args = (*(c.contiguous() for c in m), x_hat.contiguous())
    # Messages are never differentiated: without grad mode, the compiled kernel has one guard
    # state whether it is called inside a backward or not (no recompilation).
    with torch.no_grad():
        if mode == "eager":
            out = getattr(kernel, "eager", kernel)(*args)  # the compiled kernel's dense form
        else:
            out = native(*args) if native is not None else kernel(*args)
        if mode == "compiled" and spec.all_pairs:
            out = _fix_outliers(sr, m, x_hat, tuple(out), spec.as_floats)
    return sr.scale(tuple(out), row_weight[:, None])


def _kernel_inputs(sr: Semiring, m: State, x_hat: Tensor) -> bool:
    """Whether the fused kernels may take these rows: finite x̂, and messages without NaN or an
    infinite weight (+inf in a component whose "no path" is -inf). They shift each row by its
    largest message and drop NaN in their maxima, so such a row would come out partly finite;
    the dense Jacobian gives what the definition does (a NaN or infinite message reaches every
    output of its row that it has an edge to). On a GPU one value is read back for all the
    checks (each read waits for the queued kernels); on the CPU each is read as it comes."""
    if x_hat.numel() == 0:
        return True
    # One reduction per tensor, no full-size mask: min and max propagate NaN, and an infinity
    # is the extreme it is.
    low, high = torch.aminmax(x_hat)
    tops = [(c.amax(), zero) for c, zero in zip(m, sr.zero, strict=True) if c.is_floating_point()]
    if checks_on_host(x_hat):  # each read as it comes: a few small ops fewer per layer norm
        return (
            math.isfinite(low)
            and math.isfinite(high)
            and not any(_poisoned(float(top), zero) for top, zero in tops)
        )
    flags = [~torch.isfinite(low), ~torch.isfinite(high)]
    flags += [_poisoned(top, zero) for top, zero in tops]
    return not bool(torch.stack(flags).any())


def _poisoned(top: Tensor | float, zero: float) -> Tensor | bool:
    """Whether a message component's largest entry ``top`` (a tensor or a number) bars the
    fused kernels: NaN, or ``+inf`` where the component's "no path" is not ``+inf`` (there it
    is an infinite weight; where "no path" is ``+inf`` only NaN is bad)."""
    nan = top != top
    return nan if zero == float("inf") else nan | (top == float("inf"))


def native_kernel(spec: CentredPairsKernel, x_hat: Tensor) -> Callable[..., State] | None:
    """The semiring's hand-written kernel where it can run on these rows: float32 CPU tensors
    (the C code reads host memory: a CUDA tensor's pointer must never reach it) and the native
    library available; else None."""
    if spec.native is None or x_hat.dtype != torch.float32 or x_hat.device.type != "cpu":
        return None
    return spec.native if native_available() else None


def _fix_outliers(sr: Semiring, m: State, x_hat: Tensor, out: State, as_floats: bool) -> State:
    """Recompute, exactly and with the semiring's own ops, the columns j with
    x̂_j² > (n - 2) / 2, where the all-pairs kernels' diagonal correction does not apply."""
    n = x_hat.shape[-1]
    rows, cols = torch.nonzero(x_hat * x_hat > (n - 2) / 2, as_tuple=True)
    if rows.numel() == 0:
        return out
    xh = x_hat[rows]  # [k, n]: the outlier's row, entries i
    t = xh.gather(1, cols[:, None])  # [k, 1]: x̂_j
    jac = -(1.0 + xh * t) / n
    jac[torch.arange(rows.numel(), device=cols.device), cols] += 1.0  # δ_ij
    state = tuple(p[rows] for p in m)
    if as_floats:
        state = (state[0] != 0,)
    fixed = sr.sum(sr.scale(state, jac.to(x_hat.dtype)), [1])
    out = tuple(o.clone() for o in out)
    for o, f in zip(out, fixed, strict=True):
        o[rows, cols] = f.to(o.dtype)
    return out


# --- the gain's and bias's messages of a per-channel affine map ----------------------------------
def affine_param_messages(
    sr: Semiring, m: State, x: Tensor, mean: Tensor | None = None, invstd: Tensor | None = None
) -> tuple[State, State]:
    """(gain, bias) messages of ``y = g_c x̂ + b_c`` with ``x̂ = (x - mean) * invstd``: per
    channel c, ``⊕ of m ⊗ lift(x̂)`` and ``⊕ of m`` over the channel's entries.

    ``m``'s parts and ``x``: [A, C, B] in the state dtype (the channel on dim 1; the sums run
    over dims 0 and 2); ``mean`` and ``invstd`` broadcast against ``x`` (``[1, C, 1]``), or
    are both None where ``x`` is x̂ already. Returns two [C] states. From
    ``FUSED_MIN_ELEMENTS`` entries a semiring with ``affine_params_kernel`` runs it compiled
    (one pass, nothing message-sized written); the channels it flags (a gain sum that may have
    underflowed, a non-finite x̂, a NaN or ``+inf`` message) are recomputed with ``scale`` and
    ``sum``.
    """
    fused = sr.affine_params_kernel()
    owner = kernel_owner(sr, "affine_params_kernel") if fused is not None else None
    native_form = NATIVE_FORMS.get(fused) if isinstance(owner, type) else None
    found = native_form(*m, x, mean, invstd) if native_form is not None else None
    if (
        found is None
        and isinstance(owner, type)
        and compile_enabled()
        and x.numel() >= FUSED_MIN_ELEMENTS
        and all(p.dtype == x.dtype for p in m)
    ):
        with torch.no_grad():
            found = compiled_affine_params(owner)(*m, x, *_centring(x, mean, invstd))
    if found is None:
        x_hat = x if mean is None or invstd is None else (x - mean) * invstd
        return _generic_sums(sr, m, x_hat)
    gain, bias, recompute = found
    if recompute is not None:
        gain, bias = _recomputed(sr, m, x, *_centring(x, mean, invstd), gain, bias, recompute)
    return gain, bias


def _centring(x: Tensor, mean: Tensor | None, invstd: Tensor | None) -> tuple[Tensor, Tensor]:
    """(mean, invstd) for the kernels, which centre x themselves: zeros and ones where x is
    x̂ already (both None), broadcasting as ``[1, 1, 1]``."""
    if mean is None or invstd is None:
        mean = x.new_zeros((1, 1, 1))
        return mean, torch.ones_like(mean)
    return mean, invstd


def _generic_sums(sr: Semiring, m: State, x_hat: Tensor) -> tuple[State, State]:
    dims = list(CHANNEL_REDUCE)
    return sr.sum(sr.scale(m, x_hat), dims), sr.sum(m, dims)


def _affine_params_generic(sr: Semiring, *args: Tensor) -> AffineParams:
    """The reference: the semiring's ``scale`` by x̂ and ``sum`` (nothing to recompute)."""
    *m, x, mean, invstd = args
    return (*_generic_sums(sr, tuple(m), (x - mean) * invstd), None)


@functools.cache
def compiled_affine_params(owner: type[Semiring]) -> Callable[..., AffineParams]:
    """``owner().affine_params_kernel()`` compiled, with the generic ops as its eager form;
    built once per built-in class (``kernel_owner``)."""
    sr = owner()

    def eager(*args: Tensor) -> AffineParams:
        return _affine_params_generic(sr, *args)

    eager.__name__ = eager.__qualname__ = f"affine_params_{owner.__name__}"
    return compiled(eager, sr.affine_params_kernel())


def _recomputed(
    sr: Semiring,
    m: State,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    gain: State,
    bias: State,
    channels: Tensor,
) -> tuple[State, State]:
    """The kernel's (gain, bias) with the ``channels`` ([C] bool) it flagged recomputed by the
    generic ops: a gain sum that may have underflowed, or an input where the generic ops'
    conventions for infinite weights and NaN apply."""
    if not bool(channels.any()):
        return gain, bias
    picked_channels = channels.nonzero().flatten()

    def picked(t: Tensor) -> Tensor:
        return t.index_select(1, picked_channels) if t.shape[1] != 1 else t

    exact = _affine_params_generic(
        sr, *(picked(p) for p in m), picked(x), picked(mean), picked(invstd)
    )
    out = []
    for kernel_state, exact_state in zip((gain, bias), exact[:2], strict=True):
        state = tuple(c.clone() for c in kernel_state)
        for c, e in zip(state, exact_state, strict=True):
            c[picked_channels] = e.to(c.dtype)
        out.append(state)
    return out[0], out[1]
