"""cumsum and Tensor.unfold: prefix sums and overlapping windows become semiring plus."""

from __future__ import annotations

import torch

from ..messages import OpCall, register_rule
from ..semirings import Boolean, LogCount, LogSum, MaxProd, Real, Semiring, State

aten = torch.ops.aten


def prefix_plus(sr: Semiring, m: State, dim: int) -> State:
    """out[i] = ⊕_{j <= i} m[j] along ``dim``: closed forms for the common semirings, a plain
    left-to-right scan with the semiring's plus otherwise."""
    kind = type(sr)
    if kind is Real:
        return (m[0].cumsum(dim),)
    if kind is MaxProd:
        return (m[0].cummax(dim).values,)
    if kind in (LogSum, LogCount):
        return (torch.logcumsumexp(m[0], dim),)
    if kind is Boolean:
        return (m[0].to(torch.uint8).cummax(dim).values.bool(),)
    if m[0].shape[dim] == 0:
        return m
    running = tuple(p.select(dim, 0) for p in m)
    outs = [running]
    for i in range(1, m[0].shape[dim]):
        running = sr.plus(running, tuple(p.select(dim, i) for p in m))
        outs.append(running)
    return tuple(torch.stack(c, dim) for c in zip(*outs, strict=True))


@register_rule(aten.cumsum.default)
def cumsum(call: OpCall):
    msg = call["self"]
    if msg.dim() == 0:
        return call.wrap(call.run_real(), msg.parts)
    return call.wrap(
        call.run_real(), prefix_plus(call.semiring, msg.parts, call["dim"] % msg.dim())
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
    return call.wrap(call.run_real(), call.semiring.index_plus(dest, dim, index, src))
