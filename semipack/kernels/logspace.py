"""Shifts for log-space numerics: exponentiate without overflow, whatever the semiring."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from . import log_space_native
from .compiled import FUSED_MIN_ELEMENTS, compile_enabled, compiled
from .native import (
    exp_block_f32,
    log_block_f32,
    log_plus_f32,
    native_available,
)
from .shapes import broadcast_shapes, dense_block

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


#: From this many entries ``exp_``, ``exp_into`` and ``log_magnitude_`` run compiled loops on
#: the CPU (float64, or float32 without the native library); the native float32 loops
#: (``native_loops``) run at every size.
#: ATen's CPU exp and log leave their vectorised loop for a scalar one on each group of 8 or 16
#: entries that holds a special value, and log-space states are full of them: exp(-inf) (a
#: state's "no path"), an exp that underflows (an entry far below its row's shift), log(0).
#: Two million float32 entries, one core: exp 1.2 ms on ordinary numbers, 8.6 ms with half of
#: them -inf, 38 ms all near -90; log 1.5 ms, 15 ms with half zeros. Inductor's loops stay
#: vectorised on every input (0.7-1.8 ms with a copy of the input; ``benchmarks/
#: bench_kernel_costs.py --only elementwise``), within one ulp of the exact value as torch's
#: are. Below this size a compiled call's guards cost more. The native float32 loops
#: (``kernels/native/elementwise.c``) are faster than inductor's on tensors that fit in the
#: cache (both are bound by memory beyond it) and pay no compiled call's guards (about 0.1 ms
#: a call, tens of calls in a pass).
SPECIAL_SAFE_MIN_ELEMENTS = 1 << 14


def _exp_eager(x: Tensor) -> Tensor:
    return x.exp_()


def _exp_fused(x: Tensor) -> Tensor:
    return x.copy_(torch.exp(x))  # inductor writes it in place, in one loop


def _exp_into_eager(x: Tensor, out: Tensor) -> Tensor:
    return torch.exp(x, out=out)


def _exp_into_fused(x: Tensor, out: Tensor) -> Tensor:
    return out.copy_(torch.exp(x))


def _log_eager(x: Tensor) -> Tensor:
    return x.log_()


def _log_fused(x: Tensor) -> Tensor:
    return x.copy_(torch.log(x))


_exp_in_place = compiled(_exp_eager, _exp_fused, min_elements=SPECIAL_SAFE_MIN_ELEMENTS)
_exp_into = compiled(_exp_into_eager, _exp_into_fused, min_elements=SPECIAL_SAFE_MIN_ELEMENTS)
_log_in_place = compiled(_log_eager, _log_fused, min_elements=SPECIAL_SAFE_MIN_ELEMENTS)


def on_memory(t: Tensor, shape: Sequence[int], stride: Sequence[int]) -> Tensor:
    """A new tensor on ``t``'s memory (from its storage offset) with ``shape`` and ``stride``,
    and no base: a view would carry ``t``, and torch.compile guards on a base's sizes and
    strides; a new tensor object also ends weak references and memos keyed by ``t``."""
    fresh = torch.empty(0, dtype=t.dtype, device=t.device)
    return fresh.set_(t.untyped_storage(), t.storage_offset(), tuple(shape), tuple(stride))


def _flat(t: Tensor) -> Tensor | None:
    """``t``'s entries as a 1-D view in memory order, or None where its memory is not one dense
    block (overlapping or with gaps, ``dense_block``): an elementwise kernel may then run over
    the view, whatever the dims' order (a convolution's channels-last messages, a transposed
    state)."""
    if not dense_block(t):
        return None
    return on_memory(t, (t.numel(),), (1,))  # no base: one compiled variant per layout


def flat_views(*tensors: Tensor) -> list[Tensor] | None:
    """The 1-D views (``_flat``: in memory order, without a base) of tensors of one shape and
    layout on one device, or None where one is not a dense block, the layouts differ, or
    torch.compile is tracing. Why: a compiled elementwise kernel called on the tensors
    themselves is compiled again for every new pattern of size-1 dims (a 1 x 1 convolution's
    weight beside a 3 x 3 one's: torch.compile specialises sizes 0 and 1) and every base a
    view carries, until its recompilation limit; on one flat view it compiles once."""
    first = tensors[0]
    if torch.compiler.is_compiling() or not all(
        t.shape == first.shape and t.stride() == first.stride() and t.device == first.device
        for t in tensors
    ):
        return None
    flat = [_flat(t) for t in tensors]
    return None if any(f is None for f in flat) else flat


def shaped_like(flat: Tensor, like: Tensor) -> Tensor:
    """A result computed over ``flat_views`` (1-D, in ``like``'s memory order) with ``like``'s
    shape and strides, on the result's own memory."""
    return on_memory(flat, like.shape, like.stride())


def flat_on_host(*tensors: Tensor) -> list[Tensor] | None:
    """The 1-D views (``_flat``) the compiled elementwise forms run over, or None where they do
    not apply: CPU float32 or float64 tensors of one shape and layout, each one dense block, of
    at least ``SPECIAL_SAFE_MIN_ELEMENTS`` entries; not while torch.compile traces a kernel
    that calls these functions (a fused normalisation's shifted exponential: ``set_`` fails in
    its fake tensors, and inductor fuses the plain op anyway)."""
    first = tensors[0]
    if torch.compiler.is_compiling():
        return None
    if first.numel() < SPECIAL_SAFE_MIN_ELEMENTS or not all(
        checks_on_host(t)
        and t.dtype in (torch.float32, torch.float64)
        and t.shape == first.shape
        and t.dtype == first.dtype
        and t.stride() == first.stride()
        for t in tensors
    ):
        return None
    flat = [_flat(t) for t in tensors]
    return None if any(f is None for f in flat) else flat


def native_loops(t: Tensor) -> bool:
    """Whether the hand-written float32 loops (``native.exp_f32``, ``native.log_plus_f32``)
    take ``t``: a float32 CPU tensor, with the native library available. They take about half
    the compiled loops' time on tensors in cache and pay no per-call guards, within one ulp
    too. They take such a tensor at every size (one dense block, not empty): with a size
    threshold, two paths that lift the same values in tensors of different sizes (a depthwise
    kernel's log of x, the per-tap path's of its padded copy) got torch's bits on one side and
    the loop's on the other."""
    return t.dtype == torch.float32 and t.is_cpu and native_available()


def _native_block(t: Tensor) -> bool:
    """Whether the native loops run over ``t``'s memory: ``native_loops``, not empty, one dense
    block, and not traced by torch.compile. Checked here, once, so that the call itself is
    a bare ctypes call: on a tensor of a few entries the loops then cost about what torch's
    op does (a checked call through flat views cost 20 us more)."""
    # Tracing first: under torch.compile the answer is no, and asking ``native_loops`` there
    # would trace into the library's cached checks (dynamo warned about their lru_cache).
    return (
        not torch.compiler.is_compiling() and native_loops(t) and t.numel() > 0 and dense_block(t)
    )


def exp_(x: Tensor) -> Tensor:
    """``x.exp_()``, in place, without ATen's scalar slow path on -inf and underflow (see
    ``SPECIAL_SAFE_MIN_ELEMENTS``): the exponential of a log-space state or of its shifted
    entries. A float32 CPU tensor runs the native loop (``native_loops``), a float64 one the
    compiled loop. An accelerator's tensor (no slow path there) or one whose memory is not one
    dense block takes torch's."""
    if _native_block(x):
        exp_block_f32(x, x)
        return x
    flat = flat_on_host(x)
    if flat is None:
        return x.exp_()
    _exp_in_place(*flat)
    return x


def exp_into(x: Tensor, out: Tensor) -> Tensor:
    """``torch.exp(x, out=out)`` (a readout into the memory of ``p.semiring_grad``), vectorised
    on every input like ``exp_``."""
    if (
        _native_block(x)
        and out.dtype == x.dtype
        and out.device == x.device
        and out.shape == x.shape
        and out.stride() == x.stride()
    ):
        exp_block_f32(x, out)
        return out
    flat = flat_on_host(x, out)
    if flat is None:
        return torch.exp(x, out=out)
    _exp_into(*flat)
    return out


def exp(x: Tensor) -> Tensor:
    """``torch.exp(x)`` in a new tensor: ``exp_into`` a fresh one, so a readout and a readout
    written into earlier memory have the same bits."""
    return exp_into(x, torch.empty_like(x))


def log_magnitude_(mag: Tensor) -> Tensor:
    """``mag.log_()`` for magnitudes (entries >= 0, or NaN), in place: exact zeros (``-inf``,
    no path) never reach ATen's scalar slow path. A dense float32 CPU tensor takes the native
    loop at every size (``native_loops``); float64 from ``SPECIAL_SAFE_MIN_ELEMENTS`` entries
    the compiled log (both vectorised on zeros too); otherwise, from ``ZERO_SAFE_MIN_ELEMENTS``
    entries, one reduction finds whether there are zeros, and if so each is replaced by 1
    before torch's log and the result gets ``-inf`` there (the same bits as ``mag.log_()``).
    (A GPU's log has no slow path for zeros: there it is the plain log.)"""
    if _native_block(mag):
        log_block_f32(mag)
        return mag
    if (
        mag.numel() < ZERO_SAFE_MIN_ELEMENTS
        or not checks_on_host(mag)
        or torch.compiler.is_compiling()  # traced into a fused kernel: no host reads
    ):
        return mag.log_()
    flat = flat_on_host(mag) if not native_loops(mag) and compile_enabled() else None
    if flat is not None:
        _log_in_place(*flat)
        return mag
    if not bool(mag.amin() == 0):
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
    LogSum message: 1.1 ms eagerly, 0.4 ms compiled, on one core). Float32 CPU tensors take
    the native loop (``native_loops``) at every size: one pass, cheaper than the eager form's
    three even on a few entries. A shift that would
    broadcast ``mag`` to another shape or dtype takes the eager form, and so does an
    accelerator's tensor: there the log has no search for zeros, and the compiled call's
    guards cost more host time than the second kernel launch they save."""
    if (
        not checks_on_host(mag)
        or torch.compiler.is_compiling()  # traced into a fused kernel: the plain ops
        or not isinstance(shift, Tensor)
        or shift.dtype != mag.dtype
        or shift.device != mag.device
        or broadcast_shapes(mag.shape, shift.shape) != mag.shape
    ):
        return log_magnitude_(mag).add_(shift)
    if shift.numel() == 1 and _native_block(mag):  # the common case, one bare call
        log_block_f32(mag, shift)
        return mag
    # flat (``_flat``): one compiled variant per dtype and kind of shift, whatever the rank
    # and the order of the dims in memory
    same_layout = shift.shape == mag.shape and shift.stride() == mag.stride()
    if shift.numel() == 1 or same_layout:
        flat, flat_shift = _flat(mag), _flat(shift)
        if flat is not None and flat_shift is not None:
            if native_loops(mag):
                whole = flat_shift.view(1, -1) if same_layout else flat_shift
                log_plus_f32(flat.view(1, -1), whole)
            else:
                _log_plus(flat, flat_shift)
            return mag
    rows = _rows(mag, shift)
    if rows is not None:
        if native_loops(mag):
            log_plus_f32(*rows)
        else:
            _log_plus(*rows)
        return mag
    # Any other broadcast: compiled, each rank and pattern of size-1 dims was a variant of its
    # own, and a run over several models reached torch.compile's recompilation limit
    return log_magnitude_(mag).add_(shift)


def _rows(mag: Tensor, shift: Tensor) -> tuple[Tensor, Tensor] | None:
    """``mag`` as [rows, cols] and a shift per row (``shift`` of ``mag``'s shape with a last
    dim of 1: a row maximum) as [rows, 1], both contiguous views without a base (``_flat``:
    one compiled variant, whatever the rank); None for any other pair."""
    if (
        mag.dim() == 0
        or shift.shape != (*mag.shape[:-1], 1)
        or not mag.is_contiguous()
        or not shift.is_contiguous()
    ):
        return None
    cols = mag.shape[-1]
    rows = mag.numel() // max(cols, 1)
    return on_memory(mag, (rows, cols), (cols, 1)), on_memory(shift, (rows, 1), (1, 1))


def precise_log_floor(dtype: torch.dtype) -> float:
    """log of the smallest sum of products that BLAS returns to full relative precision in
    ``dtype``: below ``tiny / eps`` the subnormal terms' absolute error is no longer negligible
    (float32: about -71.4; float64: about -672). Here, below the semirings, so that the kernels
    that flag such sums (``affine_params``) and the semirings' repair read one definition."""
    info = torch.finfo(dtype)
    return math.log(info.tiny) - math.log(info.eps)


def finite_surprisal(log_w: Tensor) -> Tensor:
    """``-log|w|`` where finite, else 0 (no edge; NaN): the surprisal of an edge, as a float op
    (see ``finite_or_zero``)."""
    return log_w.neg().nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def _xlogx_eager(mag: Tensor) -> Tensor:
    out = torch.sign(mag).neg_().add_(1.0)  # 1 at a zero, 0 elsewhere, NaN at NaN
    out.add_(mag).log_()  # log 1 = 0 at the zeros
    out.mul_(mag).add_(0.0)  # + 0.0: a -0.0 magnitude gives +0.0, as the masked form does
    return out.nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf"))


def _xlogx_fused(mag: Tensor) -> Tensor:
    return torch.where(mag > 0, mag * torch.log(mag), 0.0)


_xlogx = compiled(
    _xlogx_eager,
    _xlogx_fused,
    min_elements=SPECIAL_SAFE_MIN_ELEMENTS,
    native=log_space_native.xlogx,
)


def xlogx(mag: Tensor) -> Tensor:
    """``mag log mag`` for magnitudes (>= 0 or NaN) in one new tensor, with 0 log 0 = 0 and 0 at
    NaN: ``mag.log() * mag`` masked where ``mag > 0`` fails. Eagerly (small or strided tensors,
    an accelerator's) with those bits and without a zero reaching torch's log (see
    ``log_magnitude_``) or a bool mask; on the CPU from ``SPECIAL_SAFE_MIN_ELEMENTS`` entries
    one loop, with a log within float rounding of torch's: float32 the native one
    (``log_space_native``), float64 the compiled form."""
    flat = flat_on_host(mag) if mag.is_contiguous() else None  # the result comes contiguous
    if flat is None:
        return _xlogx_eager(mag)
    return _xlogx(*flat).view(mag.shape)


def _abs_xlogx_eager(w: Tensor) -> tuple[Tensor, Tensor]:
    mag = w.abs()
    return mag, _xlogx_eager(mag)


def _abs_xlogx_fused(w: Tensor) -> tuple[Tensor, Tensor]:
    mag = w.abs()
    return mag, _xlogx_fused(mag)


_abs_xlogx = compiled(
    _abs_xlogx_eager,
    _abs_xlogx_fused,
    min_elements=SPECIAL_SAFE_MIN_ELEMENTS,
    native=log_space_native.abs_xlogx,
)


def abs_and_xlogx(w: Tensor) -> tuple[Tensor, Tensor]:
    """``(|w|, xlogx(|w|))`` (Entropy's edge magnitudes and their ``|w| log|w|``): where
    ``xlogx`` runs as one loop (native or compiled), both in one loop over ``w`` (an
    activation's, at every pass), with the bits of ``w.abs()`` then ``xlogx``."""
    flat = flat_on_host(w) if w.is_contiguous() else None
    if flat is None:
        mag = w.abs()
        return mag, xlogx(mag)
    mag, mag_log_mag = _abs_xlogx(*flat)
    return mag.view(w.shape), mag_log_mag.view(w.shape)


def batch_stacked(t: Tensor) -> Tensor | None:
    """An empty tensor of shape [2N, *t.shape[1:]] (``t``: [N, ...]) whose halves ``[:N]`` and
    ``[N:]`` have ``t``'s strides: two tensors like ``t`` in one, so that one call of a
    batch-summing op (a convolution's weight gradient) takes both. None where ``t``'s batch dim
    is not the outermost of one dense block (another layout than contiguous or channels-last)."""
    if t.dim() == 0 or t.shape[0] == 0 or _flat(t) is None:
        return None
    if t.stride(0) * t.shape[0] != t.numel():
        return None
    return torch.empty_strided(
        (2 * t.shape[0], *t.shape[1:]), t.stride(), dtype=t.dtype, device=t.device
    )


def _abs_neg_xlogx_eager(w: Tensor, mag: Tensor, neg: Tensor) -> None:
    torch.abs(w, out=mag)
    torch.neg(_xlogx_eager(mag), out=neg)


def _abs_neg_xlogx_fused(w: Tensor, mag: Tensor, neg: Tensor) -> None:
    magnitude = w.abs()
    mag.copy_(magnitude)
    neg.copy_(-_xlogx_fused(magnitude))


_abs_neg_xlogx = compiled(
    _abs_neg_xlogx_eager,
    _abs_neg_xlogx_fused,
    min_elements=SPECIAL_SAFE_MIN_ELEMENTS,
    native=log_space_native.abs_neg_xlogx,
)


def stacked_magnitudes(x: Tensor) -> Tensor | None:
    """``|x|`` and ``-xlogx(|x|)`` stacked along dim 0 (``batch_stacked``): [2N, ...], in one
    loop over ``x`` where it runs compiled, with the bits of ``abs_and_xlogx`` (the second half
    negated). Why: Entropy's ``Σ e·r |x| - Σ e |x| log|x|`` over a batch is then one sum over
    2N examples, ``[e·r; e]`` against this tensor. None where ``batch_stacked`` is."""
    out = batch_stacked(x)
    if out is None:
        return None
    n = x.shape[0]
    mag, neg = out[:n], out[n:]
    flat = flat_on_host(x, mag, neg)
    if flat is None:
        _abs_neg_xlogx_eager(x, mag, neg)
    else:
        _abs_neg_xlogx(*flat)
    return out


def finite_or_zero(x: Tensor) -> Tensor:
    """Replace non-finite shifts (rows with no path) by 0 so that ``x - shift`` stays defined."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)  # a float op: torch.where
    # on a random bool mask took 1.5 ms for 430k entries against 0.04 (bench_kernel_costs.py)


def shifted_exp(a: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """Return ``(exp(a - m), m)`` with ``m`` the finite max of ``a`` along ``dim`` (kept)."""
    m = finite_or_zero(a.amax(dim, keepdim=True))
    return exp_(a - m), m


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
#: shared machine). Float32 host tensors take the native loop of the same expression.
log_add_exp = compiled(
    _log_add_exp_eager,
    fused_log_add_exp,
    min_elements=FUSED_MIN_ELEMENTS,
    native=log_space_native.log_add_exp,
)
