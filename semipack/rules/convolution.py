"""convolution_backward in the semiring: input, weight and bias messages of a convolution.

Three forms, same values (tests/test_convolution_messages.py):

- sum-like semirings (LogSum, LogCount, Entropy): PyTorch's own convolution backward on the
  exponentiated message and |x|, |W| (``kernels.shared_shift.shared_shift_conv``);
- every other semiring, one kernel tap at a time (``per_tap_messages``): for a tap, the output
  positions read a strided slice of the padded input, so the tap's messages are two semiring
  matmuls, no im2col copy;
- path-recording semirings (TopPath), im2col window index maps (``window_map_messages``): each
  (output channel, position) sends to the taps of its window through the kernel (a semiring
  matmul), then the taps are scattered back onto the input with the semiring's plus; the
  unfolded input is the matrix of edge weights of the weight message.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..kernels.shared_shift import shared_shift_conv
from ..semirings.base import Semiring, State
from .registry import OpCall, register_rule
from .windows import ConvGeometry, scatter_windows, window_index

aten = torch.ops.aten


Messages = tuple[State | None, State | None, State | None]


def conv_messages(
    sr: Semiring, m_parts: State, x: Tensor, w: Tensor, geometry: ConvGeometry, mask: Sequence[bool]
) -> Messages:
    """Semiring messages to (input, weight, bias) of ``conv(x, w)`` from the output message.

    Sum-like semirings take PyTorch's convolution backward on exponentiated messages and
    non-negative operands (``shared_shift_conv``) when the message spans few enough nats;
    everything else goes through the window index maps and the semiring matmul.
    """
    dtype = sr.state_dtype(x.dtype)
    fast = shared_shift_conv(sr, m_parts, x.to(dtype), w.to(dtype), geometry, mask)
    if fast is not None:
        return fast
    if not getattr(sr, "records_paths", False):
        return per_tap_messages(sr, m_parts, x, w, geometry, mask)
    return window_map_messages(sr, m_parts, x, w, geometry, mask)


def per_tap_messages(
    sr: Semiring, m_parts: State, x: Tensor, w: Tensor, geometry: ConvGeometry, mask: Sequence[bool]
) -> Messages:
    """``conv_messages`` one kernel tap at a time, without an im2col copy.

    For a tap t, output position l reads input position ``l * stride - padding + t * dilation``:
    over all l, a strided slice of the zero-padded input. So the tap's share of the input message
    is one semiring matmul (output message [B·L, O] ⊗ kernel tap [O, C]) added with the
    semiring's plus into that slice, and its weight message is one semiring matmul (output
    message [O, B·L] ⊗ input slice [B·L, C]). Messages landing in the padding are dropped
    (padding is no input entry); padded zeros are no edges of the weight message.
    """
    batch, channels, out_channels = x.shape[0], x.shape[1], w.shape[0]
    out_size, kernel = list(m_parts[0].shape[2:]), list(w.shape[2:])
    stride, padding, dilation = geometry.stride, geometry.padding, geometry.dilation
    groups = geometry.groups
    c_g, o_g = channels // groups, out_channels // groups
    dtype = sr.state_dtype(x.dtype)
    positions = math.prod(out_size)
    pad = [p for pair in reversed(padding) for p in (pair, pair)]
    x_pad = torch.nn.functional.pad(x.to(dtype), pad) if any(padding) else x.to(dtype)
    # Channels last, so that a tap's slice is whole rows of channels (no transposes per tap).
    x_last = x_pad.movedim(1, -1).contiguous() if mask[1] else None
    m = tuple(p.reshape(batch, out_channels, positions) for p in m_parts)
    padded = list(x_pad.shape[2:])

    dest = sr.zeros((batch, *padded, channels), dtype, x.device) if mask[0] else None
    w_msg = sr.zeros((out_channels, c_g, *kernel), dtype, x.device) if mask[1] else None
    for g in range(groups):
        outs, ins = slice(g * o_g, (g + 1) * o_g), slice(g * c_g, (g + 1) * c_g)
        rows = tuple(p[:, outs].transpose(1, 2).reshape(batch * positions, o_g) for p in m)
        rows_t = tuple(p.t().contiguous() for p in rows) if mask[1] else None
        for tap in itertools.product(*(range(k) for k in kernel)):
            window = tuple(
                slice(t * d, t * d + (o - 1) * s + 1, s)
                for t, d, o, s in zip(tap, dilation, out_size, stride, strict=True)
            )
            where = (slice(None), *window, ins)
            if mask[0]:  # [B·L, O] ⊗ [O, C] -> [B, *out, C], into the tap's input slice
                cols = sr.matmul(rows, w[(outs, slice(None), *tap)].to(dtype))
                cols = tuple(p.reshape(batch, *out_size, c_g) for p in cols)
                merged = sr.plus(tuple(d[where] for d in dest), cols)
                for d, part in zip(dest, merged, strict=True):
                    d[where] = part
            if mask[1]:  # [O, B·L] ⊗ [B·L, C] -> [O, C]
                taken = x_last[where].reshape(batch * positions, c_g)
                found = sr.matmul(rows_t, taken)
                for d, part in zip(w_msg, found, strict=True):
                    d[(outs, slice(None), *tap)] = part
    grad_in = grad_b = None
    if mask[0]:
        crop = tuple(slice(p, p + n) for p, n in zip(padding, x.shape[2:], strict=True))
        grad_in = tuple(
            d[(slice(None), *crop)].movedim(-1, 1).contiguous(memory_format=torch.contiguous_format)
            for d in dest
        )
    if mask[2]:
        grad_b = sr.sum(m, [0, 2])
    return grad_in, w_msg, grad_b


def window_map_messages(
    sr: Semiring, m_parts: State, x: Tensor, w: Tensor, geometry: ConvGeometry, mask: Sequence[bool]
) -> Messages:
    """``conv_messages`` through im2col window index maps (path-recording semirings: their
    successor ids follow the scatter of the window maps)."""
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


@register_rule(aten.convolution_backward.default)
def convolution_backward(call: OpCall):
    msg, x, w = call["grad_output"], call["input"], call["weight"]
    if call["transposed"]:
        raise call.error("transposed convolution is not supported yet")
    mask = call["output_mask"]
    geometry = ConvGeometry.of(
        x.dim() - 2, call["stride"], call["padding"], call["dilation"], call["groups"]
    )
    grads = conv_messages(call.semiring, msg.parts, x, w, geometry, mask)
    real = call.run_real()
    reals = list(real) if real is not None else [None, None, None]
    return tuple(
        call.wrap(r, parts) if want and parts is not None else r
        for want, parts, r in zip(mask, grads, reals, strict=True)
    )
