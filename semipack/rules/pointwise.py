"""Elementwise derivatives: activations, dropout and pointwise losses.

Each of these backward ops is ``grad_input = grad_output * d`` for an elementwise factor ``d``
that depends only on the saved forward tensors. Calling the op itself with a gradient of ones
gives exactly ``d``: the local partial derivatives, i.e. the edge weights. That keeps every rule
here one line and guarantees the same derivative autograd uses.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..transport.message import Message
from .registry import OpCall, call_by_name, register_rule

aten = torch.ops.aten

ACTIVATION_BACKWARDS = [
    aten.threshold_backward.default,
    aten.gelu_backward.default,
    aten.silu_backward.default,
    aten.mish_backward.default,
    aten.tanh_backward.default,
    aten.sigmoid_backward.default,
    aten.softplus_backward.default,
    aten.leaky_relu_backward.default,
    aten.elu_backward.default,
    aten.hardtanh_backward.default,
    aten.hardswish_backward.default,
    aten.hardsigmoid_backward.default,
    aten.log_sigmoid_backward.default,
    aten.logit_backward.default,
    aten.native_dropout_backward.default,
]

# Losses whose grad_output is a scalar (reduction='mean'/'sum') or has the input's shape.
LOSS_BACKWARDS = [
    aten.mse_loss_backward.default,
    aten.binary_cross_entropy_backward.default,
    aten.smooth_l1_loss_backward.default,
    aten.huber_loss_backward.default,
    aten.soft_margin_loss_backward.default,
]

# Losses over a class dimension (dim 1): grad_output lacks that dimension when reduction='none'.
CLASS_LOSS_BACKWARDS = [
    aten.nll_loss_backward.default,
    aten.nll_loss2d_backward.default,
]


def edge_weights(call: OpCall, grad_name: str) -> Tensor:
    """The op's elementwise derivative: the op applied to a gradient of ones; a fresh tensor.

    The ones are a real tensor, not an expanded scalar: a stride-0 gradient sends the backward
    kernels to their slow non-vectorised loop (4x slower for gelu_backward), and the ones are
    freed before the rule's peak (the new state beside the regular gradient) anyway.
    """
    named = dict(call.bound)
    msg = named[grad_name]
    named[grad_name] = torch.ones(tuple(msg.shape), dtype=msg.dtype, device=msg.device)
    return call_by_name(call.func, named).to(call.weight_dtype)


def _message_arg(call: OpCall) -> tuple[str, Message]:
    name = call.func._schema.arguments[0].name
    msg = call.bound[name]
    if not isinstance(msg, Message):
        raise call.error("the message must be the gradient argument")
    for arg in call.func._schema.arguments[1:]:
        if isinstance(call.bound[arg.name], Message):
            raise call.error(f"a message reached argument '{arg.name}'")
    return name, msg


@register_rule(*ACTIVATION_BACKWARDS)
def activation(call: OpCall):
    name, msg = _message_arg(call)
    parts = call.semiring.scale_owned(msg.parts, edge_weights(call, name))
    # The regular gradient after the message: its temporaries are gone by then (peak memory).
    return call.wrap(call.run_real(), parts)


@register_rule(*LOSS_BACKWARDS, *CLASS_LOSS_BACKWARDS)
def pointwise_loss(call: OpCall):
    """Each input entry feeds one loss entry: weights = op(ones); the message is broadcast."""
    name, msg = _message_arg(call)
    weights = edge_weights(call, name)
    parts = msg.parts
    if call.func in CLASS_LOSS_BACKWARDS and msg.dim() > 0:
        parts = tuple(p.unsqueeze(1) for p in parts)
    parts = tuple(p.expand(weights.shape) for p in parts)
    return call.wrap(call.run_real(), call.semiring.scale(parts, weights))


@register_rule(aten.glu_backward.default)
def glu_backward(call: OpCall):
    """glu(x) = a * sigmoid(b) with x = [a, b] along ``dim``: out_i has one edge from a_i
    (weight sigmoid(b_i)) and one from b_i (weight a_i sigmoid(b_i)(1 - sigmoid(b_i)))."""
    msg, x, dim = call["grad_output"], call["self"], call["dim"] % call["self"].dim()
    dtype = call.weight_dtype
    a, b = x.to(dtype).chunk(2, dim)
    gate = torch.sigmoid(b)
    to_a = call.semiring.scale(msg.parts, gate)
    to_b = call.semiring.scale(msg.parts, a * gate * (1 - gate))
    parts = tuple(torch.cat(pair, dim) for pair in zip(to_a, to_b, strict=True))
    return call.wrap(call.run_real(), parts)


@register_rule(aten._prelu_kernel_backward.default)
def prelu_backward(call: OpCall):
    """prelu(x) = x if x > 0 else w_c x: edge weight 1 or w_c from x, x from w_c where x <= 0."""
    msg, x, weight = call["grad_output"], call["self"], call["weight"]
    dtype = call.weight_dtype
    xs, w = x.to(dtype), weight.to(dtype)
    shape = [1] * x.dim()
    if w.numel() > 1:
        shape[1] = -1
    w_b = w.reshape(shape)
    sr = call.semiring
    to_x = sr.scale(msg.parts, torch.where(xs > 0, torch.ones_like(xs), w_b))
    to_w = sr.scale(msg.parts, torch.where(xs > 0, torch.zeros_like(xs), xs))
    dims = [d for d in range(x.dim()) if not (w.numel() > 1 and d == 1)]
    to_w = sr.sum(to_w, dims) if dims else to_w
    to_w = tuple(p.reshape(weight.shape) for p in to_w)
    real = call.run_real()
    reals = real if real is not None else (None, None)
    return call.wrap(reals[0], to_x), call.wrap(reals[1], to_w)
