"""torch.conv1d / torch.conv2d (hence nn.Conv1d / nn.Conv2d): one fused semiring backward."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..messages.windows import ConvGeometry
from ..rules.convolution import conv_messages
from ..semirings.base import State
from .base import BackwardCall, ExtensionFunction, Sites, extends, per_sample_rule, wants_graph


@per_sample_rule
class ConvFunction(ExtensionFunction):
    """(x, W, b) -> conv(x, W) + b; x: [batch, channels, *spatial], options: ConvGeometry."""

    reads = (0, 1)

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
