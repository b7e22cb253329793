"""Cut a state's entries where an activation is off, in one pass over memory.

A ReLU's edges exist where its input is above the threshold; elsewhere the message holds the
semiring's zero (``-inf`` for log-space components). ``torch.where(x <= threshold, zero, part)``
says it, but eagerly it materialises a boolean mask and takes a slow select (6 ms for the
1.6M entries of a ResNet stem on one core); the float-op form in ``rules/pointwise.py`` takes
five passes (1 ms). Compiled, the select is one loop that reads ``x`` and ``part`` once and
writes the result once (0.25 ms), with the same bits: a select copies, it does not round.
float32 CPU states take the same select as a native loop (``native/elementwise.c``), at any size:
no compilation on a process's first ReLU (inductor's start-up: ``benchmarks/bench_first_call.py``)
and no guards per call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .compiled import compile_enabled, compiled
from .logspace import (
    SPECIAL_SAFE_MIN_ELEMENTS,
    flat_on_host,
    flat_views,
    native_loops,
    on_memory,
)
from .native import cut_below_f32


def _cut_eager(part: Tensor, x: Tensor, threshold: float, zero: float) -> Tensor:
    return torch.where(x <= threshold, zero, part)


_cut = compiled(_cut_eager, min_elements=SPECIAL_SAFE_MIN_ELEMENTS)


def _cut_in_place_eager(part: Tensor, x: Tensor, threshold: float, zero: float) -> Tensor:
    return part.masked_fill_(x <= threshold, zero)


def _cut_in_place_fused(part: Tensor, x: Tensor, threshold: float, zero: float) -> Tensor:
    return part.copy_(torch.where(x <= threshold, zero, part))


_cut_in_place = compiled(
    _cut_in_place_eager, _cut_in_place_fused, min_elements=SPECIAL_SAFE_MIN_ELEMENTS
)


def cut_below(part: Tensor, x: Tensor, threshold: float, zero: float) -> Tensor | None:
    """A new tensor: ``zero`` where ``x <= threshold``, ``part`` elsewhere (NaN in ``x`` keeps
    ``part``, as ``torch.threshold_backward`` does), laid out as ``part``. float32 CPU states
    take the native loop (any size); others the compiled select. None where neither pays or
    applies: compiled kernels off (``set_compile``), or no flat views of both
    (``logspace.flat_on_host``: another device than the CPU, few entries, operands of other
    layouts or dtypes, memory that is not one dense block); the caller then takes its eager
    form."""
    native = _native_flat(part, x)
    if native is not None:
        out = torch.empty_like(native[0])
        cut_below_f32(*native, out, threshold, zero)
        return on_memory(out, part.shape, part.stride())
    flat = flat_on_host(part, x) if compile_enabled() else None
    if flat is None:  # an accelerator's select is one fast kernel already
        return None
    flat_part, flat_x = flat
    out = _cut(flat_part, flat_x, threshold, zero)
    return on_memory(out, part.shape, part.stride())


def cut_below_in_place(part: Tensor, x: Tensor, threshold: float, zero: float) -> bool:
    """``cut_below`` written into ``part`` (a state nothing else holds, ``messages.donation``):
    True where done, False where the one-pass kernel does not apply (the caller then cuts
    another way)."""
    native = _native_flat(part, x)
    if native is not None:
        cut_below_f32(*native, native[0], threshold, zero)
        return True
    flat = flat_on_host(part, x) if compile_enabled() else None
    if flat is None:
        return False
    _cut_in_place(*flat, threshold, zero)
    return True


def _native_flat(part: Tensor, x: Tensor) -> list[Tensor] | None:
    """1-D views (``logspace.flat_views``) of ``part`` and ``x`` for the native select: float32
    CPU tensors of one shape and layout whose entries are one dense block, not empty, the
    native library available; else None."""
    if part.numel() == 0 or not native_loops(part) or x.dtype != part.dtype:
        return None
    return flat_views(part, x)
