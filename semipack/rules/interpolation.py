"""Linear, bilinear, bicubic and trilinear interpolation (antialiased too): fixed linear maps.

Every output entry of ``F.interpolate`` in these modes is a fixed combination of the input
entries of its (sample, channel), and the combination is separable: the local derivative of
output o with respect to input i is ``Π_d A_d[o_d, i_d]``, where ``A_d[o, i]`` sums the
coefficients of the taps of dim d that land on input position i (taps clamped at a border land
on the same entry: they are one edge, with the summed weight). A coefficient of exactly 0 (a
bicubic tap at an integer source position, a linear tap at a zero fraction) is no edge.

The coefficients are read off the backward op itself, one dim at a time: given an indicator
gradient along dim d, and size 2 with no scale along every other dim (where each of these ops
is the identity, with weights exactly 1 and 0), the op returns the rows of ``A_d`` exactly as it
weighs the regular gradient, whatever its scale, ``align_corners`` or antialiasing rules.

The built-in semirings lift products to products, so their messages contract one dim at a time
(``_contract_axis``: a gather, a scale and the semiring's ``sum`` over that dim's non-zero
coefficients; no [out, in] matrix). A user semiring gets the literal edges, one per
(output, input) pair with the product weight (``_contract_edges``, a gather and the semiring's
``sum``), so its ``lift`` need not be multiplicative.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch._ops import OpOverload

from ..kernels.blocking import BLOCK_ELEMENTS
from ..messages import OpCall, register_rule
from ..messages.windows import incoming_edges
from ..semirings import Semiring, State

aten = torch.ops.aten

#: Size of every other spatial dim while one dim's coefficients are read (see the module doc).
_OTHER_SIZE = 2


@dataclass(frozen=True)
class AxisCoefficients:
    """The non-zero entries of one dim's coefficient matrix ``A[o, i]`` (each 1-D, same length).

    ``out_index`` is sorted; ``weight`` holds the summed coefficient of each (o, i) pair.
    """

    out_index: Tensor
    in_index: Tensor
    weight: Tensor


def axis_coefficients(
    backward: OpOverload,
    n_in: int,
    n_out: int,
    dim: int,
    spatial_dims: int,
    align_corners: bool,
    scale: float | None,
    dtype: torch.dtype,
    device,
) -> AxisCoefficients:
    """Read ``A_dim`` off the interpolation backward ``backward`` (its aten signature:
    ``(grad, output_size, input_size, align_corners, *scales)``), a block of output positions
    at a time: channel c of the indicator gradient is 1 at output position c along ``dim``."""
    sizes_out = [_OTHER_SIZE] * spatial_dims
    sizes_in = [_OTHER_SIZE] * spatial_dims
    sizes_out[dim], sizes_in[dim] = n_out, n_in
    scales: list[float | None] = [None] * spatial_dims
    scales[dim] = scale
    others = _OTHER_SIZE ** (spatial_dims - 1)
    block = max(1, min(n_out, BLOCK_ELEMENTS // max(1, others * (n_out + n_in))))
    found: list[tuple[Tensor, Tensor, Tensor]] = []
    for start in range(0, n_out, block):
        count = min(block, n_out - start)
        positions = torch.arange(start, start + count, device=device)
        indicator = torch.zeros(count, n_out, dtype=dtype, device=device)
        indicator[torch.arange(count, device=device), positions] = 1.0
        grad = _along(indicator, dim, spatial_dims).expand(1, count, *sizes_out).contiguous()
        rows = backward(grad, sizes_out, [1, count, *sizes_in], align_corners, *scales)
        rows = rows[0].movedim(1 + dim, -1)  # [count, *others, n_in]
        rows = rows.reshape(count, -1, n_in)[:, 0]  # read at index 0 of every other dim
        out_index, in_index = torch.nonzero(rows, as_tuple=True)
        found.append((out_index + start, in_index, rows[out_index, in_index]))
    return AxisCoefficients(*(torch.cat(parts) for parts in zip(*found, strict=True)))


@functools.cache
def keeps_same_size_exactly(
    backward: OpOverload, spatial_dims: int, align_corners: bool, dtype: torch.dtype, device: str
) -> bool:
    """Whether ``backward`` at size ``_OTHER_SIZE`` in every dim, without scales, is exactly
    the identity, as ``axis_coefficients`` assumes of the dims it does not read."""
    sizes = [_OTHER_SIZE] * spatial_dims
    n = _OTHER_SIZE**spatial_dims
    eye = torch.eye(n, dtype=dtype, device=device)
    grad = eye.reshape(1, n, *sizes)
    back = backward(grad, sizes, [1, n, *sizes], align_corners, *([None] * spatial_dims))
    return torch.equal(back.reshape(n, n), eye)


def _along(indicator: Tensor, dim: int, spatial_dims: int) -> Tensor:
    """[count, n] -> [1, count, 1, .., n (at spatial dim ``dim``), .., 1]."""
    shape = [1, indicator.shape[0]] + [1] * spatial_dims
    shape[2 + dim] = indicator.shape[1]
    return indicator.reshape(shape)


def _contract_axis(
    sr: Semiring, m: State, dim: int, coeffs: AxisCoefficients, n_in: int, grad_dtype
) -> State:
    """``out[.., i, ..] = ⊕_o m[.., o, ..] ⊗ lift(A[o, i])`` along ``dim`` of ``m``.

    Each input position gathers the outputs it feeds (``incoming_edges``); unused slots gather
    the semiring's zero (an appended entry) with weight 1, so they add nothing, successor ids
    included. Then one ``scale`` and one ``sum`` over the slots.
    """
    table = incoming_edges(coeffs.in_index, n_in)  # [n_in, degree], -1 unused
    moved = tuple(p.movedim(dim, -1) for p in m)
    if table.shape[1] == 0:
        shape = (*moved[0].shape[:-1], n_in)
        return tuple(p.movedim(-1, dim) for p in sr.zeros(shape, grad_dtype, m[0].device))
    used = table >= 0
    n_out = moved[0].shape[-1]
    picks = torch.where(used, coeffs.out_index[table], n_out)
    weights = torch.where(used, coeffs.weight[table], 1.0)
    nowhere = sr.zeros((*moved[0].shape[:-1], 1), grad_dtype, m[0].device)
    src = tuple(
        torch.cat([p, z], -1)[..., picks] for p, z in zip(moved, nowhere, strict=True)
    )  # [..., n_in, degree]
    parts = sr.sum(sr.scale(src, weights), [src[0].dim() - 1])
    return tuple(p.movedim(-1, dim) for p in parts)


def _contract_edges(
    sr: Semiring, m: State, axes: list[AxisCoefficients], in_sizes: list[int], grad_dtype
) -> State:
    """The same contraction over the literal edges: every (output, input) pair with a non-zero
    product of coefficients, lifted once. ``m``: [lead, *out_sizes].

    Each input entry gathers its incoming edges (padded to the largest in-degree with weight 0,
    which lifts to the semiring's zero) and plus-reduces them with ``sum``: the primitives only,
    and memory proportional to the edges, not to outputs times inputs.
    """
    lead, out_sizes = m[0].shape[0], list(m[0].shape[1:])
    device = m[0].device
    out_flat = torch.zeros(1, dtype=torch.long, device=device)
    in_flat = torch.zeros(1, dtype=torch.long, device=device)
    weight = torch.ones(1, dtype=axes[0].weight.dtype, device=device)
    for coeffs, n_out, n_in in zip(axes, out_sizes, in_sizes, strict=True):
        out_flat = (out_flat[:, None] * n_out + coeffs.out_index[None, :]).reshape(-1)
        in_flat = (in_flat[:, None] * n_in + coeffs.in_index[None, :]).reshape(-1)
        weight = (weight[:, None] * coeffs.weight[None, :]).reshape(-1)
    table = incoming_edges(in_flat, math.prod(in_sizes))  # [I, degree], -1 unused
    if table.shape[1] == 0:
        return sr.zeros((lead, *in_sizes), grad_dtype, device)
    used = table >= 0
    sources = torch.where(used, out_flat[table], 0)
    weights = torch.where(used, weight[table], 0.0)
    src = tuple(p.reshape(lead, -1)[:, sources] for p in m)  # [lead, I, degree]
    parts = sr.sum(sr.scale(src, weights[None]), [2])
    return tuple(p.reshape(lead, *in_sizes) for p in parts)


def interpolation_messages(call: OpCall) -> State:
    """The input message of an interpolation backward call (any of ``_BACKWARDS``)."""
    bound = call.bound
    msg = bound["grad_output"]
    input_size = list(bound["input_size"])
    out_sizes, in_sizes = list(bound["output_size"]), input_size[2:]
    spatial = len(out_sizes)
    scales = [value for name, value in bound.items() if name.startswith("scales")]
    sr, device = call.semiring, msg.device
    if msg.numel() == 0 or math.prod(input_size) == 0:
        return call.zeros(input_size)
    align_corners = bool(bound["align_corners"])
    if not keeps_same_size_exactly(
        call.func, spatial, align_corners, call.weight_dtype, str(device)
    ):
        raise call.error(
            "its coefficients cannot be read off exactly (this PyTorch build does not keep a "
            "same-size dimension as the exact identity)"
        )
    axes = [
        axis_coefficients(
            call.func,
            in_sizes[d],
            out_sizes[d],
            d,
            spatial,
            align_corners,
            scales[d],
            call.weight_dtype,
            device,
        )
        for d in range(spatial)
    ]
    lead = input_size[0] * input_size[1]
    m = tuple(p.reshape(lead, *out_sizes) for p in msg.parts)
    if sr.lift_is_multiplicative():  # a separable map contracts dim by dim
        for d in range(spatial):
            m = _contract_axis(sr, m, 1 + d, axes[d], in_sizes[d], call.dtype)
    else:
        m = _contract_edges(sr, m, axes, in_sizes, call.dtype)
    return tuple(p.reshape(input_size) for p in m)


_BACKWARDS = [
    aten.upsample_linear1d_backward.default,
    aten.upsample_bilinear2d_backward.default,
    aten.upsample_bicubic2d_backward.default,
    aten.upsample_trilinear3d_backward.default,
    aten._upsample_bilinear2d_aa_backward.default,
    aten._upsample_bicubic2d_aa_backward.default,
]


@register_rule(*_BACKWARDS)
def interpolation_backward(call: OpCall):
    """Every interpolation mode (nearest, linear, bilinear, bicubic, trilinear,
    antialiased): edges with the coefficients PyTorch's own backward applies."""
    return call.wrap(call.run_regular(), interpolation_messages(call))
