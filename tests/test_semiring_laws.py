"""Each built-in semiring obeys the semiring laws, and its fast kernels equal the generic ones.

States are produced by lifting random edge weights (with exact zeros mixed in) and combining
them, so they cover "no path" entries and both signs.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import all_semirings
from hypothesis import given, settings
from hypothesis import strategies as st

import semipack
from semipack.semirings.base import Semiring, State, blocked_matmul

# hypothesis draws many examples per test call, so the semiring is a parameter, not the fixture
SEMIRINGS = [*all_semirings(), semipack.KBest(3)]  # KBest: not in helpers (k-wide readout)
IDS = [s.name for s in SEMIRINGS]


def random_weights(seed: int, shape: tuple[int, ...], zero_fraction: float = 0.3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g, dtype=torch.float64) * 2
    w[torch.rand(shape, generator=g) < zero_fraction] = 0.0
    return w


def random_state(sr: Semiring, seed: int, shape: tuple[int, ...]) -> State:
    """A valid state: the plus of two lifted products, so it can hold several paths."""
    a = sr.times(sr.lift(random_weights(seed, shape)), sr.lift(random_weights(seed + 1, shape)))
    b = sr.lift(random_weights(seed + 2, shape))
    return sr.plus(a, b)


def assert_same(sr: Semiring, a: State, b: State) -> None:
    """States are equal where they matter: Entropy's mean is free where its mass is zero."""
    if isinstance(sr, semipack.Entropy):
        assert torch.equal(a[0] == -math.inf, b[0] == -math.inf)
        live = a[0] > -math.inf
        torch.testing.assert_close(a[0][live], b[0][live], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(a[1][live], b[1][live], rtol=1e-9, atol=1e-9)
        return
    for x, y in zip(a, b, strict=True):
        if x.dtype == torch.bool:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-9, equal_nan=False)


seeds = st.integers(min_value=0, max_value=10_000)


@pytest.mark.parametrize("sr", SEMIRINGS, ids=IDS)
@settings(max_examples=25, deadline=None)
@given(seed=seeds)
def test_identities_and_annihilation(sr: Semiring, seed: int) -> None:
    a = random_state(sr, seed, (4, 5))
    zero = sr.zeros((4, 5), torch.float64, "cpu")
    one = sr.ones((4, 5), torch.float64, "cpu")
    assert_same(sr, sr.plus(a, zero), a)
    assert_same(sr, sr.plus(zero, a), a)
    assert_same(sr, sr.times(a, one), a)
    assert_same(sr, sr.times(one, a), a)
    assert sr.is_zero(sr.times(a, zero)).all()
    assert sr.is_zero(sr.lift(torch.zeros(3, dtype=torch.float64))).all()


@pytest.mark.parametrize("sr", SEMIRINGS, ids=IDS)
@settings(max_examples=25, deadline=None)
@given(seed=seeds)
def test_commutativity_associativity_distributivity(sr: Semiring, seed: int) -> None:
    a, b, c = (random_state(sr, seed + 10 * i, (3, 4)) for i in range(3))
    assert_same(sr, sr.plus(a, b), sr.plus(b, a))
    assert_same(sr, sr.plus(sr.plus(a, b), c), sr.plus(a, sr.plus(b, c)))
    assert_same(sr, sr.times(sr.times(a, b), c), sr.times(a, sr.times(b, c)))
    assert_same(sr, sr.times(a, sr.plus(b, c)), sr.plus(sr.times(a, b), sr.times(a, c)))


@pytest.mark.parametrize("sr", SEMIRINGS, ids=IDS)
@settings(max_examples=20, deadline=None)
@given(seed=seeds)
def test_sum_is_repeated_plus(sr: Semiring, seed: int) -> None:
    a = random_state(sr, seed, (3, 4, 5))
    folded = tuple(c[:, 0] for c in a)
    for j in range(1, 4):
        folded = sr.plus(folded, tuple(c[:, j] for c in a))
    assert_same(sr, sr.sum(a, [1]), folded)
    kept = sr.sum(a, [1], keepdim=True)
    assert kept[0].shape == (3, 1, 5)
    # a sum over no dim is the state itself, for every semiring (torch's reductions differ)
    assert_same(sr, sr.sum(a, []), a)
    assert all(s is not c for s, c in zip(sr.sum(a, []), a, strict=True))


@pytest.mark.parametrize("sr", SEMIRINGS, ids=IDS)
@settings(max_examples=20, deadline=None)
@given(seed=seeds)
def test_scale_is_times_lift(sr: Semiring, seed: int) -> None:
    a = random_state(sr, seed, (4, 6))
    w = random_weights(seed + 99, (4, 6))
    assert_same(sr, sr.scale(a, w), sr.times(a, sr.lift(w)))


@pytest.mark.parametrize("sr", SEMIRINGS, ids=IDS)
@settings(max_examples=20, deadline=None)
@given(seed=seeds, n=st.integers(1, 5), k=st.integers(1, 6), m=st.integers(1, 5))
def test_matmul_kernel_matches_broadcast_definition(
    sr: Semiring, seed: int, n: int, k: int, m: int
) -> None:
    a = random_state(sr, seed, (2, n, k))
    w = random_weights(seed + 7, (2, k, m), zero_fraction=0.4)
    # the generic definition: ⊕_k a[i, k] ⊗ lift(w[k, j]), one column at a time
    expected = []
    for j in range(m):
        col = sr.times(a, tuple(c[:, None, :, j] for c in sr.lift(w)))
        expected.append(sr.sum(col, [2]))
    expected = tuple(torch.stack(p, -1) for p in zip(*expected, strict=True))
    assert_same(sr, sr.matmul(a, w), expected)
    assert_same(sr, blocked_matmul(sr, a, w), expected)


@pytest.mark.parametrize("sr", SEMIRINGS, ids=IDS)
@settings(max_examples=20, deadline=None)
@given(seed=seeds, n=st.integers(1, 8), size=st.integers(1, 4))
def test_index_plus_kernel_matches_routing_definition(
    sr: Semiring, seed: int, n: int, size: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, size, (n,), generator=g)
    dest = random_state(sr, seed, (3, size))
    src = random_state(sr, seed + 5, (3, n))
    expected = Semiring.index_plus(sr, dest, 1, index, src)
    assert_same(sr, sr.index_plus(dest, 1, index, src), expected)
    # and by hand: fold every source column into its destination column
    manual = tuple(c.clone() for c in dest)
    for i, target in enumerate(index.tolist()):
        col = sr.plus(tuple(c[:, target] for c in manual), tuple(c[:, i] for c in src))
        for c, v in zip(manual, col, strict=True):
            c[:, target] = v
    assert_same(sr, sr.index_plus(dest, 1, index, src), manual)


def test_readouts_of_known_states() -> None:
    """Readouts of hand-built states: paths {+2, -3}, {+2}, {-3} and none."""
    sr = semipack.SignedMaxProd()
    both = sr.plus(sr.lift(torch.tensor([2.0])), sr.lift(torch.tensor([-3.0])))
    assert sr.readout(both).largest.item() == pytest.approx(2.0)
    assert sr.readout(both).smallest.item() == pytest.approx(-3.0)
    neg_only = sr.plus(sr.lift(torch.tensor([-3.0])), sr.lift(torch.tensor([-0.5])))
    assert sr.readout(neg_only).largest.item() == pytest.approx(-0.5)
    assert sr.readout(neg_only).smallest.item() == pytest.approx(-3.0)
    none = sr.zeros((1,), torch.float32, "cpu")
    assert sr.readout(none).largest.item() == 0.0 and sr.readout(none).smallest.item() == 0.0
    logged = semipack.SignedMaxProd(log=True).readout(both)
    assert logged.largest.sign.item() == 1.0
    assert logged.largest.log_abs.item() == pytest.approx(math.log(2.0))

    ent = semipack.Entropy()
    # two paths of weight 1 and 3: p = (1/4, 3/4)
    two = ent.plus(ent.lift(torch.tensor([1.0])), ent.lift(torch.tensor([3.0])))
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert ent.readout(two).item() == pytest.approx(h, rel=1e-6)
    assert math.isnan(ent.readout(ent.zeros((1,), torch.float32, "cpu")).item())

    mp = semipack.MaxProd()
    assert mp.readout(mp.lift(torch.tensor([-4.0]))).item() == pytest.approx(4.0)
    assert semipack.MaxProd(log=True).readout(mp.lift(torch.tensor([-4.0]))).item() == (
        pytest.approx(math.log(4.0))
    )
    ls = semipack.LogSum(log=False)
    assert ls.readout(
        ls.plus(ls.lift(torch.tensor([1.0])), ls.lift(torch.tensor([-3.0])))
    ).item() == (pytest.approx(4.0))


@pytest.mark.parametrize("sr", SEMIRINGS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("state_shape", "weight_shape"), [((4, 5), (4, 5)), ((1, 5), (4, 5)), ((4, 5), (1, 5))]
)
def test_scale_owned_is_bitwise_scale(sr, dtype, state_shape, weight_shape) -> None:
    """Writing the result into the edge weights' memory gives exactly ``scale``'s bits; where
    the weights cannot hold the result (broadcast), it falls back to ``scale``."""
    w = random_weights(7, weight_shape).to(dtype)
    a = tuple(
        c.to(dtype) if c.dtype == torch.float64 else c for c in random_state(sr, 3, state_shape)
    )
    expected = sr.scale(a, w)
    got = sr.scale_owned(a, w.clone())
    for x, y in zip(got, expected, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


def test_scale_owned_of_a_subclass_with_its_own_lift_uses_that_lift() -> None:
    """A fast path written for a built-in semiring must not bypass a subclass's primitives."""

    class SquaredMaxProd(semipack.MaxProd):
        def lift(self, w):
            return super().lift(w * w)

    sr = SquaredMaxProd()
    a = sr.lift(random_weights(1, (3, 4)))
    w = random_weights(2, (3, 4))
    torch.testing.assert_close(sr.scale_owned(a, w.clone())[0], sr.scale(a, w)[0], rtol=0, atol=0)


@pytest.mark.parametrize("sr", [semipack.MaxProd(), semipack.TopPath()], ids=["MaxProd", "TopPath"])
def test_matmul_on_lifted_weights_is_matmul(sr) -> None:
    assert sr.has_lifted_matmul()
    a = sr.lift(random_weights(4, (5, 6)).float())
    w = random_weights(5, (6, 3)).float()
    for x, y in zip(sr.matmul_lifted(a, sr.lift(w)), sr.matmul(a, w), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_semirings_without_a_lifted_matmul_say_so() -> None:
    class SquaredMaxProd(semipack.MaxProd):
        def lift(self, w):
            return super().lift(w * w)

    assert not SquaredMaxProd().has_lifted_matmul()
    assert not semipack.LogSum().has_lifted_matmul()
    with pytest.raises(NotImplementedError, match="LogSum has no matmul on lifted weights"):
        semipack.LogSum().matmul_lifted((torch.zeros(1, 1),), (torch.zeros(1, 1),))
