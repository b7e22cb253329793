"""Shape arithmetic at the cost of the C++ it calls, for code that runs once per autograd node.

``torch.broadcast_shapes`` goes through ``torch._refs`` and the symbolic-shape guards: 7-15
microseconds a call on this machine's CPU, against a plain backward's 2 microseconds per node
of a chain of small elementwise ops, where a semiring rule asks it two or three times per node.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def broadcast_shapes(*shapes: Sequence[int]) -> torch.Size:
    """The shape ``shapes`` broadcast to, as ``torch.broadcast_shapes`` gives it (and with its
    error where they do not broadcast), through ATen's own two-shape rule (0.1 microseconds)."""
    if torch.compiler.is_compiling():  # traced: symbolic sizes take torch's own rule
        return torch.broadcast_shapes(*shapes)
    if not shapes:
        return torch.Size([])
    out = torch.Size(shapes[0])
    try:
        for shape in shapes[1:]:
            out = torch._C._infer_size(out, torch.Size(shape))
    except (RuntimeError, TypeError):
        return torch.broadcast_shapes(*shapes)  # its own error message
    return out


def dense_block(t: torch.Tensor) -> bool:
    """Whether ``t``'s entries fill one block of memory (in some order of its dims), which a
    native loop can then read from ``t.data_ptr()`` on as ``t.numel()`` consecutive entries."""
    if t.is_contiguous():
        return True
    # Read from the strides, not from a permuted view's flags: a view and its check took 9
    # microseconds, per operand of every small product of a pass. Dims of size 1 have any
    # stride; the others, from the fastest, must each step over all the faster ones.
    steps = sorted(
        (stride, size) for stride, size in zip(t.stride(), t.shape, strict=True) if size != 1
    )
    if any(size == 0 for _, size in steps):
        return True
    block = 1
    for stride, size in steps:
        if stride != block:
            return False
        block *= size
    return True
