"""An independent reference for convolution messages: im2col window index maps.

Each (output channel, position) sends to the taps of its window through the kernel (a semiring
matmul), then the taps are scattered back onto the input with the semiring's plus where windows
overlap; the unfolded input is the matrix of edge weights of the weight message. semipack used
this form before the per-tap one; the tests keep it to check the library's forms against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from semipack.messages.windows import ConvGeometry, scatter_windows, window_index
from semipack.semirings.base import Semiring, State


def window_map_messages(
    sr: Semiring, m_parts: State, x: Tensor, w: Tensor, geometry: ConvGeometry, mask: Sequence[bool]
) -> tuple[State | None, State | None, State | None]:
    """(input, weight, bias) messages of ``conv(x, w)`` through im2col window index maps."""
    dtype = sr.state_dtype(x.dtype)
    batch, channels, out_channels = x.shape[0], x.shape[1], w.shape[0]
    in_size, out_size, kernel = list(x.shape[2:]), list(m_parts[0].shape[2:]), list(w.shape[2:])
    g_ = geometry
    index = window_index(
        in_size, out_size, kernel, g_.stride, g_.padding, g_.dilation, device=x.device
    )  # [taps, L]
    taps, positions = index.shape
    spatial = math.prod(in_size)
    groups = geometry.groups
    c_g, o_g = channels // groups, out_channels // groups
    m = tuple(p.reshape(batch, out_channels, positions) for p in m_parts)

    grad_in = grad_w = grad_b = None
    if mask[0]:
        dest = sr.zeros((batch, channels * spatial), dtype, x.device)
        per_channel = torch.arange(c_g, device=x.device)[:, None, None] * spatial
        group_index = (per_channel + index).reshape(c_g * taps, positions)
        group_index = torch.where(index.repeat(c_g, 1) >= 0, group_index, -1)
        for g in range(groups):
            m_g = tuple(p[:, g * o_g : (g + 1) * o_g].transpose(1, 2) for p in m)  # [B, L, Og]
            w_g = w[g * o_g : (g + 1) * o_g].reshape(o_g, c_g * taps).to(dtype)
            cols = sr.matmul(m_g, w_g)  # [B, L, Cg*T]
            cols = tuple(p.transpose(1, 2) for p in cols)  # [B, Cg*T, L]
            shift = torch.where(group_index >= 0, group_index + g * c_g * spatial, -1)
            dest = scatter_windows(sr, dest, batch, channels * spatial, shift, cols)
        grad_in = tuple(p.reshape(x.shape) for p in dest)
    if mask[1]:
        pad = x.new_zeros(batch, channels, 1)
        x_flat = torch.cat([x.reshape(batch, channels, spatial), pad], -1)
        unfolded = x_flat[:, :, torch.where(index >= 0, index, spatial)].to(dtype)  # [B,C,T,L]
        pieces = []
        for g in range(groups):
            x_g = unfolded[:, g * c_g : (g + 1) * c_g].permute(0, 3, 1, 2)
            x_g = x_g.reshape(batch * positions, c_g * taps)
            m_g = tuple(
                p[:, g * o_g : (g + 1) * o_g].permute(1, 0, 2).reshape(o_g, batch * positions)
                for p in m
            )
            pieces.append(sr.matmul(m_g, x_g))
        grad_w = tuple(torch.cat(p, 0).reshape(w.shape) for p in zip(*pieces, strict=True))
    if mask[2]:
        grad_b = sr.sum(m, [0, 2])
    return grad_in, grad_w, grad_b
