"""Shared-shift products (one exponentiation for both products of a bilinear op) against the
semirings' own per-product ``matmul`` and ``sum``, which shift along the reduced dimension."""

from __future__ import annotations

import pytest
import torch

import semipack
from semipack.extensions.linear import linear_messages
from semipack.kernels.shared_shift import SHARED_SHIFT_SPAN, global_shift, shared_shift_products
from semipack.semirings import Semiring

F64 = torch.float64
SUM_LIKE = [semipack.LogSum(), semipack.LogCount(), semipack.Entropy()]


def message(sr: Semiring, shape: tuple[int, ...], spread: float, seed: int):
    """A state whose log-normaliser spans ``spread`` nats, with some entries without a path."""
    gen = torch.Generator().manual_seed(seed)
    log_z = torch.rand(shape, generator=gen, dtype=F64) * spread
    log_z[..., 1, :2] = float("-inf")
    if isinstance(sr, semipack.Entropy):
        return (log_z, torch.randn(shape, generator=gen, dtype=F64))
    return (log_z,)


def weights(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen, dtype=F64)
    return torch.where(torch.rand(shape, generator=gen, dtype=F64) < 0.2, 0.0, w)


def assert_states_close(sr: Semiring, got, want) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    if isinstance(sr, semipack.Entropy):
        live = torch.isfinite(want[0])
        torch.testing.assert_close(got[1][live], want[1][live], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("sr", SUM_LIKE, ids=lambda s: s.name)
@pytest.mark.parametrize("batch", [(), (2, 3)])
def test_both_products_and_sum_match_the_semiring_ops(sr: Semiring, batch) -> None:
    m = message(sr, (*batch, 5, 7), spread=30.0, seed=1)
    right = weights(*batch, 7, 4, seed=2)
    left = weights(*batch, 5, 6, seed=3)
    by_right, by_left, total = shared_shift_products(sr, m, right, left, want_sum=True)
    assert_states_close(sr, by_right, sr.matmul(m, right))
    m_t = tuple(p.transpose(-1, -2) for p in m)
    assert_states_close(sr, by_left, sr.matmul(m_t, left))
    assert_states_close(sr, total, sr.sum(m, [m[0].dim() - 2]))


@pytest.mark.parametrize("sr", SUM_LIKE, ids=lambda s: s.name)
def test_wide_or_empty_messages_fall_back(sr: Semiring) -> None:
    wide = message(sr, (5, 7), spread=SHARED_SHIFT_SPAN + 5.0, seed=4)
    wide[0][0, 0], wide[0][0, 1] = 0.0, SHARED_SHIFT_SPAN + 1.0
    assert shared_shift_products(sr, wide, weights(7, 3, seed=5)) is None
    empty = (torch.full((5, 7), float("-inf"), dtype=F64), *wide[1:])
    assert global_shift(empty[0]) is None
    assert shared_shift_products(sr, empty, weights(7, 3, seed=5)) is None


def test_only_the_sum_like_log_semirings_take_it() -> None:
    m = (torch.zeros(3, 4, dtype=F64),)
    for sr in [semipack.Real(), semipack.MaxProd(), semipack.Boolean()]:
        assert shared_shift_products(sr, m, torch.ones(4, 2, dtype=F64)) is None

    class MyLogSum(semipack.LogSum):  # may change plus: no inherited fast path
        pass

    assert shared_shift_products(MyLogSum(), m, torch.ones(4, 2, dtype=F64)) is None


@pytest.mark.parametrize("sr", SUM_LIKE, ids=lambda s: s.name)
@pytest.mark.parametrize("spread", [10.0, 80.0])
def test_linear_messages_equal_per_product_shifts(sr: Semiring, spread: float) -> None:
    """Both sides of the span threshold give the per-product values."""
    m = message(sr, (6, 5), spread=spread, seed=6)
    x, w = weights(6, 4, seed=7), weights(5, 4, seed=8)
    m_x, m_w, m_b = linear_messages(sr, m, x, w, True, True, True)
    assert_states_close(sr, m_x, sr.matmul(m, w))
    assert_states_close(sr, m_w, sr.matmul(tuple(p.t() for p in m), x))
    assert_states_close(sr, m_b, sr.sum(m, [0]))
