"""Ops whose forward copies input entries to output positions: padding, nearest upsampling.

Each output entry has exactly one edge, of weight 1, from the input entry it copies. Running the
forward op on a tensor of input indices gives that source map exactly as PyTorch computes it, so
the backward is a scatter with the semiring's plus (entries copied several times meet there).
"""

from __future__ import annotations

import torch

from ..messages import OpCall, register_rule

aten = torch.ops.aten


def _scatter_from_sources(call: OpCall, sources: torch.Tensor, input_shape):
    msg = call["grad_output"]
    dest = tuple(p.reshape(-1) for p in call.zeros(tuple(input_shape)))
    src = tuple(p.reshape(-1) for p in msg.parts)
    parts = call.semiring.index_plus(dest, 0, sources.reshape(-1).long(), src)
    return call.wrap(call.run_regular(), tuple(p.reshape(tuple(input_shape)) for p in parts))


def _index_image(shape, device) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    return torch.arange(numel, dtype=torch.float64, device=device).reshape(tuple(shape))


def _padding_rule(forward):
    def rule(call: OpCall):
        x = call["self"]
        sources = forward(_index_image(x.shape, x.device), call["padding"])
        return _scatter_from_sources(call, sources, x.shape)

    return rule


for _backward, _forward in [
    (aten.reflection_pad1d_backward.default, aten.reflection_pad1d.default),
    (aten.reflection_pad2d_backward.default, aten.reflection_pad2d.default),
    (aten.reflection_pad3d_backward.default, aten.reflection_pad3d.default),
    (aten.replication_pad1d_backward.default, aten.replication_pad1d.default),
    (aten.replication_pad2d_backward.default, aten.replication_pad2d.default),
    (aten.replication_pad3d_backward.default, aten.replication_pad3d.default),
]:
    register_rule(_backward)(_padding_rule(_forward))


def _upsample_rule(forward):
    def rule(call: OpCall):
        b = call.bound
        scales = [v for k, v in b.items() if k.startswith("scales")]
        image = _index_image(b["input_size"], b["grad_output"].device)
        sources = forward(image, b["output_size"], *scales)
        return _scatter_from_sources(call, sources, b["input_size"])

    return rule


for _backward, _forward in [
    (aten.upsample_nearest1d_backward.default, aten.upsample_nearest1d.default),
    (aten.upsample_nearest2d_backward.default, aten.upsample_nearest2d.default),
    (aten.upsample_nearest3d_backward.default, aten.upsample_nearest3d.default),
    (aten._upsample_nearest_exact1d_backward.default, aten._upsample_nearest_exact1d.default),
    (aten._upsample_nearest_exact2d_backward.default, aten._upsample_nearest_exact2d.default),
    (aten._upsample_nearest_exact3d_backward.default, aten._upsample_nearest_exact3d.default),
]:
    register_rule(_backward)(_upsample_rule(_forward))
