"""Max-plus kernels: compiled == eager fallback == the broadcast-then-reduce definition.

The reference is the one-line broadcast ``(a[..., :, :, None] + b[..., None, :, :]).amax(-2)``,
so both code paths are checked against the definition, not against each other only. The
compiled path is forced by lowering ``COMPILE_MIN_PAIRS`` and a spy asserts it really ran.
Sizes stay small so the few compiled graphs (dtype x batch 1 / several) build quickly.
"""

from __future__ import annotations

import pytest
import torch

import semipack
from semipack.kernels import tropical
from semipack.kernels.compiled import compile_enabled, set_compile
from semipack.kernels.tropical import maxplus, maxplus_argmax
from semipack.semirings.base import Semiring, State, blocked_matmul

NEG_INF = float("-inf")
DTYPES = [torch.float32, torch.float64]

# (a shape, b shape): plain, batched, broadcast batches, k = 1, k = 2, odd sizes.
SHAPES = [
    ((5, 7), (7, 3)),
    ((1, 1), (1, 1)),
    ((9, 1), (1, 6)),
    ((6, 2), (2, 11)),
    ((3, 5, 7), (3, 7, 4)),
    ((2, 5, 7), (7, 9)),
    ((5, 7), (3, 7, 9)),
    ((2, 1, 5, 7), (1, 3, 7, 9)),
    ((2, 3, 5, 7), (3, 7, 9)),
    ((33, 40), (40, 70)),
    ((3, 17, 65), (3, 65, 30)),
]


# --- helpers -------------------------------------------------------------------------------------
def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a[..., :, :, None] + b[..., None, :, :]).amax(-2)


def reference_argmax(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    found = (a[..., :, :, None] + b[..., None, :, :]).max(-2)
    return found.values, found.indices


def log_operands(
    shape_a: tuple[int, ...], shape_b: tuple[int, ...], dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-magnitudes as the semirings make them: ``b = log|w|`` with 30% exact zeros (-inf),
    ``a`` with scattered -inf and its first row entirely -inf (an output row with no path)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(shape_a, generator=gen, dtype=torch.float64) * 3
    a[torch.rand(shape_a, generator=gen) < 0.2] = NEG_INF
    a[..., 0, :] = NEG_INF
    w = torch.randn(shape_b, generator=gen, dtype=torch.float64)
    w[torch.rand(shape_b, generator=gen) < 0.3] = 0.0
    return a.to(dtype), w.abs().log().to(dtype)


@pytest.fixture
def compile_on():
    """Compiled kernels on (whatever SEMIPACK_COMPILE says), restored afterwards."""
    before = compile_enabled()
    set_compile(True)
    yield
    set_compile(before)


@pytest.fixture
def force_compiled(monkeypatch, compile_on):
    """Every problem takes the compiled path (not the native kernel, tested in
    test_kernels_native.py); returns the list of kernel calls made."""
    calls: list[str] = []
    monkeypatch.setattr(tropical, "COMPILE_MIN_PAIRS", 0)
    monkeypatch.setattr(tropical, "native_available", lambda: False)
    for name in ("_maxplus_kernel", "_maxplus_argmax_kernel"):
        kernel = getattr(tropical, name)

        def spy(*args, kernel=kernel, name=name):
            calls.append(name)
            return kernel(*args)

        monkeypatch.setattr(tropical, name, spy)
    return calls


def eager_only(fn, *args):
    before = compile_enabled()
    set_compile(False)
    try:
        return fn(*args)
    finally:
        set_compile(before)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want), (got - want).abs().nan_to_num(0.0).max()


# --- maxplus -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("shape_a", "shape_b"), SHAPES, ids=str)
def test_maxplus_compiled_eager_reference(shape_a, shape_b, dtype, force_compiled):
    a, b = log_operands(shape_a, shape_b, dtype, seed=sum(shape_a) + 7 * sum(shape_b))
    want = reference(a, b)
    assert_same(eager_only(maxplus, a, b), want)
    assert_same(maxplus(a, b), want)
    if shape_a[-1] >= 2:  # k == 1 is an outer sum and stays eager by design
        assert force_compiled == ["_maxplus_kernel"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_maxplus_above_threshold_compiles_by_default(dtype, compile_on, monkeypatch):
    monkeypatch.setattr(tropical, "native_available", lambda: False)
    calls = []
    kernel = tropical._maxplus_kernel
    monkeypatch.setattr(tropical, "_maxplus_kernel", lambda *x: calls.append(1) or kernel(*x))
    a, b = log_operands((2, 70, 96), (96, 80), dtype, seed=3)  # 2 * 70 * 96 * 80 pairs
    assert a.shape[0] * 70 * 96 * 80 >= tropical.COMPILE_MIN_PAIRS
    assert_same(maxplus(a, b), reference(a, b))
    assert calls == [1]
    small_a, small_b = log_operands((4, 6), (6, 5), dtype, seed=4)
    assert_same(maxplus(small_a, small_b), reference(small_a, small_b))
    assert calls == [1], "a tiny product must stay eager"


def test_maxplus_padding_rows_and_columns_are_cut(force_compiled):
    """Sizes that are not whole tiles / column blocks (padding with -inf must not leak)."""
    for n, k, m in [(1, 2, 1), (5, 3, 2), (7, 9, 513), (4, 2, 3)]:
        a, b = log_operands((n, k), (k, m), torch.float32, seed=n + m)
        a[0] = torch.randn(k)  # keep some finite rows even for n == 1
        assert_same(maxplus(a, b), reference(a, b))


def test_maxplus_no_path_gives_minus_inf(force_compiled):
    a = torch.full((6, 8), NEG_INF)
    b = torch.randn(8, 5)
    assert torch.equal(maxplus(a, b), torch.full((6, 5), NEG_INF))
    assert torch.equal(maxplus(torch.randn(3, 0), torch.randn(0, 4)), torch.full((3, 4), NEG_INF))
    assert not maxplus(torch.full((4, 4), NEG_INF), torch.full((4, 4), 1e30)).isnan().any()


def test_maxplus_promotes_dtypes_like_addition(force_compiled):
    a, b = log_operands((9, 12), (12, 7), torch.float64, seed=5)
    got = maxplus(a.float(), b)
    assert_same(got, reference(a.float(), b))


def minplus(a, b):
    """Min-plus as users build it (README: MinProd): exact, since negation commutes with
    rounding."""
    return -maxplus(-a, -b)


def test_minplus_matches_reference(force_compiled):
    a, b = log_operands((3, 10, 12), (12, 9), torch.float64, seed=6)
    a, b = -a, -b  # +inf = no edge
    want = (a[..., :, :, None] + b[..., None, :, :]).amin(-2)
    assert_same(minplus(a, b), want)
    assert_same(eager_only(minplus, a, b), want)


def test_maxplus_rejects_bad_shapes():
    with pytest.raises(ValueError):
        maxplus(torch.randn(3, 4), torch.randn(5, 2))
    with pytest.raises(ValueError):
        maxplus(torch.randn(4), torch.randn(4, 2))


def test_maxplus_stays_differentiable_eagerly(force_compiled):
    a, b = log_operands((6, 8), (8, 5), torch.float64, seed=7)
    a = a.clamp_min(-50).requires_grad_()
    maxplus(a, b).clamp_min(-1e3).sum().backward()
    assert a.grad is not None and force_compiled == []


# --- argmax --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("shape_a", "shape_b"), SHAPES, ids=str)
def test_maxplus_argmax_compiled_eager_reference(shape_a, shape_b, dtype, force_compiled):
    # Random reals never tie; all -inf outputs (first row) all tie and must give index 0.
    a, b = log_operands(shape_a, shape_b, dtype, seed=11 + sum(shape_b))
    want_values, want_index = reference_argmax(a, b)
    for values, index in (eager_only(maxplus_argmax, a, b), maxplus_argmax(a, b)):
        assert_same(values, want_values)
        assert_same(index, want_index)
    assert torch.equal(want_index[..., 0, :], torch.zeros_like(want_index[..., 0, :]))
    if shape_a[-1] >= 2:
        assert force_compiled == ["_maxplus_argmax_kernel"]


def test_maxplus_argmax_first_index_on_ties(force_compiled):
    a = torch.tensor([[0.0, 1.0, 1.0, 0.5]]).repeat(8, 1)
    b = torch.zeros(4, 3)
    values, index = maxplus_argmax(a, b)
    assert torch.equal(values, torch.ones(8, 3))
    assert torch.equal(index, torch.ones(8, 3, dtype=torch.int64))


# --- semiring matmuls ----------------------------------------------------------------------------
def random_weights(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    w = torch.randn(shape, generator=gen, dtype=torch.float64) * 2
    return torch.where(torch.rand(shape, generator=gen, dtype=torch.float64) < 0.3, 0.0, w)


def random_state(sr: Semiring, gen: torch.Generator, shape: tuple[int, ...]) -> State:
    """A genuine state: plus of a product and a lifted weight (no-path entries, both signs)."""
    a = sr.times(sr.lift(random_weights(gen, shape)), sr.lift(random_weights(gen, shape)))
    return sr.plus(a, sr.lift(random_weights(gen, shape)))


MATMUL_SHAPES = [
    ((4, 6), (6, 5)),
    ((3, 4, 6), (6, 5)),
    ((4, 6), (2, 6, 5)),
    ((2, 3, 4, 6), (3, 6, 5)),
    ((2, 33, 40), (2, 40, 30)),
    ((70, 1), (1, 9)),
]


@pytest.mark.parametrize("compiled_path", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("w_dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("shape_a", "shape_w"), MATMUL_SHAPES, ids=str)
@pytest.mark.parametrize("sr", [semipack.MaxProd(), semipack.SignedMaxProd()], ids=repr)
def test_semiring_matmul_equals_blocked(sr, shape_a, shape_w, w_dtype, compiled_path, request):
    calls = request.getfixturevalue("force_compiled") if compiled_path else None
    gen = torch.Generator().manual_seed(sum(shape_a) * 31 + sum(shape_w))
    state = random_state(sr, gen, shape_a)
    w = random_weights(gen, shape_w).to(w_dtype)
    got = sr.matmul(state, w) if compiled_path else eager_only(sr.matmul, state, w)
    want = blocked_matmul(sr, state, w)
    assert len(got) == len(want)
    for g, x in zip(got, want, strict=True):
        assert_same(g, x)
    if calls is not None and shape_a[-1] >= 2:
        assert calls == ["_maxplus_kernel"], "one kernel call per matmul"


# --- switching compilation off -------------------------------------------------------------------
def test_compile_off_uses_eager_path(monkeypatch, compile_on):
    a, b = log_operands((2, 40, 50), (50, 60), torch.float32, seed=21)
    monkeypatch.setattr(tropical, "COMPILE_MIN_PAIRS", 0)
    monkeypatch.setattr(tropical, "native_available", lambda: False)
    compiled_values = maxplus(a, b)
    compiled_pair = maxplus_argmax(a, b)

    def fail(*args):
        raise AssertionError("compiled kernel called with compilation off")

    monkeypatch.setattr(tropical, "_maxplus_kernel", fail)
    monkeypatch.setattr(tropical, "_maxplus_argmax_kernel", fail)
    set_compile(False)
    try:
        assert not compile_enabled()
        assert_same(maxplus(a, b), compiled_values)
        values, index = maxplus_argmax(a, b)
        assert_same(values, compiled_pair[0])
        assert_same(index, compiled_pair[1])
    finally:
        set_compile(True)
    with pytest.raises(AssertionError, match="compilation off"):
        maxplus(a, b)


def test_eager_fallback_blocks_stay_bounded(monkeypatch, compile_on):
    """The eager path never broadcasts more than EAGER_BLOCK_ELEMENTS pairs at once."""
    monkeypatch.setattr(tropical, "EAGER_BLOCK_ELEMENTS", 300)
    seen: list[int] = []
    original_add = torch.Tensor.__add__

    def counting_add(x, y):
        out = original_add(x, y)
        seen.append(out.numel())
        return out

    a, b = log_operands((3, 13, 10), (3, 10, 11), torch.float64, seed=22)
    monkeypatch.setattr(torch.Tensor, "__add__", counting_add)
    got = eager_only(maxplus, a, b)
    monkeypatch.undo()
    assert seen and max(seen) <= 300
    assert_same(got, reference(a, b))
