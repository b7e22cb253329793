"""The hand-written max-plus kernels (dense, pruned, convolution taps) against the definition.

The reference is the broadcast ``(a[:, :, None] + b[None]).max(1)``: values bit for bit and the
first argmax. Random operands with scattered and whole-row ``-inf``, integer-valued operands
(many ties), every tile/panel remainder and both orientations of the pruned kernel are covered;
a hypothesis test draws the rest. Every test runs on the AVX2 build and, where the CPU has
AVX-512, on the AVX-512 build too (16 lanes per register, other tile heights). Skipped where the
kernel cannot be built (no AVX2 or no C compiler), where the compiled and eager kernels take over.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from semipack.kernels import native, tropical
from semipack.kernels.tropical import maxplus, maxplus_argmax

pytestmark = pytest.mark.skipif(
    not native.native_available(), reason="native max-plus kernel unavailable here"
)
NEG_INF = float("-inf")
WIDE = native._cpu_capability() == "AVX512"


@pytest.fixture(
    scope="module", autouse=True, params=[False, True] if WIDE else [False],
    ids=lambda wide: "avx512" if wide else "avx2",
)  # fmt: skip
def vector_width(request):
    """Each test on each build of the kernels this CPU runs (module scope: hypothesis tests
    refuse function-scoped fixtures)."""
    previous = native.set_avx512(request.param)
    assert native.native_width() == (16 if request.param else 8)
    yield
    native.set_avx512(previous)


def reference(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    found = (a[..., :, :, None] + b[..., None, :, :]).max(-2)
    return found.values, found.indices


def operands(s: int, n: int, k: int, m: int, seed: int, ties: bool = False, spread: float = 3.0):
    """Log-magnitude-like operands: a spread over ``spread`` nats, b = log|w| with exact zeros;
    20% of a and 10% of b are -inf, and the first row of a is all -inf (an output without path).
    """
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(s, n, k, generator=gen) * spread
    b = torch.randn(s, k, m, generator=gen).abs().log()
    if ties:
        a, b = a.round(), b.clamp_min(-4).round()
    a[torch.rand(a.shape, generator=gen) < 0.2] = NEG_INF
    b[torch.rand(b.shape, generator=gen) < 0.1] = NEG_INF
    a[:, 0] = NEG_INF
    return a, b


def assert_exact(got: tuple, want: tuple) -> None:
    assert torch.equal(got[0], want[0]), (got[0] - want[0]).abs().nan_to_num(0).max()
    if got[1] is not None:
        assert torch.equal(got[1], want[1])


# Shapes cover: fewer rows than a tile, row and column remainders (tiles of 6 / 3 rows in the
# AVX2 build, 12 / 8 in the AVX-512 one, panels of 16 columns, sweeps of 32), k = 1, single
# columns, and batches.
SHAPES = [
    (1, 1, 1, 1),
    (1, 5, 7, 3),
    (1, 7, 1, 17),
    (1, 13, 40, 33),
    (2, 97, 20, 16),
    (3, 8, 9, 70),
    (1, 25, 6, 47),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("ties", [False, True], ids=["reals", "ties"])
def test_dense_kernel_is_exact(shape, ties):
    a, b = operands(*shape, seed=sum(shape), ties=ties)
    want = reference(a, b)
    assert_exact(native.maxplus_f32(a, b, with_index=True), want)
    assert_exact(native.maxplus_f32(a, b, with_index=False), (want[0], None))


def test_dense_kernel_reads_strided_operands():
    a, b = operands(2, 30, 24, 40, seed=1)
    want = reference(a, b)
    a_t = a.transpose(1, 2).contiguous().transpose(1, 2)  # unit stride along rows, not k
    b_t = b.transpose(1, 2).contiguous().transpose(1, 2)
    assert_exact(native.maxplus_f32(a_t, b_t, with_index=True), want)


@pytest.mark.parametrize("shape", [s[1:] for s in SHAPES], ids=str)
@pytest.mark.parametrize("ties", [False, True], ids=["reals", "ties"])
@pytest.mark.parametrize("top", [1, 4, 32])
def test_pruned_kernel_is_exact(shape, ties, top):
    a, b = operands(1, *shape, seed=3 + sum(shape), ties=ties)
    want = reference(a[0], b[0])
    values, index, kept = native.maxplus_pruned_f32(a[0], b[0], with_index=True, top=top)
    assert_exact((values, index), want)
    assert 0 <= kept <= shape[0] * shape[1]
    assert_exact(native.maxplus_pruned_f32(a[0], b[0], False, top)[:2], (want[0], None))


@pytest.mark.parametrize("shape", [(5, 7, 3), (13, 40, 33), (97, 20, 16), (25, 6, 47)], ids=str)
@pytest.mark.parametrize("ties", [False, True], ids=["reals", "ties"])
def test_tap_kernels_read_and_write_rows_through_tables(shape, ties):
    """The convolution taps' kernels: ``gather`` reads b's rows through a table (into a packed
    b of more rows, at an offset), ``scatter_max`` maxes its product into rows of ``out`` named
    by a table, keeping what is there on ties and carrying the winner's id (TopPath)."""
    n, k, m = shape
    a, b = operands(1, n, k, m, seed=11 + n, ties=ties)
    a, b = a[0], b[0]
    gen = torch.Generator().manual_seed(n)
    big = torch.randn(3 * k + 2, m, generator=gen).abs().log()
    rows = torch.randperm(3 * k, generator=gen)[:k]  # distinct rows of big, past an offset of 2
    big[2 + rows] = b
    want = reference(a, b)
    panels = native.pack_panels_f32(big)
    assert_exact(native.maxplus_gather_f32(a, panels, rows, 2, m, with_index=True), want)
    assert_exact(native.maxplus_gather_f32(a, panels, rows, 2, m), (want[0], None))

    out = torch.randn(2 * n + 1, m, generator=gen) * 3
    if ties:
        out = out.round()
    out_ids = torch.randint(-5, 0, out.shape, generator=gen)
    ids = torch.randint(0, 1000, (n, k), generator=gen)
    targets = torch.randperm(2 * n, generator=gen)[:n]
    expected, expected_ids = out.clone(), out_ids.clone()
    wins = want[0] > out[1 + targets]  # strictly larger replaces
    expected[1 + targets] = torch.where(wins, want[0], out[1 + targets])
    expected_ids[1 + targets] = torch.where(wins, ids.gather(1, want[1]), out_ids[1 + targets])
    plain = out.clone()
    native.maxplus_scatter_max_f32(a, native.pack_panels_f32(b), plain, targets, 1)
    assert torch.equal(plain, expected)
    native.maxplus_scatter_max_f32(a, native.pack_panels_f32(b), out, targets, 1, ids, out_ids)
    assert torch.equal(out, expected) and torch.equal(out_ids, expected_ids)


@pytest.mark.skipif(not WIDE, reason="no AVX-512 on this CPU")
def test_both_builds_give_the_same_bits_on_a_large_product():
    """Tiles and thread blocks of both widths over a product large enough to be threaded."""
    a, b = operands(1, 300, 200, 100, seed=9)
    got = []
    previous = native.set_avx512(False)
    try:
        for wide in (False, True):
            native.set_avx512(wide)
            got.append(native.maxplus_f32(a, b, with_index=True))
    finally:
        native.set_avx512(previous)
    assert_exact(got[1], got[0])
    assert_exact(got[0], reference(a, b))


def test_pruning_skips_pairs_that_cannot_win():
    """One dominant k per row: the bound keeps few candidates, the values stay exact."""
    a, b = operands(1, 64, 300, 50, seed=5, spread=0.5)
    a[0, 1:, 7] = 100.0  # row 0 stays without paths
    b[0, 7] = 0.0
    values, index, kept = native.maxplus_pruned_f32(a[0], b[0], with_index=True)
    assert_exact((values, index), reference(a[0], b[0]))
    assert kept == 63  # k = 7 alone in each row with paths; other bounds are < 10
    assert torch.equal(index[1:], torch.full((63, 50), 7))


@pytest.mark.parametrize("n", [7, 600], ids=["a-chunk-per-thread", "chunks-of-256"])
def test_pruned_kernel_splits_rows_over_threads_and_chunks(monkeypatch, n):
    """On 2 threads rows go in chunks of at most 256, and of half the rows where that is less
    (so both threads work): 7 rows as chunks of 4 and 3; 600 rows as 256, 256 and 88. Every
    split gives the definition's values and first argmax, with and without the index."""
    monkeypatch.setattr(native, "THREADED_MIN_PAIRS", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a, b = operands(1, n, 300, 70, seed=n, spread=6.0)
        want = reference(a[0], b[0])
        assert_exact(native.maxplus_pruned_f32(a[0], b[0], True)[:2], want)
        assert_exact(native.maxplus_pruned_f32(a[0], b[0], False)[:2], (want[0], None))
    finally:
        torch.set_num_threads(threads)


def test_whole_row_without_path_gives_minus_inf_and_index_zero():
    a = torch.full((5, 40), NEG_INF)
    b = torch.randn(40, 20)
    values, index, _ = native.maxplus_pruned_f32(a, b, with_index=True)
    assert torch.equal(values, torch.full((5, 20), NEG_INF))
    assert torch.equal(index, torch.zeros((5, 20), dtype=torch.int64))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    k=st.integers(1, 80),
    m=st.integers(1, 50),
    spread=st.floats(0.0, 20.0),
    ties=st.booleans(),
    top=st.integers(1, 40),
    transposed_b=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_pruned_kernel_property(n, k, m, spread, ties, top, transposed_b, seed):
    """With the index every kept k is swept in phase 2; without it phase 2 sweeps only the
    kept ks phase 1 did not, onto phase 1's maxima. Both give the definition's values. The
    counting pass (the estimate's) keeps exactly the kernel's phase-2 candidates, whatever b's
    layout."""
    a, b = operands(1, n, k, m, seed=seed, ties=ties, spread=spread)
    want = reference(a[0], b[0])
    assert_exact(native.maxplus_pruned_f32(a[0], b[0], True, top)[:2], want)
    values, _, kept = native.maxplus_pruned_f32(a[0], b[0], False, top)
    assert_exact((values, None), (want[0], None))
    b0 = b[0].t().contiguous().t() if transposed_b else b[0]
    assert native.maxplus_pruned_counts_f32(a[0], b0, b[0].amax(1), top)[0] == kept


@pytest.fixture
def prune_everything(monkeypatch):
    """Route every float32 product through the native kernels, pruned whenever possible."""
    monkeypatch.setattr(tropical, "NATIVE_MIN_PAIRS", 0)
    monkeypatch.setattr(tropical, "PRUNE_MIN_PAIRS", 0)
    monkeypatch.setattr(tropical, "PRUNE_MIN_K", 1)
    monkeypatch.setattr(tropical, "PRUNE_MAX_KEPT", 10.0)
    monkeypatch.setattr(tropical, "PRUNE_MIN_COLS", 1)
    monkeypatch.setattr(tropical, "PRUNE_ESTIMATE_SHARE", float("inf"))


@pytest.mark.parametrize("orientation", ["direct", "transposed"])
def test_public_maxplus_routes_both_orientations(prune_everything, monkeypatch, orientation):
    """``maxplus`` prunes over a's rows or, transposed, over b's columns: same result."""
    estimates = {"direct": (0.1, 0.9), "transposed": (0.9, 0.1)}[orientation]
    calls = iter(estimates * 4)
    monkeypatch.setattr(tropical, "kept_fraction", lambda a, b: next(calls))
    seen = []
    pruned = tropical.maxplus_pruned_f32
    monkeypatch.setattr(
        tropical,
        "maxplus_pruned_f32",
        lambda a, b, i, **kw: seen.append(a.shape) or pruned(a, b, i, **kw),
    )
    a, b = operands(1, 21, 30, 11, seed=9)
    want = reference(a[0], b[0])
    assert_exact((maxplus(a[0], b[0]), None), (want[0], None))
    assert_exact(maxplus_argmax(a[0], b[0]), want)
    assert seen == [(21, 30)] * 2 if orientation == "direct" else seen == [(11, 30)] * 2


def test_nan_and_plus_inf_inputs_take_the_propagating_path(prune_everything):
    """vmaxps drops NaN; such inputs must go to the kernels that propagate it like torch."""
    a, b = operands(1, 9, 12, 10, seed=2)
    a[0, 3, 4] = float("nan")
    values = maxplus(a[0], b[0])
    assert values[3].isnan().all() and not values[4:].isnan().any()
    a[0, 3, 4] = float("inf")
    b[0, 4, 0] = NEG_INF
    assert maxplus(a[0], b[0])[3, 0].isnan()  # inf + -inf, as the definition gives


def test_kept_fraction_estimate_counts_the_candidates():
    """The estimate is the kernel's own phase-2 count on the sampled rows, plus phase 1, read
    from b where it lies (a column-major b gives the same counts)."""
    a, b = operands(1, 8, 64, 40, seed=4, spread=2.0)
    a[0, 0] = torch.randn(64)  # sampled rows must hold paths
    _, _, kept = native.maxplus_pruned_f32(a[0], b[0], False, top=native.PRUNE_TOP)
    bmax = b[0].amax(1)
    counts = native.maxplus_pruned_counts_f32(a[0], b[0], bmax)
    assert counts[0] == kept
    assert 8 <= counts[1] <= 8 * 64  # every row holds paths: at least its best candidate
    column_major = b[0].t().contiguous().t()
    assert native.maxplus_pruned_counts_f32(a[0], column_major, bmax) == counts
    assert tropical.kept_fraction(a[0], b[0], rows=8) == (counts[0] + counts[1]) / (8 * 64)


@pytest.mark.parametrize(
    ("rows", "n"), [(3, 1), (4, 7), (2, 8), (3, 9), (5, 16), (3, 17), (2, 37), (2, 48), (2, 768)]
)
def test_norm_entropy_sums_match_float64_definition(rows, n):
    """S, T, U of normalization.c against the same sums over the broadcast pairs in float64."""
    gen = torch.Generator().manual_seed(rows * 100 + n)
    x = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    x_hat = x - x.mean(-1, keepdim=True)
    x_hat[0, 0] = 0.0  # c = 1 exactly
    if n > 1:
        x_hat[1, 1], x_hat[1, 0] = 2.0, -0.5  # c = 0 exactly: no edge, no log
    a = torch.rand(rows, n, generator=gen, dtype=torch.float64)
    a[-1, -1] = 0.0
    r = torch.rand(rows, n, generator=gen, dtype=torch.float64) * 4
    c = (1 + x_hat[:, :, None] * x_hat[:, None, :]).abs()  # [row, i, j]
    w = a[:, :, None] * c
    logs = torch.where(c > 0, c.log(), 0.0)
    want = (w.sum(1), (w * r[:, :, None]).sum(1), (w * logs).sum(1))
    got = native.norm_entropy_sums_f32(a.float(), r.float(), x_hat.float())
    for g, expected in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), expected, rtol=2e-6, atol=2e-6)


def _sorted_kernel_rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, x̂, r) float64 rows with what the O(n log n) kernels must get right: exact zero
    crossings |1 + x̂_i x̂_j| = 0, ties, x̂ = 0 and -0, a single dominant a (the prefix sums
    cancel: the columns are recomputed directly), zeros of a, all-equal x̂, ordinary rows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(7, n, generator=gen, dtype=torch.float64)
    x_hat = (x - x.mean(-1, keepdim=True)) / x.std(-1, unbiased=False, keepdim=True)
    x_hat = torch.nan_to_num(x_hat)  # n = 1: zero spread
    x_hat[0] = torch.tensor([2.0, -0.5, 1.0, -1.0] * (n // 4) + [0.25] * (n % 4))
    x_hat[1, : n // 3], x_hat[1, n // 3 :] = 0.75, -1.5  # two values, many ties
    x_hat[2, ::3], x_hat[2, 1::3] = 0.0, -0.0
    x_hat[5] = 0.3  # every entry equal
    a = torch.rand(7, n, generator=gen, dtype=torch.float64)
    a[3] = a[3] * 1e-12
    a[3, n // 2] = 1.0  # one entry dominates ...
    x_hat[3, n // 2], x_hat[3, ::7] = 2.0, -0.5  # ... and has no edge to some columns: there
    # the prefix sums cancel to rounding noise, and those columns are recomputed directly
    a[4, ::2] = 0.0
    a[6] = a[6] ** 8  # a wide range of weights
    r = torch.randn(7, n, generator=gen, dtype=torch.float64) * 5
    return a, x_hat, r


def _pair_reductions(a, x_hat, r):
    """max_i a_i c_ij and the sums S, T, U over the broadcast pairs in float64, c = |1 + x̂ x̂|."""
    c = (1 + x_hat[:, :, None] * x_hat[:, None, :]).abs()  # [row, i, j]
    w = a[:, :, None] * c
    logs = torch.where(c > 0, c.log(), 0.0)
    return w.amax(1), w.sum(1), (w * r[:, :, None]).sum(1), (w * logs).sum(1)


@pytest.mark.parametrize("n", [1, 2, 5, 9, 64, 1000, 1031])
def test_sorted_normalization_kernels_match_float64_definition(n):
    """The envelope, prefix-sum and series-tree kernels of normalization_sorted.c against the
    float64 pair reductions, relative to each column's scale (S for the sums, |r|max S for T)."""
    a, x_hat, r = _sorted_kernel_rows(n, seed=n)
    best, s, t, u = _pair_reductions(a, x_hat, r)
    f32 = torch.float32
    got_best, got_arg = native.norm_sorted_max_f32(a.to(f32), x_hat.to(f32), with_index=True)
    got_s, got_t, got_u = native.norm_sorted_sums_f32(a.to(f32), x_hat.to(f32), r.to(f32), True)
    only_s, no_t, no_u = native.norm_sorted_sums_f32(a.to(f32), x_hat.to(f32))
    assert no_t is None and no_u is None
    assert torch.equal(only_s, got_s)
    # the inputs themselves are rounded to float32: the reference uses the rounded ones
    a32, x32, r32 = (v.to(f32).double() for v in (a, x_hat, r))
    best, s, t, u = _pair_reductions(a32, x32, r32)
    torch.testing.assert_close(got_best.double(), best, rtol=2e-7, atol=0)
    # the index attains the maximum (any of exact ties), -1 only where every term is 0
    c = (1 + x32[:, :, None] * x32[:, None, :]).abs()  # [row, i, j]
    attained = (a32[:, :, None] * c).gather(1, got_arg.clamp_min(0)[:, None, :])[:, 0]
    torch.testing.assert_close(attained, best, rtol=2e-7, atol=0)
    assert torch.equal(got_arg < 0, best == 0)
    assert native.norm_sorted_max_f32(a.to(f32), x_hat.to(f32))[1] is None
    scale = s.clamp_min(1e-300)
    for got, want, weight in ((got_s, s, 1.0), (got_t, t, r32.abs().amax()), (got_u, u, 1.0)):
        err = (got.double() - want).abs() / (scale * weight)
        assert err.max() < 3e-7, err.max()


def _envelope_rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, x̂) float64 rows for the three ways of the envelope kernel, whose lines are
    a_i + a_i x̂_i t: every line on the envelope (the points (a_i x̂_i, a_i) on a concave curve:
    more lines than its candidate sets hold, so the sorting envelope takes the row); 20 lines on
    it and the others 1e-3 below (above the envelope of the first candidates, so candidates are
    added in rounds); ordinary rows (candidates in one pass)."""
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    s_all = torch.linspace(-0.5, 0.5, n, dtype=f64)
    s_some = torch.cat(
        [
            torch.linspace(-0.5, 0.5, 20, dtype=f64),
            torch.rand(n - 20, generator=gen, dtype=f64) - 0.5,
        ]
    )
    c_all, c_some = 1 - s_all * s_all, 1 - s_some * s_some
    c_some[20:] -= 1e-3
    order = torch.randperm(n, generator=gen)
    a = torch.stack([c_all[order], c_some[order], torch.rand(n, generator=gen, dtype=f64)])
    x = torch.stack(
        [(s_all / c_all)[order], (s_some / c_some)[order], torch.randn(n, generator=gen, dtype=f64)]
    )
    return a, x


@pytest.mark.parametrize("n", [200, 777])
def test_envelope_kernel_on_long_envelopes_and_near_lines(n):
    """Rows that take each way through the envelope kernel (checked in C while writing it: the
    first row falls back to sorting, the second adds candidates in rounds) against the float64
    definition, values and the attaining index."""
    a, x_hat = (v.to(torch.float32) for v in _envelope_rows(n, seed=n))
    a32, x32 = a.double(), x_hat.double()
    best = _pair_reductions(a32, x32, torch.zeros_like(a32))[0]
    got, arg = native.norm_sorted_max_f32(a, x_hat, with_index=True)
    torch.testing.assert_close(got.double(), best, rtol=2e-7, atol=0)
    assert torch.equal(native.norm_sorted_max_f32(a, x_hat)[0], got)
    c = (1 + x32[:, :, None] * x32[:, None, :]).abs()
    attained = (a32[:, :, None] * c).gather(1, arg[:, None, :])[:, 0]
    torch.testing.assert_close(attained, best, rtol=2e-7, atol=0)


def test_sorted_kernels_take_long_finite_rows_only(monkeypatch):
    """From SORTED_MIN_ENTRIES_MAX entries (SORTED_MIN_ENTRIES_ENTROPY for Entropy) the native
    message kernels sort; shorter rows keep the all-pairs kernels, and rows with NaN reach
    neither (the dense Jacobian takes them, so NaN propagates as the definition says)."""
    import semipack
    from semipack.kernels import normalization as knorm
    from semipack.messages.normalization import normalized_messages

    calls = []

    def record(name, result):
        return lambda *args, **kwargs: calls.append(name) or result

    monkeypatch.setattr(knorm, "norm_sorted_max_f32", record("sorted", (0, None)))
    monkeypatch.setattr(knorm, "norm_abs_reduce_f32", record("pairs", 0))
    monkeypatch.setattr(knorm, "_max_prod_from_best_compiled", record("done", None))
    monkeypatch.setattr(knorm, "norm_sorted_sums_f32", record("sorted sums", (0, 0, 0)))
    monkeypatch.setattr(knorm, "norm_entropy_sums_f32", record("pair sums", (0, 0, 0)))
    monkeypatch.setattr(knorm, "_entropy_readout_of_sums", record("done", None))
    for kernel, n in (
        ("max", knorm.SORTED_MIN_ENTRIES_MAX),
        ("entropy", knorm.SORTED_MIN_ENTRIES_ENTROPY),
    ):
        for width in (n, n - 1):
            x_hat = torch.randn(2, width)
            if kernel == "max":
                knorm.max_prod_native(torch.zeros(2, width), x_hat)
            else:
                knorm.entropy_native(torch.zeros(2, width), torch.zeros(2, width), x_hat)
        x_hat = torch.randn(2, n)
        x_hat[1, 3] = float("nan")
        sr = semipack.MaxProd() if kernel == "max" else semipack.Entropy()
        m = sr.zeros((2, n), torch.float32, "cpu")
        ones = torch.ones(2)
        assert normalized_messages(sr, m, x_hat, ones, ones, True) is None
    assert [c for c in calls if c != "done"] == [
        *("sorted", "pairs"),
        *("sorted sums", "pair sums"),
    ]


def _softmax_rows(rows: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 (message, log-probabilities) rows with the edge cases of the kernel's contract."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, n, generator=gen) * 4
    if n > 2:
        scores[0, 1] = float("-inf")  # masked key: p = 0 exactly
        scores[1, :] = float("-inf")
        scores[1, 0] = 0.0  # one-hot row: p = 1 and 0
        scores[2, 2] = -95.0  # p subnormal next to normal entries
        scores[2, 0] = -300.0  # p = e^-300: zero in float32, an edge in log space
        scores[3 % rows, 1] = 40.0  # p = 1 - 1e-17: 1 - p is 0 in float32, not in log space
    log_probs = torch.log_softmax(scores, -1)
    m = torch.randn(rows, n, generator=gen) * 30
    m[0, 0] = float("-inf")
    if rows > 3:
        m[3, :] = float("-inf")  # a row without any path (one path when n > 1)
        if n > 1:
            m[3, 1] = 2.0
    if rows > 4 and n > 1:
        m[4, :] = float("-inf")
        m[4, n - 1] = 5.0  # a single path: "second" is -inf
    return m, log_probs


def _dense_softmax_log_sum(m: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """log Σ_i exp(m_i) |J_ij| over the dense Jacobian in log form, brute force in float64:
    log|J_ij| = lp_i + lp_j (i != j), lp_j + log Σ_{k != j} p_k (i = j)."""
    n = log_probs.shape[-1]
    eye = torch.eye(n, dtype=torch.bool)
    others = torch.logsumexp(log_probs[:, None, :].masked_fill(eye, NEG_INF), -1)
    log_jac = log_probs[:, :, None] + torch.where(eye, others[:, None, :], log_probs[:, None, :])
    return torch.logsumexp(m[:, :, None] + log_jac, 1)


@pytest.mark.parametrize(("rows", "n"), [(5, 1), (6, 5), (6, 8), (7, 13), (9, 128)])
def test_softmax_log_sum_matches_float64_definition(rows, n):
    """softmax.c against the exclusive-reduction form of rowwise.py evaluated in float64, and
    against log Σ_i exp(m_i) |J_ij| over the dense Jacobian (in log form)."""
    from semipack import LogSum
    from semipack.messages.rowwise import softmax_from_log_probs

    m, log_probs = _softmax_rows(rows, n, seed=rows * 10 + n)
    got = native.softmax_log_sum_f32(m, log_probs)
    m64, lp64 = m.double(), log_probs.double()
    (want,) = softmax_from_log_probs(LogSum(), (m64,), lp64)
    dense = _dense_softmax_log_sum(m64, lp64)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(torch.isinf(want), torch.isinf(dense))
    live = torch.isfinite(want)
    torch.testing.assert_close(got.double()[live], want[live], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(want[live], dense[live], rtol=1e-9, atol=1e-9)


def test_softmax_log_sum_keeps_underflowed_probabilities():
    """The e^-300 probability and the 1 - 1e-17 complement (both 0 in float32) are edges."""
    m, log_probs = _softmax_rows(6, 8, seed=1)
    got = native.softmax_log_sum_f32(m, log_probs)
    assert torch.softmax(torch.tensor([-300.0, 0.0]), -1)[0] == 0  # really 0 in float32
    assert bool(torch.isfinite(got[2, 0]))  # message to the e^-300 entry
    # row 3: one path, into entry 1 (p_1 = 1 - 1e-17): the diagonal edge p_1 (1 - p_1) exists
    assert bool(torch.isfinite(got[3, 1]))


def test_logsum_softmax_messages_take_the_native_kernel_unless_nan(monkeypatch):
    from semipack import LogSum
    from semipack.messages import rowwise
    from semipack.semirings import log_sum

    m, log_probs = _softmax_rows(64, 128, seed=3)
    probs = log_probs.exp()
    (routed,) = rowwise.softmax_messages(LogSum(), (m,), probs, log_probs)
    assert torch.equal(routed, native.softmax_log_sum_f32(m, log_probs))

    def refuse(*args):
        raise AssertionError("NaN inputs must not reach the native kernel")

    monkeypatch.setattr(log_sum, "softmax_log_sum_f32", refuse)
    m[5, 7] = float("nan")
    (fallback,) = rowwise.softmax_messages(LogSum(), (m,), probs, log_probs)
    assert torch.isnan(fallback[5]).any()


def test_a_shared_pruning_choice_is_estimated_once_per_shape_and_stays_exact(monkeypatch):
    """In a ``shared_pruning_choice`` scope (a convolution's taps) products of the same
    shapes reuse the first estimate; every product still equals the definition."""
    calls = []
    estimate = tropical.kept_fraction
    monkeypatch.setattr(tropical, "kept_fraction", lambda a, b: calls.append(1) or estimate(a, b))
    monkeypatch.setattr(tropical, "PRUNE_MIN_PAIRS", 1 << 22)  # small products, kept quick
    g = torch.Generator().manual_seed(3)
    spread = [torch.randn(256, 256, generator=g) * 8 for _ in range(6)]
    pairs = [(spread[0], spread[1]), (spread[2], spread[3]), (spread[4], spread[5])]
    with tropical.shared_pruning_choice():
        for a, b in pairs:
            assert torch.equal(tropical.maxplus(a, b), (a[:, :, None] + b[None]).amax(1))
    assert len(calls) == 2  # both orientations, once
    calls.clear()
    for a, b in pairs:  # outside a scope each product estimates its own
        tropical.maxplus(a, b)
    assert len(calls) == 2 * len(pairs)


def test_products_with_few_output_columns_are_not_pruned(monkeypatch):
    """An orientation with fewer than PRUNE_MIN_COLS output columns is never estimated nor
    pruned (a convolution's weight message, [O, B·L] x [B·L, C] with small O and C, ran slower
    pruned than dense); the dense kernel gives the definition's values."""
    calls, pruned = [], []
    estimate = tropical.kept_fraction
    monkeypatch.setattr(
        tropical, "kept_fraction", lambda a, b: calls.append(b.shape) or estimate(a, b)
    )
    kernel = tropical.maxplus_pruned_f32
    monkeypatch.setattr(
        tropical,
        "maxplus_pruned_f32",
        lambda a, b, i, **kw: pruned.append(1) or kernel(a, b, i, **kw),
    )
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(64, 8192, generator=g) * 8, torch.randn(8192, 16, generator=g) * 8
    assert torch.equal(tropical.maxplus(a, b), (a[:, :, None] + b[None]).amax(1))
    assert calls == [] and pruned == []
    wide = torch.randn(8192, 300, generator=g) * 8  # 300 columns: the direct orientation is tried
    tropical.maxplus(a, wide)
    assert calls == [torch.Size([8192, 300])]


def test_an_estimate_costing_much_of_the_product_is_skipped(monkeypatch):
    """A Linear(16, 72) input message over 6272 rows, [6272, 72] x [72, 16]: the direct
    orientation has 16 columns (never pruned), and the transposed one's estimate would read 32
    candidates of 8 of its 16 rows over all 6272 columns, a fifth of the product: neither is
    estimated, the dense kernel gives the definition's values. A product with a long ``k`` and
    as few rows is still estimated (the sample is a small share of it)."""
    calls = []
    estimate = tropical.kept_fraction
    monkeypatch.setattr(
        tropical, "kept_fraction", lambda a, b: calls.append(tuple(a.shape)) or estimate(a, b)
    )
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(6272, 72, generator=g) * 8, torch.randn(72, 16, generator=g) * 8
    assert torch.equal(tropical.maxplus(a, b), (a[:, :, None] + b[None]).amax(1))
    assert calls == []
    long_k = torch.randn(16, 8192, generator=g) * 8, torch.randn(8192, 1100, generator=g) * 8
    assert torch.equal(tropical.maxplus(*long_k), (long_k[0][:, :, None] + long_k[1][None]).amax(1))
    assert calls == [(16, 8192)]


@pytest.mark.parametrize("n", [256, 1500])
def test_envelope_kernel_keeps_a_tiny_line_where_the_others_cancel(n):
    """A weight of 1e-30 beside a weight of 1 whose line crosses zero exactly at a query
    (1 + 0.5 t = 0 at t = -2): the envelopes' double-precision comparisons drop the tiny line,
    and the maximum there read 0 ("no path", MaxProd -inf) where the definition has 1e-30 (a
    trial found it). Such columns are recomputed directly; the index names the tiny line."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, n, generator=gen)
    a = torch.zeros(1, n)
    a[0, 0], x[0, 0] = 1.0, 0.5
    a[0, 1], x[0, 1] = 1e-30, 1.0
    x[0, 2] = -2.0
    best, arg = native.norm_sorted_max_f32(a, x, with_index=True)
    want = (a.double()[0, :, None] * (1 + x.double()[0, :, None] * x.double()[0]).abs()).amax(0)
    torch.testing.assert_close(best[0].double(), want, rtol=2e-7, atol=0)
    assert best[0, 2] > 0 and int(arg[0, 2]) == 1


@pytest.mark.parametrize(
    ("value", "on"),
    [("0", False), ("false", False), (" False ", False), ("OFF", False), ("no", False),
     ("1", True), ("yes", True), ("", True)],
)  # fmt: skip
def test_environment_switches_read_every_spelling_of_off(monkeypatch, value, on):
    from semipack.kernels.switches import switched_on

    monkeypatch.setenv("SEMIPACK_SOME_KERNEL", value)
    assert switched_on("SEMIPACK_SOME_KERNEL") is on


def test_the_width_in_use_builds_no_other_library(monkeypatch):
    """With AVX-512 switched off, asking the width builds (and loads) the AVX2 library only."""
    built = []
    real = native._build
    monkeypatch.setattr(native, "_build", lambda avx512: built.append(avx512) or real(avx512))
    previous = native.set_avx512(False)
    try:
        assert native.native_width() == 8
    finally:
        native.set_avx512(previous)
    assert built == [False]


def test_threads_building_at_once_all_get_the_library(monkeypatch, tmp_path):
    """Two threads of one process building into an empty cache: each gets the library, with
    no warning (they shared the partial file's name, and the slower one's rename failed)."""
    import threading
    import warnings

    monkeypatch.setenv("SEMIPACK_CACHE_DIR", str(tmp_path))
    native._build.cache_clear()
    got, caught = [], []

    def build() -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got.append(native._build(False))
        caught.extend(seen)

    try:
        threads = [threading.Thread(target=build) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        native._build.cache_clear()  # later tests load from the usual cache again
    assert len(got) == 2 and all(lib is not None for lib in got)
    assert not [w for w in caught if "failed" in str(w.message)]
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []


@pytest.mark.skipif(not WIDE, reason="no AVX-512 on this CPU")
def test_sorted_sums_walk_the_tree_to_the_same_bits_in_both_builds():
    """The AVX-512 build walks U's tree for 8 queries at once, the AVX2 one for 4: each query
    visits the same nodes in the same order, so S, T and U have the same bits (rows with exact
    cancellations, zero entries and sources too few for the moments' translation)."""
    gen = torch.Generator().manual_seed(12)
    for rows, n in [(4, 3000), (3, 17), (2, 40), (16, 1024)]:
        a = torch.rand(rows, n, generator=gen)
        a[torch.rand(rows, n, generator=gen) < 0.5] = 0.0
        r = torch.rand(rows, n, generator=gen)
        x_hat = torch.randn(rows, n, generator=gen) * 2
        x_hat[0, :5] = 0.0
        x_hat[1] = -1 / x_hat[1, 0]  # 1 + x_i x_0 = 0: exact cancellations
        got = []
        previous = native.set_avx512(False)
        try:
            for wide in (False, True):
                native.set_avx512(wide)
                got.append(native.norm_sorted_sums_f32(a, x_hat, r, with_log=True))
        finally:
            native.set_avx512(previous)
        for narrow, wide in zip(*got, strict=True):
            assert torch.equal(narrow, wide)


@pytest.mark.parametrize("ties", [False, True], ids=["reals", "ties"])
def test_long_inner_sizes_keep_the_first_argmax(ties):
    """An inner size of 9000 (panels far past the L1 cache; ties far apart keep the earliest
    k), dense and gathered products, against the definition."""
    n, k, m = 20, 9000, 33
    a, b = operands(1, n, k, m, seed=21, ties=ties)
    a, b = a[0], b[0]
    if ties:  # the best value of row 2 reached at k = 100, again at 5000 and 8500
        a[2] = -50.0
        a[2, [100, 5000, 8500]] = 10.0
        b[[100, 5000, 8500]] = 0.0
    want = reference(a, b)
    assert_exact(
        native.maxplus_f32(a[None], b[None], with_index=True), tuple(w[None] for w in want)
    )
    rows = torch.arange(k)
    panels = native.pack_panels_f32(b)
    assert_exact(native.maxplus_gather_f32(a, panels, rows, 0, m, with_index=True), want)
    assert_exact(native.maxplus_gather_f32(a, panels, rows, 0, m), (want[0], None))
    if ties:
        assert torch.equal(want[1][2], torch.full((m,), 100))


@pytest.mark.parametrize("n", [1024, 640], ids=["sorted", "all pairs"])
def test_native_normalization_readouts_compiled_equal_their_eager_forms(n, monkeypatch):
    """From FUSED_MIN_ELEMENTS entries the native kernels' readouts (the scaling of the sums,
    the i = j corrections, log Z, the mean) run as one compiled loop: within float32 rounding
    of the eager ops, with rows without a path (-inf) and zeros of x̂ among the entries."""
    from semipack.kernels import normalization as knorm

    gen = torch.Generator().manual_seed(n)
    rows = 64
    x = torch.randn(rows, n, generator=gen)
    x_hat = (x - x.mean(-1, keepdim=True)) / x.std(-1, unbiased=False, keepdim=True)
    x_hat[:, 7] = 0.0
    log_z, surprisal = torch.randn(rows, n, generator=gen) * 3, torch.rand(rows, n, generator=gen)
    log_z[3] = float("-inf")
    log_z[5, ::4] = float("-inf")
    assert rows * n >= knorm.FUSED_MIN_ELEMENTS
    kernels = {
        "entropy": (knorm.entropy_native, (log_z, surprisal, x_hat), "_entropy_readout_of_sums"),
        "max": (knorm.max_prod_native, (log_z, x_hat), "_max_prod_from_best_compiled"),
        "sum": (knorm.log_sum_native, (log_z, x_hat), "_log_sum_from_total_compiled"),
    }
    for kernel, args, readout in kernels.values():
        got = kernel(*args)
        with monkeypatch.context() as patch:
            patch.setattr(knorm, readout, getattr(knorm, readout).eager)
            want = kernel(*args)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.isinf(), w.isinf()) and torch.equal(g.isnan(), w.isnan())
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def _holds_nan_or_posinf(t: torch.Tensor) -> bool:
    return bool((t.isnan() | (t == float("inf"))).any())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "plus-inf"])
def test_finite_check_reads_every_entry_of_any_dense_layout(monkeypatch, bad):
    """``no_nan_or_posinf`` (the gate of every max-plus kernel) gives the definition's answer
    with one NaN or +inf at each position of tensors of 1 to 70 entries (the native loop's
    blocks of 32 and its tail), in contiguous, transposed and permuted layouts, and with -inf
    entries (no edge) alone; those layouts go through the native loop, an expanded or sliced
    tensor and a float64 one through torch's reduction."""
    lib = native._library()
    calls = []
    loop = lib.semipack_below_inf_f32
    monkeypatch.setattr(lib, "semipack_below_inf_f32", lambda *a: calls.append(1) or loop(*a))
    g = torch.Generator().manual_seed(0)
    for n in [1, 7, 31, 32, 33, 64, 70]:
        base = torch.randn(n, generator=g)
        base[:: max(1, n // 3)] = float("-inf")
        assert native.no_nan_or_posinf(base) and not _holds_nan_or_posinf(base)
        for at in range(n):
            t = base.clone()
            t[at] = bad
            assert native.no_nan_or_posinf(t) is False
    calls.clear()
    cube = torch.randn(5, 6, 7, generator=g)
    for layout in (cube, cube.transpose(0, 2), cube.permute(1, 2, 0)):
        clean = layout.clone(memory_format=torch.preserve_format)
        assert clean.stride() == layout.stride() and native.no_nan_or_posinf(clean)
        for at in [(0, 0, 0), (2, 3, 4), tuple(d - 1 for d in layout.shape)]:
            t = clean.clone(memory_format=torch.preserve_format)
            t[at] = bad
            assert native.no_nan_or_posinf(t) is False and _holds_nan_or_posinf(t)
    assert len(calls) == 12
    calls.clear()
    expanded = torch.randn(1, 8, generator=g).expand(4, 8)
    gapped = torch.randn(6, 10, generator=g)[:, ::2]
    wide = torch.randn(40, generator=g, dtype=torch.float64)
    for t in (expanded, gapped, wide):
        assert native.no_nan_or_posinf(t)
    gapped[2, 3] = bad
    assert native.no_nan_or_posinf(gapped) is False
    assert calls == []


def test_a_failed_build_says_so_and_falls_back(tmp_path, monkeypatch, capsys) -> None:
    """A compiler that fails: the build announces itself on stderr (a first build takes minutes
    and looked hung, trial 128), warns naming the failure, leaves no partial file, and gives
    None (the compiled kernels run instead)."""
    if not native.native_available():
        pytest.skip("no native build on this machine")
    monkeypatch.setenv("SEMIPACK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # exits 1 on every source
    with pytest.warns(RuntimeWarning, match="building the native max-plus kernel failed"):
        assert native._build_locked(False) is None
    assert "semipack: building the native kernels for this CPU" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["build.lock"]  # nothing of the build


def test_a_build_sweeps_what_an_interrupted_one_left(tmp_path, monkeypatch, capsys) -> None:
    """A build stopped by a signal left its objects' folder in the cache folder for good
    (trial 133): the next build, holding the lock, removes it and any partial library. CC
    may carry arguments, as make reads it ("ccache gcc")."""
    if not native.native_available():
        pytest.skip("no native build on this machine")
    monkeypatch.setenv("SEMIPACK_CACHE_DIR", str(tmp_path))
    (tmp_path / "build-abc").mkdir()
    (tmp_path / "build-abc" / "maxplus.o").write_bytes(b"half")
    (tmp_path / "kernels-0123.1.2.partial.so").write_bytes(b"half")
    monkeypatch.setenv("CC", "false --an-argument")  # split into a program and its argument
    with pytest.warns(RuntimeWarning, match="building the native max-plus kernel failed"):
        assert native._build_locked(False) is None
    assert [p.name for p in tmp_path.iterdir()] == ["build.lock"]
