"""torch.conv1d / torch.conv2d (hence nn.Conv1d / nn.Conv2d): one fused semiring backward."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
    """(x, W, b) -> conv(x, W) + b; x: [batch, channels, *spatial], options: ConvOptions."""

    direct_regular_grads = True

    reads = (0, 1)
    read_for = staticmethod(bilinear_reads)

    @classmethod
    def per_sample(cls, call: BackwardCall) -> list[State | None]:
        x, weight, _ = call.inputs
        options: ConvOptions = call.options
        m_w, m_b = conv_per_sample(
            call.semiring, call.incoming[0], options.padded(x), weight, options.geometry, call.needs
        )
        return [None, m_w, m_b]

    @staticmethod
    def messages(call: BackwardCall) -> tuple[State | None, ...]:
        x, weight, _ = call.inputs
        options: ConvOptions = call.options
        m_x, m_w, m_b = conv_messages(
            call.semiring, call.incoming[0], options.padded(x), weight, options.geometry, call.needs
        )
        return options.cropped(m_x, x.shape[2:]), m_w, m_b

    @staticmethod
    def sites(out: Tensor) -> Sites:
        names = ("position",) if out.dim() == 3 else ("row", "column")
        return (("output", ("batch", "channel", *names)),)


def _padding_numbers(
    weight: Tensor,
    padding: str,
    stride: int | Sequence[int],
    dilation: int | Sequence[int],
    spatial: int,
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``padding="valid"`` or ``"same"`` as numbers: (each side's padding per dim, one more zero
    on the right per dim), as PyTorch's convolution pads. "valid" is none; "same" pads
    ``dilation * (kernel - 1)`` per dim, half on each side and the odd one on the right. None
    for what PyTorch refuses ("same" with a stride, another word): the plain call raises."""
    if weight.dim() != spatial + 2:  # PyTorch's own error names the shapes
        return None
    geometry = ConvGeometry.of(spatial, stride, 0, dilation)
    if padding == "valid":
        return (0,) * spatial, (0,) * spatial
    if padding != "same" or any(s != 1 for s in geometry.stride):
        return None
    totals = [d * (k - 1) for d, k in zip(geometry.dilation, weight.shape[2:], strict=True)]
    return tuple(t // 2 for t in totals), tuple(t % 2 for t in totals)


@dataclass(frozen=True)
class ConvOptions:
    """A convolution's geometry, and the zeros PyTorch adds after the end of each spatial dim
    before it (``padding="same"`` with an even kernel): the messages read the input padded so."""

    geometry: ConvGeometry
    right: tuple[int, ...] = ()

    def padded(self, x: Tensor) -> Tensor:
        """``x`` [N, C, *spatial] with the right-hand zeros."""
        if not any(self.right):
            return x
        return F.pad(x, [p for r in reversed(self.right) for p in (0, r)])

    def cropped(self, state: State | None, spatial: Sequence[int]) -> State | None:
        """The input's message without the entries of the right-hand zeros (no input entry)."""
        if state is None or not any(self.right):
            return state
        window = (slice(None), slice(None), *(slice(0, n) for n in spatial))
        return tuple(p[window].contiguous() for p in state)


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

        if not wants_graph(input, weight, bias):
            return plain(input, weight, bias)
        if input.dim() == spatial + 1:  # unbatched input
            return handler(
                input.unsqueeze(0), weight, bias, stride, padding, dilation, groups
            ).squeeze(0)
        numbers, right = padding, ()
        if isinstance(padding, str):  # SigLIP's patch embedding is padding="valid" (trial 66:
            # it took the generic path, which has no per-sample rule); ``plain`` keeps the word
            found = _padding_numbers(weight, padding, stride, dilation, spatial)
            if found is None:  # PyTorch refuses it: its own error
                return plain(input, weight, bias)
            numbers, right = found
        geometry = ConvGeometry.of(spatial, stride, numbers, dilation, groups)
        return ConvFunction.run(plain, [input, weight, bias], ConvOptions(geometry, right))

    handler.__doc__ = f"``{conv.__name__}`` inside ``extend``: one fused semiring backward."
    return handler


conv1d = extends(torch.conv1d)(_conv_handler(torch.conv1d, 1))
conv2d = extends(torch.conv2d)(_conv_handler(torch.conv2d, 2))
