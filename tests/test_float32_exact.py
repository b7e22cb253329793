"""float32 never cuts a path: exact log-space edge weights, fully masked attention rows, NaN.

* Per function: the log-derivatives of ``kernels.log_derivatives`` on dense float32 grids out to
  |x| = 1e4 and on the floats next to each zero crossing, against references written here from
  the textbook derivatives in float64 (``math``) where those neither underflow nor cancel, and
  from asymptotic expansions (derived in each docstring) in the far tails.
* Deep saturated networks: the float32 model and the same model in float64 give the same
  Boolean and LogCount values, and MaxProd / LogSum / Entropy within float32 tolerance, both
  against the brute-force oracle on the float64 model; the old output-based weights are shown to
  be exactly 0 there (and the forward-outside-``extend`` fallback, which keeps them, to cut).
* Fully masked attention rows carry no path (SDPA returns 0 there); the decomposition drawn with
  ``torch.where(all_masked, 0, softmax)`` is the oracle.
* SignedMaxProd propagates a NaN derivative as MaxProd does.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import SEMIRINGS, MinProd, assert_readout_matches, oracle_readouts, semiring_names
from oracle import build_graph, dynamic_programming
from torch import Tensor, nn

import semipack
from semipack.kernels import log_derivatives as logd
from semipack.kernels import tropical
from semipack.kernels.compiled import set_compile
from semipack.kernels.native import native_available
from semipack.semirings.base import DERIVED_OPERATIONS, NO_EDGE_LOG, Semiring

aten = torch.ops.aten
F32, F64 = torch.float32, torch.float64
INF = float("inf")
LOG_2PI = math.log(2.0 * math.pi)


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ================================================================================================
# References: log|f'(x)| and sign f'(x) in float64, one Python float at a time
# ================================================================================================
def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z > -700 else math.exp(z)


def _log_sigmoid(z: float) -> float:
    """log sigma(z) = -log(1 + e^-z); for z < -700, log sigma(z) = z - log(1 + e^z) = z."""
    return -math.log1p(math.exp(-z)) if z > -700 else z


def ref_tanh(x: float) -> tuple[float, int]:
    """tanh' = sech^2 = 1 / cosh^2: log = -2 log cosh|x|; beyond |x| = 350 (cosh overflows at
    710) sech^2 x = 4 e^{-2|x|} (1 + e^{-2|x|})^-2 = 4 e^{-2|x|} (1 + O(e^{-700}))."""
    a = abs(x)
    return (-2.0 * math.log(math.cosh(a)) if a < 350 else math.log(4.0) - 2.0 * a), 1


def ref_sigmoid(x: float) -> tuple[float, int]:
    """sigma' = sigma(x) sigma(-x) = 1 / (2 + 2 cosh x); beyond |x| = 700 it is
    e^{-|x|} (1 + O(e^{-700}))."""
    a = abs(x)
    return (-math.log(2.0 + 2.0 * math.cosh(a)) if a < 700 else -a), 1


def ref_gelu(x: float) -> tuple[float, int]:
    """gelu' = Phi(x) + x phi(x), Phi(x) = erfc(-x / sqrt 2) / 2 (no cancellation for x < 0).
    Below x = -30, with t = -x and Phi(-t) = phi(t) / t (1 - 1/t^2 + 3/t^4 - 15/t^6 + ...):
    gelu' = -t phi(t) (1 - 1/t^2 + 1/t^4 - 3/t^6 + O(t^-8))."""
    if x > -30:
        d = 0.5 * math.erfc(-x / math.sqrt(2.0)) + x * math.exp(-0.5 * x * x) / math.sqrt(
            2.0 * math.pi
        )
        return math.log(abs(d)), (d > 0) - (d < 0)
    t = -x
    u = 1.0 / (t * t)
    return -0.5 * t * t - 0.5 * LOG_2PI + math.log(t) + math.log1p(-u + u * u - 3 * u**3), -1


def ref_gelu_tanh(x: float) -> tuple[float, int]:
    """PyTorch's tanh approximation, gelu = x (1 + tanh u) / 2, u = b (x + k x^3): derivative
    (1 + tanh u) / 2 + x u' sech^2(u) / 2 with (1 + tanh u) / 2 = 1 / (1 + e^{-2u}). For
    u < -300: (1 + tanh u) / 2 = e^{2u} (1 + O(e^{2u})), sech^2 u = 4 e^{2u} (1 + O(e^{2u})),
    so the derivative is e^{2u} (1 + 2 x u')."""
    b, k = math.sqrt(2.0 / math.pi), 0.044715
    u = b * (x + k * x**3)
    du = b * (1.0 + 3.0 * k * x * x)
    if u > -300:
        sech2 = 1.0 / math.cosh(u) ** 2 if abs(u) < 350 else 0.0
        d = 1.0 / (1.0 + math.exp(-2.0 * u)) + 0.5 * x * du * sech2
        return math.log(abs(d)), (d > 0) - (d < 0)
    bracket = 1.0 + 2.0 * x * du
    return 2.0 * u + math.log(abs(bracket)), (bracket > 0) - (bracket < 0)


def ref_silu(x: float) -> tuple[float, int]:
    """silu' = sigma(x) (1 + x (1 - sigma(x))), 1 - sigma(x) = sigma(-x); below x = -700,
    sigma(x) = e^x (1 + O(e^x)) and sigma(-x) = 1 + O(e^x): silu' = e^x (1 + x)."""
    if x > -700:
        bracket = 1.0 + x * _sigmoid(-x)
        return _log_sigmoid(x) + math.log(abs(bracket)), (bracket > 0) - (bracket < 0)
    return x + math.log(abs(1.0 + x)), -1


def ref_mish(x: float) -> tuple[float, int]:
    """mish' = tanh(sp) + x sigma(x) sech^2(sp), sp = log(1 + e^x). Below x = -700: sp = e^x,
    tanh(sp) = e^x, sech^2(sp) = 1, sigma(x) = e^x, each to 1 + O(e^x): mish' = e^x (1 + x)."""
    if x > -700:
        sp = math.log1p(math.exp(x)) if x < 700 else x
        sech2 = 1.0 / math.cosh(sp) ** 2 if sp < 350 else 0.0
        d = math.tanh(sp) + x * _sigmoid(x) * sech2
        return math.log(abs(d)), (d > 0) - (d < 0)
    return x + math.log(abs(1.0 + x)), -1


def ref_softplus(beta: float, threshold: float) -> Callable[[float], tuple[float, int]]:
    def ref(x: float) -> tuple[float, int]:
        z = x * beta
        return (0.0 if z > threshold else _log_sigmoid(z)), 1

    return ref


def ref_log_sigmoid(x: float) -> tuple[float, int]:
    return _log_sigmoid(-x), 1  # d/dx log sigma(x) = 1 - sigma(x) = sigma(-x)


def ref_erf(x: float) -> tuple[float, int]:
    return math.log(2.0 / math.sqrt(math.pi)) - x * x, 1


def _grid(roots: tuple[float, ...] = ()) -> Tensor:
    """float32 points: a dense grid over [-60, 60], far points out to 1e4, and for each zero
    crossing the 41 floats around it (every one of them, bit patterns stepped by one)."""
    dense = torch.linspace(-60.0, 60.0, 24001)
    far = torch.tensor([-1e4, -3e3, -1e3, -350.5, -120.25, -30.5, 30.5, 120.25, 1e3, 1e4])
    parts = [dense, far]
    for r in roots:
        bits = torch.tensor([r], dtype=F32).view(torch.int32) + torch.arange(
            -20, 21, dtype=torch.int32
        )
        parts.append(bits.view(F32))
    return torch.cat(parts)


def assert_log_derivative(
    log: Tensor, sign: Tensor | float, x: Tensor, ref: Callable[[float], tuple[float, int]]
) -> None:
    """|log - ref| <= 1e-6 max(1, |ref|) (float32: a few ulps of the weight, or of its log when
    that is large), signs equal, no -inf and no NaN for finite x."""
    want = [ref(v) for v in x.double().tolist()]
    want_log = torch.tensor([w[0] for w in want], dtype=F64)
    want_sign = torch.tensor([float(w[1]) for w in want], dtype=F64)
    got = log.double()
    assert torch.isfinite(got).all(), x[~torch.isfinite(got)]
    err = (got - want_log).abs() / want_log.abs().clamp(min=1.0)
    worst = int(err.argmax())
    assert err[worst] <= 1e-6, (x[worst].item(), got[worst].item(), want_log[worst].item())
    signs = torch.as_tensor(sign, dtype=F64).expand(got.shape)
    assert torch.equal(signs, want_sign), x[signs != want_sign]


SIGN_CHANGING = {
    "gelu": (logd.GELU, ref_gelu, -0.7517915246935644),
    "gelu_tanh": (logd.GELU_TANH, ref_gelu_tanh, -0.7524614220710161),
    "silu": (logd.SILU, ref_silu, -1.278464542761074),
    "mish": (logd.MISH, ref_mish, -1.1924312145154954),
}


@pytest.mark.parametrize("name", list(SIGN_CHANGING))
def test_sign_changing_log_derivatives_on_dense_grids(name: str) -> None:
    spec, ref, root = SIGN_CHANGING[name]
    assert spec.root == pytest.approx(root, rel=1e-14, abs=0)  # the crossing the grid probes
    x = _grid((root,))
    log, sign = spec.log_and_sign(x, True)
    assert_log_derivative(log, sign, x, ref)


def test_sign_changing_log_derivatives_in_float64() -> None:
    """The float64 form (narrower window around the crossing) on the same grid: within 1e-9
    (the float64 root itself is only known to 1e-16, so next to it delta is not exact)."""
    for spec, ref, root in SIGN_CHANGING.values():
        x = _grid((root,)).double()
        log, _ = spec.log_and_sign(x, False)
        want = torch.tensor([ref(v)[0] for v in x.tolist()], dtype=F64)
        err = (log - want).abs() / want.abs().clamp(min=1.0)
        assert err.max() <= 1e-8, (spec.name, x[err.argmax()].item())


@pytest.mark.parametrize(
    ("name", "function", "ref"),
    [
        ("tanh", logd.tanh_log_derivative, ref_tanh),
        ("sigmoid", logd.sigmoid_log_derivative, ref_sigmoid),
        ("log_sigmoid", logd.log_sigmoid_log_derivative, ref_log_sigmoid),
        ("softplus", lambda x: logd.softplus_log_derivative(x, 1.0, 20.0), ref_softplus(1, 20)),
        ("softplus_b2", lambda x: logd.softplus_log_derivative(x, 2.0, 7.0), ref_softplus(2, 7)),
        ("erf", logd.erf_log_derivative, ref_erf),
    ],
)
def test_positive_log_derivatives_on_dense_grids(name: str, function, ref) -> None:
    x = _grid()
    if name == "erf":
        x = x[x.abs() < 1e3]  # -x^2 stays a float32 (1e8 at 1e4 too, but its ulp is 8)
    log, sign = function(x)
    assert_log_derivative(log, sign, x, ref)


def test_elu_family_log_derivatives() -> None:
    """ELU / SELU / CELU: log|coefficient| + x * input_scale for x <= 0 (exact in float32 up to
    one rounding of x * input_scale), log|scale| above; a zero coefficient is no edge."""
    x = _grid()
    selu_alpha, selu_scale = 1.6732632423543772, 1.0507009873554805
    for alpha, scale, input_scale in [(1.0, 1.0, 1.0), (selu_alpha, selu_scale, 1.0), (0.5, 1, 2)]:
        log, sign = logd.elu_log_derivative(x, alpha, scale, input_scale)
        neg = math.log(alpha * scale * input_scale) + (x * input_scale).double()
        want = torch.where(x <= 0, neg, math.log(scale))
        torch.testing.assert_close(log.double(), want, rtol=1e-7, atol=1e-6)
        assert sign == 1.0
    log, sign = logd.elu_log_derivative(x, 0.0, 1.0, 1.0)  # alpha = 0: nothing on x <= 0
    assert torch.equal(log == -INF, x <= 0) and torch.equal(
        log[x > 0], torch.zeros(int((x > 0).sum()))
    )
    assert torch.equal(sign, (x > 0).to(F32))


def test_exact_zeros_only_where_the_derivative_is_zero() -> None:
    """±inf inputs: tanh' and sigmoid' are 0 there (log -inf); NaN stays NaN everywhere."""
    x = torch.tensor([INF, -INF, float("nan"), 0.0])
    for function in (logd.tanh_log_derivative, logd.sigmoid_log_derivative):
        log, _ = function(x)
        assert log[:2].tolist() == [-INF, -INF] and math.isnan(log[2]) and math.isfinite(log[3])
    for spec in (logd.GELU, logd.GELU_TANH, logd.SILU, logd.MISH):
        log, _ = spec.log_and_sign(torch.tensor([float("nan"), 0.0]), True)
        assert math.isnan(log[0]) and math.isfinite(log[1])


@pytest.mark.slow
def test_compiled_kernel_equals_the_eager_form() -> None:
    """Large tensors run ``log_and_sign`` as one inductor kernel where there is no native form
    (its erf and exp are not ATen's): as accurate as the eager form."""
    x = _grid((SIGN_CHANGING["gelu"][2],))
    assert x.numel() >= logd.COMPILE_MIN_ENTRIES
    log, sign = logd._COMPILED["gelu"][True](x)
    assert_log_derivative(log, sign, x, ref_gelu)


needs_native = pytest.mark.skipif(
    not native_available(), reason="the native kernels need x86-64 Linux, AVX2 and a C compiler"
)


@needs_native
@pytest.mark.parametrize("name", ["gelu", "silu"])
def test_native_forms_on_dense_grids(name: str) -> None:
    """GELU's and SiLU's native loops (``native/log_derivatives.c``) as accurate as the torch
    form on the dense grid and every float around the crossing, with its signs; and they are
    what ``sign_changing_log_derivative`` runs for float32 CPU tensors, at any size (no
    compiled kernel: ``set_compile(False)`` changes nothing)."""
    spec, ref, root = SIGN_CHANGING[name]
    assert name in logd.NATIVE_SPECS
    x = _grid((root,))
    log, sign = logd._native_form(spec, x, True)
    assert_log_derivative(log, sign, x, ref)
    eager, _ = spec.log_and_sign(x, False)
    assert ((log - eager).abs() / eager.abs().clamp(min=1.0)).max() <= 4e-7  # a few ulps
    for size in (1, 7, 8, 9, 4097, 70001):  # tails of a vector, of a block; threads
        y = x[:size] if size <= x.numel() else torch.randn(size) * 3
        via_dispatch, signs = logd.sign_changing_log_derivative(spec, y.clone(), True)
        alone, alone_signs = logd._native_form(spec, y, True)
        assert torch.equal(via_dispatch, alone) and torch.equal(signs, alone_signs)
    set_compile(False)
    try:
        small, _ = logd.sign_changing_log_derivative(spec, x[:100], False)
    finally:
        set_compile(True)
    assert torch.equal(small, log[:100])


@needs_native
@pytest.mark.parametrize("name", ["gelu", "silu"])
def test_native_forms_special_values_and_layouts(name: str) -> None:
    """NaN, infinities, signed zeros, subnormals, huge values and GELU's tail edge (-2) give
    the torch form's values and signs (NaN where it gives NaN); a strided input gives the
    values of its contiguous copy, in the input's shape; without signs, the sign is 1.0."""
    spec = SIGN_CHANGING[name][0]
    root_hi = spec.root_split[torch.float32][0]
    x = torch.tensor(
        [math.nan, INF, -INF, 0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38, -2.0, 1.5, 90.0, -90.0]
        + [root_hi, -104.0, 104.0]
        + [float(torch.tensor(-2.0).nextafter(torch.tensor(v))) for v in (-3.0, 0.0)]
    )
    log, sign = logd._native_form(spec, x, True)
    want, want_sign = spec.log_and_sign(x, True)
    assert torch.equal(log.isnan(), want.isnan()) and torch.equal(sign, want_sign)
    assert torch.equal(log.isinf(), want.isinf())
    finite = want.isfinite()
    assert torch.allclose(log[finite], want[finite], rtol=4e-7, atol=4e-7)
    grid = torch.linspace(-5, 5, 60).reshape(6, 10)
    strided, _ = logd.sign_changing_log_derivative(spec, grid.t(), False)
    dense, unsigned = logd.sign_changing_log_derivative(spec, grid.t().contiguous(), False)
    assert strided.shape == (10, 6) and torch.equal(strided, dense) and unsigned == 1.0


# ================================================================================================
# The log-space semiring operations
# ================================================================================================


def _weights(shape, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g, dtype=F64) * (2 * torch.randn(shape, generator=g)).exp()
    return torch.where(torch.rand(shape, generator=g) < 0.3, 0.0, w)


def _state(sr: Semiring, shape, seed: int):
    return sr.plus(sr.lift(_weights(shape, seed)), sr.lift(_weights(shape, seed + 1)))


def _same(sr: Semiring, got, want) -> None:
    for g, w in zip(got, want, strict=True):
        if g.dtype == torch.bool or g.dtype == torch.int64:
            assert torch.equal(g, w)
        else:
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, equal_nan=True)


def test_log_forms_equal_the_linear_forms(semiring: Semiring) -> None:
    """lift_log / scale_log / scale_log_owned / matmul_log of (log|w|, sign w) equal lift /
    scale / matmul of w wherever w is representable (exact zeros included)."""
    sr = semiring
    w = _weights((5, 6), seed=3)
    log_w, sign = w.abs().log(), torch.sign(w)
    a = _state(sr, (5, 6), seed=5)
    _same(sr, sr.lift_log(log_w, sign), sr.lift(w))
    _same(sr, sr.scale_log(a, log_w, sign), sr.scale(a, w))
    _same(sr, sr.scale_log_owned(a, log_w.clone(), sign), sr.scale(a, w))
    m = _state(sr, (4, 5), seed=7)
    _same(sr, sr.matmul_log(m, log_w, sign), sr.matmul(m, w))


# Real is left out: its state is the linear product, where e^-200 is 0 in float32.
@pytest.mark.parametrize("semiring_name", semiring_names("real"))
def test_log_forms_keep_weights_below_float32(semiring: Semiring) -> None:
    """An edge of weight e^-200 (0 in float32) is an edge: one path of log-weight -200."""
    sr = semiring
    a = sr.ones((1, 2), F32, "cpu")
    log_w = torch.tensor([[-200.0, -INF]])
    assert sr.is_zero(sr.scale(a, log_w.exp())).tolist() == [[True, True]]  # linear: both cut
    assert sr.is_zero(sr.scale_log(a, log_w, 1.0)).tolist() == [[False, True]]
    if type(sr) in (semipack.MaxProd, semipack.TopPath, semipack.LogSum, semipack.Entropy):
        assert sr.scale_log(a, log_w, 1.0)[0][0, 0] == -200.0
    column = sr.matmul_log(a, torch.tensor([[-200.0], [-INF]]), 1.0)
    assert sr.is_zero(column).tolist() == [[False]]


def test_signs_and_defaults() -> None:
    """Sign-free built-ins say so; a subclass that redefines a log-form op, or a primitive the
    log forms rely on, reads signs again; a user semiring gets correct defaults via lift."""

    class Doubled(semipack.MaxProd):
        def scale_log(self, a, log_abs, sign=1.0):
            return super().scale_log(a, log_abs, sign)

    class OwnLift(semipack.LogSum):
        def lift(self, w):
            return super().lift(w)

    for sr in (semipack.MaxProd(), semipack.TopPath(), semipack.LogSum(), semipack.LogCount()):
        assert not sr.uses_edge_signs()
    for sr in (semipack.Entropy(), semipack.Boolean()):
        assert not sr.uses_edge_signs()
    for sr in (semipack.SignedMaxProd(), semipack.Real(), Doubled(), OwnLift()):
        assert sr.uses_edge_signs()
    assert {
        "lift_log",
        "scale_log",
        "scale_log_owned",
        "matmul_log",
        "uses_edge_signs",
    } <= set(DERIVED_OPERATIONS)
    assert all(callable(getattr(Semiring, name)) for name in DERIVED_OPERATIONS)

    sr = MinProd()
    a = (torch.tensor([1.0, 2.0, 3.0]),)
    got = sr.scale_log(a, torch.tensor([math.log(0.5), -INF, 0.0]), torch.tensor([-1.0, 0, 1]))
    assert got[0].tolist() == pytest.approx([1.0 + math.log(0.5), INF, 3.0], rel=1e-7)


# ================================================================================================
# Rules: recorded inputs, fallbacks, exact products
# ================================================================================================
def _log_value(fn, x: Tensor, inside: bool, sr=None) -> Tensor:
    sr = sr or semipack.MaxProd(log=True)
    x = x.detach().clone().requires_grad_(True)
    if inside:
        with semipack.extend(None, sr):
            fn(x).sum().backward()
        return x.semiring_grad
    return semipack.grad(fn(x).sum(), x, sr)[0]


def test_tanh_at_20_has_its_exact_log_derivative() -> None:
    x = torch.tensor([20.0, -15.0, 0.5, 1e4])
    y = torch.tanh(x)
    old = aten.tanh_backward(torch.ones_like(y), y)
    assert old[:2].tolist() == [0.0, 0.0] and old[3] == 0.0  # the output-based weight is cut
    got = _log_value(torch.tanh, x, inside=True)
    want = torch.tensor([ref_tanh(v)[0] for v in x.tolist()], dtype=F64)
    # tanh'(1e4) = 4 e^-20000 is 0 even in float64: below NO_EDGE_LOG, no edge (a documented
    # convention: a weight no float can hold is a structural zero, like a -1e4 attention mask).
    assert want[3] < NO_EDGE_LOG
    want[3] = float("-inf")
    torch.testing.assert_close(got.double(), want, rtol=1e-7, atol=1e-6)
    assert torch.isfinite(got[:3]).all()


@pytest.mark.parametrize(
    "fn", [torch.tanh, torch.sigmoid, torch.exp], ids=["tanh", "sigmoid", "exp"]
)
def test_forward_outside_extend_keeps_the_output_based_weights(fn) -> None:
    """Without a recorded input the rules use exactly today's weights: log of the op applied
    to a gradient of ones, -inf where that rounds to 0."""
    x = torch.tensor([0.3, -2.0, 20.0, -120.0])
    got = _log_value(fn, x, inside=False)
    y = fn(x)
    if fn is torch.tanh:
        old = aten.tanh_backward(torch.ones_like(y), y)
    elif fn is torch.sigmoid:
        old = aten.sigmoid_backward(torch.ones_like(y), y)
    else:
        old = y
    assert torch.equal(got, old.abs().log())
    assert got.isinf().any()  # and they do cut (tanh(20), sigmoid(20) and exp(-120))
    assert torch.isfinite(_log_value(fn, x, inside=True)).all()


def test_softmax_outside_extend_uses_its_output_as_before() -> None:
    """Without a recorded input the softmax rule works from the output probabilities p, as
    before; the diagonal p_j (1 - p_j) is now taken as p_j times the sum of the other
    probabilities, so where 1 - p_j rounds to 0 (row 1) the edge stays, everything else is
    today's value: max_i log|w_i| + log|J_ij| with J from p."""
    x = torch.tensor([[0.5, -1.0, 2.0, 0.1], [0.0, -18.0, -19.0, -20.0]], requires_grad=True)
    w = torch.tensor([[1.0, -2.0, 0.5, 3.0], [2.0, 1.0, -1.0, 0.5]])
    (got,) = semipack.grad((torch.softmax(x, -1) * w).sum(), x, semipack.MaxProd(log=True))
    p = torch.softmax(x.detach(), -1).double()
    assert p[1, 0] == 1.0 and (p[1, 1:] > 0).all()  # float32: 1 - p_0 = 0, others are fine
    others = torch.stack([p[:, [k for k in range(4) if k != j]].sum(-1) for j in range(4)], -1)
    eye = torch.eye(4, dtype=torch.bool)
    jac = torch.where(eye, torch.diag_embed(p * others), -p[:, :, None] * p[:, None, :])
    want = (w.double().abs().log()[:, :, None] + jac.abs().log()).amax(1)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_recorded_input_is_not_used_after_an_in_place_change() -> None:
    x = torch.tensor([20.0, 0.5], requires_grad=True)
    base = x * 1
    with semipack.extend(None, semipack.MaxProd(log=True)):
        y = torch.tanh(base)
        with torch.no_grad():
            base.add_(1.0)  # tanh's recorded input no longer is what tanh saw
        y.sum().backward()
    old = aten.tanh_backward(torch.ones_like(y), y.detach())
    assert torch.equal(x.semiring_grad, old.abs().log())


def test_in_place_and_dtype_variants_are_recorded() -> None:
    sr = semipack.MaxProd(log=True)
    x = torch.tensor([[20.0, 0.0, -90.0]], requires_grad=True)
    with semipack.extend(None, sr):
        h = x * 1
        h.tanh_()
        h.sum().backward()
    want = torch.tensor([ref_tanh(v)[0] for v in (20.0, 0.0, -90.0)])
    torch.testing.assert_close(x.semiring_grad[0], want, rtol=1e-7, atol=1e-6)
    with semipack.extend(None, sr):
        p = F.softmax(x * 1, -1, dtype=F64)  # one-hot in float32 and in float64
        (p[:, 1] * 1).sum().backward()
    # d p_1 / d x_j: p_1 (1 - p_1) for j = 1, -p_1 p_j otherwise; p_1 = e^-20 / (1 + ...)
    lp = torch.log_softmax(x.detach().double(), -1)[0]
    want = lp[1] + torch.stack([lp[0], torch.logsumexp(lp[[0, 2]], 0), lp[2]])
    torch.testing.assert_close(x.semiring_grad[0].double(), want, rtol=1e-6, atol=1e-5)


def test_exact_products_of_exp_erf_logsumexp_and_bce() -> None:
    """exp(-120), erf'(12), softmax weights inside logsumexp and sigmoid(x) - t of BCE with
    logits are all 0 in float32; their logs are exact."""
    sr = semipack.MaxProd(log=True)
    x = torch.tensor([-120.0, 12.0, -3.0, 30.0])
    assert torch.exp(x[0]) == 0 and (2 / math.sqrt(math.pi)) * torch.exp(-(x[1] ** 2)) == 0
    torch.testing.assert_close(_log_value(torch.exp, x, True, sr), x)
    want = torch.tensor([ref_erf(v)[0] for v in x.tolist()])
    # erf'(-120) and erf'(30) (e^-14400, e^-900) are 0 in float64 too: no edge (NO_EDGE_LOG)
    want = want.masked_fill(want < NO_EDGE_LOG, float("-inf"))
    assert want.isinf().tolist() == [True, False, False, True]
    torch.testing.assert_close(_log_value(torch.erf, x, False, sr), want)  # input saved: no record
    torch.testing.assert_close(_log_value(torch.special.erfc, x, False, sr), want)
    # logsumexp: d lse / d x_j = exp(x_j - lse)
    got = _log_value(lambda t: torch.logsumexp(t, 0), x, False, sr)
    torch.testing.assert_close(got, x - torch.logsumexp(x, 0))
    # BCE with logits, targets 1, 0, 0.25, 1 (mean over 4): sigma(x) - t / 4
    t = torch.tensor([1.0, 0.0, 0.25, 1.0])
    assert torch.sigmoid(x[3]) - 1 == 0  # the linear factor is cut at x = 30, t = 1
    got = _log_value(lambda v: F.binary_cross_entropy_with_logits(v, t), x, False, sr)
    lin = (torch.sigmoid(x.double()[2]) - 0.25).abs().log()
    want = torch.stack(
        [
            F.logsigmoid(-x.double()[0]),
            F.logsigmoid(x.double()[1]),
            lin,
            F.logsigmoid(-x.double()[3]),
        ]
    ) - math.log(4)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    pos = torch.tensor([3.0, 3.0, 3.0, 0.0])  # pos_weight 0 at t = 1: a structural zero
    got = _log_value(
        lambda v: F.binary_cross_entropy_with_logits(v, t, pos_weight=pos, reduction="sum"),
        x,
        False,
        sr,
    )
    assert got[3] == -INF
    torch.testing.assert_close(got[0].double(), math.log(3) + F.logsigmoid(-x.double()[0]))


def test_expm1_and_logaddexp_keep_the_edges_their_formulas_lose() -> None:
    """expm1's ``grad * (result + 1)`` cancels to 0 below x = -37 in float64 and loses digits
    from -20 (4% off at -36), logaddexp's ``grad / (1 + exp(other - self))`` overflows to 0
    where the other operand is larger by more than 745: both read as no edge, or a wrong one
    (trial 83). Their logs are exact: e^x's, and logsigmoid(self - other)."""
    sr = semipack.MaxProd(log=True)
    x = torch.tensor([-40.0, -36.0, -20.0, 0.5, 3.0], dtype=F64)
    assert torch.expm1(x[0]) + 1 == 0  # the formula's factor: no edge at -40
    torch.testing.assert_close(_log_value(torch.expm1, x, True, sr), x, rtol=0, atol=0)
    torch.testing.assert_close(_log_value(lambda t: t.clone().expm1_(), x, True, sr), x)
    x = torch.tensor([-740.0, -3.0, 0.0, 800.0], dtype=F64)
    other = torch.tensor([0.0, 1.0, 0.0, -5.0], dtype=F64)
    assert 1 / (1 + torch.exp(other[0] - x[0])) == 0
    want = F.logsigmoid(x - other)
    torch.testing.assert_close(_log_value(lambda t: torch.logaddexp(t, other), x, False, sr), want)
    torch.testing.assert_close(_log_value(lambda t: torch.logaddexp(other, t), x, False, sr), want)
    boolean = _log_value(lambda t: torch.logaddexp(t, other), x, False, semipack.Boolean())
    assert boolean.tolist() == [True] * 4


def test_soft_margin_and_glu_saturate_exactly() -> None:
    sr = semipack.MaxProd(log=True)
    x = torch.tensor([120.0, -3.0, 0.5])
    y = torch.tensor([1.0, -1.0, 0.0])
    got = _log_value(lambda v: F.soft_margin_loss(v, y, reduction="sum"), x, False, sr)
    assert got[2] == -INF  # target 0: derivative exactly 0
    torch.testing.assert_close(got[:2].double(), F.logsigmoid(-(y * x).double()[:2]))
    v = torch.tensor([[2.0, 40.0]])  # glu: a * sigmoid(b), b = 40 saturates sigmoid'
    got = _log_value(lambda t: F.glu(t, -1), v, False, sr)
    want = [F.logsigmoid(torch.tensor(40.0, dtype=F64)), math.log(2.0) + ref_sigmoid(40.0)[0]]
    torch.testing.assert_close(got[0].double(), torch.tensor(want, dtype=F64))


# ================================================================================================
# Deep saturated networks: float32 and float64 against the float64 oracle
# ================================================================================================
ORACLE_NAMES = ["boolean", "log_count", "max_prod", "log_sum", "entropy", "signed_max_prod"]
#: Tolerance of log-space values (MaxProd and SignedMaxProd as logs of magnitudes, LogSum,
#: Entropy in nats) against the float64 oracle. float32: every edge weight carries ~1e-6
#: relative error (weights and pre-activations rounded, log-derivatives to a few ulps) and
#: paths multiply up to ~10 of them. float64: the oracle's own Jacobians of saturated tanh and
#: sigmoid (1 - y^2, y (1 - y) at y = 1 - 1e-9) are only good to ~3e-7.
FLOAT32_TOLERANCE = {"atol": 5e-5, "rtol": 1e-6}
FLOAT64_TOLERANCE = {"atol": 1e-6, "rtol": 1e-9}


def _semipack(name: str):
    if name == "max_prod":
        return semipack.MaxProd(log=True)
    if name == "signed_max_prod":
        return semipack.SignedMaxProd(log=True)
    return SEMIRINGS[name]()


def assert_log_space_match(name: str, expected, actual, where: str, tolerance: dict) -> None:
    """Boolean and LogCount exactly (the same edges: the same counts); the others in log space
    within ``tolerance``, "no path" markers equal."""
    if name == "boolean":
        assert torch.equal(actual, expected), where
        return
    if name == "signed_max_prod":
        for e, a in zip(expected, (actual.largest, actual.smallest), strict=True):
            assert torch.equal(torch.sign(e), a.sign.double()), where
            torch.testing.assert_close(a.log_abs.double(), e.abs().log(), msg=where, **tolerance)
        return
    expected = expected.double().log() if name == "max_prod" else expected
    actual = actual.double()
    if name == "log_count":  # equal counts: logs equal up to the rounding of a float32 log
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6, msg=where)
        return
    torch.testing.assert_close(actual, expected, equal_nan=True, msg=where, **tolerance)


class SaturatedMLP(nn.Module):
    """Seven linear layers with tanh, sigmoid, GELU, tanh-GELU, SiLU, Mish and softplus, then
    cross-entropy. Each layer's rows are rescaled so that its pre-activations sit where wanted
    (``TARGETS``: centre and half-width per unit), so that float32 saturates where float64 is
    still exact: tanh at |x| in [9.3, 11.5] (1 - tanh^2 is 0 in float32, good to 3e-7 in
    float64), sigmoid at [17.5, 20.5], GELU at [-5.5, -3.5] (the float32 erf cancels), softplus
    above its threshold (derivative exactly 1), and logits 21 and 112 apart (1 - p is 0 and
    p = e^-112 underflows in float32). No other range contains 0, where tanh, GELU, SiLU and
    Mish themselves cross 0: a forward value near 0 differs between float32 and float64 by more
    than float32 tolerance (the next layer's weight edges are forward values). A half-width of
    0 makes a unit bias-only (zero weight
    row: no edges from the inputs) with its bias the float32 next to the zero crossing of
    GELU, tanh-GELU, SiLU or Mish: there the derivative is ill-conditioned (relative change
    1 / |x - root| per unit of x), so float32 and float64 must see the same pre-activation; the
    float32 derivatives computed by PyTorch are off by 10-100% there."""

    ACTIVATIONS = (
        torch.tanh,
        torch.sigmoid,
        F.gelu,
        lambda t: F.gelu(t, approximate="tanh"),
        F.silu,
        F.mish,
        F.softplus,
    )
    TARGETS = (
        [(10.4, 1.1), (-10.4, 1.1), (0.9, 0.4), (2.0, 0.5)],
        [(19.0, 1.5), (1.0, 0.5), (-2.0, 0.5), (18.0, 0.5)],
        [(-0.7517915, 0.0), (-2.5, 0.3), (0.9, 0.4), (1.5, 0.5)],
        [(-0.7524614, 0.0), (-3.0, 0.5), (0.9, 0.4), (-2.0, 0.5)],
        [(-1.2784645, 0.0), (-6.0, 1.0), (0.9, 0.4), (-3.0, 0.5)],
        [(-1.1924312, 0.0), (-8.0, 1.0), (0.9, 0.4), (2.0, 0.5)],
        [(21.0, 0.5), (3.0, 0.5), (-2.0, 0.5), (0.2, 0.5)],
        [(0.0, 0.5), (-21.0, 0.5), (-112.0, 0.5)],
    )

    def __init__(self, x: Tensor, generator: torch.Generator) -> None:
        super().__init__()
        sizes = [x.shape[1]] + [len(t) for t in self.TARGETS]
        self.layers = nn.ModuleList(nn.Linear(a, b).double() for a, b in itertools.pairwise(sizes))
        h = x
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator, dtype=F64))
                pre = h @ layer.weight.t()
                targets = self.TARGETS[i]
                centre = torch.tensor([c for c, _ in targets], dtype=F64)
                half = torch.tensor([width for _, width in targets], dtype=F64)
                centre = centre.float().double()  # the same value in both models
                span = (pre.amax(0) - pre.amin(0)).clamp(min=1e-12)
                layer.weight.mul_((2 * half / span)[:, None])
                pre = h @ layer.weight.t()
                layer.bias.copy_(centre - (pre.amax(0) + pre.amin(0)) / 2)
                if i < len(self.ACTIVATIONS):
                    h = self.ACTIVATIONS[i](layer(h))

    def forward(self, x: Tensor) -> Tensor:
        for layer, activation in zip(self.layers, self.ACTIVATIONS, strict=False):
            x = activation(layer(x))
        return self.layers[-1](x)

    def pre_activations(self, x: Tensor) -> list[Tensor]:
        out = []
        for layer, activation in zip(self.layers, self.ACTIVATIONS, strict=False):
            out.append(layer(x))
            x = activation(out[-1])
        out.append(self.layers[-1](x))
        return out


def _mlp_case():
    g = torch.Generator().manual_seed(11)
    x64 = torch.randn(3, 3, generator=g, dtype=F64)
    model64 = SaturatedMLP(x64, g)
    labels = torch.tensor([0, 1, 2])
    return model64, x64, (lambda m, x: F.cross_entropy(m(x), labels))


class SharpAttention(nn.Module):
    """Designed scores, then three more layers. x = I (4 tokens), so the keys are the rows of
    Wk^T (a dense orthogonal matrix) and Wq is solved for so that the scores are S (``SCORES``:
    gaps of 20 and of 110 under the row maximum, key 3 masked). In float32, 1 - p_top and
    p = e^-110 are 0; in float64 both are exact. O = attention(x Wq, x Wk, x Wv), then Wo, tanh,
    W2 and a sum against fixed weights. (Dense keys: with one nonzero key entry per column, a
    score message 110 nats under its row's maximum would be the only term of its column in the
    BLAS products of LogSum and Entropy and underflow there; see the report's limits.)"""

    SCORES = (
        (0.0, -20.0, -110.0, 0.0),
        (-20.5, 0.0, -3.0, 0.0),
        (-115.0, -0.5, 0.0, 0.0),
        (2.0, 1.0, -108.0, 0.0),
    )

    def __init__(self, generator: torch.Generator, eager: bool) -> None:
        super().__init__()
        self.eager = eager
        self.scale = 0.5
        keys, _ = torch.linalg.qr(torch.randn(4, 4, generator=generator, dtype=F64))
        scores = torch.tensor(self.SCORES, dtype=F64)
        queries = scores @ torch.linalg.inv(keys.t()) / self.scale  # q k^T scale = S
        self.wq = nn.Parameter(queries.t().contiguous())
        self.wk = nn.Parameter(keys.t().contiguous())
        # positive values: O = P V has no cancellation, so float32 and float64 forward values
        # (the weights of Wo's edges) agree to float32 precision
        self.wv = nn.Parameter(torch.rand(4, 4, generator=generator, dtype=F64) + 0.5)
        self.wo = nn.Parameter(torch.randn(4, 4, generator=generator, dtype=F64) * 2)
        self.w2 = nn.Parameter(torch.randn(4, 3, generator=generator, dtype=F64))
        self.mask = torch.ones(4, 4, dtype=torch.bool)
        self.mask[:, 3] = False  # key 3 is masked for every query
        self.weights = torch.randn(4, 3, generator=generator, dtype=F64)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (x @ w.t() for w in (self.wq, self.wk, self.wv))
        q, k, v = (t[None, None] for t in (q, k, v))
        if self.eager:
            s = (q @ k.transpose(-1, -2) * self.scale).masked_fill(~self.mask, -INF)
            o = torch.softmax(s, -1) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=self.scale)
        h = torch.tanh(o[0, 0] @ self.wo)
        return ((h @ self.w2) * self.weights.to(h.dtype)).sum()


def _oracle(model64: nn.Module, leaves64: list[Tensor], loss64: Tensor) -> dict:
    graph = build_graph(loss64)
    return {name: dynamic_programming(graph, leaves64, name) for name in ORACLE_NAMES}


def _run(model: nn.Module, leaves: list[Tensor], loss_fn, name: str, extensions=True, inside=True):
    for t in leaves:
        t.grad = None
    sr = _semipack(name)
    if inside:
        with semipack.extend(model, sr, extensions=extensions):
            loss_fn().backward()
        return [t.semiring_grad for t in leaves]
    return list(semipack.grad(loss_fn(), leaves, sr))


def _float32_copy(model64: nn.Module) -> nn.Module:
    import copy

    model = copy.deepcopy(model64).float()
    for name, buf in vars(model).items():  # plain tensor attributes (masks, fixed weights)
        if isinstance(buf, Tensor) and buf.is_floating_point():
            setattr(model, name, buf.float())
    return model


def test_saturated_mlp_float32_matches_the_float64_oracle() -> None:
    model64, x64, loss_of = _mlp_case()
    pre = model64.pre_activations(x64)
    for values, targets in zip(pre, SaturatedMLP.TARGETS, strict=True):
        for unit, (centre, half) in enumerate(targets):  # the design holds
            assert (values[:, unit] - centre).abs().max() <= half * 1.0001 + 1e-6
    leaves64 = [x64.requires_grad_(True), *model64.parameters()]
    oracle = _oracle(model64, leaves64, loss_of(model64, x64))
    model32 = _float32_copy(model64)
    x32 = x64.detach().float().requires_grad_(True)
    leaves32 = [x32, *model32.parameters()]

    # today's weights are exactly 0 at the saturated units (the paths the test is about)
    pre32 = model32.pre_activations(x32)
    y = torch.tanh(pre32[0])
    assert (aten.tanh_backward(torch.ones_like(y), y)[:, :2] == 0).all()
    y = torch.sigmoid(pre32[1])
    assert (aten.sigmoid_backward(torch.ones_like(y), y)[:, [0, 3]] == 0).all()
    log_probs = torch.log_softmax(pre32[-1], -1)
    assert (1 - log_probs.exp()[:, 0] == 0).all() and (log_probs.exp()[:, 2] == 0).all()

    for name in ORACLE_NAMES:
        got32 = _run(model32, leaves32, lambda: loss_of(model32, x32), name)
        got64 = _run(model64, leaves64, lambda: loss_of(model64, x64), name)
        for leaf_no, (want, a32, a64) in enumerate(zip(oracle[name], got32, got64, strict=True)):
            assert_log_space_match(name, want, a32, f"float32 leaf {leaf_no}", FLOAT32_TOLERANCE)
            assert_log_space_match(name, want, a64, f"float64 leaf {leaf_no}", FLOAT64_TOLERANCE)

    # the forward outside extend keeps today's output-based weights: they cut those paths
    old = _run(model32, leaves32, lambda: loss_of(model32, x32), "boolean", inside=False)
    assert not all(torch.equal(o, e) for o, e in zip(old, oracle["boolean"], strict=True))


@pytest.mark.parametrize("extensions", [True, False], ids=["extension", "generic"])
def test_sharp_attention_float32_matches_the_float64_oracle(extensions: bool) -> None:
    g = torch.Generator().manual_seed(4)
    eager64 = SharpAttention(g, eager=True)
    x64 = torch.eye(4, dtype=F64, requires_grad=True)
    leaves64 = [x64, *eager64.parameters()]
    oracle = _oracle(eager64, leaves64, eager64(x64))
    fused32 = _float32_copy(eager64)
    fused32.eager = False
    x32 = x64.detach().float().requires_grad_(True)
    leaves32 = [x32, *fused32.parameters()]
    s = x32 @ fused32.wq.t() @ (x32 @ fused32.wk.t()).t() * fused32.scale
    p = torch.softmax(s.masked_fill(~fused32.mask, -INF), -1)
    assert p[0, 0] == 1.0 and p[0, 2] == 0.0  # 1 - p and p cut in float32
    for name in ORACLE_NAMES:
        got = _run(fused32, leaves32, lambda: fused32(x32), name, extensions=extensions)
        for leaf_no, value in enumerate(got):
            where = f"{name} leaf {leaf_no}"
            assert_log_space_match(name, oracle[name][leaf_no], value, where, FLOAT32_TOLERANCE)


def test_recorded_softmax_matches_the_float64_oracle() -> None:
    """A plain softmax inside extend: its input is recorded and its weights come from it. Rows
    with gaps of 18.5 to 25 under the top: 1 - p_top is 0 in float32 (the old diagonal weight
    p (1 - p) with it), but no probability underflows (``p @ w`` uses the forward value of p
    as the weight of its w edges, which the float32 model does compute as 0 below e^-103)."""
    g = torch.Generator().manual_seed(8)
    scores = [(0.0, -20.0, -25.0, -18.5), (-1.0, 0.0, -3.0, -2.0), (3.0, -19.0, -22.0, -20.0)]
    x64 = torch.tensor(scores, dtype=F64).requires_grad_(True)
    w64 = torch.randn(4, 3, generator=g, dtype=F64, requires_grad=True)
    out_w = torch.randn(3, 3, generator=g, dtype=F64)

    def loss(x, w):
        return (torch.tanh(2 * (torch.softmax(x * 1, -1) @ w)) * out_w.to(x.dtype)).sum()

    oracle = _oracle(None, [x64, w64], loss(x64, w64))
    x32 = x64.detach().float().requires_grad_(True)
    w32 = w64.detach().float().requires_grad_(True)
    p = torch.softmax(x32.detach(), -1)
    old = aten._softmax_backward_data(torch.eye(4)[0].expand(3, 4), p, -1, F32)
    assert old[0, 0] == 0 and old[2, 0] == 0  # d p_0 / d x_0 = p_0 (1 - p_0) cut in float32
    for name in ORACLE_NAMES:
        for t in (x32, w32):
            t.grad = None
        with semipack.extend(None, _semipack(name)):
            loss(x32, w32).backward()
        for leaf_no, leaf in enumerate((x32, w32)):
            where = f"{name} leaf {leaf_no}"
            want = oracle[name][leaf_no]
            assert_log_space_match(name, want, leaf.semiring_grad, where, FLOAT32_TOLERANCE)


# ================================================================================================
# Fully masked attention rows
# ================================================================================================
def _masked_eager(q, k, v, mask: Tensor, scale: float) -> Tensor:
    """The reference decomposition with P = where(all masked, 0, softmax(S)); the softmax of a
    fully masked row runs on zeros (not on -inf: its NaN would poison the oracle's Jacobians)
    and is not used."""
    s = q @ k.transpose(-1, -2) * scale
    s = s.masked_fill(~mask, -INF) if mask.dtype == torch.bool else s + mask
    dead = (s == -INF).all(-1, keepdim=True)
    p = torch.where(dead, 0.0, torch.softmax(torch.where(dead, 0.0, s), -1))
    return p @ v


def _masks() -> dict[str, Tensor]:
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    padding = torch.tensor([False, True, True, True])  # key 0 is padding
    bool_mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    bool_mask[0, 0, 2] = False  # batch 0: query 2 sees nothing
    additive = torch.zeros(2, 1, 4, 4, dtype=F64)
    additive[1, 0, 0] = -INF  # batch 1: query 0 sees nothing
    additive[1, 0, 3, 1] = -INF
    return {
        "bool": bool_mask,
        "additive": additive,
        "causal_padding": (causal & padding)[None, None].expand(2, 1, 4, 4),  # query 0: none
    }


@pytest.mark.parametrize("mask_kind", list(_masks()))
@pytest.mark.parametrize("extensions", [True, False], ids=["extension", "generic"])
def test_fully_masked_rows_carry_no_path(mask_kind: str, extensions: bool) -> None:
    g = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(2, 1, 4, 3, generator=g, dtype=F64, requires_grad=True) for _ in range(3)
    )
    weights = torch.randn(2, 1, 4, 3, generator=g, dtype=F64)
    mask = _masks()[mask_kind]
    scale = 0.7
    fused = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    eager = _masked_eager(q, k, v, mask, scale)
    torch.testing.assert_close(fused, eager)  # PyTorch returns 0 on those rows too
    graph = build_graph((eager * weights).sum())
    for name in SEMIRINGS:
        sr = SEMIRINGS[name]()
        if extensions:
            for t in (q, k, v):
                t.grad = None
            with semipack.extend(None, sr):
                (
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale) * weights
                ).sum().backward()
            got = [t.semiring_grad for t in (q, k, v)]
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            got = semipack.grad((out * weights).sum(), [q, k, v], sr)
        want = oracle_readouts(graph, [q, k, v], name)
        for leaf, (expected, actual) in enumerate(zip(want, got, strict=True)):
            assert_readout_matches(name, expected, actual, f"{mask_kind} leaf {leaf}")
    # Real against autograd on the fused op, and the dead query rows exactly without a path
    auto = torch.autograd.grad((fused * weights).sum(), [q, k, v])
    real = semipack.grad(
        (F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale) * weights).sum(),
        [q, k, v],
        semipack.Real(),
    )
    for a, b in zip(auto, real, strict=True):
        torch.testing.assert_close(b, a)
    dead = (mask if mask.dtype == torch.bool else mask > -INF).logical_not().all(-1)  # [2, 1, 4]
    (max_q,) = semipack.grad(
        (F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale) * weights).sum(),
        [q],
        semipack.MaxProd(),
    )
    assert torch.equal(max_q[dead], torch.zeros_like(max_q[dead]))
    visible = (mask if mask.dtype == torch.bool else mask > -INF).sum(-1)
    assert (max_q[visible >= 2] > 0).all()  # a single visible key: P = 1, no path to S either


def test_a_fully_masked_softmax_row_has_no_path() -> None:
    """The generic rule on a softmax whose input row is all -inf (recorded inside extend): no
    edges for the log-space semirings; Real keeps autograd's NaN there."""
    x = torch.tensor([[1.0, -INF, 2.0], [-INF, -INF, -INF]], dtype=F64, requires_grad=True)
    w = torch.tensor([[0.5, 2.0, -1.0], [1.0, 1.0, 1.0]], dtype=F64)

    def loss(t):
        p = torch.softmax(t * 1, -1)
        return (torch.where(torch.isnan(p), 0.0, p) * w).sum()

    with semipack.extend(None, semipack.LogSum()):
        loss(x).backward()
    assert torch.equal(x.semiring_grad[1], torch.full((3,), -INF, dtype=F64))
    assert x.semiring_grad[0, 1] == -INF and torch.isfinite(x.semiring_grad[0, [0, 2]]).all()
    with semipack.extend(None, semipack.Real()):
        loss(x).backward()
    (auto,) = torch.autograd.grad(loss(x), x)
    torch.testing.assert_close(x.semiring_grad, auto, equal_nan=True)
    assert torch.isnan(auto[1]).all()


# ================================================================================================
# NaN honesty
# ================================================================================================
def test_signed_max_prod_propagates_a_nan_derivative() -> None:
    x = torch.tensor([1.0, float("nan")], requires_grad=True)
    (signed,) = semipack.grad((x * x).sum(), x, semipack.SignedMaxProd())
    (best,) = semipack.grad((x * x).sum(), x, semipack.MaxProd())
    assert signed.largest[0] == 1.0 and signed.smallest[0] == 1.0 and best[0] == 1.0
    assert math.isnan(signed.largest[1]) and math.isnan(signed.smallest[1]) and math.isnan(best[1])
    (logs,) = semipack.grad((x * x).sum(), x, semipack.SignedMaxProd(log=True))
    assert all(math.isnan(t[1]) for t in (*logs.largest, *logs.smallest))


@pytest.mark.parametrize("path", ["eager", "compiled", "native"])
def test_nan_weights_propagate_through_max_plus_products(path: str, monkeypatch) -> None:
    """A NaN entry of W makes its whole output column NaN in MaxProd and SignedMaxProd (every
    max-plus kernel propagates it or is routed around)."""
    from semipack.kernels import native

    if path == "native" and not native.native_available():
        pytest.skip("no native kernel here")
    set_compile(path == "compiled")
    monkeypatch.setattr(tropical, "COMPILE_MIN_PAIRS", 0 if path == "compiled" else 1 << 62)
    monkeypatch.setattr(tropical, "NATIVE_MIN_PAIRS", 0 if path == "native" else 1 << 62)
    try:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(8, 16, generator=g, requires_grad=True)
        w = torch.randn(16, 8, generator=g)
        w[3, 5] = float("nan")
        for sr in (semipack.MaxProd(), semipack.SignedMaxProd()):
            (got,) = semipack.grad((x @ w).sum(), x, sr)
            values = got if isinstance(sr, semipack.MaxProd) else got.largest
            assert torch.isnan(values[:, 3]).all() and not torch.isnan(values[:, :3]).any()
    finally:
        set_compile(True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(SIGN_CHANGING))
def test_sign_changing_log_derivatives_on_cuda(name: str) -> None:
    """The compiled kernels on the GPU (triton) against the same references."""
    spec, ref, root = SIGN_CHANGING[name]
    x = _grid((root,))
    log, sign = logd.sign_changing_log_derivative(spec, x.cuda(), True)
    assert_log_derivative(log.cpu(), sign.cpu(), x, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_saturated_tanh_and_masked_attention_on_cuda() -> None:
    """Recorded inputs and fully masked attention rows on the GPU: the CPU's values."""
    x = torch.tensor([20.0, -15.0, 0.5])
    values = [_log_value(torch.tanh, x.to(device), inside=True).cpu() for device in ("cpu", "cuda")]
    torch.testing.assert_close(values[1], values[0])
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 1, 4, 3, generator=g) for _ in range(3))
    mask = _masks()["bool"]
    got = []
    for device in ("cpu", "cuda"):
        leaves = [t.to(device).requires_grad_(True) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask.to(device))
        got.append([t.cpu() for t in semipack.grad(out.sum(), leaves, semipack.LogSum())])
    for a, b in zip(*got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
