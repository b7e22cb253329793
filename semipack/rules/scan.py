"""cumsum and Tensor.unfold: prefix sums and overlapping windows become semiring plus."""

from __future__ import annotations

import torch

from ..messages import OpCall, register_rule

aten = torch.ops.aten


@register_rule(aten.cumsum.default)
def cumsum(call: OpCall):
    """``cumsum`` of a message (as the backward formulas of ``cumsum`` apply it, between two
    flips): ``out[i] = ⊕_{j <= i} m[j]`` along ``dim`` (``Semiring.prefix_plus``)."""
    msg = call["self"]
    if msg.dim() == 0:
        return call.wrap(call.run_regular(), msg.parts)
    # out[i] = ⊕_{j <= i} m[j]: the semiring's cumulative kernel, or a scan with its plus
    return call.wrap(
        call.run_regular(), call.semiring.prefix_plus(msg.parts, call["dim"] % msg.dim())
    )


@register_rule(aten.unfold_backward.default)
def unfold_backward(call: OpCall):
    """grad_in[..., w, ..., t] goes to input position w * step + t along ``dim``."""
    msg, sizes = call["grad_in"], tuple(call["input_sizes"])
    dim, size, step = call["dim"] % len(sizes), call["size"], call["step"]
    windows = msg.shape[dim]
    src = tuple(p.movedim(-1, dim + 1).flatten(dim, dim + 1) for p in msg.parts)
    index = (
        torch.arange(windows, device=msg.device)[:, None] * step
        + torch.arange(size, device=msg.device)[None, :]
    ).reshape(-1)
    dest = call.zeros(sizes)
    return call.wrap(call.run_regular(), call.semiring.index_plus(dest, dim, index, src))
