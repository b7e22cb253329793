"""Elementwise derivatives: activations, dropout and pointwise losses.

Each of these backward ops is ``grad_input = grad_output * d`` for an elementwise factor ``d``
that depends only on the saved forward tensors. Calling the op itself with a gradient of ones
gives exactly ``d``: the local partial derivatives, i.e. the edge weights, the same derivative
autograd uses. Real always takes that ``d``.

The other semirings keep log-space states, and for the saturating functions (tanh, sigmoid,
GELU, SiLU, Mish, softplus, logsigmoid, ELU/SELU/CELU, soft margin loss, GLU) they take the exact
``log|d|`` instead (``kernels.log_derivatives``): ``d`` itself rounds to 0 in float32 where the
function saturates (1 - tanh(20)^2 = 0), which would cut a path that exists. tanh and sigmoid
save only their output; their exact log-derivative needs the input recorded during a forward
inside ``semipack.extend`` (``transport.saved_inputs``), and without it they keep ``d``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..graph.saved_inputs import recorded_input
from ..kernels import log_derivatives as logd
from ..kernels.cuts import cut_below, cut_below_in_place
from ..messages import OpCall, call_by_name, register_rule
from ..messages.message import Message, accepts_donations
from ..semirings.base import Sign

aten = torch.ops.aten

ACTIVATION_BACKWARDS = [
    aten.gelu_backward.default,
    aten.silu_backward.default,
    aten.mish_backward.default,
    aten.tanh_backward.default,
    aten.sigmoid_backward.default,
    aten.softplus_backward.default,
    aten.leaky_relu_backward.default,
    aten.rrelu_with_noise_backward.default,  # the slope (sampled per entry in training) or 1
    aten.elu_backward.default,
    aten.hardtanh_backward.default,
    aten.hardswish_backward.default,
    aten.hardsigmoid_backward.default,
    aten.log_sigmoid_backward.default,
    aten.logit_backward.default,
    aten.native_dropout_backward.default,
    aten.softshrink_backward.default,  # derivative 1 outside [-lambd, lambd], else 0
    aten.hardshrink_backward.default,
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
# Each input entry feeds only its own sample's loss, so op(ones) is that one edge's weight (for
# the margin losses the target class's weight is the sum of its terms: one partial, one edge).
CLASS_LOSS_BACKWARDS = [
    aten.nll_loss_backward.default,
    aten.nll_loss2d_backward.default,
    aten.multi_margin_loss_backward.default,
    aten.multilabel_margin_loss_backward.default,
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


#: ``(log|d|, sign)`` of an op's elementwise derivative, or None where the exact form does not
#: apply (then the rule takes ``d`` itself). The bool asks for signs (see ``uses_edge_signs``).
LogDerivative = Callable[[OpCall, bool], "tuple[Tensor, Sign] | None"]


def _input(call: OpCall, name: str = "self") -> Tensor:
    return call[name].to(call.weight_dtype)


def _from_recorded(node_name: str, exact: Callable[[Tensor], tuple[Tensor, Sign]]) -> LogDerivative:
    """For tanh and sigmoid: the exact form needs the input recorded during the forward."""

    def log_derivative(call: OpCall, signs: bool) -> tuple[Tensor, Sign] | None:
        x = recorded_input(node_name, call["output"])
        return None if x is None else exact(x.to(call.weight_dtype))

    return log_derivative


def _sign_changing(spec: logd.SignChangingDerivative) -> LogDerivative:
    """For GELU, SiLU and Mish: exact on the whole line, zero crossing and tails included."""

    def log_derivative(call: OpCall, signs: bool) -> tuple[Tensor, Sign] | None:
        return logd.sign_changing_log_derivative(spec, _input(call), signs)

    return log_derivative


def _gelu(call: OpCall, signs: bool) -> tuple[Tensor, Sign] | None:
    spec = logd.GELU_TANH if call["approximate"] == "tanh" else logd.GELU
    return _sign_changing(spec)(call, signs)


def _softplus(call: OpCall, signs: bool) -> tuple[Tensor, Sign] | None:
    return logd.softplus_log_derivative(_input(call), call["beta"], call["threshold"])


def _elu(call: OpCall, signs: bool) -> tuple[Tensor, Sign] | None:
    if call["is_result"]:  # in-place ELU saved its output: e^x from it would cancel
        return None
    alpha, scale, input_scale = (float(call[n]) for n in ("alpha", "scale", "input_scale"))
    return logd.elu_log_derivative(_input(call, "self_or_result"), alpha, scale, input_scale)


def _log_sigmoid(call: OpCall, signs: bool) -> tuple[Tensor, Sign] | None:
    return logd.log_sigmoid_log_derivative(_input(call))


EXACT_ACTIVATIONS: dict[object, LogDerivative] = {
    aten.tanh_backward.default: _from_recorded("TanhBackward0", logd.tanh_log_derivative),
    aten.sigmoid_backward.default: _from_recorded("SigmoidBackward0", logd.sigmoid_log_derivative),
    aten.gelu_backward.default: _gelu,
    aten.silu_backward.default: _sign_changing(logd.SILU),
    aten.mish_backward.default: _sign_changing(logd.MISH),
    aten.softplus_backward.default: _softplus,
    aten.elu_backward.default: _elu,
    aten.log_sigmoid_backward.default: _log_sigmoid,
}


def exact_log_derivative(call: OpCall) -> tuple[Tensor, Sign] | None:
    """The exact ``(log|d|, sign)`` of this call's op for a log-space semiring, else None."""
    if call.semiring.linear_weights:
        return None
    exact = EXACT_ACTIVATIONS.get(call.func)
    return None if exact is None else exact(call, call.semiring.uses_edge_signs())


@register_rule(aten.threshold_backward.default)
@accepts_donations
def threshold_backward(call: OpCall):
    """ReLU (threshold): an edge of weight exactly 1 where ``self > threshold`` (the message
    passes unchanged: ⊗ one), none elsewhere (the semiring zero). The same values as scaling by
    the 0/1 derivative, without building it and taking its logarithm (a ResNet's ReLUs spent 6%
    of its MaxProd backward there). Entries are cut where torch's own backward zeroes the
    gradient, ``self <= threshold`` (a NaN input passes, as there). The cut is written into
    the incoming state and regular gradient where nothing else holds them (``call.donated``):
    the node then allocates nothing, as a plain ReLU's backward allocates one gradient."""
    _, msg = _message_arg(call)
    x = call["self"]
    cut = _ReluCut(x, call["threshold"])
    parts = tuple(  # in place only in the layout the op's own result would take
        cut(p, zero, id(p) in call.donated and p.stride() == x.stride())
        for p, zero in zip(msg.parts, call.semiring.zero, strict=True)
    )
    return call.wrap(call.run_regular_donated(), parts)


class _ReluCut:
    """``torch.where(x <= threshold, zero, part)`` with float ops where the zero is 0 or ±inf:
    torch.threshold_backward keeps ``part`` or writes 0 in a vectorised select, and adding an
    offset that is -0.0 where kept (every value, -0.0 and NaN included, unchanged) and ±inf where
    cut gives the infinite zeros. where on the bool mask took 8.5 ms for a ResNet stem's 1.6M
    entries on one core, these ops 1.7 ms, with the same bits (tests). Dense float32 CPU
    states take the native select of ``kernels/cuts.py`` instead (one pass, any size), large
    dense states of other dtypes its compiled select (0.25 ms there)."""

    def __init__(self, x: Tensor, threshold: float) -> None:
        self.x, self.threshold = x, threshold
        self._offsets: dict[float, Tensor] = {}

    def __call__(self, part: Tensor, zero: float | bool, in_place: bool = False) -> Tensor:
        """``part`` cut where the input is off: a new tensor, or ``part`` itself written over
        with ``in_place`` (a state nothing else holds)."""
        x, threshold = self.x, self.threshold
        plus_zero = zero == 0.0 and math.copysign(1.0, zero) > 0  # threshold_backward's own
        if (
            part.dtype != x.dtype
            or not part.is_floating_point()
            or not (plus_zero or zero in (math.inf, -math.inf))
        ):
            return torch.where(x <= threshold, zero, part)
        if not plus_zero:
            if in_place and cut_below_in_place(part, x, threshold, zero):
                return part
            one_pass = None if in_place else cut_below(part, x, threshold, zero)
            if one_pass is not None:
                return one_pass
        if in_place:  # 0 where cut, in the incoming state's memory
            kept = aten.threshold_backward.grad_input(part, x, threshold, grad_input=part)
        else:
            kept = aten.threshold_backward(part, x, threshold)  # a new tensor, 0 where cut
        return kept if plus_zero else kept.add_(self._offset(zero))

    def _offset(self, zero: float) -> Tensor:
        """-0.0 where kept, ``zero`` (±inf) where cut, built once per call."""
        if zero not in self._offsets:
            ones = torch.ones((), dtype=self.x.dtype, device=self.x.device).expand_as(self.x)
            inverse = aten.threshold_backward(ones, self.x, self.threshold).reciprocal_()
            # inverse: 1 where kept, inf where cut; where kept -(1 - 1) and -(-1 + 1) are -0.0,
            # where cut -(inf - 1) = -inf and -(-inf + 1) = inf
            negative = zero < 0
            self._offsets[zero] = (
                inverse.sub_(1.0).neg_() if negative else inverse.neg_().add_(1.0).neg_()
            )
        return self._offsets[zero]


@register_rule(*ACTIVATION_BACKWARDS)
@accepts_donations
def activation(call: OpCall):
    """Elementwise activations' backward ops: each output entry has one edge, the exact
    local derivative (from the recorded input in log form where it saturates)."""
    name, msg = _message_arg(call)
    exact = exact_log_derivative(call)
    if exact is None:
        parts = call.semiring.scale_owned(msg.parts, edge_weights(call, name))
    else:
        parts = call.semiring.scale_log_owned(msg.parts, *exact)
    # The regular gradient after the message: its temporaries are gone by then (peak memory).
    return call.wrap(call.run_regular_donated(), parts)


def _soft_margin(call: OpCall) -> tuple[Tensor, Sign]:
    """soft margin loss log(1 + e^{-y x}) (mean: divided by N): derivative -y sigma(-y x) / N,
    log = log|y| + logsigmoid(-y x) - log N, sign = -sign(y)."""
    x, y = _input(call), _input(call, "target")
    log = logd.log_sigmoid_of(-y * x).add_(y.abs().log())
    if call["reduction"] == 1:  # mean
        log.sub_(math.log(max(x.numel(), 1)))
    return log, torch.sign(y).neg_()


@register_rule(*LOSS_BACKWARDS, *CLASS_LOSS_BACKWARDS)
def pointwise_loss(call: OpCall):
    """Each input entry feeds one loss entry: weights = op(ones); the message is broadcast."""
    name, msg = _message_arg(call)
    sr = call.semiring
    exact = None
    if call.func is aten.soft_margin_loss_backward.default and not sr.linear_weights:
        exact = _soft_margin(call)
    weights = edge_weights(call, name) if exact is None else exact[0]
    parts = msg.parts
    if call.func in CLASS_LOSS_BACKWARDS and msg.dim() > 0:
        parts = tuple(p.unsqueeze(1) for p in parts)
    parts = tuple(p.expand(weights.shape) for p in parts)
    parts = sr.scale(parts, weights) if exact is None else sr.scale_log(parts, *exact)
    return call.wrap(call.run_regular(), parts)


@register_rule(aten.glu_backward.default)
def glu_backward(call: OpCall):
    """glu(x) = a * sigmoid(b) with x = [a, b] along ``dim``: out_i has one edge from a_i
    (weight sigmoid(b_i)) and one from b_i (weight a_i sigmoid(b_i)(1 - sigmoid(b_i)), in log
    space log|a_i| + logsigmoid(b_i) + logsigmoid(-b_i) for the log-space semirings)."""
    msg, x, dim = call["grad_output"], call["self"], call["dim"] % call["self"].dim()
    dtype = call.weight_dtype
    sr = call.semiring
    a, b = x.to(dtype).chunk(2, dim)
    if sr.linear_weights:
        gate = torch.sigmoid(b)
        to_a = sr.scale(msg.parts, gate)
        to_b = sr.scale(msg.parts, a * gate * (1 - gate))
    else:
        log_gate = logd.log_sigmoid_of(b)
        to_a = sr.scale_log(msg.parts, log_gate)
        log_b = logd.log_sigmoid_of(-b).add_(log_gate).add_(a.abs().log())
        to_b = sr.scale_log(msg.parts, log_b, torch.sign(a))
    parts = tuple(torch.cat(pair, dim) for pair in zip(to_a, to_b, strict=True))
    return call.wrap(call.run_regular(), parts)


@register_rule(aten._prelu_kernel_backward.default)
def prelu_backward(call: OpCall):
    """prelu(x) = x if x > 0 else w x, ``w`` broadcast against ``x`` (F.prelu passes it as
    [1, C, 1, ...]): edge weight 1 or w from x, and x from w where x <= 0. The op's gradient for
    the weight has x's shape, one entry per use of a weight entry, and autograd's broadcast
    reduction adds those up (a sum rule); so the state does too, unreduced here."""
    msg, x, weight = call["grad_output"], call["self"], call["weight"]
    dtype = call.weight_dtype
    xs, w = x.to(dtype), weight.to(dtype)
    sr = call.semiring
    positive = xs > 0
    to_x = sr.scale(msg.parts, torch.where(positive, 1.0, w))
    to_w = sr.scale(msg.parts, torch.where(positive, 0.0, xs))
    regular = call.run_regular()
    reals = regular if regular is not None else (None, None)
    return call.wrap(reals[0], to_x), call.wrap(reals[1], to_w)
