"""Entropy's and LogSum's native elementwise loops and per-channel affine sums
(``native/log_space.c``, ``kernels/log_space_native.py``, ``affine_params.*_native``) against
float64 references computed from the definitions, with NaN and infinities where the compiled
forms (evaluated eagerly: they are torch expressions) put them, the arithmetic ones bit for bit
with their eager forms, and nothing compiled on the way."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import needs_native
from torch import nn

import semipack
from semipack.kernels import affine_params, log_space_native, logspace, native, normalization
from semipack.kernels.compiled import set_compile
from semipack.messages import shared_shift
from semipack.semirings import entropy

pytestmark = needs_native

SPECIALS = [
    float("nan"),
    float("inf"),
    float("-inf"),
    0.0,
    -0.0,
    1e-45,  # the smallest subnormal
    3e-39,
    1.0,
    -1.0,
    2.0,
    3e38,
    -3e38,
    90.0,
    -90.0,
    -104.5,
]
SIZES = [1, 7, 8, 9, 4097, 70001]


def _values(n: int, seed: int, low: float = -20.0, high: float = 20.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.empty(n, dtype=torch.float64).uniform_(low, high, generator=gen).float()
    k = min(n, len(SPECIALS))
    picked = torch.randperm(len(SPECIALS), generator=gen)[:k]
    x[:k] = torch.tensor(SPECIALS)[picked]
    return x[torch.randperm(n, generator=gen)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _same_specials(got: torch.Tensor, want: torch.Tensor) -> None:
    for kind in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(kind(got), kind(want)), kind.__name__


def _close(got: torch.Tensor, exact: torch.Tensor, ulps: float = 4.0) -> None:
    """Finite entries within ``ulps`` float32 ulps of max(1, |exact|)... of the exact value:
    the loops' exp and log are within one ulp, and each result adds a few roundings."""
    finite = torch.isfinite(exact) & torch.isfinite(got.double())
    scale = exact.abs().clamp(min=1.0)
    error = (got.double() - exact).abs() / scale
    assert bool((error[finite] <= ulps * 2.0**-23).all()), float(error[finite].max())


@pytest.mark.parametrize("n", SIZES)
def test_abs_xlogx_against_float64(n: int) -> None:
    w = _values(n, 1)
    mag, out = log_space_native.abs_xlogx(w)
    assert torch.equal(_bits(mag), _bits(w.abs()))
    exact = w.double().abs()
    exact = torch.where(exact > 0, exact * exact.log(), 0.0)
    exact = torch.where(torch.isnan(exact), 0.0, exact)  # 0 at NaN, as the fused form
    _same_specials(out, exact.float())  # 3e38 log 3e38 overflows float32
    _close(out, exact)
    zero = w == 0
    assert bool((out[zero] == 0).all()) and not bool(torch.signbit(out[zero]).any())
    assert bool((out[torch.isnan(w)] == 0).all())
    # the negated form: -xlogx, -0.0 at zeros (torch.neg), and |w| written too
    mag2, neg = torch.empty_like(w), torch.empty_like(w)
    assert log_space_native.abs_neg_xlogx(w, mag2, neg) is None
    assert torch.equal(_bits(mag2), _bits(mag)) and torch.equal(_bits(neg), _bits(-out))
    assert bool(torch.signbit(neg[zero]).all())


@pytest.mark.parametrize("n", SIZES)
def test_xlogx_of_magnitudes_has_the_bits_of_abs_xlogx(n: int) -> None:
    """``xlogx`` of magnitudes and ``abs_xlogx`` of any values are one loop: the same bits for
    ``|w|``; a negative entry (no magnitude) gives 0, as the fused form's ``mag > 0`` does."""
    w = _values(n, 17)
    _, want = log_space_native.abs_xlogx(w)
    assert torch.equal(_bits(log_space_native.xlogx(w.abs())), _bits(want))
    got = log_space_native.xlogx(w)
    assert bool((got[w < 0] == 0).all())
    fused = logspace._xlogx_fused(w)
    _same_specials(got, fused)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("per_entry", [False, True])
def test_entropy_mean_is_the_eager_forms_bits(n: int, per_entry: bool) -> None:
    total = _values(n, 2).abs()
    total[: min(n, 3)] = torch.tensor([0.0, -0.0, float("nan")])[: min(n, 3)]
    weighted = _values(n, 3)
    less = _values(n, 4) if per_entry else torch.tensor(0.75)
    want = entropy._mean_eager(total, weighted.clone(), less)
    got = weighted.clone()
    assert log_space_native.entropy_mean(total, got, less) is got
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("n", SIZES)
def test_entropy_readouts_are_the_eager_forms_bits(n: int) -> None:
    log_z, mean = _values(n, 5), _values(n, 6)
    want = entropy._readout_eager(log_z, mean)
    got = log_space_native.entropy_readout(log_z, mean)
    assert torch.equal(_bits(got), _bits(want))
    out = torch.empty_like(log_z)
    assert log_space_native.entropy_readout_into(log_z, mean, out) is out
    assert torch.equal(_bits(out), _bits(want))


def _log_add_exp64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.logaddexp(a.double(), b.double())


@pytest.mark.parametrize("n", SIZES)
def test_log_add_exp_against_float64(n: int) -> None:
    a, b = _values(n, 7), _values(n, 8)
    b[: min(n, 4)] = a[: min(n, 4)]  # equal pairs: big + log 2
    got = log_space_native.log_add_exp(a, b)
    _same_specials(got, logspace.fused_log_add_exp(a, b))  # the fused form's specials
    _close(got, _log_add_exp64(a, b))


@pytest.mark.parametrize("n", SIZES)
def test_entropy_plus_against_float64(n: int) -> None:
    log_a, log_b = _values(n, 9), _values(n, 10)
    r_a, r_b = _values(n, 11, 0.0, 30.0), _values(n, 12, 0.0, 30.0)
    log_z, r = log_space_native.entropy_plus(log_a, r_a, log_b, r_b)
    fused = entropy._plus_fused(log_a, r_a, log_b, r_b)
    _same_specials(log_z, fused[0])
    _same_specials(r, fused[1])
    exact_z = _log_add_exp64(log_a, log_b)
    _close(log_z, exact_z)
    safe = torch.nan_to_num(exact_z, nan=0.0, posinf=0.0, neginf=0.0)
    share_a, share_b = (log_a.double() - safe).exp(), (log_b.double() - safe).exp()
    exact_r = share_a * r_a.double() + share_b * r_b.double()
    # each share is exp(log - log Z) with log Z rounded to float32: an error of a few ulps of
    # |log Z| in the exponent (the fused form's too), relative to the terms
    finite = torch.isfinite(exact_r) & torch.isfinite(r.double())
    terms = (share_a * r_a.double()).abs() + (share_b * r_b.double()).abs()
    bound = 4 * 2.0**-23 * terms * (1.0 + safe.abs()) + 1e-38
    assert bool(((r.double() - exact_r).abs() <= bound)[finite].all())


@pytest.mark.parametrize("n", SIZES)
def test_nonzero_magnitude_min_is_torchs(n: int) -> None:
    x = _values(n, 13)
    for case in (x, torch.nan_to_num(x, nan=1.0), torch.zeros(n), -torch.zeros(n)):
        got = log_space_native.nonzero_magnitude_min(case)
        want = shared_shift._nonzero_magnitude_min(case)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want) or (bool(got.isnan()) and bool(want.isnan()))


def test_forms_decline_what_they_do_not_take() -> None:
    x = _values(64, 14)
    assert log_space_native.abs_xlogx(x.double()) is NotImplemented
    strided = torch.stack([x, x], 1)[:, 0]  # every other entry: not one block
    assert log_space_native.abs_xlogx(strided) is NotImplemented
    square = x.reshape(8, 8)
    assert log_space_native.log_add_exp(square, square.t()) is NotImplemented  # two layouts
    # one layout, transposed alike: the loops run over memory, results keep the layout
    a, b = square.t(), square.flip(0).contiguous().t()
    got = log_space_native.log_add_exp(a, b)
    assert got is not NotImplemented and got.stride() == a.stride()
    want = log_space_native.log_add_exp(a.contiguous(), b.contiguous())
    assert torch.equal(_bits(got.contiguous()), _bits(want))
    one64 = torch.tensor(1.0, dtype=torch.float64)
    assert log_space_native.entropy_mean(x, x.clone(), one64) is NotImplemented
    native.set_native(False)
    try:
        assert log_space_native.abs_xlogx(x) is NotImplemented
    finally:
        native.set_native(True)


def test_the_kernels_compile_nothing_on_float32_host_tensors(monkeypatch) -> None:
    """Every kernel with a native form runs it (large float32 CPU arguments): torch.compile is
    never called; on float64 the compiled form still runs (here forced eager, same values)."""

    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile called")

    monkeypatch.setattr(torch, "compile", refuse)
    n = 1 << 16
    x, y = _values(n, 15), _values(n, 16)
    for got, want in zip(logspace._abs_xlogx(x), log_space_native.abs_xlogx(x), strict=True):
        assert torch.equal(_bits(got), _bits(want))
    logspace._abs_neg_xlogx(x, torch.empty_like(x), torch.empty_like(x))
    logspace.log_add_exp(x, y)
    entropy._entropy_plus(x, y.abs(), y, x.abs())
    entropy._entropy_readout(x, y)
    entropy._entropy_readout_into(x, y, torch.empty_like(x))
    entropy._mean_kernel(y.abs(), x.clone(), torch.tensor(0.0))
    shared_shift._nonzero_magnitude_min_fused(x)
    set_compile(False)
    try:  # float64: no native form, the (eager) fallback
        got = logspace.log_add_exp(x.double(), y.double())
        want = torch.logaddexp(x.double(), y.double())
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    finally:
        set_compile(True)


# --- per-channel affine sums --------------------------------------------------------------------
def _affine_case(seed: int, outer: int = 2, channels: int = 6, inner: int = 3001):
    gen = torch.Generator().manual_seed(seed)
    shape = (outer, channels, inner)
    m = torch.randn(shape, generator=gen) * 4.0
    r = torch.rand(shape, generator=gen) * 10.0
    x = torch.randn(shape, generator=gen)
    mean = torch.randn((1, channels, 1), generator=gen) * 0.1
    invstd = torch.rand((1, channels, 1), generator=gen) + 0.5
    return m, r, x, mean, invstd


def _affine64(m, r, x, mean, invstd):
    """The definitions in float64, straight from the sums (no shift needed there)."""
    m, x = m.double(), x.double()
    mag = ((x - mean.double()) * invstd.double()).abs()
    e = m.exp()
    dims = (0, 2)
    gain_mass, bias_mass = (e * mag).sum(dims), e.sum(dims)
    out = {"gain": gain_mass.log(), "bias": bias_mass.log()}
    if r is not None:
        r = r.double()
        terms = torch.where(mag > 0, e * mag * (r - mag.log()), 0.0)
        out["gain_mean"] = terms.sum(dims) / gain_mass
        out["bias_mean"] = (e * r).sum(dims) / bias_mass
    return out


@pytest.mark.parametrize("with_r", [False, True])
def test_affine_sums_against_float64(with_r: bool) -> None:
    m, r, x, mean, invstd = _affine_case(20)
    m[:, 1] = float("-inf")  # a channel without a path: bias -inf, mean 0, nothing to redo
    if with_r:
        gain, bias, redo = affine_params.entropy_native(m, r, x, mean, invstd)
    else:
        gain, bias, redo = affine_params.log_sum_native(m, x, mean, invstd)
    exact = _affine64(m, r if with_r else None, x, mean, invstd)
    assert not bool(redo.any())
    keep = torch.arange(6) != 1
    assert bool(torch.isneginf(gain[0][1])) and bool(torch.isneginf(bias[0][1]))
    _close(gain[0][keep], exact["gain"][keep], ulps=8)
    _close(bias[0][keep], exact["bias"][keep], ulps=8)
    if with_r:
        assert gain[1][1] == 0 and bias[1][1] == 0
        _close(gain[1][keep], exact["gain_mean"][keep], ulps=64)
        _close(bias[1][keep], exact["bias_mean"][keep], ulps=64)


def test_affine_sums_flag_the_channels_the_fused_form_flags() -> None:
    m, r, x, mean, invstd = _affine_case(21)
    m[0, 0, 5] = float("nan")  # a NaN message
    m[1, 2, 7] = float("inf")  # a +inf message
    x[0, 3, 9] = float("inf")  # a non-finite x̂
    x[:, 4] = mean[0, 4, 0]  # x̂ = 0 everywhere but one tiny entry under a large message:
    x[0, 4, 0] = mean[0, 4, 0] + 1e-30  # the gain's shifted sum underflows
    m[0, 4, 0] = -30.0
    _, _, want = affine_params.entropy(m, r, x, mean, invstd)
    _, _, got = affine_params.entropy_native(m, r, x, mean, invstd)
    assert want.tolist() == [True, False, True, True, True, False]
    assert torch.equal(got, want)
    _, _, got = affine_params.log_sum_native(m, x, mean, invstd)
    _, _, want = affine_params.log_sum(m, x, mean, invstd)
    assert torch.equal(got, want)


@pytest.mark.parametrize("inner", [3001, 3000])
def test_affine_sums_ignore_the_lanes_past_a_row(inner: int) -> None:
    """A channel whose x̂ is 0 everywhere (x = mean = 1e24, invstd 1e15: |0 - mean| invstd
    overflows in the lanes past a row of 3001 entries, which hold no entry) has no gain path:
    a gain sum of 0, log -inf, not NaN (trial 108: NaN reached ``semiring_grad``)."""
    m, r, x, mean, invstd = _affine_case(23, inner=inner)
    mean[0, 1, 0], invstd[0, 1, 0] = 1e24, 1e15
    x[:, 1] = 1e24
    for native_form, fused, args in (
        (affine_params.log_sum_native, affine_params.log_sum, (m, x, mean, invstd)),
        (affine_params.entropy_native, affine_params.entropy, (m, r, x, mean, invstd)),
    ):
        gain, bias, redo = native_form(*args)
        assert bool(torch.isneginf(gain[0][1])), native_form.__name__
        assert bool(torch.isfinite(bias[0][1]))
        # no gain path under a bias path: flagged for the generic ops, as the fused form does
        assert torch.equal(redo, fused(*args)[2]) and bool(redo[1])


def test_affine_native_forms_take_only_what_the_compiled_form_would() -> None:
    m, r, x, mean, invstd = _affine_case(22, inner=100)  # 1200 entries: the generic ops
    assert affine_params.log_sum_native(m, x, mean, invstd) is None
    m, r, x, mean, invstd = _affine_case(22, outer=4000, inner=4)  # inner dim under 8
    assert affine_params.entropy_native(m, r, x, mean, invstd) is None
    m, r, x, mean, invstd = _affine_case(22)
    assert affine_params.log_sum_native(m.double(), x.double(), mean, invstd) is None


@pytest.mark.parametrize("semiring", [semipack.LogSum(), semipack.Entropy()])
def test_a_batch_norm_model_gets_the_generic_values(semiring) -> None:
    """A batch norm of 36864 entries (the native sums) against the same backward with the
    native library off and compiling off (the generic ops)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()).eval()
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 48, 48)

    def run() -> dict[str, torch.Tensor]:
        model.zero_grad()
        with semipack.extend(model, semiring):
            model(x).square().sum().backward()
        return {n: p.semiring_grad.clone() for n, p in model.named_parameters()}

    fast = run()
    native.set_native(False)
    set_compile(False)
    try:
        slow = run()
    finally:
        native.set_native(True)
        set_compile(True)
    for name in fast:
        torch.testing.assert_close(fast[name], slow[name], rtol=2e-5, atol=2e-5 * math.e)


# --- a normalisation's row readouts ---------------------------------------------------------------
def _rows_case(seed: int, rows: int = 37, n: int = 203):
    gen = torch.Generator().manual_seed(seed)
    x_hat = torch.randn(rows, n, generator=gen) * 2.0
    x_hat[0, :5] = torch.tensor([0.0, -0.0, 30.0, -1.0, 1.0])
    log_z = torch.randn(rows, n, generator=gen) * 20.0
    log_z[1] = float("-inf")  # a row without a path
    log_z[2, 3] = float("nan")
    log_z[3, :7] = float("-inf")
    a, shift = normalization._entropy_rows_eager(log_z, torch.zeros_like(log_z))[:2]
    total = torch.rand(rows, n, generator=gen) * n
    total[4, :3] = torch.tensor([0.0, float("nan"), float("inf")])
    return log_z, a, shift, x_hat, total


@pytest.mark.parametrize("kind", ["max_prod", "log_sum"])
def test_norm_readouts_against_their_eager_forms(kind: str) -> None:
    _, a, shift, x_hat, total = _rows_case(30)
    eager = getattr(normalization, f"_{kind}_from_{'best' if kind == 'max_prod' else 'total'}")
    native_form = getattr(
        log_space_native, f"{kind}_from_{'best' if kind == 'max_prod' else 'total'}"
    )
    (want,) = eager(a, shift, x_hat, total)
    (got,) = native_form(a, shift, x_hat, total)
    _same_specials(got, want)
    _close(got, want.double(), ulps=4)  # the same ops; the log within an ulp of torch's


def test_entropy_rows_are_the_eager_forms_bits() -> None:
    log_z, *_ = _rows_case(31)
    surprisal = torch.randn(log_z.shape, generator=torch.Generator().manual_seed(5))
    want = normalization._entropy_rows_eager(log_z, surprisal)
    got = log_space_native.entropy_rows(log_z, surprisal)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert torch.equal(_bits(g), _bits(w))


def test_entropy_readout_of_sums_against_its_eager_form() -> None:
    _, a, shift, x_hat, total = _rows_case(32)
    gen = torch.Generator().manual_seed(6)
    r = torch.where(a > 0, torch.rand(a.shape, generator=gen) * 10, 0.0)
    s_c = total
    t_c = s_c * torch.rand(a.shape, generator=gen) * 10
    u_c = s_c * torch.randn(a.shape, generator=gen)
    log_n = torch.tensor(math.log(a.shape[1]), dtype=torch.float32)
    want = normalization._entropy_readout_of_sums_eager(a, r, shift, x_hat, s_c, t_c, u_c, log_n)
    got = log_space_native.entropy_readout_of_sums(a, r, shift, x_hat, s_c, t_c, u_c, log_n)
    for g, w in zip(got, want, strict=True):
        _same_specials(g, w)
        finite = torch.isfinite(g) & torch.isfinite(w)
        scale = w.abs().clamp(min=1.0)
        assert bool(((g - w).abs() / scale <= 1e-5)[finite].all())
    assert torch.equal(got[1] == 0, want[1] == 0)


def test_row_readouts_decline_other_layouts() -> None:
    _, a, shift, x_hat, total = _rows_case(33)
    assert log_space_native.log_sum_from_total(a.t(), shift, x_hat.t(), total.t()) is (
        NotImplemented
    )
    assert log_space_native.max_prod_from_best(a.double(), shift, x_hat, total) is NotImplemented
    assert log_space_native.entropy_rows(a[:, :0], a[:, :0]) is NotImplemented


def test_a_train_mode_batch_norm_compiles_nothing(monkeypatch) -> None:
    """Trial 108: a train-mode batch norm's row kernels compiled on a first LogSum or Entropy
    backward; with their native forms nothing does (64 x 64 images: 8192 entries per channel
    row, the sums' native kernels and these readouts)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()).train()
    x = torch.randn(2, 3, 64, 64)

    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile called")

    monkeypatch.setattr(torch, "compile", refuse)
    for semiring in (semipack.MaxProd(), semipack.LogSum(), semipack.Entropy()):
        model.zero_grad()
        with semipack.extend(model, semiring):
            model(x).square().sum().backward()
        assert all(torch.isfinite(p.semiring_grad).all() for p in model.parameters())
