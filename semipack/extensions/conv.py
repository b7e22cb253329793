"""torch.conv1d / torch.conv2d (hence nn.Conv1d / nn.Conv2d): one fused semiring backward."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..messages.windows import ConvGeometry
from ..rules.convolution import conv_messages
from ..semirings.base import Semiring, State
from .base import (
    BackwardCall,
    ExtensionFunction,
    Sites,
    bilinear_reads,
    extends,
    per_sample_rule,
    wants_graph,
)


def conv_per_sample(
    sr: Semiring, m: State, x: Tensor, weight: Tensor, geometry: ConvGeometry, need: Sequence[bool]
) -> tuple[State | None, State | None]:
    """Per-sample (weight, bias) states of ``conv(x, W) + b``: ``[N, *W.shape]`` and ``[N, O]``.

    The input's windows (``F.unfold``, a conv1d as a conv2d of height 1) against the output
    message, one batched semiring product per example and group:
    ``rows[n, o, c, k] = ⊕_l m[n, o, l] ⊗ x_window[n, c, k, l]``. Padded zeros are no edges.
    """
    n = x.shape[0]
    out_channels, kernel = weight.shape[0], tuple(weight.shape[2:])
    groups = geometry.groups
    m_w = m_b = None
    if need[1]:
        stride, padding, dilation = geometry.stride, geometry.padding, geometry.dilation
        x2 = x.to(sr.state_dtype(x.dtype))
        size = kernel
        if x.dim() == 3:  # [N, C, L] as [N, C, 1, L]
            x2, size = x2.unsqueeze(2), (1, *kernel)
            stride, padding, dilation = (1, *stride), (0, *padding), (1, *dilation)
        windows = F.unfold(x2, size, dilation=dilation, padding=padding, stride=stride)
        positions = windows.shape[-1]
        windows = windows.reshape(n, groups, -1, positions).transpose(-1, -2)
        rows = tuple(p.reshape(n, groups, out_channels // groups, positions) for p in m)
        m_w = tuple(p.reshape(n, *weight.shape) for p in sr.matmul(rows, windows))
    if need[2]:
        m_b = sr.sum(tuple(p.reshape(n, out_channels, -1) for p in m), [2])
    return m_w, m_b


@per_sample_rule
class ConvFunction(ExtensionFunction):
    """(x, W, b) -> conv(x, W) + b; x: [batch, channels, *spatial], options: ConvGeometry."""

    reads = (0, 1)
    read_for = staticmethod(bilinear_reads)

    @classmethod
    def per_sample(cls, call: BackwardCall) -> list[State | None]:
        x, weight, _ = call.inputs
        m_w, m_b = conv_per_sample(
            call.semiring, call.incoming[0], x, weight, call.options, call.needs
        )
        return [None, m_w, m_b]

    @staticmethod
    def messages(call: BackwardCall) -> tuple[State | None, ...]:
        x, weight, _ = call.inputs
        return conv_messages(call.semiring, call.incoming[0], x, weight, call.options, call.needs)

    @staticmethod
    def sites(out: Tensor) -> Sites:
        names = ("position",) if out.dim() == 3 else ("row", "column")
        return (("output", ("batch", "channel", *names)),)


def _conv_handler(conv: Callable[..., Tensor], spatial: int) -> Callable[..., Tensor]:
    def handler(
        input: Tensor,
        weight: Tensor,
        bias: Tensor | None = None,
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] | str = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
    ) -> Tensor:
        def plain(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
            return conv(x, w, b, stride, padding, dilation, groups)

        # String padding ("same") may pad asymmetrically: the generic path handles it.
        if isinstance(padding, str) or not wants_graph(input, weight, bias):
            return plain(input, weight, bias)
        if input.dim() == spatial + 1:  # unbatched input
            return handler(
                input.unsqueeze(0), weight, bias, stride, padding, dilation, groups
            ).squeeze(0)
        geometry = ConvGeometry.of(spatial, stride, padding, dilation, groups)
        return ConvFunction.run(plain, [input, weight, bias], geometry)

    handler.__doc__ = f"``{conv.__name__}`` inside ``extend``: one fused semiring backward."
    return handler


conv1d = extends(torch.conv1d)(_conv_handler(torch.conv1d, 1))
conv2d = extends(torch.conv2d)(_conv_handler(torch.conv2d, 2))
