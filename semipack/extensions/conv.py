"""torch.conv1d / torch.conv2d (hence nn.Conv1d / nn.Conv2d): one fused semiring backward."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..graph.provenance import current_module
from ..graph.sites import Site, stamp
from ..messages.windows import ConvGeometry
from ..rules.convolution import conv_messages
from .base import InnerGraph, extends, frees_context, messages, split_message, wants_graph


class ConvFunction(torch.autograd.Function):
    """(x, W, b) -> conv(x, W) + b, with the call's inner graph recorded beforehand."""

    @staticmethod
    def forward(ctx, inner: InnerGraph, x, weight, bias, geometry: ConvGeometry):
        ctx.inner, ctx.geometry = inner, geometry
        return inner.take_outputs()

    @staticmethod
    @frees_context
    def backward(ctx, grad):
        regular, parts, sr = split_message(grad)
        reg = ctx.inner.regular_grads([regular])
        if parts is None:
            return (None, *reg, None)
        ctx.inner.check_unmodified((0, 1))
        x, weight, bias = ctx.inner.values()
        need = ctx.needs_input_grad[1:]
        mask = (need[0], need[1], need[2] and bias is not None)
        states = conv_messages(sr, parts, x, weight, ctx.geometry, mask)
        return (None, *messages(reg, states, sr, (x, weight, bias)), None)


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
        inner = InnerGraph(plain, [input, weight, bias])
        if inner.escapes:
            return inner.plain_outputs()
        geometry = ConvGeometry.of(spatial, stride, padding, dilation, groups)
        out = ConvFunction.apply(inner, input, weight, bias, geometry)
        names = ("position",) if spatial == 1 else ("row", "column")
        stamp(out, (Site(current_module(), "output", ("batch", "channel", *names)),))
        return out

    handler.__doc__ = f"``{conv.__name__}`` inside ``extend``: one fused semiring backward."
    return handler


conv1d = extends(torch.conv1d)(_conv_handler(torch.conv1d, 1))
conv2d = extends(torch.conv2d)(_conv_handler(torch.conv2d, 2))
