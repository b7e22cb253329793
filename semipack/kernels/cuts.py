"""Cut a state's entries where an activation is off, in one pass over memory.

A ReLU's edges exist where its input is above the threshold; elsewhere the message holds the
semiring's zero (``-inf`` for log-space components). ``torch.where(x <= threshold, zero, part)``
says it, but eagerly it materialises a boolean mask and takes a slow select (6 ms for the
1.6M entries of a ResNet stem on one core); the float-op form in ``rules/pointwise.py`` takes
five passes (1 ms). Compiled, the select is one loop that reads ``x`` and ``part`` once and
writes the result once (0.25 ms), with the same bits: a select copies, it does not round.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .compiled import compile_enabled, compiled
from .logspace import SPECIAL_SAFE_MIN_ELEMENTS, flat_on_host, on_memory


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
    ``part``, as ``torch.threshold_backward`` does), laid out as ``part``. None where the
    one-pass kernel does not pay or apply: compiled kernels off (``set_compile``), or no
    flat views of both (``logspace.flat_on_host``: another device than the CPU, few entries,
    operands of other layouts or dtypes, memory that is not one dense block); the caller then
    takes its eager form."""
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
    flat = flat_on_host(part, x) if compile_enabled() else None
    if flat is None:
        return False
    _cut_in_place(*flat, threshold, zero)
    return True
