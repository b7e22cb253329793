"""The native float32 exp and log of whole log-space tensors (``elementwise.c``), against
float64 torch as the exact reference: within one ulp, every special value as torch gives it,
subnormal results kept, the same bits whatever the thread count or a tensor's length."""

from __future__ import annotations

import pytest
import torch
from helpers import needs_native
from hypothesis import given, settings
from hypothesis import strategies as st

from semipack.kernels import native

pytestmark = needs_native

SPECIAL_EXPONENTS = [
    float("nan"),
    float("inf"),
    float("-inf"),
    0.0,
    -0.0,
    88.72,  # just below overflow
    88.73,  # overflows
    -87.33,  # the smallest normal result
    -103.28,  # the smallest subnormal
    -103.97,  # rounds to 0 or the smallest subnormal
    -104.5,  # rounds to 0
    1e-8,
    -1e-8,
]
SPECIAL_MAGNITUDES = [0.0, -0.0, float("inf"), float("nan"), 1e-45, 3e-39, 1.0, 2.0, 1.0000001]


def _ulp(rounded: torch.Tensor) -> torch.Tensor:
    """The float32 ulp of each entry (the subnormal step below the normal range), float64."""
    exponent = torch.frexp(rounded.float().abs())[1]
    one = torch.ones_like(rounded, dtype=torch.float64)
    return torch.ldexp(one, (exponent - 24).clamp(min=-149))


def _assert_within_one_ulp(got: torch.Tensor, exact: torch.Tensor) -> None:
    rounded = exact.float()
    for same in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(same(got), same(rounded))
    assert torch.equal(got == 0, rounded == 0)  # no path cut, none made up
    finite = torch.isfinite(rounded) & (rounded != 0)
    error = (got.double() - exact).abs() / _ulp(rounded)
    assert bool((error[finite] <= 1.0).all())


def _exponents(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    x = torch.empty(n, dtype=torch.float64).uniform_(-110.0, 92.0, generator=gen).float()
    x[: len(SPECIAL_EXPONENTS)] = torch.tensor(SPECIAL_EXPONENTS)
    return x


def test_exp_is_within_one_ulp_with_every_special_value() -> None:
    x = _exponents(1 << 20)
    got = native.exp_f32(x, torch.empty_like(x))
    _assert_within_one_ulp(got, x.double().exp())
    assert got[9] > 0 and got[10] == 0  # exp(-103.28) subnormal, exp(-104.5) rounds to 0


def test_exp_in_place_gives_the_same_bits() -> None:
    x = _exponents(50_001)
    want = native.exp_f32(x, torch.empty_like(x))
    assert native.exp_f32(x, x) is x
    assert torch.equal(x.nan_to_num(), want.nan_to_num())


def test_log_is_within_one_ulp_with_every_special_value() -> None:
    gen = torch.Generator().manual_seed(4)
    mag = torch.empty(1 << 20, dtype=torch.float64).uniform_(-104.0, 88.0, generator=gen)
    mag = mag.exp().float()
    mag[: len(SPECIAL_MAGNITUDES)] = torch.tensor(SPECIAL_MAGNITUDES)
    got = native.log_plus_f32(mag.clone()[None], None)[0]
    _assert_within_one_ulp(got, mag.double().log())
    assert got[0] == got[1] == float("-inf")  # log 0 and log -0: no path
    assert torch.isfinite(got[4:6]).all()  # subnormal magnitudes keep finite logs


@pytest.mark.parametrize("kind", ["scalar", "row", "full"])
def test_log_plus_adds_the_shift_to_the_log(kind) -> None:
    """The shift is one float addition after the log: the bits of the log alone plus it."""
    gen = torch.Generator().manual_seed(5)
    rows, cols = 37, 301  # neither a whole number of vectors nor of blocks
    mag = torch.randn(rows, cols, generator=gen).mul_(20).exp_()
    mag[:, ::7] = 0.0
    shift = {
        "scalar": torch.tensor([2.5]),
        "row": torch.randn(rows, 1, generator=gen) * 40,
        "full": torch.randn(rows, cols, generator=gen),
    }[kind]
    log = native.log_plus_f32(mag.clone(), None)
    got = native.log_plus_f32(mag.clone(), shift)
    want = log + shift
    assert torch.equal(got.isneginf(), mag == 0)
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_the_bits_do_not_depend_on_threads_or_length() -> None:
    """Every entry is computed alone: one thread or two, a tensor of any length (tails of
    fewer than 8 entries go through masked loads), each entry has the same bits."""
    x = _exponents(200_003)
    mag = x.exp()
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_exp = native.exp_f32(x, torch.empty_like(x))
        one_log = native.log_plus_f32(mag.clone()[None], None)[0]
        torch.set_num_threads(2)
        two_exp = native.exp_f32(x, torch.empty_like(x))
        two_log = native.log_plus_f32(mag.clone()[None], None)[0]
    finally:
        torch.set_num_threads(previous)
    for a, b in ((one_exp, two_exp), (one_log, two_log)):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    for length in [*range(0, 20), 4095, 4097, 8199]:
        for start in (0, 3):
            part = x[start : start + length].clone()
            got = native.exp_f32(part, torch.empty_like(part))
            assert torch.equal(got.nan_to_num(), one_exp[start : start + length].nan_to_num())
            logs = native.log_plus_f32(mag[start : start + length].clone()[None], None)[0]
            assert torch.equal(logs.nan_to_num(), one_log[start : start + length].nan_to_num())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1))
def test_exp_of_any_floats_is_within_one_ulp(values) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    _assert_within_one_ulp(native.exp_f32(x, torch.empty_like(x)), x.double().exp())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1))
def test_log_of_any_magnitudes_is_within_one_ulp(values) -> None:
    mag = torch.tensor(values, dtype=torch.float32).abs()  # magnitudes: -0.0 and NaN kept
    _assert_within_one_ulp(native.log_plus_f32(mag.clone()[None], None)[0], mag.double().log())
