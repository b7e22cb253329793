"""Exact log-space edge weights for saturating factors that backward formulas build as tensors.

Some backward formulas compute their derivative as plain tensors and multiply the message by it
(or divide it by one): exp's ``grad * result``, expm1's ``grad * (result + 1)``, logaddexp's
``grad / (1 + exp(other - self))``, erf's ``2/sqrt(pi) * exp(-x^2) * grad`` (erfc's with a minus),
logsumexp's ``grad * exp(x - result)`` and binary_cross_entropy_with_logits'
``(sigmoid(x) - t) * grad``. The ``mul`` rule only sees the finished factor, already rounded to 0
where the function saturates (e^-110, erf'(10), sigmoid(20) - 1 in float32). For these autograd
nodes the factor's exact logarithm follows from the node's saved tensors (for exp, from the
input recorded during a forward inside ``extend``, see ``transport.saved_inputs``), so the
log-space semirings get ``scale_log`` with it instead.

A product is only taken over when the running node is one of these, the message is the operand
the formula multiplies, and the plain factor equals (to 1e-6, exact zeros exactly) what the
formula computes from the saved tensors; anything else keeps the linear factor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..graph.saved_inputs import recorded_input
from ..kernels import log_derivatives as logd
from ..messages import OpCall
from ..messages.message import Message
from ..semirings.base import Sign

#: f(node, factor, call) -> (log|factor|, sign) or None. ``factor`` is the plain operand.
ExactFactor = Callable[[Any, Tensor, OpCall], "tuple[Tensor, Sign] | None"]

TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def exact_product(call: OpCall) -> Message | None:
    """The ``mul`` of a message by one of the factors above, in log form; None otherwise."""
    node = _running_node(call)
    entry = None if node is None else EXACT_FACTORS.get(node.name())
    if entry is None:
        return None
    message_first, factor_of = entry
    msg, plain = (call["self"], call["other"]) if message_first else (call["other"], call["self"])
    return _scaled_exactly(call, node, factor_of, msg, plain)


def exact_quotient(call: OpCall) -> Message | None:
    """The ``div`` of a message by one of the divisors of ``EXACT_DIVISORS``, in log form; None
    otherwise."""
    node = _running_node(call)
    divisor_of = None if node is None else EXACT_DIVISORS.get(node.name())
    if divisor_of is None:
        return None
    return _scaled_exactly(call, node, divisor_of, call["self"], call["other"])


def _running_node(call: OpCall) -> Any:
    """The autograd node whose backward runs the call, for a semiring with log-form weights."""
    return None if call.semiring.linear_weights else torch._C._current_autograd_node()


def _scaled_exactly(
    call: OpCall, node: Any, exact_of: ExactFactor, msg: Any, plain: Any
) -> Message | None:
    """``msg`` scaled by ``exact_of``'s log-form weight for the plain operand, or None where
    the operands are not a message and a plain tensor or the formula does not match."""
    if not isinstance(msg, Message) or not isinstance(plain, Tensor) or isinstance(plain, Message):
        return None
    with torch.no_grad():
        exact = exact_of(node, plain, call)
    if exact is None:
        return None
    log_abs, sign = exact
    return call.wrap(call.run_regular(), call.semiring.scale_log(msg.parts, log_abs, sign))


def _matches(factor: Tensor, expected: Tensor) -> bool:
    """Whether ``factor`` is what the formula computes: same shape, same exact zeros, within
    1e-6 elsewhere (a changed PyTorch formula must fall back, never be misread)."""
    return factor.shape == expected.shape and torch.allclose(
        factor, expected, rtol=1e-6, atol=0.0, equal_nan=True
    )


def _logaddexp(node: Any, divisor: Tensor, call: OpCall) -> tuple[Tensor, Sign] | None:
    """LogaddexpBackward0: ``grad / (1 + exp(other - self))`` for self (and the mirror for
    other). The divisor overflows to inf where the other operand is larger by about 709 (745
    where its inverse is a subnormal), and the edge, e^(self - result), read as no edge (trial
    83); its log, logsigmoid(self - other), is exact."""
    a, b = node._saved_self, node._saved_other
    for x, y in ((a, b), (b, a)):
        if _matches(divisor, 1 + torch.exp(y - x)):
            return logd.log_sigmoid_of((x - y).to(call.weight_dtype)).expand(divisor.shape), 1.0
    return None


def _expm1(node: Any, factor: Tensor, call: OpCall) -> tuple[Tensor, Sign] | None:
    """Expm1Backward0: ``grad * (result + 1)``: e^x, which ``result + 1`` loses to cancellation
    below x = -20 and to 0 below -37 (trial 83: no path at -40); its log is the input
    recorded in the forward."""
    result = node._saved_result
    if not _matches(factor, result + 1):
        return None
    x = recorded_input("Expm1Backward0", result)
    return None if x is None else logd.exp_log_derivative(x.to(call.weight_dtype))


def _exp(node: Any, factor: Tensor, call: OpCall) -> tuple[Tensor, Sign] | None:
    """ExpBackward0: ``grad * result``; the factor is the saved result itself."""
    result = node._saved_result
    same = factor.shape == result.shape and factor.data_ptr() == result.data_ptr()
    x = recorded_input("ExpBackward0", factor) if same else None
    return None if x is None else logd.exp_log_derivative(x.to(call.weight_dtype))


def _erf(negate: bool) -> ExactFactor:
    """ErfBackward0 / ErfcBackward0: ``±2/sqrt(pi) * exp(-(x^2)) * grad``."""

    def factor_of(node: Any, factor: Tensor, call: OpCall) -> tuple[Tensor, Sign] | None:
        x = node._saved_self
        coefficient = -TWO_OVER_SQRT_PI if negate else TWO_OVER_SQRT_PI
        if not _matches(factor, torch.exp(-(x.pow(2))) * coefficient):
            return None
        return logd.erf_log_derivative(x.to(call.weight_dtype), negate)

    return factor_of


def _signed(dim: int) -> int:
    """A saved ``int[]`` dim as autograd exposes it: unsigned 64-bit (``-1`` reads back as
    2^64 - 1), so negative dims must be converted before taking them modulo the rank."""
    return dim - (1 << 64) if dim >= 1 << 63 else dim


def _logsumexp(node: Any, factor: Tensor, call: OpCall) -> tuple[Tensor, Sign] | None:
    """LogsumexpBackward0: ``grad * exp(x - result)`` (result unsqueezed unless keepdim)."""
    x, result = node._saved_self, node._saved_result
    if not node._saved_keepdim and x.dim() != 0:
        for d in sorted(_signed(dim) % x.dim() for dim in node._saved_dim):
            result = result.unsqueeze(d)
    log = x - result
    if not _matches(factor, log.exp()):
        return None
    return log.to(call.weight_dtype), 1.0


def _bce_with_logits(node: Any, factor: Tensor, call: OpCall) -> tuple[Tensor, Sign] | None:
    """BinaryCrossEntropyWithLogitsBackward0: the factor is sigmoid(x) - t, or with pos_weight
    pw: (pw t + 1 - t) sigmoid(x) - pw t. For t = 0 that is sigmoid(x) (log: logsigmoid(x)),
    for t = 1 it is -pw sigmoid(-x) (log: log|pw| + logsigmoid(-x)); other targets keep the
    linear factor (no saturation to a cancelling difference to fix)."""
    x, t, pw = node._saved_self, node._saved_target, node._saved_pos_weight
    if pw is None:
        linear = x.sigmoid() - t
    else:
        t_pw = pw.mul(t)
        linear = (t_pw + 1 - t).mul(x.sigmoid()).sub(t_pw)
    if not _matches(factor, linear):
        return None
    dtype = call.weight_dtype
    x, t, linear = x.to(dtype), t.to(dtype), linear.to(dtype)
    one, zero = t == 1, t == 0
    log_one = logd.log_sigmoid_of(-x)
    sign_one: Tensor | float = -1.0
    if pw is not None:
        pw = pw.to(dtype)
        log_one = log_one + pw.abs().log()
        sign_one = -torch.sign(pw)
    log = torch.where(one, log_one, torch.where(zero, logd.log_sigmoid_of(x), linear.abs().log()))
    sign = torch.where(one, sign_one, torch.where(zero, 1.0, torch.sign(linear)))
    return log.expand(linear.shape), sign.to(dtype).expand(linear.shape)


#: Node name -> (whether the formula puts the message first, exact factor).
EXACT_FACTORS: dict[str, tuple[bool, ExactFactor]] = {
    "ExpBackward0": (True, _exp),
    "Expm1Backward0": (True, _expm1),
    "ErfBackward0": (False, _erf(negate=False)),
    "ErfcBackward0": (False, _erf(negate=True)),
    "LogsumexpBackward0": (True, _logsumexp),
    "BinaryCrossEntropyWithLogitsBackward0": (False, _bce_with_logits),
}

#: Node name -> the exact divisor: f(node, divisor, call) -> (log|1 / divisor|, sign) or None.
EXACT_DIVISORS: dict[str, ExactFactor] = {
    "LogaddexpBackward0": _logaddexp,
}
