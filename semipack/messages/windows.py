"""Index maps of sliding windows, shared by convolution and pooling rules.

A window map is a [taps, positions] tensor of flat input indices (-1 where a tap falls in the
padding). Scattering with it and the semiring's ``index_plus`` turns "sum over the windows that
overlap an input entry" into the semiring's plus, for any stride, padding and dilation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def expand_param(
    value: Sequence[int] | int, n: int, default: Sequence[int] | None = None
) -> list[int]:
    """A conv/pool parameter given as an int, a one-element or an ``n``-element sequence, as a
    list of ``n`` ints; an empty sequence means ``default`` (pooling's ``stride=[]`` is the
    kernel size)."""
    if isinstance(value, int):
        return [value] * n
    value = list(value)
    if not value and default is not None:
        return list(default)
    return value * n if len(value) == 1 else value


@dataclass(frozen=True)
class ConvGeometry:
    """Stride, padding and dilation (one entry per spatial dim) and groups of a convolution;
    ``transposed`` and ``output_padding`` (one entry per spatial dim) for a transposed one."""

    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int = 1
    transposed: bool = False
    output_padding: tuple[int, ...] = ()

    @classmethod
    def of(
        cls,
        spatial_dims: int,
        stride,
        padding,
        dilation,
        groups: int = 1,
        transposed: bool = False,
        output_padding=0,
    ) -> ConvGeometry:
        """From the forms the modules and aten use (an int or one value per dim)."""
        return cls(
            tuple(expand_param(stride, spatial_dims)),
            tuple(expand_param(padding, spatial_dims)),
            tuple(expand_param(dilation, spatial_dims)),
            groups,
            transposed,
            tuple(expand_param(output_padding, spatial_dims, default=[0] * spatial_dims)),
        )


def combine_dims(positions: list[Tensor], in_size: Sequence[int]) -> Tensor:
    """Per-dim positions [K_d, O_d] -> flat indices [prod K_d, prod O_d], -1 where out of range."""
    n = len(positions)
    flat = None
    valid = None
    stride = math.prod(in_size)
    for d, (pos, size) in enumerate(zip(positions, in_size, strict=True)):
        stride //= size
        shape = [1] * (2 * n)
        shape[d], shape[n + d] = pos.shape
        p = pos.reshape(shape)
        ok = (p >= 0) & (p < size)
        flat = p * stride if flat is None else flat + p * stride
        valid = ok if valid is None else valid & ok
    taps = math.prod(p.shape[0] for p in positions)
    outs = math.prod(p.shape[1] for p in positions)
    return torch.where(valid, flat, -1).reshape(taps, outs)


def sliding_positions(
    in_size: Sequence[int],
    out_size: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    device=None,
) -> list[Tensor]:
    """Per spatial dim d, the input coordinate of tap k for output o,
    ``o * stride - padding + k * dilation``, as a ``[kernel[d], out_size[d]]`` int64 tensor
    (out of range where the tap falls in the padding)."""
    out = []
    for o, k, s, p, d in zip(out_size, kernel, stride, padding, dilation, strict=True):
        taps = torch.arange(k, device=device)[:, None] * d
        starts = torch.arange(o, device=device)[None, :] * s - p
        out.append(taps + starts)
    return out


def window_index(in_size, out_size, kernel, stride, padding, dilation, device=None) -> Tensor:
    """Flat input index of every (kernel tap, output position) pair of a sliding window:
    ``[prod(kernel), prod(out_size)]`` int64, ``-1`` where the tap falls in the padding."""
    positions = sliding_positions(in_size, out_size, kernel, stride, padding, dilation, device)
    return combine_dims(positions, in_size)


def adaptive_positions(in_size: Sequence[int], out_size: Sequence[int], device=None):
    """Adaptive pooling windows: [floor(o*I/O), ceil((o+1)*I/O)) per dim, padded to the widest.

    Returns (positions [K_d, O_d] with out-of-window taps set to -1, window lengths [O_d]).
    """
    positions, lengths = [], []
    for i, o in zip(in_size, out_size, strict=True):
        idx = torch.arange(o, device=device)
        start = (idx * i) // o
        end = -((-(idx + 1) * i) // o)
        width = int((end - start).max())
        pos = start[None, :] + torch.arange(width, device=device)[:, None]
        positions.append(torch.where(pos < end[None, :], pos, -1))
        lengths.append(end - start)
    return positions, lengths


def scatter_windows(sr, dest_parts, lead: int, spatial: int, index: Tensor, src_parts):
    """dest[l, index[t, o]] ⊕= src[l, t, o] for each leading row l (flat over leading dims).

    ``dest_parts``: [lead, spatial]; ``src_parts``: [lead, taps, outs]; ``index``: [taps, outs].
    """
    valid = index >= 0
    flat_index = index[valid]
    rows = torch.arange(lead, device=index.device)[:, None] * spatial
    targets = (rows + flat_index[None, :]).reshape(-1)
    src = tuple(p[:, valid].reshape(-1) for p in src_parts)
    dest = tuple(p.reshape(-1) for p in dest_parts)
    out = sr.index_plus(dest, 0, targets, src)
    return tuple(p.reshape(lead, spatial) for p in out)


def incoming_edges(targets: Tensor, n_targets: int) -> Tensor:
    """Edges grouped by target: [n_targets, largest in-degree] of edge numbers, -1 in unused
    slots. ``targets``: 1-D, the target of each edge (-1: the edge goes nowhere).

    A semiring plus into the targets is then a gather and a ``sum`` over the slots, with no
    scatter: fast for every semiring, and for semirings without ``index_plus`` kernels it avoids
    the dense routing matrix of the generic one.
    """
    edges = torch.nonzero(targets >= 0).reshape(-1)
    order = torch.argsort(targets[edges], stable=True)
    edges = edges[order]
    landing = targets[edges]
    degree = torch.bincount(landing, minlength=n_targets)
    width = int(degree.max()) if degree.numel() else 0
    starts = torch.cumsum(degree, 0) - degree
    slot = torch.arange(edges.numel(), device=targets.device) - starts[landing]
    table = torch.full((n_targets, width), -1, dtype=torch.long, device=targets.device)
    table[landing, slot] = edges
    return table
