"""Exact log|derivative| of saturating elementwise functions, computed from their inputs.

A saturating function's derivative leaves float32's range long before its logarithm does:
tanh'(20) = 4e-17 is computed by autograd as 1 - tanh(20)^2 = 1 - 1 = 0, although its log
(-38.6) is an ordinary float. The log-space semirings take edge weights as ``(log|w|, sign)``
(``Semiring.scale_log``), so each function here returns exactly that, from the function's input,
with formulas that neither cancel nor underflow (derivations next to each one):

* in float32 the log is within 1e-6 of the exact one (relative to it where |log| > 1):
  ``tests/test_float32_exact.py`` checks dense grids out to |x| = 1e4, and every float next to
  a zero crossing, against float64 and asymptotic references;
* ``-inf`` only where the derivative is exactly 0 (x = ±inf for tanh, a zero coefficient of ELU);
* NaN in, NaN out.

``sign`` is a Python number where it is the same for every entry, else a tensor of -1 / 0 / +1.
Functions whose derivative changes sign (GELU, tanh-GELU, SiLU, Mish) factor it as a positive
part with an exact log and a bracket with one root, which is a polynomial in the distance to
that root near it (``SignChangingDerivative``); on large tensors the whole computation is one
compiled kernel, and GELU's and SiLU's on float32 CPU tensors one native loop at any size
(``native/log_derivatives.c``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .compiled import compile_enabled, compiled
from .native import native_available, sign_changing_log_derivative_f32

Sign = Tensor | float

LOG_4 = math.log(4.0)
LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
SQRT_HALF = math.sqrt(0.5)
SQRT_HALF_PI = math.sqrt(0.5 * math.pi)
LOG_2_OVER_SQRT_PI = math.log(2.0 / math.sqrt(math.pi))
GELU_TANH_BETA = math.sqrt(2.0 / math.pi)
GELU_TANH_KAPPA = 0.044715


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


# --- derivatives that change sign: d = P(x) b(x), one simple root of b -----------------------
@dataclass(frozen=True)
class SignChangingDerivative:
    """A derivative ``d(x) = P(x) b(x)`` with P > 0 and a bracket ``b`` with one simple root
    ``r`` (GELU, tanh-GELU, SiLU, Mish: d < 0 below r, at about -0.75, -0.75, -1.28, -1.19).

    ``direct(x)`` gives ``(prefix, value)`` with ``log|d| = prefix + log|value|`` and d's sign
    that of ``value``, from closed forms that neither underflow nor overflow, accurate except
    near ``r``, where two O(1) terms of ``b`` cancel (in float32 to ~1e-7 absolute: a relative
    error of 1e-7 / |b|, unbounded at r). Within
    ``ROOT_WINDOW`` of r, ``b = delta q(delta)`` with ``delta = (x - r_hi) - r_lo`` (r split
    into two floats, so delta keeps full relative precision down to the float next to r) and
    ``q`` a polynomial, and ``log|d| = log P(x) + log|b|``: a few ulps everywhere. The root and
    ``q`` come from ``bracket`` itself at import (float64 Newton iteration; least-squares fit of
    b / delta on Chebyshev nodes of the window), so the formula and its expansion agree.
    """

    name: str
    direct: Callable[[Tensor], tuple[Tensor, Tensor]]  # x -> (prefix, value)
    log_p: Callable[[Tensor], Tensor]
    bracket: Callable[[Tensor], Tensor]
    root: float
    near_root: dict[torch.dtype, tuple[float, ...]]  # coefficients of q, constant term first
    root_split: dict[torch.dtype, tuple[float, float]]  # (hi, lo): hi the root in that dtype

    @classmethod
    def build(
        cls,
        name: str,
        direct: Callable[[Tensor], tuple[Tensor, Tensor]],
        log_p: Callable[[Tensor], Tensor],
        bracket: Callable[[Tensor], Tensor],
        guess: float,
    ) -> SignChangingDerivative:
        """The derivative of ``name`` from its direct log-form and its sign-change bracket."""
        root = _newton_root(bracket, guess)
        near_root = {
            dtype: _quotient_polynomial(bracket, root, window)
            for dtype, window in ROOT_WINDOW.items()
        }
        split = {}
        for dtype in ROOT_WINDOW:
            hi = torch.tensor(root, dtype=torch.float64).to(dtype).item()
            split[dtype] = (hi, root - hi)
        return cls(name, direct, log_p, bracket, root, near_root, split)

    def log_and_sign(self, x: Tensor, signs: bool) -> tuple[Tensor, Tensor | None]:
        """``(log|d|, sign d)`` (sign None unless ``signs``), elementwise on x (float32 or
        float64): pure tensor code, compiled into one fused kernel for large inputs."""
        prefix, value = self.direct(x)
        hi, lo = self.root_split[x.dtype]
        delta = (x - hi) - lo
        coefficients = self.near_root[x.dtype]
        b = torch.full_like(x, coefficients[-1])
        for c in reversed(coefficients[:-1]):
            b = b * delta + c
        near = delta.abs() < ROOT_WINDOW[x.dtype]
        value = torch.where(near, b * delta, value)
        log = torch.where(near, self.log_p(x), prefix) + value.abs().log()  # one log per entry
        return log, (torch.sign(value) if signs else None)


#: Half-width of the window around a bracket's root where it is a polynomial, per dtype:
#: outside it the cancellation costs at most ~1e-6 relative in float32 (checked on dense grids
#: by the tests) and ~1e-13 in float64. ``QUOTIENT_DEGREE``: degree of q (fit error below 1e-9
#: relative on the float32 window, 1e-15 on the float64 one).
ROOT_WINDOW = {torch.float32: 0.25, torch.float64: 1e-3}
QUOTIENT_DEGREE = 9


def _newton_root(bracket: Callable[[Tensor], Tensor], guess: float) -> float:
    """The root of ``bracket`` near ``guess``: float64 Newton steps with autograd slopes (with
    gradients on: semipack may be imported under ``torch.no_grad()`` or ``inference_mode()``)."""
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.tensor(guess, dtype=torch.float64)
        for _ in range(100):
            x = x.detach().requires_grad_(True)
            y = bracket(x)
            (slope,) = torch.autograd.grad(y, x)
            step = (y / slope).item()
            x = x.detach() - step
            if abs(step) <= 1e-16 * abs(x.item()):
                break
        return x.item()


def _quotient_polynomial(
    bracket: Callable[[Tensor], Tensor], root: float, window: float
) -> tuple[float, ...]:
    """Coefficients (constant first) of the polynomial q with b(root + delta) = delta q(delta)
    on |delta| <= window: a float64 least-squares fit of b / delta on 64 Chebyshev nodes (none
    at delta = 0, where b / delta would cancel)."""
    k = torch.arange(64, dtype=torch.float64)
    delta = window * torch.cos(math.pi * (k + 0.5) / 64)
    with torch.no_grad():
        quotient = bracket(root + delta) / delta
    powers = (delta / window)[:, None] ** torch.arange(QUOTIENT_DEGREE + 1, dtype=torch.float64)
    scaled = torch.linalg.lstsq(powers, quotient[:, None]).solution[:, 0]
    return tuple((scaled / window ** torch.arange(QUOTIENT_DEGREE + 1)).tolist())


# GELU: gelu'(x) = Phi(x) + x phi(x) = phi(x) (R(t) - t) for t = -x, with the Mills ratio
# R(t) = Phi(-t) / phi(t) = sqrt(pi/2) erfc(t / sqrt 2) e^{t^2/2}.

#: t R(t) = f(v), v = 1/t^2 in [0, 1/4] (t >= 2), as a Chebyshev series in 8 v - 1: a
#: least-squares fit on 200 Chebyshev nodes of 50-digit values of t R(t), max relative error
#: 2.6e-8 on a 3001-point grid (R enters gelu' as R / t <= 0.21 of it: 6e-9). float32 only:
#: inductor has no vectorised erfc, and this keeps the GELU kernel one fused loop.
MILLS_CHEBYSHEV = (
    0.9131494217868191,
    -0.0774106229331912,
    0.007997394683285912,
    -0.0011735085387624094,
    0.00021156164614932098,
    -4.3900675865596694e-05,
    1.0112824133316636e-05,
    -2.5282083226469995e-06,
    6.755309013755636e-07,
    -1.9081650830489496e-07,
    5.651721350635599e-08,
)
#: Below x = -GELU_TAIL the erf form of Phi(x) loses relative precision (1 + erf cancels).
GELU_TAIL = 2.0


def _mills_ratio(t: Tensor) -> Tensor:
    """R(t) for t >= 2: the Chebyshev fit in float32; in float64 erfc e^{t^2/2} up to t = 26
    and the asymptotic series 1/t (1 - 1/t^2 + 3/t^4 - 15/t^6 + 105/t^8 - 945/t^10) beyond
    (relative error < 1e-13 there)."""
    v = 1.0 / (t * t)
    if t.dtype == torch.float32:
        y = 8.0 * v - 1.0
        later, last = torch.zeros_like(t), torch.zeros_like(t)
        for c in reversed(MILLS_CHEBYSHEV[1:]):  # Clenshaw
            later, last = 2.0 * y * later - last + c, later
        return (MILLS_CHEBYSHEV[0] + y * later - last) / t
    exact = torch.special.erfc(t * SQRT_HALF) * torch.exp(0.5 * t * t) * SQRT_HALF_PI
    series = 1.0 - v * (1.0 - v * (3.0 - v * (15.0 - v * (105.0 - v * 945.0))))
    return torch.where(t > 26.0, series / t, exact)


def _gelu_log_p(x: Tensor) -> Tensor:
    return -0.5 * x * x - LOG_SQRT_2PI  # log phi(x)


def _gelu_direct(x: Tensor) -> tuple[Tensor, Tensor]:
    """x >= -2: Phi(x) + x phi(x) with Phi from erf (relative error < 4e-7 there); below:
    phi(x) (R(t) - t) as log phi(x) + log|R(t) - t|, with no cancellation (R(t) / t <= 0.21)."""
    log_phi = _gelu_log_p(x)
    d = 0.5 * (1.0 + torch.erf(x * SQRT_HALF)) + x * torch.exp(log_phi)
    t = (-x).clamp(min=GELU_TAIL)
    in_tail = x < -GELU_TAIL
    return torch.where(in_tail, log_phi, 0.0), torch.where(in_tail, _mills_ratio(t) - t, d)


def _gelu_bracket(x: Tensor) -> Tensor:
    """R(t) - t, t = -x (for the root and its Taylor series, float64 autograd near x = -0.75)."""
    t = -x
    return torch.special.erfc(t * SQRT_HALF) * torch.exp(0.5 * t * t) * SQRT_HALF_PI - t


# tanh-GELU: gelu(x) = x sigma(2u), u = b (x + k x^3), b = sqrt(2/pi), k = 0.044715. With
# 1 + tanh u = 2 sigma(2u) and 1 - tanh^2 u = 4 sigma(2u) sigma(-2u): d = sigma(2u) [1 + 2 x u'
# sigma(-2u)], u' = b (1 + 3 k x^2).
def _gelu_tanh_inner(x: Tensor) -> tuple[Tensor, Tensor]:
    u = GELU_TANH_BETA * (x + GELU_TANH_KAPPA * x * x * x)
    du = GELU_TANH_BETA * (1.0 + 3.0 * GELU_TANH_KAPPA * x * x)
    return u, du


def _log_sigmoid(z: Tensor) -> Tensor:
    """log sigma(z) = min(z, 0) - log(1 + e^-|z|), with log rather than log1p: inductor
    vectorises log but not log1p (10x slower), and log(1 + e) is off by at most an ulp of 1
    (6e-8), an absolute error of the log-weight, i.e. a relative one of the weight."""
    return torch.clamp(z, max=0.0) - torch.log(1.0 + torch.exp(-z.abs()))


def _gelu_tanh_log_p(x: Tensor) -> Tensor:
    return _log_sigmoid(2.0 * _gelu_tanh_inner(x)[0])


def _gelu_tanh_bracket(x: Tensor) -> Tensor:
    u, du = _gelu_tanh_inner(x)
    return 1.0 + 2.0 * x * du * torch.sigmoid(-2.0 * u)


def _gelu_tanh_direct(x: Tensor) -> tuple[Tensor, Tensor]:
    return _gelu_tanh_log_p(x), _gelu_tanh_bracket(x)


# SiLU: silu'(x) = sigma(x) (1 + x sigma(-x)).
def _silu_bracket(x: Tensor) -> Tensor:
    return 1.0 + x * torch.sigmoid(-x)


def _silu_direct(x: Tensor) -> tuple[Tensor, Tensor]:
    return _log_sigmoid(x), _silu_bracket(x)


# Mish: mish(x) = x tanh(softplus x). For x < 0, with s = e^x and D = s^2 + 2 s + 2 (in [2, 5]):
# tanh(softplus x) = s (s + 2) / D, sech^2(softplus x) = 4 (1 + s)^2 / D^2, sigma(x) = s/(1 + s),
# so d = (s / D) [(s + 2) + 4 x (1 + s) / D]. For x >= 0, with q = e^-x and E = 1 + 2q + 2q^2:
# d = (1 + 2q) / E + 4 x q^2 (1 + q) / E^2 (all terms positive, nothing overflows).
def _mish_parts(x: Tensor) -> tuple[Tensor, Tensor]:
    s = torch.exp(x.clamp(max=0.0))
    return s, s * s + 2.0 * s + 2.0


def _mish_log_p(x: Tensor) -> Tensor:
    return x - _mish_parts(x)[1].log()


def _mish_bracket(x: Tensor) -> Tensor:
    s, d = _mish_parts(x)
    return (s + 2.0) + 4.0 * x * (1.0 + s) / d


def _mish_direct(x: Tensor) -> tuple[Tensor, Tensor]:
    q = torch.exp(-x.clamp(min=0.0))
    e = 1.0 + 2.0 * q + 2.0 * q * q
    positive = (1.0 + 2.0 * q) / e + 4.0 * x * q * q * (1.0 + q) / (e * e)
    negative = x < 0
    prefix = torch.where(negative, _mish_log_p(x), 0.0)
    return prefix, torch.where(negative, _mish_bracket(x), positive)


GELU = SignChangingDerivative.build("gelu", _gelu_direct, _gelu_log_p, _gelu_bracket, -0.75)
GELU_TANH = SignChangingDerivative.build(
    "gelu_tanh", _gelu_tanh_direct, _gelu_tanh_log_p, _gelu_tanh_bracket, -0.75
)
SILU = SignChangingDerivative.build("silu", _silu_direct, _log_sigmoid, _silu_bracket, -1.28)
MISH = SignChangingDerivative.build("mish", _mish_direct, _mish_log_p, _mish_bracket, -1.19)

#: Use the compiled kernel from this many entries up (smaller tensors run the same code eagerly).
COMPILE_MIN_ENTRIES = 1 << 13


def _kernels(spec: SignChangingDerivative) -> dict[bool, Callable[..., tuple]]:
    def with_signs(x: Tensor) -> tuple:
        return spec.log_and_sign(x, True)

    def without_signs(x: Tensor) -> tuple:
        return spec.log_and_sign(x, False)

    with_signs.__name__ = with_signs.__qualname__ = f"log_derivative_{spec.name}_signed"
    without_signs.__name__ = without_signs.__qualname__ = f"log_derivative_{spec.name}"
    return {True: compiled(with_signs), False: compiled(without_signs)}


_COMPILED = {spec.name: _kernels(spec) for spec in (GELU, GELU_TANH, SILU, MISH)}


def _native_form(
    spec: SignChangingDerivative, x: Tensor, signs: bool
) -> tuple[Tensor, Tensor | None] | None:
    """``spec``'s ``log_and_sign`` by the native loop (``native/log_derivatives.c``: the torch
    form's operations; GELU's erf from torch) for float32 CPU tensors of any size, else None.
    Why: the compiled kernel cost a compilation on a process's first GELU or SiLU (for GELU,
    most of a sentence's first semiring backward through MiniLM) and guards on every call."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not native_available():
        return None
    hi, lo = spec.root_split[torch.float32]
    near, mills = _native_constants(spec.name)
    with torch.no_grad():
        x = x.contiguous()
        # GELU: the torch form's erf(x * SQRT_HALF), overwritten by the log
        out = torch.mul(x, SQRT_HALF).erf_() if spec is GELU else torch.empty_like(x)
        return sign_changing_log_derivative_f32(
            spec.name, x, out, near, (hi, lo), ROOT_WINDOW[torch.float32], signs, mills
        )


@functools.cache
def _native_constants(name: str) -> tuple[Tensor, Tensor | None]:
    """The near-root polynomial (and for GELU the Mills ratio's series) as float32 tensors,
    built once per derivative."""
    spec = NATIVE_SPECS[name]
    near = torch.tensor(spec.near_root[torch.float32], dtype=torch.float32)
    mills = torch.tensor(MILLS_CHEBYSHEV, dtype=torch.float32) if spec is GELU else None
    return near, mills


#: The derivatives with a native form (``_native_form``), by name.
NATIVE_SPECS = {spec.name: spec for spec in (GELU, SILU)}


def sign_changing_log_derivative(
    spec: SignChangingDerivative, x: Tensor, signs: bool
) -> tuple[Tensor, Sign]:
    """``(log|d|, sign d)`` of ``spec`` at ``x`` (in x's dtype, at least float32);
    ``signs=False`` gives 1.0 for the sign (for semirings that ignore signs: no sign tensor).
    A native form (``NATIVE_SPECS``: GELU, SiLU) takes float32 CPU tensors of any size; else
    large tensors take the compiled kernel, small ones the eager form."""
    if x.dtype not in ROOT_WINDOW:
        x = x.to(torch.float32)
    done = _native_form(spec, x, signs) if spec.name in NATIVE_SPECS else None
    if done is not None:
        log, sign = done
    elif compile_enabled() and x.numel() >= COMPILE_MIN_ENTRIES:
        with torch.no_grad():
            log, sign = _COMPILED[spec.name][signs](x.reshape(-1))
        log = log.view(x.shape)
        sign = sign.view(x.shape) if sign is not None else None
    else:
        log, sign = spec.log_and_sign(x, signs)
    return log, (sign if sign is not None else 1.0)


# --- helpers ------------------------------------------------------------------------------------
def _log_abs_number(c: float) -> float:
    return math.log(abs(c)) if c != 0 else -math.inf


def _sign_number(c: float) -> int:
    return (c > 0) - (c < 0)
