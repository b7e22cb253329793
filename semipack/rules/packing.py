"""Packed sequences: ``pack_padded_sequence`` recorded as indexing.

The backward of ``torch._pack_padded_sequence`` writes the incoming gradient into a freshly
allocated plain tensor, so a semiring message cannot pass through it. Inside
``semipack.extend`` the packing is recorded as what it is, a gather of the padded positions:
``data = padded.flatten(0, 1)[positions]``. The forward values are the same copies; the
backward is an indexing rule (each packed entry has one edge, of weight 1, to its padded entry)
and its regular gradient is the same scatter of copies.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..messages import route_forward

_pack = torch._C._VariableFunctions._pack_padded_sequence


@route_forward(_pack)
def pack_padded_by_indexing(
    input: Tensor, lengths: Tensor, batch_first: bool = False
) -> tuple[Tensor, Tensor]:
    """``torch._pack_padded_sequence`` as a gather: returns (data, batch_sizes)."""
    if not (torch.is_grad_enabled() and input.requires_grad):
        return _pack(input, lengths, batch_first)
    steps_first = input.transpose(0, 1) if batch_first else input
    steps, batch = steps_first.shape[:2]
    positions = torch.arange(steps * batch, device=input.device).view(steps, batch)
    # The same validation and the same order as the op itself, on the positions.
    where, batch_sizes = _pack(positions, lengths, False)
    return steps_first.flatten(0, 1)[where], batch_sizes
