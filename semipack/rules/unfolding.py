"""F.unfold and F.fold (aten ``im2col`` and ``col2im``): copies of entries into sliding windows.

``im2col`` copies input entry (c, position) into column entry (c·K + tap, window) for every
window and tap that covers it (taps in the padding copy nothing); ``col2im`` is its adjoint and
adds the column entries back onto the positions. Every edge has weight 1. So the backward of
``F.unfold`` (``col2im`` on the message) plus-reduces, with the semiring's ``sum``, the column
entries each input entry was copied to (gathered per entry: no scatter); the backward of
``F.fold`` (``im2col`` on the message) hands each column entry the message of the one position
it was added to, or the semiring's zero where the column entry fell in the padding (no edge).
Both use the window index maps of ``windows``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..messages import OpCall, register_rule
from ..messages.windows import expand_param, incoming_edges, window_index

aten = torch.ops.aten


def column_sources(
    channels: int,
    in_size: Sequence[int],
    kernel: Sequence[int],
    dilation: Sequence[int],
    padding: Sequence[int],
    stride: Sequence[int],
    device,
) -> Tensor:
    """[C·K, L]: the flat input index (c·H·W + position) each column entry copies, -1 where the
    tap falls in the padding. K = prod(kernel) taps, L = sliding windows (row-major, as
    ``im2col`` lays them out)."""
    out_size = [
        (n + 2 * p - d * (k - 1) - 1) // s + 1
        for n, k, d, p, s in zip(in_size, kernel, dilation, padding, stride, strict=True)
    ]
    index = window_index(in_size, out_size, kernel, stride, padding, dilation, device)  # [K, L]
    spatial = math.prod(in_size)
    per_channel = torch.arange(channels, device=device)[:, None, None] * spatial + index
    return torch.where(index >= 0, per_channel, -1).reshape(-1, index.shape[1])


def _geometry(call: OpCall) -> tuple[list[int], list[int], list[int], list[int]]:
    return (
        expand_param(call["kernel_size"], 2),
        expand_param(call["dilation"], 2),
        expand_param(call["padding"], 2),
        expand_param(call["stride"], 2),
    )


def _gather(call: OpCall, parts: tuple[Tensor, ...], lead: int, index: Tensor):
    """``parts`` flattened to [lead, n], gathered at ``index`` (any shape) along n: [lead,
    *index.shape], the semiring's zero where the index is -1."""
    nowhere = call.zeros((lead, 1))
    n = parts[0].numel() // max(1, lead)
    picks = torch.where(index >= 0, index, n)
    return tuple(
        torch.cat([p.reshape(lead, n), z], 1)[:, picks] for p, z in zip(parts, nowhere, strict=True)
    )


@register_rule(aten.col2im.default)
def col2im(call: OpCall):
    """Message of ``F.unfold``'s input: [N, C·K, L] (or [C·K, L]) -> [N, C, H, W] (or
    [C, H, W]); each input entry plus-reduces the column entries it was copied to."""
    msg = call["self"]
    kernel, dilation, padding, stride = _geometry(call)
    in_size = list(call["output_size"])
    batched = msg.dim() == 3
    lead = msg.shape[0] if batched else 1
    channels = msg.shape[-2] // math.prod(kernel)
    sources = column_sources(channels, in_size, kernel, dilation, padding, stride, msg.device)
    spatial = channels * math.prod(in_size)
    copies = incoming_edges(sources.reshape(-1), spatial)  # [C·H·W, copies], -1 unused
    if copies.shape[1] == 0:
        parts = call.zeros((lead, spatial))
    else:
        parts = call.semiring.sum(_gather(call, msg.parts, lead, copies), [2])
    shape = (lead, channels, *in_size) if batched else (channels, *in_size)
    return call.wrap(call.run_regular(), tuple(p.reshape(shape) for p in parts))


@register_rule(aten.im2col.default)
def im2col(call: OpCall):
    """Message of ``F.fold``'s input: [N, C, H, W] (or [C, H, W]) -> [N, C·K, L] (or
    [C·K, L]); each column entry takes the message of the position it was added to, the
    semiring's zero where it fell in the padding."""
    msg = call["self"]
    kernel, dilation, padding, stride = _geometry(call)
    batched = msg.dim() == 4
    lead = msg.shape[0] if batched else 1
    channels, in_size = msg.shape[-3], list(msg.shape[-2:])
    sources = column_sources(channels, in_size, kernel, dilation, padding, stride, msg.device)
    parts = _gather(call, msg.parts, lead, sources)
    shape = (lead, *sources.shape) if batched else tuple(sources.shape)
    return call.wrap(call.run_regular(), tuple(p.reshape(shape) for p in parts))
