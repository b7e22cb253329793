"""convolution_backward in the semiring: input, weight and bias messages of a convolution.

Two forms, same values (tests/test_convolution_messages.py checks both against an im2col
reference):

- sum-like semirings (LogSum, LogCount, Entropy): PyTorch's own convolution backward on the
  exponentiated message and |x|, |W| (``kernels.shared_shift.shared_shift_conv``), when the
  message spans few enough nats;
- otherwise one kernel tap at a time (``per_tap_messages``): for a tap, the output positions
  read a strided slice of the padded input, so the tap's messages are two semiring matmuls and
  no im2col copy is built. TopPath's successor ids travel through the same matmuls and pluses.

Transposed convolutions take the same two forms: PyTorch's transposed-convolution backward on
the non-negative operands, or ``transposed_per_tap_messages``, where a tap links every input
position to one strided slice of the output (the forward convolution's edges, reversed).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..kernels.native import (
    maxplus_gather_f32,
    maxplus_scatter_max_f32,
    native_available,
    pack_panels_f32,
)
from ..kernels.tropical import shared_pruning_choice
from ..kernels.weight_cache import WEIGHTS, no_nan_or_posinf_kept
from ..messages import OpCall, register_rule
from ..messages.shared_shift import shared_shift_conv
from ..messages.windows import ConvGeometry
from ..semirings.base import Semiring, State
from .depthwise import depthwise_max_plus, few_channels_max_plus

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
    if not geometry.transposed:
        native = depthwise_max_plus(sr, m_parts, x, w, geometry, mask)
        if native is None:
            native = few_channels_max_plus(sr, m_parts, x, w, geometry, mask)
        if native is not None:
            return native
    # The taps' products share shapes and nearly their data: one pruning estimate for all.
    with shared_pruning_choice():
        if geometry.transposed:
            return transposed_per_tap_messages(sr, m_parts, x, w, geometry, mask)
        return per_tap_messages(sr, m_parts, x, w, geometry, mask)


def per_tap_messages(
    sr: Semiring, m_parts: State, x: Tensor, w: Tensor, geometry: ConvGeometry, mask: Sequence[bool]
) -> Messages:
    """``conv_messages`` one kernel tap at a time, without an im2col copy.

    For a tap t, output position l reads input position ``l * stride - padding + t * dilation``:
    over all l, a strided slice of the zero-padded input. So the tap's share of the input message
    is one semiring matmul (output message [B·L, O] ⊗ kernel tap [O, C]) added with the
    semiring's plus into that slice, and its weight message is one semiring matmul (output
    message [O, B·L] ⊗ input slice [B·L, C]). Messages landing in the padding are dropped
    (padding is no input entry); padded zeros are no edges of the weight message. Grouped
    convolutions run every group's product of a tap as one batched matmul over a leading group
    dim (a depthwise convolution has as many groups as channels: one Python step per group and
    tap made MobileNet's backward thousands of tiny matmuls).
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
    # Semirings that multiply by lifted weights lift the input once, not once per tap.
    lifted = sr.lift(x_last) if x_last is not None and sr.has_lifted_matmul() else None
    padded = list(x_pad.shape[2:])
    # [B, O, *out] -> [G, B·L, O/G]: the rows of each group's output message.
    rows = tuple(
        _grouped(p.reshape(batch, groups, o_g, positions).permute(1, 0, 3, 2), groups)
        for p in m_parts
    )
    rows_t = tuple(p.transpose(-1, -2).contiguous() for p in rows) if mask[1] else None
    w_groups = w.to(dtype).reshape(groups, o_g, c_g, *kernel)
    all_taps = list(itertools.product(*(range(k) for k in kernel)))
    depthwise = c_g == 1 and groups > 1
    # The weights' lift once per pass, not once per tap (and kept across passes for a model's
    # weights: ``Semiring.kept_lift``).
    w_lifted = None
    if mask[0] and not depthwise and sr.has_lifted_matmul():
        w_lifted = tuple(c.reshape(w_groups.shape) for c in sr.kept_lift(w.to(dtype)))

    dest = sr.zeros((batch, *padded, channels), dtype, x.device) if mask[0] else None
    w_msg = sr.zeros((out_channels, c_g, *kernel), dtype, x.device) if mask[1] else None
    taps = None  # max-plus products without per-tap copies, where they apply
    if groups == 1 and (lifted is not None or w_lifted is not None):
        # rows_t holds rows' values: checked (for NaN and +inf) once
        values = [s[0] for s in (lifted, w_lifted, rows) if s is not None]
        taps = _MaxPlusTaps.make(sr, values, [batch, *padded], out_size, stride)
        if taps is not None and ((mask[0] and w_lifted is None) or (mask[1] and lifted is None)):
            taps = None
        if taps is not None and mask[0]:  # read by every tap: one copy, not one per tap
            rows = tuple(p.contiguous() for p in rows)
            # each tap's [O, C] slice of log|W| packed for the kernel: kept across passes
            # with the weight's other forms (the packing is a copy of the whole weight)
            packed = WEIGHTS.derived(
                w,
                ("max-plus tap panels", dtype),
                lambda: tuple(
                    pack_panels_f32(w_lifted[0][(0, slice(None), slice(None), *tap)])
                    for tap in all_taps
                ),
            )
            taps.weight_panels = dict(zip(all_taps, packed, strict=True))
    if depthwise:  # [B, *out, G, O/G]: each output channel's message, channels last
        m_last = tuple(
            p.reshape(batch, groups, o_g, *out_size).movedim((1, 2), (-2, -1)) for p in m_parts
        )
    for tap in all_taps:
        window = tuple(
            slice(t * d, t * d + (o - 1) * s + 1, s)
            for t, d, o, s in zip(tap, dilation, out_size, stride, strict=True)
        )
        where = (slice(None), *window, slice(None))
        if depthwise:
            w_tap = w_groups[(slice(None), slice(None), 0, *tap)]  # [G, O/G]
            _depthwise_tap(sr, m_last, w_tap, x_last, lifted, dest, w_msg, where, tap, mask)
            continue
        if mask[0] and taps is not None:  # straight into the tap's window of dest
            taps.add_input_message(dest, rows, tap, dilation)
        elif mask[0]:  # [G, B·L, O/G] ⊗ [G, O/G, C/G] -> [B, *out, C], into the tap's input slice
            at_tap = (slice(None), slice(None), slice(None), *tap)
            if w_lifted is not None:
                cols = sr.matmul_lifted(
                    rows, tuple(_grouped(c[at_tap], groups).contiguous() for c in w_lifted)
                )
            else:
                cols = sr.matmul(rows, _grouped(w_groups[at_tap], groups))
            cols = tuple(_ungroup_channels(p, groups, batch, out_size) for p in cols)
            merged = sr.plus(tuple(d[where] for d in dest), cols)
            for d, part in zip(dest, merged, strict=True):
                d[where] = part
        if mask[1]:  # [G, O/G, B·L] ⊗ [G, B·L, C/G] -> [O, C/G]
            if taps is not None:
                found = taps.weight_message(lifted[0], rows_t, tap, dilation)
            elif lifted is not None:
                inputs = tuple(_group_inputs(c[where], groups) for c in lifted)
                found = sr.matmul_lifted(rows_t, inputs)
            else:
                found = sr.matmul(rows_t, _group_inputs(x_last[where], groups))
            for d, part in zip(w_msg, found, strict=True):
                d[(slice(None), slice(None), *tap)] = part.reshape(out_channels, c_g)
    grad_in = grad_b = None
    if mask[0]:
        crop = tuple(slice(p, p + n) for p, n in zip(padding, x.shape[2:], strict=True))
        grad_in = tuple(
            d[(slice(None), *crop)].movedim(-1, 1).contiguous(memory_format=torch.contiguous_format)
            for d in dest
        )
    if mask[2]:
        m = tuple(p.reshape(batch, out_channels, positions) for p in m_parts)
        grad_b = sr.sum(m, [0, 2])
    return grad_in, w_msg, grad_b


class _MaxPlusTaps:
    """A convolution's taps in max-plus algebra without a copy per tap.

    A tap's output positions read (and its input message lands on) a strided window of the
    padded input, channels last: rows ``start(tap) + rows[l]`` of its ``[B·padded, C]`` form,
    one offset table for every tap. So the lifted input is packed once per convolution and each
    tap's weight message is read through the table (``maxplus_gather_f32``), and each tap's
    input message is added with max straight into those rows (``maxplus_scatter_max_f32``),
    instead of copying, packing, reading and writing back the window per tap. For TopPath the
    kernels also carry the first argmax, whose successor id the state takes (ties keep the
    earlier tap's, as TopPath's plus does). Same values and ids as the per-tap products: max
    does not round. ``make`` returns None where this does not apply (another algebra, no native
    kernel, not float32 on the CPU, NaN or +inf among the operands, an empty batch). Wide
    products, which the per-tap path may prune, take this path too: ResNet-18 eval MaxProd took
    4.38x a plain backward so and 4.35x with them left to the per-tap path (one thread).
    """

    def __init__(
        self, grid: list[int], out_size: Sequence[int], stride: Sequence[int], ids: bool
    ) -> None:
        self.grid = grid  # [B, *padded]
        self.ids = ids  # whether states carry successor ids (TopPath)
        # tap 0's row of each output position
        key = (tuple(grid), tuple(out_size), tuple(stride))
        small = grid[0] * math.prod(out_size) <= KEPT_ROWS_MAX_POSITIONS
        self.rows = _kept_output_rows(*key) if small else _output_rows(*key)
        self.panels: Tensor | None = None
        #: per tap, its [O, C] lifted weights packed for the kernel
        self.weight_panels: dict[tuple[int, ...], Tensor] = {}

    @staticmethod
    def make(
        sr: Semiring,
        values: Sequence[Tensor],
        grid: list[int],
        out_size: Sequence[int],
        stride: Sequence[int],
    ) -> _MaxPlusTaps | None:
        """``values``: the log-value component of every operand."""
        ids = sr.is_max_plus_with_ids()
        if not (
            (sr.is_max_plus() or ids)
            and native_available()
            and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in values)
            and all(t.numel() > 0 for t in values)
            and no_nan_or_posinf_kept(*values)
        ):
            return None
        return _MaxPlusTaps(grid, out_size, stride, ids)

    def start(self, tap: Sequence[int], dilation: Sequence[int]) -> int:
        """The row of the padded grid that output position 0 of ``tap`` reads."""
        return sum(
            t * d * math.prod(self.grid[dim + 2 :])
            for dim, (t, d) in enumerate(zip(tap, dilation, strict=True))
        )

    def weight_message(
        self, lifted_x: Tensor, rows_t: State, tap: Sequence[int], dilation: Sequence[int]
    ) -> State:
        """``rows_t`` [O, B·L] ⊗ the tap's window of ``lifted_x`` [B, *padded, C] -> [O, C]."""
        channels = lifted_x.shape[-1]
        if self.panels is None:
            self.panels = pack_panels_f32(lifted_x.reshape(-1, channels))
        start = self.start(tap, dilation)
        values, index = maxplus_gather_f32(
            rows_t[0], self.panels, self.rows, start, channels, with_index=self.ids
        )
        if not self.ids:
            return (values,)
        return values, torch.gather(rows_t[1], 1, index)

    def add_input_message(
        self, dest: State, rows: State, tap: Sequence[int], dilation: Sequence[int]
    ) -> None:
        """``dest`` [B, *padded, C] ⊕= ``rows`` [B·L, O] ⊗ the tap's lifted weights [O, C]
        (``weight_panels``) on the window."""
        flat = dest[0].reshape(-1, dest[0].shape[-1])
        panels = self.weight_panels[tuple(tap)]
        start = self.start(tap, dilation)
        if not self.ids:
            maxplus_scatter_max_f32(rows[0], panels, flat, self.rows, start)
            return
        flat_ids = dest[1].reshape(flat.shape)
        maxplus_scatter_max_f32(rows[0], panels, flat, self.rows, start, rows[1], flat_ids)


#: Row tables of at most this many output positions (128 KiB) are kept for the next pass.
KEPT_ROWS_MAX_POSITIONS = 1 << 14


def _output_rows(grid: Sequence[int], out_size: Sequence[int], stride: Sequence[int]) -> Tensor:
    """The row of the ``[B·padded, C]`` grid (``grid`` [B, *padded]) that each output position
    reads at tap 0, in output order (int64)."""
    index = torch.zeros((), dtype=torch.int64)
    for dim, (size, step) in enumerate(zip([grid[0], *out_size], [1, *stride], strict=True)):
        index = index[..., None] + torch.arange(size, dtype=torch.int64) * (
            step * math.prod(grid[dim + 1 :])
        )
    return index.reshape(-1).contiguous()


#: ``_output_rows`` of small convolutions, shared (read-only) by every later call with the
#: same geometry: a model runs the same convolutions at every pass, and on small planes these
#: few ops were a visible share of a convolution's fixed cost. At most 128 tables of 128 KiB.
_kept_output_rows = functools.lru_cache(maxsize=128)(_output_rows)


def _depthwise_tap(
    sr: Semiring,
    m_last: State,
    w_tap: Tensor,
    x_last: Tensor | None,
    lifted: State | None,
    dest: State | None,
    w_msg: State | None,
    where: tuple[slice, ...],
    tap: tuple[int, ...],
    mask: Sequence[bool],
) -> None:
    """One tap of a convolution whose output channels each read one input channel (depthwise,
    with any channel multiplier O/G): no sum over input channels, so both messages are
    elementwise products and a plus over the multiplier (input) or over batch and positions
    (weight), with no matmul of inner size 1. ``m_last`` [B, *out, G, O/G]; ``w_tap`` [G, O/G];
    ``x_last`` [B, *padded, C] (C = G), ``lifted`` its lift where the semiring has one."""
    spatial = m_last[0].dim() - 3
    if mask[0]:  # [B, *out, G]: ⊕ over the multiplier of m ⊗ w, into the tap's input slice
        cols = sr.sum(sr.scale(m_last, w_tap), [m_last[0].dim() - 1])
        merged = sr.plus(tuple(d[where] for d in dest), cols)
        for d, part in zip(dest, merged, strict=True):
            d[where] = part
    if mask[1]:  # [G, O/G]: ⊕ over batch and positions of m ⊗ x
        if lifted is not None:
            inputs = tuple(c[where][..., None] for c in lifted)
        else:
            inputs = sr.lift(x_last[where][..., None])
        found = sr.sum(sr.times(m_last, inputs), list(range(spatial + 1)))
        for d, part in zip(w_msg, found, strict=True):
            d[(slice(None), 0, *tap)] = part.reshape(-1)


def _tap_box(
    tap: Sequence[int], in_size: Sequence[int], out_size: Sequence[int], geometry: ConvGeometry
) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Where tap ``tap`` of a transposed convolution lands: (input box, output slices).

    Input position i of dim d feeds output position ``i * stride - padding + t * dilation``;
    the input positions whose target lies inside the output form a range per dim, and their
    targets a strided slice of the output. None when the tap reaches no output entry.
    """
    inputs, outputs = [], []
    for t, n_in, n_out, s, p, d in zip(
        tap, in_size, out_size, geometry.stride, geometry.padding, geometry.dilation, strict=True
    ):
        offset = t * d - p  # target of input position 0
        first = max(0, -(offset // s))  # the first i with i * s + offset >= 0
        last = min(n_in - 1, (n_out - 1 - offset) // s)
        if last < first:
            return None
        inputs.append(slice(first, last + 1))
        start = first * s + offset
        outputs.append(slice(start, start + (last - first) * s + 1, s))
    return tuple(inputs), tuple(outputs)


def transposed_per_tap_messages(
    sr: Semiring, m_parts: State, x: Tensor, w: Tensor, geometry: ConvGeometry, mask: Sequence[bool]
) -> Messages:
    """Messages of a transposed convolution one kernel tap at a time, without an im2col copy.

    ``x``: [B, C, *in]; ``w``: [C, O/groups, *kernel]; ``m_parts``: [B, O, *out]. Tap t links
    input position i to output position ``i * stride - padding + t * dilation``, so over the
    input positions whose target exists (a box, ``_tap_box``) its targets are a strided slice
    of the output. The tap's input message is one semiring matmul (output slice [B·L, O] ⊗
    kernel tap [O, C]) added with the semiring's plus into the box; its weight message one
    semiring matmul (output slice [O, B·L] ⊗ input box [B·L, C]). Outputs no input reaches
    (cropped by ``padding``) are no edges; neither are taps that reach no output.
    """
    batch, channels, out_channels = x.shape[0], x.shape[1], m_parts[0].shape[1]
    in_size, out_size, kernel = list(x.shape[2:]), list(m_parts[0].shape[2:]), list(w.shape[2:])
    groups = geometry.groups
    c_g, o_g = channels // groups, out_channels // groups
    dtype = sr.state_dtype(x.dtype)
    # Channels last, so that a box or a slice is whole rows of channels.
    m_last = tuple(p.movedim(1, -1).contiguous() for p in m_parts)
    x_last = x.to(dtype).movedim(1, -1) if mask[1] else None
    lifted = sr.lift(x_last) if x_last is not None and sr.has_lifted_matmul() else None
    dest = sr.zeros((batch, *in_size, channels), dtype, x.device) if mask[0] else None
    w_msg = sr.zeros((channels, o_g, *kernel), dtype, x.device) if mask[1] else None
    for tap in itertools.product(*(range(k) for k in kernel)):
        box = _tap_box(tap, in_size, out_size, geometry)
        if box is None:
            continue
        inputs, outputs = box
        rows_shape = (batch, *(b.stop - b.start for b in inputs))
        positions = math.prod(rows_shape)
        for g in range(groups):
            outs, ins = slice(g * o_g, (g + 1) * o_g), slice(g * c_g, (g + 1) * c_g)
            rows = tuple(p[(slice(None), *outputs, outs)].reshape(positions, o_g) for p in m_last)
            where = (slice(None), *inputs, ins)
            if mask[0]:  # [B·L, O] ⊗ [O, C] -> [B, *box, C], into the box
                cols = sr.matmul(rows, w[(ins, slice(None), *tap)].t().to(dtype))
                cols = tuple(p.reshape(*rows_shape, c_g) for p in cols)
                merged = sr.plus(tuple(d[where] for d in dest), cols)
                for d, part in zip(dest, merged, strict=True):
                    d[where] = part
            if mask[1]:  # [O, B·L] ⊗ [B·L, C] -> [O, C], stored as [C, O]
                rows_t = tuple(p.t().contiguous() for p in rows)
                if lifted is not None:
                    found = sr.matmul_lifted(
                        rows_t, tuple(c[where].reshape(positions, c_g) for c in lifted)
                    )
                else:
                    found = sr.matmul(rows_t, x_last[where].reshape(positions, c_g))
                for d, part in zip(w_msg, found, strict=True):
                    d[(ins, slice(None), *tap)] = part.t()
    grad_in = grad_b = None
    if mask[0]:
        grad_in = tuple(
            d.movedim(-1, 1).contiguous(memory_format=torch.contiguous_format) for d in dest
        )
    if mask[2]:
        grad_b = sr.sum(tuple(p.reshape(batch, out_channels, -1) for p in m_parts), [0, 2])
    return grad_in, w_msg, grad_b


def _grouped(t: Tensor, groups: int) -> Tensor:
    """[G, B, L, k] or [G, k, m] with the group dim leading -> [G, rows, k] (or, for one group,
    the plain 2-D [rows, k] that ungrouped convolutions have always multiplied)."""
    t = t.reshape(groups, -1, t.shape[-1])
    return t[0] if groups == 1 else t


def _ungroup_channels(t: Tensor, groups: int, batch: int, out_size: Sequence[int]) -> Tensor:
    """Per-group input messages [G, B·L, C/G] (or [B·L, C]) -> [B, *out, C], channel g·C/G + c."""
    c_g = t.shape[-1]
    t = t.reshape(groups, batch, *out_size, c_g).movedim(0, -2)
    return t.reshape(batch, *out_size, groups * c_g)


def _group_inputs(t: Tensor, groups: int) -> Tensor:
    """An input slice [B, *out, C], channels last -> [G, B·L, C/G] (or [B·L, C])."""
    channels = t.shape[-1]
    t = t.reshape(-1, groups, channels // groups).transpose(0, 1)
    return t[0] if groups == 1 else t


@register_rule(aten.convolution_backward.default)
def convolution_backward(call: OpCall):
    """Every convolution (1-3 d, transposed, grouped, strided, dilated): messages to the
    input, the weight and the bias as the semiring's products over the kernel taps."""
    msg, x, w = call["grad_output"], call["input"], call["weight"]
    mask = call["output_mask"]
    geometry = ConvGeometry.of(
        x.dim() - 2,
        call["stride"],
        call["padding"],
        call["dilation"],
        call["groups"],
        call["transposed"],
        call["output_padding"],
    )
    grads = conv_messages(call.semiring, msg.parts, x, w, geometry, mask)
    regular = call.run_regular()
    reals = list(regular) if regular is not None else [None, None, None]
    return tuple(
        call.wrap(r, parts) if want and parts is not None else r
        for want, parts, r in zip(mask, grads, reals, strict=True)
    )
