"""nn.Conv1d / nn.Conv2d: semiring convolution via window index maps and the semiring matmul."""

from __future__ import annotations

import torch
from torch import nn

from ..readout.sites import Site, stamp
from ..rules.convolution import conv_messages
from ..rules.windows import ConvGeometry
from ..transport.provenance import current_module
from .base import (
    ModuleExtension,
    frees_context,
    inner_inputs,
    messages,
    record_inner,
    register_extension,
    split_message,
)


class ConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module):
        ctx.geometry = ConvGeometry.of(
            x.dim() - 2, module.stride, module.padding, module.dilation, module.groups
        )
        return record_inner(ctx, module._conv_forward, [x, weight, bias])

    @staticmethod
    @frees_context
    def backward(ctx, grad):
        regular, parts, sr = split_message(grad)
        inner = ctx.inner
        reg = inner.regular_grads([regular])
        if parts is None:
            return (*reg, None)
        x, weight, bias = inner_inputs(ctx)
        need = ctx.needs_input_grad
        mask = (need[0], need[1], need[2] and bias is not None)
        states = conv_messages(sr, parts, x, weight, ctx.geometry, mask)
        return (*messages(reg, states, sr, (x, weight, bias)), None)


class ConvExtension(ModuleExtension):
    def applies_to(self, module: nn.Module) -> bool:
        # Only zero padding given as numbers maps onto the window index maps.
        return (
            super().applies_to(module)
            and module.padding_mode == "zeros"
            and not isinstance(module.padding, str)
        )

    def forward(self, module, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == module.weight.dim() - 1:  # unbatched input
            return self.forward(module, x.unsqueeze(0)).squeeze(0)
        out = ConvFunction.apply(x, module.weight, module.bias, module)
        spatial = ("position",) if out.dim() == 3 else ("row", "column")
        stamp(out, (Site(current_module(), "output", ("batch", "channel", *spatial)),))
        return out


class Conv1dExtension(ConvExtension):
    module_class = nn.Conv1d


class Conv2dExtension(ConvExtension):
    module_class = nn.Conv2d


register_extension(Conv1dExtension())
register_extension(Conv2dExtension())
