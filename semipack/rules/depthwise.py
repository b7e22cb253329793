"""MaxProd and TopPath messages of a 2-D depthwise convolution from the native kernels.

The native kernels (``kernels/native/depthwise.c``) vectorise stride 1: eight neighbouring
results read eight neighbouring entries. A strided layer (MobileNet's downsampling blocks) is
rewritten here as stride-1 problems, one per *phase*, so it takes the same vectorised loops.
At dilation 1 and stride (SH, SW), padded input row ``ih = oh * SH + kh``. Write
``ih = SH * p + s`` with the phase ``s = ih mod SH``: row ``ih`` is read by the taps
``kh = s + SH * j`` only, from output row ``oh = p - j``. So:

- the input message at the entries ``[s::SH, r::SW]`` of the padded input is the stride-1
  input message of the sub-kernel ``w[..., s::SH, r::SW]`` over the same output message;
- the weight message of the taps ``kw = r + SW * j`` is a message of row stride SH and column
  stride 1 over the columns ``r::SW`` of the padded input (tap ``kw`` reads column
  ``SW * ow + kw = SW * (ow + j) + r``, the phase's column ``ow + j``).

Every result gets the same candidates as in the strided form, in the same order (taps by
(kh, kw), then positions), so the maxima are the same floats and TopPath's first candidates,
hence its successor ids, are the same (tests/test_convolution_messages.py compares both with
the per-tap path bit for bit).

The input message of the most common strided layer, stride 2 with one output channel per
input channel and input rows of at least 16 entries (MobileNets' and EfficientNets'
downsampling blocks), has a kernel of its own that reads the phases' candidates in one sweep
and writes the unpadded input's layout (``_stride_two_kernel_fits``): by phases, four stride-1
problems of one to four taps each, over the whole message, and a strided copy of each phase's
entries took 3-5 times as long. The weight message's plane kernels read a column stride of 2 in
place (two loads deinterleaved per vector of input columns), where the phases copied each
column phase of the input first; larger column strides still go by phases
(``benchmarks/bench_kernel_costs.py --only stride_two`` times both messages both ways).

Two more routes live here: planes under ``SMALL_PLANE`` columns take the channels-last kernel
(``kernels/native/depthwise_channels.c``: 8 channels per vector, any stride), and a dense
convolution over at most ``FEW_CHANNELS`` input channels (an image stem), or a grouped one
over at most ``FEW_CHANNELS_PER_GROUP`` per group (ResNeXt, RegNet), runs as a depthwise one
with a channel multiplier (``few_channels_max_plus``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..kernels.native import (
    channels_kernel_fits,
    depthwise_channels_f32,
    depthwise_f32,
    depthwise_input_stride2_f32,
    native_available,
)
from ..kernels.weight_cache import no_nan_or_posinf_kept
from ..messages.windows import ConvGeometry
from ..semirings._log import log_magnitude_
from ..semirings.base import Semiring, State

Messages = tuple[State | None, State | None, State | None]

#: Planes with fewer columns than this (output or input) take the channels-last kernel where
#: it fits: the plane kernels' vectors hold a row's columns, and short rows leave them empty.
SMALL_PLANE = 8


def depthwise_max_plus(
    sr: Semiring, m_parts: State, x: Tensor, w: Tensor, geometry: ConvGeometry, mask: Sequence[bool]
) -> Messages | None:
    """The messages of a 2-D depthwise convolution (one input channel per group) in MaxProd's
    algebra, and TopPath's with its successor ids, from the native kernel (every tap swept
    once, where the per-tap path builds and reduces an output-sized sum per tap), or None where
    it does not apply: another algebra, not 2-D depthwise, not float32 on the CPU, no native
    library, or a NaN or +inf among the operands. Same values and ids as ``per_tap_messages``,
    bit for bit (max does not round, and ties go to the same candidate)."""
    groups = geometry.groups
    ids = sr.is_max_plus_with_ids()
    if not (
        (sr.is_max_plus() or ids)
        and x.dim() == 4
        and groups == x.shape[1]
        and w.shape[1] == 1
        and x.dtype == w.dtype == m_parts[0].dtype == torch.float32
        and x.device.type == "cpu"
        and native_available()
        and x.numel() > 0  # an empty batch: no message to read (TopPath's ids had none)
    ):
        return None
    m = m_parts[0]
    lw = sr.kept_lift(w)[0].reshape(w.shape[0], *w.shape[2:])
    lx = _padded_log_abs(x, geometry.padding) if mask[1] else None
    if not no_nan_or_posinf_kept(m, *([lw] if mask[0] else []), *([] if lx is None else [lx])):
        return None  # the kernel's max would not propagate a NaN
    successors = m_parts[1].expand(m.shape).contiguous() if ids else None
    no_successor = int(sr.zero[1]) if ids else -1
    kernel = _kernel_for(m, lw, x, geometry)
    grad_in = grad_w = grad_b = None
    if mask[0]:
        grad_in = _input_message(kernel, m, lw, x.shape, geometry, successors, no_successor)
    if mask[1]:
        grad_w = _weight_message(kernel, m, lw, lx, geometry, successors)
        grad_w = tuple(p.reshape(w.shape) for p in grad_w)
    if mask[2]:
        grad_b = _bias_message(sr, m_parts)
    return grad_in, grad_w, grad_b


#: Dense convolutions over at most this many input channels (an RGB or grey stem) take the
#: depthwise kernels: the tap products' panels of 16 columns held 3 of them.
FEW_CHANNELS = 4
#: Grouped convolutions with at most this many input channels per group (ResNeXt's 4, RegNet's
#: 8 or 16) take them too: their tap products are one small product per group, whose inner
#: size is the group's channels (a ResNeXt layer of 32 groups of 4 channels paid 3.4 ns per
#: multiply-add of MaxProd's messages that way, a dense layer of its width 0.11).
FEW_CHANNELS_PER_GROUP = 16
#: ... while the message repeated for each input channel of a group stays under this many
#: bytes, or the groups have at most ``FEW_CHANNELS`` channels: 16 channels per group repeat a
#: [64, 256, 56, 56] float32 message into 3.3 GB, where the per-tap products build nothing of
#: that size.
REPEATED_MESSAGE_MAX_BYTES = 256 * 2**20
#: ... when their stride has at most this many phases: a ViT's 16 x 16 patch embedding (256
#: phases of one tap each, 16 calls for the weight message alone) ran slower that way than per
#: tap, a 4 x 4 one (16 phases) faster.
FEW_CHANNELS_MAX_PHASES = 16


def few_channels_max_plus(
    sr: Semiring, m_parts: State, x: Tensor, w: Tensor, geometry: ConvGeometry, mask: Sequence[bool]
) -> Messages | None:
    """The messages of a dense 2-D convolution over few input channels (``FEW_CHANNELS``), or
    of a grouped one with few input channels per group (``FEW_CHANNELS_PER_GROUP``), as a
    depthwise one with a channel multiplier, or None where ``depthwise_max_plus`` would not
    apply or the convolution is not of that kind.

    With G groups of k input and M output channels each, output channel u of group g (global
    ``g * M + u``) and input channel j of that group (global ``c = g * k + j``) become
    depthwise output ``c * M + u``: its message is output ``g * M + u``'s (the group's message
    repeated for each of its k input channels) and its kernel ``w[g * M + u, j]``. Each weight
    entry then has the same candidates, in the same order (positions), as in the per-tap
    products, and each input entry the candidates of every tap and output channel of its
    group, taps first as there, so values and TopPath's ids are the per-tap path's. ResNet-18's
    7 x 7 stem on 3 channels took 1.7 G pairs/s per tap (its products' output is 64 x 3)."""
    if x.dim() != 4 or w.dim() != 4:
        return None  # 2-D convolutions only
    channels, groups, phases = x.shape[1], geometry.groups, math.prod(geometry.stride)
    per_group = channels // groups
    limit = FEW_CHANNELS if groups == 1 else FEW_CHANNELS_PER_GROUP
    strided = phases > 1
    if not (
        not geometry.transposed
        and 1 < per_group <= limit
        and per_group * groups == channels
        and phases <= FEW_CHANNELS_MAX_PHASES
        and not (strided and tuple(geometry.dilation) != (1, 1))  # no phases: scalar loops
        and w.shape[1] == per_group
        and w.shape[0] % groups == 0
    ):
        return None
    outputs = w.shape[0] // groups  # per group
    batch, _, *plane = m_parts[0].shape
    repeated_bytes = per_group * sum(m_parts[0].numel() * p.element_size() for p in m_parts)
    if per_group > FEW_CHANNELS and repeated_bytes > REPEATED_MESSAGE_MAX_BYTES:
        return None
    repeated = tuple(
        p.expand(m_parts[0].shape)
        .reshape(batch, groups, 1, outputs, *plane)
        .expand(batch, groups, per_group, outputs, *plane)
        .reshape(batch, channels * outputs, *plane)
        for p in m_parts
    )
    taps = w.shape[2:]
    kernels = (
        w.reshape(groups, outputs, per_group, *taps)
        .transpose(1, 2)
        .reshape(channels * outputs, 1, *taps)
    )
    depthwise = dataclasses.replace(geometry, groups=channels)
    got = depthwise_max_plus(sr, repeated, x, kernels, depthwise, (mask[0], mask[1], False))
    if got is None:
        return None
    grad_in, grad_w, _ = got
    if grad_w is not None:
        shape = (groups, per_group, outputs, *taps)
        grad_w = tuple(p.reshape(shape).transpose(1, 2).reshape(w.shape) for p in grad_w)
    return grad_in, grad_w, _bias_message(sr, m_parts) if mask[2] else None


def _bias_message(sr: Semiring, m_parts: State) -> State:
    """The bias message [O]: the output message [B, O, Ho, Wo] summed over batch and plane."""
    shape = m_parts[0].shape
    rows = tuple(p.expand(shape).reshape(shape[0], shape[1], -1) for p in m_parts)
    return sr.sum(rows, [0, 2])


def _kernel_for(m: Tensor, lw: Tensor, x: Tensor, geometry: ConvGeometry) -> str:
    """Which kernel computes the messages: "channels" (the channels-last kernel, for planes
    under ``SMALL_PLANE`` columns it takes), "phases" (a strided layer as stride-1 ones) or
    "planes" (the plane kernels as they are)."""
    if min(m.shape[3], x.shape[3]) < SMALL_PLANE and channels_kernel_fits(m, lw, x.shape[1]):
        return "channels"
    if tuple(geometry.stride) != (1, 1) and tuple(geometry.dilation) == (1, 1):
        return "phases"
    return "planes"


def _input_message(
    kernel: str,
    m: Tensor,
    lw: Tensor,
    shape: Sequence[int],
    geometry: ConvGeometry,
    successors: Tensor | None,
    no_successor: int,
) -> tuple[Tensor, ...]:
    """The input message [B, C, H, W] (``shape``, the input's) by ``kernel``."""
    stride, dilation = tuple(geometry.stride), tuple(geometry.dilation)
    padding = tuple(geometry.padding)
    if kernel == "phases" and _stride_two_kernel_fits(m, shape, stride, successors is not None):
        return depthwise_input_stride2_f32(m, lw, shape, padding, successors, no_successor)
    if kernel == "phases":
        return _input_by_phases(m, lw, shape, padding, stride, successors, no_successor)
    (pad_h, pad_w), (height, width) = padding, shape[2:]
    padded = _shape_only((*shape[:2], height + 2 * pad_h, width + 2 * pad_w))
    if kernel == "channels":
        return depthwise_channels_f32(
            m, lw, padded, stride, dilation, padding, True, False, successors, no_successor
        )[0]
    planes = depthwise_f32(
        m, lw, padded, stride, dilation, True, False, successors, no_successor, padding
    )[0]
    crop = (slice(None), slice(None), slice(pad_h, pad_h + height), slice(pad_w, pad_w + width))
    return tuple(p[crop].contiguous() for p in planes)


def _stride_two_kernel_fits(
    m: Tensor, shape: Sequence[int], stride: tuple[int, int], with_ids: bool
) -> bool:
    """Whether the stride-2 input kernel takes the input message (``native/depthwise.c``): a
    stride of 2 (a ``phases`` layer: dilation 1), one output channel per input channel, input
    rows of at least 16 entries, and for TopPath message positions exact as floats."""
    _, channels, _, width = shape
    return (
        stride == (2, 2)
        and m.shape[1] == channels
        and width >= 16
        and (not with_ids or m.shape[2] * m.shape[3] < 2**24)
    )


def _weight_message(
    kernel: str,
    m: Tensor,
    lw: Tensor,
    lx: Tensor,
    geometry: ConvGeometry,
    successors: Tensor | None,
) -> tuple[Tensor, ...]:
    """The weight message [C * M, KH, KW] (``lw``'s shape) by ``kernel``; ``lx`` is log|x| of
    the padded input. A column stride of 1 or 2 the plane kernels read in place (at 2 each
    vector of input columns is deinterleaved from two loads); larger ones go by phases."""
    stride, dilation = tuple(geometry.stride), tuple(geometry.dilation)
    if kernel == "phases" and stride[1] > 2:
        return _weight_by_phases(m, lw.shape, lx, stride, successors)
    if kernel == "channels":
        padding = tuple(geometry.padding)
        return depthwise_channels_f32(
            m, lw, lx, stride, dilation, padding, False, True, successors
        )[1]
    return depthwise_f32(m, lw, lx, stride, dilation, False, True, successors)[1]


def _padded_log_abs(x: Tensor, padding: Sequence[int]) -> Tensor:
    """log|x| of ``x`` [B, C, H, W] zero-padded by ``padding`` (rows, columns) on each side:
    ``-inf`` in the padding, no edge. One buffer and one log over all of it, where the log of
    x and then a padded copy took two allocations and two passes (line-profiled on a
    72-channel 56 x 56 layer, batch 2: that lift took about twice its weight message's kernel).
    The per-tap path lifts the same padded input (``per_tap_messages``' ``x_pad``) with the
    same loop: the same bits."""
    (pad_h, pad_w), (height, width) = padding, x.shape[2:]
    padded = x.new_zeros((*x.shape[:2], height + 2 * pad_h, width + 2 * pad_w))
    inside = padded[:, :, pad_h : pad_h + height, pad_w : pad_w + width]
    torch.abs(x.detach(), out=inside)
    return log_magnitude_(padded)


def _shape_only(shape: Sequence[int]) -> Tensor:
    """A float32 tensor of ``shape`` without memory, for an operand the kernel does not read."""
    return torch.empty(1, dtype=torch.float32, device="cpu").expand(*shape)


def _input_by_phases(
    m: Tensor,
    lw: Tensor,
    planes: Sequence[int],
    padding: Sequence[int],
    stride: tuple[int, int],
    successors: Tensor | None,
    no_successor: int,
) -> tuple[Tensor, ...]:
    """The input message [B, C, H, W] (``planes``, the unpadded input's shape), phase by phase
    (see the module's docstring): each phase's stride-1 message covers its entries of the
    padded input, and those inside the ``padding`` are written to their place. ``m``
    [B, C * M, Ho, Wo], ``lw`` [C * M, KH, KW]. Entries no tap reads (a kernel smaller than
    the stride, rows past the last window) get no message."""
    (sh, sw), (ho, wo) = stride, m.shape[2:]
    phases = []  # (sub-kernel, its stride-1 plane's rows and columns, where its inputs lie)
    for s in range(sh):
        for r in range(sw):
            sub = lw[:, s::sh, r::sw]
            if sub.numel() == 0:
                continue  # no tap reads these entries
            rows, cols = ho + sub.shape[1] - 1, wo + sub.shape[2] - 1
            at_rows = _inside(s, sh, rows, padding[0], planes[2])
            at_cols = _inside(r, sw, cols, padding[1], planes[3])
            if at_rows is None or at_cols is None:
                continue  # the phase's entries are all padding
            phases.append((sub, rows, cols, at_rows, at_cols))
    # Every entry some phase writes: no fill first (the fill wrote the whole plane once more).
    covered = _covers([at_rows[1] for *_, at_rows, _ in phases], planes[2]) and _covers(
        [at_cols[1] for *_, at_cols in phases], planes[3]
    )
    fill = torch.empty if covered else functools.partial(torch.full, fill_value=float("-inf"))
    values = fill(tuple(planes), dtype=torch.float32, device="cpu")
    ids = None
    if successors is not None:
        fill = torch.empty if covered else functools.partial(torch.full, fill_value=no_successor)
        ids = fill(tuple(planes), dtype=torch.int64, device="cpu")
    for sub, rows, cols, at_rows, at_cols in phases:
        phase = _shape_only((*planes[:2], rows, cols))
        got = depthwise_f32(m, sub, phase, (1, 1), (1, 1), True, False, successors, no_successor)
        source = (slice(None), slice(None), at_rows[0], at_cols[0])
        target = (slice(None), slice(None), at_rows[1], at_cols[1])
        values[target] = got[0][0][source]
        if ids is not None:
            ids[target] = got[0][1][source]
    return (values,) if ids is None else (values, ids)


def _covers(slices: Sequence[slice], size: int) -> bool:
    """Whether ``slices`` of an axis of ``size`` entries together hold every entry."""
    seen: set[int] = set()
    for part in slices:
        seen.update(range(size)[part])
    return len(seen) == size


def _inside(phase: int, stride: int, count: int, pad: int, size: int) -> tuple[slice, slice] | None:
    """Of a phase's ``count`` entries along one axis (padded index ``phase + stride * p``), those
    that are inputs (padded index in ``[pad, pad + size)``): their slice among the phase's
    entries and their slice of the unpadded axis; None if there are none."""
    first = max(0, -(-(pad - phase) // stride))
    last = min(count - 1, (pad + size - 1 - phase) // stride)
    if last < first:
        return None
    start = phase + stride * first - pad
    return slice(first, last + 1), slice(start, start + stride * (last - first) + 1, stride)


def _weight_by_phases(
    m: Tensor,
    kernel: Sequence[int],
    lx: Tensor,
    stride: tuple[int, int],
    successors: Tensor | None,
) -> tuple[Tensor, ...]:
    """The weight message ``[C * M, KH, KW]`` (``kernel``), the taps of each column phase from
    the padded input's columns of that phase at column stride 1 (see the module's docstring).
    ``m`` [B, C * M, Ho, Wo], ``lx`` [B, C, Hp, Wp]."""
    sh, sw = stride
    outputs, kh, kw = kernel
    values = torch.empty((outputs, kh, kw), dtype=torch.float32, device="cpu")
    ids = None
    if successors is not None:
        ids = torch.empty((outputs, kh, kw), dtype=torch.int64, device="cpu")
    for r in range(min(sw, kw)):
        taps = len(range(r, kw, sw))
        columns = lx[..., r::sw]
        got = depthwise_f32(
            m, _shape_only((outputs, kh, taps)), columns, (sh, 1), (1, 1), False, True, successors
        )
        values[:, :, r::sw] = got[1][0]
        if ids is not None:
            ids[:, :, r::sw] = got[1][1]
    return (values,) if ids is None else (values, ids)
