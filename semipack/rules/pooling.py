"""Pooling: max pooling routes each output to its argmax, average pooling spreads 1/size."""

from __future__ import annotations

import math

import torch

from ..messages import OpCall, register_rule
from ..messages.windows import (
    adaptive_positions,
    combine_dims,
    expand_param,
    scatter_windows,
    sliding_positions,
)

aten = torch.ops.aten


def _flat(call: OpCall, nsp: int):
    msg, x = call["grad_output"], call["self"]
    lead = math.prod(x.shape[:-nsp])
    spatial = math.prod(x.shape[-nsp:])
    outs = math.prod(msg.shape[-nsp:])
    m = tuple(p.reshape(lead, outs) for p in msg.parts)
    dest = call.semiring.zeros((lead, spatial), msg.dtype, x.device)
    return msg, x, lead, spatial, outs, m, dest


def _max_pool(call: OpCall, nsp: int, disjoint: bool = False):
    """Each output entry has one edge, of weight 1, from the input entry it selected. With
    ``disjoint`` windows no input entry is selected twice: each selected entry's state is
    its one output's (``0 ⊕ a``, normalised by the semiring's ``plus``), placed by a scatter
    instead of a plus-reduction by destination (several times cheaper for Entropy)."""
    _msg, x, lead, spatial, outs, m, dest = _flat(call, nsp)
    index = call["indices"].reshape(lead, outs)
    targets = (torch.arange(lead, device=x.device)[:, None] * spatial + index).reshape(-1)
    src = tuple(p.reshape(-1) for p in m)
    flat = tuple(p.reshape(-1) for p in dest)
    sr = call.semiring
    if disjoint:
        own = sr.plus(sr.zeros(src[0].shape, src[0].dtype, x.device), src)
        summed = tuple(d.scatter(0, targets, a) for d, a in zip(flat, own, strict=True))
    else:
        summed = sr.index_plus(flat, 0, targets, src)
    return call.wrap(call.run_regular(), tuple(p.reshape(x.shape) for p in summed))


def _disjoint_windows(call: OpCall, nsp: int) -> bool:
    """Whether no two windows of a max pooling share an input entry: each stride at least
    the dilated kernel's extent."""
    kernel = expand_param(call["kernel_size"], nsp)
    stride = expand_param(call["stride"], nsp, default=kernel)
    dilation = expand_param(call["dilation"], nsp)
    return all(s >= d * (k - 1) + 1 for k, s, d in zip(kernel, stride, dilation, strict=True))


@register_rule(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_backward(call: OpCall):
    """2-d max pooling: one edge of weight 1 from each window's selected input entry, none
    from the others."""
    return _max_pool(call, 2, _disjoint_windows(call, 2))


@register_rule(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(call: OpCall):
    """2-d adaptive max pooling: as ``max_pool2d_backward`` (windows may overlap)."""
    return _max_pool(call, 2)


@register_rule(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_backward(call: OpCall):
    """3-d max pooling: as ``max_pool2d_backward``."""
    return _max_pool(call, 3, _disjoint_windows(call, 3))


@register_rule(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(call: OpCall):
    """3-d adaptive max pooling: as ``max_pool2d_backward`` (windows may overlap)."""
    return _max_pool(call, 3)


def _avg_divisors(call: OpCall, in_size, out_size, kernel, stride, padding) -> torch.Tensor:
    """PyTorch's divisor per output position, as a flat [L] tensor."""
    override = call["divisor_override"]
    include_pad = call["count_include_pad"]
    sizes = []
    for i, o, k, s, p in zip(in_size, out_size, kernel, stride, padding, strict=True):
        start = torch.arange(o) * s - p
        end = torch.minimum(start + k, torch.tensor(i + p))
        full = end - start
        clipped = torch.minimum(end, torch.tensor(i)) - torch.clamp(start, min=0)
        sizes.append(full if include_pad else clipped)
    div = sizes[0]
    for extra in sizes[1:]:
        div = div[..., None] * extra
    div = div.reshape(-1)
    return torch.full_like(div, override) if override else div


def _avg_pool(call: OpCall, nsp: int):
    msg, x, lead, spatial, outs, m, dest = _flat(call, nsp)
    in_size, out_size = list(x.shape[-nsp:]), list(msg.shape[-nsp:])
    kernel = expand_param(call["kernel_size"], nsp)
    stride = expand_param(call["stride"], nsp, default=kernel)
    padding = expand_param(call["padding"], nsp)
    positions = sliding_positions(in_size, out_size, kernel, stride, padding, [1] * nsp, x.device)
    index = combine_dims(positions, in_size)
    dtype = call.weight_dtype
    weights = 1.0 / _avg_divisors(call, in_size, out_size, kernel, stride, padding).to(dtype)
    src = call.semiring.scale(tuple(p[:, None, :] for p in m), weights.to(x.device)[None, None, :])
    src = tuple(p.expand(lead, index.shape[0], outs) for p in src)
    parts = scatter_windows(call.semiring, dest, lead, spatial, index, src)
    return call.wrap(call.run_regular(), tuple(p.reshape(x.shape) for p in parts))


@register_rule(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(call: OpCall):
    """2-d average pooling: an edge of weight 1/divisor from every input entry in the
    window (padding included or not, as ``count_include_pad`` says)."""
    return _avg_pool(call, 2)


@register_rule(aten.avg_pool3d_backward.default)
def avg_pool3d_backward(call: OpCall):
    """3-d average pooling: as ``avg_pool2d_backward``."""
    return _avg_pool(call, 3)


def _adaptive_avg(call: OpCall, nsp: int):
    msg, x, lead, spatial, outs, m, dest = _flat(call, nsp)
    in_size, out_size = list(x.shape[-nsp:]), list(msg.shape[-nsp:])
    positions, lengths = adaptive_positions(in_size, out_size, x.device)
    index = combine_dims(positions, in_size)
    area = lengths[0]
    for extra in lengths[1:]:
        area = area[..., None] * extra
    dtype = call.weight_dtype
    weights = 1.0 / area.reshape(-1).to(dtype)
    src = call.semiring.scale(tuple(p[:, None, :] for p in m), weights[None, None, :])
    src = tuple(p.expand(lead, index.shape[0], outs) for p in src)
    parts = scatter_windows(call.semiring, dest, lead, spatial, index, src)
    return call.wrap(call.run_regular(), tuple(p.reshape(x.shape) for p in parts))


@register_rule(aten._adaptive_avg_pool2d_backward.default)
def adaptive_avg_pool2d_backward(call: OpCall):
    """2-d adaptive average pooling: an edge of weight 1/size from every input
    entry of each (variable-size) window."""
    return _adaptive_avg(call, 2)


@register_rule(aten._adaptive_avg_pool3d_backward.default)
def adaptive_avg_pool3d_backward(call: OpCall):
    """3-d adaptive average pooling: as ``adaptive_avg_pool2d_backward``."""
    return _adaptive_avg(call, 3)
