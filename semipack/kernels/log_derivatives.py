"""Exact log|derivative| of saturating elementwise functions, computed from their inputs.

A saturating function's derivative leaves float32's range long before its logarithm does:
tanh'(20) = 4e-17 is computed by autograd as 1 - tanh(20)^2 = 1 - 1 = 0, although its log
(-38.6) is an ordinary float. The log-space semirings take edge weights as ``(log|w|, sign)``
(``Semiring.scale_log``), so each function here returns exactly that, from the function's input,
with formulas that neither cancel nor underflow (derivations next to each one):

* the log is accurate to a few float32 ulps of |log|w|| plus about 2e-6 absolute
  (``tests/test_float32_exact.py`` checks dense grids out to |x| = 1e4 against float64 and
  asymptotic references);
* ``-inf`` only where the derivative is exactly 0 (x = ±inf for tanh, a zero coefficient of ELU);
* NaN in, NaN out.

``sign`` is a Python number where it is the same for every entry, else a tensor of -1 / 0 / +1.
Functions whose derivative changes sign (GELU, SiLU, Mish) start from the op's own float32
derivative and recompute, in float64 and log form, the entries whose float32 value cannot be
trusted (``recompute_small``): near the zero crossing the float32 terms cancel, and in the
negative tail the float32 value loses precision and then underflows.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

Sign = Tensor | float

LOG_4 = math.log(4.0)
LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
SQRT_HALF = math.sqrt(0.5)
SQRT_HALF_PI = math.sqrt(0.5 * math.pi)
LOG_2_OVER_SQRT_PI = math.log(2.0 / math.sqrt(math.pi))
GELU_TANH_BETA = math.sqrt(2.0 / math.pi)
GELU_TANH_KAPPA = 0.044715

#: |derivative| below which the float32 value of a sign-changing derivative is recomputed in
#: float64. Above it the op's float32 derivative is within 1.3e-6 (relative) of the exact one
#: (measured on a grid of 2e6 points over [-12, 12]: GELU 1.3e-6, tanh-GELU 1.0e-6, SiLU 7.6e-7,
#: Mish 9.7e-7); below it the error grows like 1e-7 / |derivative| near the zero crossing.
RECOMPUTE_BELOW = 0.125
_LOG_RECOMPUTE_BELOW = math.log(RECOMPUTE_BELOW)


# --- all-positive derivatives: closed forms in log space -----------------------------------------
def tanh_log_derivative(x: Tensor) -> tuple[Tensor, Sign]:
    """tanh'(x) = sech^2 x = 4 e^{-2|x|} / (1 + e^{-2|x|})^2, so with t = -2|x|:
    log tanh'(x) = log 4 + t - 2 log1p(e^t)  (no cancellation that matters: near x = 0 the
    terms cancel to about -x^2, an absolute error of a few 1e-8 in the log)."""
    t = x.abs().mul_(-2.0)
    return t.sub_(F.softplus(t), alpha=2.0).add_(LOG_4), 1.0


def sigmoid_log_derivative(x: Tensor) -> tuple[Tensor, Sign]:
    """sigma'(x) = sigma(x) sigma(-x) = e^{-|x|} / (1 + e^{-|x|})^2, so with t = -|x|:
    log sigma'(x) = t - 2 log1p(e^t)."""
    t = x.abs().neg_()
    return t.sub_(F.softplus(t), alpha=2.0), 1.0


def log_sigmoid_log_derivative(x: Tensor) -> tuple[Tensor, Sign]:
    """d/dx log sigma(x) = sigma(-x): log = logsigmoid(-x)."""
    return F.logsigmoid(-x), 1.0


def softplus_log_derivative(x: Tensor, beta: float, threshold: float) -> tuple[Tensor, Sign]:
    """softplus_beta(x) = log(1 + e^{beta x}) / beta, the identity where beta x > threshold
    (PyTorch's linear region, same test in the same precision): derivative sigma(beta x), or
    exactly 1 there. log sigma(z) = logsigmoid(z)."""
    z = x * beta
    return F.logsigmoid(z).masked_fill_(z > threshold, 0.0), 1.0


def elu_log_derivative(
    x: Tensor, alpha: float, scale: float, input_scale: float
) -> tuple[Tensor, Sign]:
    """ELU / SELU / CELU with PyTorch's branches: for x <= 0 the derivative is
    input_scale * scale * alpha * e^{x * input_scale} (log: log|coefficient| + x * input_scale),
    else scale. A coefficient of exactly 0 gives no edge (log -inf). NaN takes the x > 0 branch,
    as in PyTorch's kernel."""
    neg_coef = input_scale * scale * alpha
    negative = x <= 0
    log = (x * input_scale).add_(_log_abs_number(neg_coef))
    log = torch.where(negative, log, _log_abs_number(scale))
    neg_sign, pos_sign = _sign_number(neg_coef), _sign_number(scale)
    if neg_sign == pos_sign:
        return log, float(pos_sign)
    sign = torch.where(negative, float(neg_sign), float(pos_sign)).to(log.dtype)
    return log, sign.masked_fill_(log == -math.inf, 0.0)


def exp_log_derivative(x: Tensor) -> tuple[Tensor, Sign]:
    """exp'(x) = e^x: log = x (x = -inf: the derivative is exactly 0)."""
    return x.clone(), 1.0


def erf_log_derivative(x: Tensor, negate: bool = False) -> tuple[Tensor, Sign]:
    """erf'(x) = 2/sqrt(pi) e^{-x^2} (erfc' is its negative): log = log(2/sqrt(pi)) - x^2."""
    return (x * x).neg_().add_(LOG_2_OVER_SQRT_PI), -1.0 if negate else 1.0


def log_sigmoid_of(z: Tensor) -> Tensor:
    """log sigma(z), exact for every z (PyTorch's logsigmoid: min(z, 0) - log1p(e^{-|z|}))."""
    return F.logsigmoid(z)


# --- derivatives that change sign: float32 value, recomputed in float64 where it is small -------
def recompute_small(
    linear: Tensor, x: Tensor, exact64: Callable[[Tensor], tuple[Tensor, Tensor]], signs: bool
) -> tuple[Tensor, Sign]:
    """``(log|d|, sign d)`` from the op's own float32 derivative ``linear`` (a fresh tensor of
    x's shape, overwritten), with every entry where |d| < ``RECOMPUTE_BELOW`` (underflowed ones
    included) replaced by ``exact64`` of x in float64. ``signs=False`` skips the sign tensor
    (for semirings that ignore signs) and returns 1.0."""
    sign: Sign = torch.sign(linear) if signs else 1.0
    log_abs = linear.abs_().log_()
    small = (log_abs < _LOG_RECOMPUTE_BELOW).nonzero(as_tuple=True)
    if small[0].numel():
        log64, sign64 = exact64(x[small].to(torch.float64))
        log_abs[small] = log64.to(log_abs.dtype)
        if isinstance(sign, Tensor):
            sign[small] = sign64.to(sign.dtype)
    return log_abs, sign


def gelu_log_derivative64(x: Tensor) -> tuple[Tensor, Tensor]:
    """log|gelu'(x)| and its sign in float64, gelu'(x) = Phi(x) + x phi(x).

    For x < 0, with t = -x: gelu'(x) = phi(t) (R(t) - t), R(t) = Phi(-t) / phi(t) the Mills
    ratio, R(t) = sqrt(pi/2) erfcx(t / sqrt 2). So log|gelu'| = -x^2/2 - log sqrt(2 pi) +
    log|R(t) - t|: no underflow (erfcx is scaled), and the sign change at t ~ 0.7518 is a
    float64 cancellation of two O(1) terms (absolute error ~1e-16). For x >= 0 both terms of
    Phi(x) + x phi(x) are positive.
    """
    t = x.abs()
    gap = torch.special.erfcx(t * SQRT_HALF).mul_(SQRT_HALF_PI).sub_(t)
    log_neg = (x * x).mul_(-0.5).sub_(LOG_SQRT_2PI).add_(gap.abs().log())
    phi = torch.exp((x * x).mul_(-0.5).sub_(LOG_SQRT_2PI))
    log_pos = (0.5 * torch.special.erfc(-x * SQRT_HALF) + x * phi).log()
    negative = x < 0
    return torch.where(negative, log_neg, log_pos), torch.where(negative, torch.sign(gap), 1.0)


def gelu_tanh_log_derivative64(x: Tensor) -> tuple[Tensor, Tensor]:
    """The tanh approximation gelu(x) = x sigma(2u), u = b (x + k x^3) (b = sqrt(2/pi),
    k = 0.044715): with 1 + tanh u = 2 sigma(2u) and 1 - tanh^2 u = 4 sigma(2u) sigma(-2u),
    gelu'(x) = sigma(2u) [1 + 2 x u' sigma(-2u)], u' = b (1 + 3 k x^2)."""
    u = (x * x * x).mul_(GELU_TANH_KAPPA).add_(x).mul_(GELU_TANH_BETA)
    du = (x * x).mul_(3.0 * GELU_TANH_KAPPA).add_(1.0).mul_(GELU_TANH_BETA)
    bracket = torch.sigmoid(-2.0 * u).mul_(du).mul_(x).mul_(2.0).add_(1.0)
    return log_sigmoid_of(2.0 * u).add_(bracket.abs().log()), torch.sign(bracket)


def silu_log_derivative64(x: Tensor) -> tuple[Tensor, Tensor]:
    """silu'(x) = sigma(x) (1 + x sigma(-x)): log sigma(x) + log|1 + x sigma(-x)|."""
    bracket = torch.sigmoid(-x).mul_(x).add_(1.0)
    return log_sigmoid_of(x).add_(bracket.abs().log()), torch.sign(bracket)


def mish_log_derivative64(x: Tensor) -> tuple[Tensor, Tensor]:
    """mish(x) = x tanh(softplus x). With s = e^x and D = s^2 + 2s + 2: tanh(softplus x) =
    s (s + 2) / D, sech^2(softplus x) = 4 (1 + s)^2 / D^2 and sigma(x) = s / (1 + s), so
    mish'(x) = (s / D) [(s + 2) + 4 x (1 + s) / D]; log = x - log D + log|bracket|.
    (Only entries with |mish'| < 1/8, i.e. x < 0, come here; s is capped to stay finite.)"""
    s = x.clamp(max=300.0).exp()
    d = (s * s).add_(s, alpha=2.0).add_(2.0)
    bracket = (s + 1.0).mul_(x).mul_(4.0).div_(d).add_(s).add_(2.0)
    return x - d.log() + bracket.abs().log(), torch.sign(bracket)


# --- helpers ------------------------------------------------------------------------------------
def _log_abs_number(c: float) -> float:
    return math.log(abs(c)) if c != 0 else -math.inf


def _sign_number(c: float) -> int:
    return (c > 0) - (c < 0)
