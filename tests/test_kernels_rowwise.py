"""Row-wise kernels (softmax, log_softmax, layer_norm, batch_norm) equal the dense Jacobian path.

The reference for every semiring is ``contract_rows`` on a Jacobian written out here in full from
its formula, so the kernels are checked against the definition, not against themselves. Real is
also checked against torch's own backward.
"""

from __future__ import annotations

import importlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import semipack
import semipack.messages.normalization as knorm
from semipack.kernels.compiled import compile_enabled, set_compile
from semipack.kernels.exclusive import exclusive_logsumexp, exclusive_max, exclusive_min
from semipack.messages.jacobian import contract_rows
from semipack.messages.normalization import normalized_messages
from semipack.messages.rowwise import has_fast_rowwise, log_softmax_messages, softmax_messages
from semipack.rules.softmax import softmax_contract
from semipack.semirings import Semiring, State

F64 = torch.float64
NEG_INF = float("-inf")


# --- helpers -------------------------------------------------------------------------------------
def random_state(sr: Semiring, rows: int, n: int, seed: int) -> State:
    """Genuine states: the plus of two lifted random weights, 40% of them exactly 0, so about
    16% of the entries have no path (-inf / +inf / False) and SignedMaxProd mixes signs."""
    gen = torch.Generator().manual_seed(seed)

    def weights() -> torch.Tensor:
        w = (
            torch.randn(rows, n, generator=gen, dtype=F64)
            * (2 * torch.randn(rows, n, generator=gen, dtype=F64)).exp()
        )
        return torch.where(torch.rand(rows, n, generator=gen, dtype=F64) < 0.4, 0.0, w)

    return sr.plus(sr.lift(weights()), sr.lift(weights()))


def dense(sr: Semiring, m: State, jacobian: torch.Tensor) -> State:
    """The generic path: ``contract_rows`` over an explicit [rows, n_out, n_in] Jacobian."""
    return contract_rows(sr, m, lambda rows, cols: jacobian[rows, :, cols], jacobian.shape[-1])


def assert_same_state(sr: Semiring, got: State, want: State) -> None:
    assert len(got) == len(want)
    if isinstance(sr, semipack.Boolean):
        assert torch.equal(got[0], want[0])
        return
    if isinstance(sr, semipack.Entropy):
        torch.testing.assert_close(got[0], want[0], rtol=1e-9, atol=1e-11)
        live = torch.isfinite(want[0])
        torch.testing.assert_close(got[1][live], want[1][live], rtol=1e-8, atol=1e-9)
        return
    for g, w in zip(got, want, strict=True):
        # Infinities (no path) must match exactly; assert_close checks inf == inf by value.
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


def softmax_logits(n: int = 9) -> torch.Tensor:
    """Rows that exercise every special case, in float64."""
    gen = torch.Generator().manual_seed(7)
    plain = torch.randn(4, n, generator=gen, dtype=F64) * 3
    masked = torch.randn(3, n, generator=gen, dtype=F64)
    masked[0, 2:5] = NEG_INF
    masked[1, ::2] = NEG_INF
    masked[2, 1:] = NEG_INF  # one live key: y = (1, 0, ..., 0) exactly
    one_hot = torch.full((2, n), -1e4, dtype=F64)
    one_hot[0, 3] = 0.0  # softmax underflows to an exact one-hot row
    one_hot[1, n - 1] = 0.0
    dominant = torch.zeros(2, n, dtype=F64)
    dominant[0, 0] = 30.0  # y_0 = 1 - 1e-12: exclusive sums must not cancel
    dominant[1, 4] = 60.0
    uniform = torch.zeros(1, n, dtype=F64)  # ties everywhere
    return torch.cat([plain, masked, one_hot, dominant, uniform])


def others_sum(probs: torch.Tensor) -> torch.Tensor:
    """Σ_{i != j} p_i for every j, summed directly: 1 - p_j without the cancellation (for the
    dominant rows 1 - p_j is below float64's resolution at 1)."""
    n = probs.shape[-1]
    off = 1.0 - torch.eye(n, dtype=probs.dtype)
    return (probs[:, None, :] * off).sum(-1)


def softmax_jacobian(probs: torch.Tensor) -> torch.Tensor:
    """J[r, i, j] = y_i (δ_ij - y_j) written out in full, J_jj = y_j Σ_{i != j} y_i."""
    eye = torch.eye(probs.shape[-1], dtype=probs.dtype)
    off = -probs[:, :, None] * probs[:, None, :]
    return torch.where(eye.bool(), torch.diag_embed(probs * others_sum(probs)), off)


def log_softmax_jacobian(log_probs: torch.Tensor) -> torch.Tensor:
    """J[r, i, j] = δ_ij - p_j written out in full, J_jj = Σ_{i != j} p_i."""
    probs = log_probs.exp()
    eye = torch.eye(probs.shape[-1], dtype=probs.dtype).bool()
    off = (-probs[:, None, :]).expand(probs.shape[0], -1, -1)
    return torch.where(eye, torch.diag_embed(others_sum(probs)), off)


def log_softmax_log_jacobian(log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log|J|, sign J) of log_softmax from the log-probabilities, brute force: the diagonal
    log Σ_{i != j} p_i as a logsumexp over the row with entry j left out (-1e4 log-probs are
    edges of weight e^-1e4, which float64's exp would turn into exact zeros)."""
    n = log_probs.shape[-1]
    eye = torch.eye(n, dtype=torch.bool)
    others = log_probs[:, None, :].masked_fill(eye, NEG_INF)  # [rows, j, i]
    diag = torch.logsumexp(others, -1)
    log = torch.where(eye, torch.diag_embed(diag), log_probs[:, None, :].expand(-1, n, -1))
    sign = torch.where(eye, 1.0, -1.0).to(log.dtype).expand(log.shape)
    return log, sign


def log_softmax_reference(sr: Semiring, m: State, log_probs: torch.Tensor) -> State:
    """The dense log_softmax Jacobian: linear for Real; for the others every edge in log form,
    one ``scale_log`` per (i, j) and a semiring sum over i (no matmul, so no shifted BLAS that
    could drop an e^-1e4 edge)."""
    if sr.linear_weights:
        return dense(sr, m, log_softmax_jacobian(log_probs))
    log, sign = log_softmax_log_jacobian(log_probs)  # [rows, i, j]
    edges = sr.scale_log(tuple(c[:, :, None] for c in m), log, sign)
    return sr.sum(edges, [1])


def normalization_jacobian(x_hat, rstd, gain, gain_per_row) -> torch.Tensor:
    """J[r, i, j] = g_i rstd_r (δ_ij - 1/n - x̂_ri x̂_rj / n) written out in full."""
    n = x_hat.shape[-1]
    eye = torch.eye(n, dtype=x_hat.dtype)
    centred = eye - (1.0 + x_hat[:, :, None] * x_hat[:, None, :]) / n
    g = gain[:, None, None] if gain_per_row else gain[None, :, None]
    return g * rstd[:, None, None] * centred


def layer_norm_stats(x: torch.Tensor, eps: float = 1e-5):
    var, mean = torch.var_mean(x, -1, unbiased=False, keepdim=True)
    rstd = (var + eps).rsqrt()
    return (x - mean) * rstd, rstd.squeeze(-1)


# --- exclusive reductions ------------------------------------------------------------------------
def brute_exclusive(a: torch.Tensor, reduce) -> torch.Tensor:
    n = a.shape[-1]
    cols = []
    for j in range(n):
        keep = torch.arange(n) != j
        cols.append(reduce(a[:, keep]) if n > 1 else torch.full_like(a[:, 0], NEG_INF))
    return torch.stack(cols, -1)


def test_exclusive_reductions_match_brute_force() -> None:
    a = torch.tensor(
        [
            [0.0, -50.0, -60.0, -700.0],  # one dominant entry: naive log(total - own) fails
            [1.0, 1.0, -2.0, NEG_INF],  # a tie at the top
            [NEG_INF, 3.0, NEG_INF, NEG_INF],  # a single live entry
            [NEG_INF] * 4,  # nothing
            [5.0, 4.0, 3.0, 2.0],
        ],
        dtype=F64,
    )
    lse, _ = exclusive_logsumexp(a)
    want = brute_exclusive(a, lambda t: torch.logsumexp(t, -1))
    # Log-domain values: absolute error = relative error of the sum (the brute force rounds
    # log(1 + 1e-26) to 0 where the kernel keeps it; both are right to 1e-14).
    torch.testing.assert_close(lse, want, rtol=0, atol=1e-14)
    torch.testing.assert_close(exclusive_max(a), brute_exclusive(a, lambda t: t.amax(-1)))
    flipped = -a
    want_min = -brute_exclusive(a, lambda t: t.amax(-1))
    torch.testing.assert_close(exclusive_min(flipped), want_min)


def test_exclusive_weighted_mean_matches_brute_force() -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(6, 7, generator=gen, dtype=F64) * 4
    a[0, 0] = 40.0  # dominant
    a[1, 1:] = NEG_INF  # one live entry: the others see only it, it sees nothing
    a[2, ::3] = NEG_INF
    b = torch.randn(6, 7, generator=gen, dtype=F64) * 10
    _, mean = exclusive_logsumexp(a, b)
    want = torch.zeros_like(a)
    for j in range(a.shape[-1]):
        keep = torch.arange(a.shape[-1]) != j
        w = torch.softmax(a[:, keep], -1).nan_to_num(0.0)
        want[:, j] = (w * b[:, keep]).sum(-1)
    torch.testing.assert_close(mean, want, rtol=1e-10, atol=1e-10)


def test_single_entry_rows() -> None:
    a = torch.tensor([[2.0], [NEG_INF]], dtype=F64)
    assert torch.equal(exclusive_max(a), torch.full_like(a, NEG_INF))
    assert torch.equal(exclusive_logsumexp(a)[0], torch.full_like(a, NEG_INF))


# --- softmax and log_softmax ---------------------------------------------------------------------
def test_softmax_matches_dense_jacobian(semiring: Semiring) -> None:
    probs = torch.softmax(softmax_logits(), -1)
    assert probs[6, 0] == 1.0 and probs[7, 3] == 1.0  # exact one-hot rows really occur
    m = random_state(semiring, *probs.shape, seed=1)
    got = softmax_messages(semiring, m, probs)
    assert got is not None
    assert_same_state(semiring, got, dense(semiring, m, softmax_jacobian(probs)))


def test_log_softmax_matches_dense_jacobian(semiring: Semiring) -> None:
    log_probs = torch.log_softmax(softmax_logits(), -1)
    m = random_state(semiring, *log_probs.shape, seed=2)
    got = log_softmax_messages(semiring, m, log_probs)
    assert got is not None
    assert_same_state(semiring, got, log_softmax_reference(semiring, m, log_probs))


@pytest.mark.parametrize("n", [1, 2])
def test_tiny_rows(semiring: Semiring, n: int) -> None:
    logits = torch.randn(3, n, generator=torch.Generator().manual_seed(n), dtype=F64)
    m = random_state(semiring, 3, n, seed=3)
    probs, log_probs = torch.softmax(logits, -1), torch.log_softmax(logits, -1)
    assert_same_state(
        semiring, softmax_messages(semiring, m, probs), dense(semiring, m, softmax_jacobian(probs))
    )
    want = log_softmax_reference(semiring, m, log_probs)
    assert_same_state(semiring, log_softmax_messages(semiring, m, log_probs), want)


def test_real_softmax_matches_autograd() -> None:
    x = softmax_logits().requires_grad_()
    gen = torch.Generator().manual_seed(4)
    g = torch.randn(x.shape, generator=gen, dtype=F64)
    for fn, kernel in [
        (torch.softmax, softmax_messages),
        (torch.log_softmax, log_softmax_messages),
    ]:
        x_live = torch.where(torch.isfinite(x), x, -1e300)  # keep autograd free of inf - inf
        y = fn(x_live, -1)
        (want,) = torch.autograd.grad(y, x_live, g)
        (got,) = kernel(semipack.Real(), (g,), y.detach())
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_user_semirings_fall_back_to_the_dense_path() -> None:
    class WeakestPath(semipack.MaxProd):
        """A subclass that changes plus must not inherit the O(n) kernels."""

        def plus(self, a, b):
            return (torch.minimum(a[0], b[0]),)

        def sum(self, a, dims, keepdim=False):
            return (a[0].amin(dims, keepdim=keepdim),)

    class Renamed(semipack.MaxProd):
        """A subclass that changes nothing keeps them."""

    sr = WeakestPath()
    assert not has_fast_rowwise(sr) and has_fast_rowwise(semipack.MaxProd())
    assert has_fast_rowwise(Renamed())
    probs = torch.softmax(softmax_logits(), -1)
    m = random_state(sr, *probs.shape, seed=5)
    assert softmax_messages(sr, m, probs) is None
    assert_same_state(sr, softmax_contract(sr, m, probs), dense(sr, m, softmax_jacobian(probs)))


# --- layer_norm and batch_norm -------------------------------------------------------------------
def norm_case(kind: str, rows: int = 6, n: int = 24):
    """(x_hat, rstd, gain, gain_per_row) for a normalisation layout with exact-zero gains."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(rows, n, generator=gen, dtype=F64) * 2 + 1
    x_hat, rstd = layer_norm_stats(x)
    if kind == "layer_norm_plain":
        return x_hat, rstd, torch.ones(n, dtype=F64), False
    if kind == "layer_norm_affine":
        gain = torch.randn(n, generator=gen, dtype=F64)
        gain[[2, 7]] = 0.0
        return x_hat, rstd, gain, False
    gain = torch.randn(rows, generator=gen, dtype=F64)  # batch_norm: one gain per channel (row)
    gain[1] = 0.0
    return x_hat, rstd, gain, True


NORM_KINDS = ["layer_norm_plain", "layer_norm_affine", "batch_norm_train"]


@pytest.mark.parametrize("kind", NORM_KINDS)
def test_normalization_eager_kernel_matches_dense_jacobian(semiring: Semiring, kind: str) -> None:
    x_hat, rstd, gain, per_row = norm_case(kind)
    m = random_state(semiring, *x_hat.shape, seed=6)
    got = normalized_messages(semiring, m, x_hat, rstd, gain, per_row, mode="eager")
    want = dense(semiring, m, normalization_jacobian(x_hat, rstd, gain, per_row))
    assert_same_state(semiring, got, want)


def test_normalization_compiled_kernel_matches_dense_jacobian(semiring: Semiring) -> None:
    if not compile_enabled():
        pytest.skip("compiled kernels are switched off (SEMIPACK_COMPILE=0)")
    # Both layouts share one compiled kernel per semiring (dynamic shapes, one dtype).
    for kind, (rows, n) in zip(NORM_KINDS, [(5, 40), (7, 33), (4, 56)], strict=True):
        x_hat, rstd, gain, per_row = norm_case(kind, rows, n)
        m = random_state(semiring, rows, n, seed=8)
        got = normalized_messages(semiring, m, x_hat, rstd, gain, per_row, mode="compiled")
        want = dense(semiring, m, normalization_jacobian(x_hat, rstd, gain, per_row))
        assert_same_state(semiring, got, want)


def test_signed_max_prod_compiles_its_normalisation_kernel_from_a_million_pairs() -> None:
    """Without a native kernel, rows below 2^24 pairs take the dense contraction, except for
    SignedMaxProd, whose dense form is slow enough that compiling pays from 2^20 pairs (one
    MiniLM sentence: 20 x 384 x 384). float64 rows: no native kernel for any semiring."""
    if not compile_enabled():
        pytest.skip("compiled kernels are switched off (SEMIPACK_COMPILE=0)")
    x_hat, rstd, gain, per_row = norm_case(NORM_KINDS[0], 8, 384)  # 1.18M pairs
    small = norm_case(NORM_KINDS[0], 6, 384)  # 0.88M pairs
    for sr, compiles in ((semipack.SignedMaxProd(), True), (semipack.MaxProd(), False)):
        m = random_state(sr, 8, 384, seed=8)
        got = normalized_messages(sr, m, x_hat, rstd, gain, per_row)
        assert (got is not None) == compiles, sr.name
        if compiles:
            want = dense(sr, m, normalization_jacobian(x_hat, rstd, gain, per_row))
            assert_same_state(sr, got, want)
        m_small = random_state(sr, 6, 384, seed=8)
        assert normalized_messages(sr, m_small, *small) is None, sr.name


def test_real_layer_norm_and_batch_norm_match_autograd() -> None:
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 5, 16, generator=gen, dtype=F64, requires_grad=True)
    weight = torch.randn(16, generator=gen, dtype=F64)
    weight[3] = 0.0
    g = torch.randn(3, 5, 16, generator=gen, dtype=F64)
    (want,) = torch.autograd.grad(F.layer_norm(x, (16,), weight, None, 1e-5), x, g)
    x_hat, rstd = layer_norm_stats(x.detach().reshape(-1, 16))
    (got,) = normalized_messages(semipack.Real(), (g.reshape(-1, 16),), x_hat, rstd, weight, False)
    torch.testing.assert_close(got.reshape(x.shape), want, rtol=1e-10, atol=1e-12)

    xb = torch.randn(4, 3, 2, 5, generator=gen, dtype=F64, requires_grad=True)
    wb = torch.tensor([0.5, 0.0, -2.0], dtype=F64)
    gb = torch.randn(xb.shape, generator=gen, dtype=F64)
    yb = F.batch_norm(xb, None, None, wb, None, training=True, eps=1e-5)
    (want_b,) = torch.autograd.grad(yb, xb, gb)
    rows = xb.detach().movedim(1, 0).reshape(3, -1)
    x_hat_b, rstd_b = layer_norm_stats(rows)
    m_b = (gb.movedim(1, 0).reshape(3, -1),)
    (got_b,) = normalized_messages(semipack.Real(), m_b, x_hat_b, rstd_b, wb, True)
    got_b = got_b.reshape(3, 4, 2, 5).movedim(0, 1)
    torch.testing.assert_close(got_b, want_b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("sr", [semipack.MaxProd(), semipack.Entropy()], ids=lambda s: s.name)
def test_compiled_path_inside_a_semiring_backward(sr: Semiring, monkeypatch) -> None:
    """The rules pick the fused kernel above the size threshold, also inside backward."""
    if not compile_enabled():
        pytest.skip("compiled kernels are switched off (SEMIPACK_COMPILE=0)")
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(4, 3, 20, generator=gen, dtype=F64, requires_grad=True)
    weight = torch.randn(20, generator=gen, dtype=F64)
    xb = torch.randn(5, 3, 4, generator=gen, dtype=F64, requires_grad=True)
    wb = torch.randn(3, generator=gen, dtype=F64)

    def values() -> list[torch.Tensor]:
        y = F.layer_norm(x, (20,), weight, None).sin().sum()
        yb = F.batch_norm(xb, None, None, wb, None, training=True).sin().sum()
        (a,) = semipack.grad(y, x, sr)
        (b,) = semipack.grad(yb, xb, sr)
        return [a, b]

    monkeypatch.setattr(knorm, "COMPILE_MIN_PAIRS", math.inf)
    want = values()
    monkeypatch.setattr(knorm, "COMPILE_MIN_PAIRS", 0)
    calls = []
    kernel = knorm.compiled_normalization(type(sr))
    monkeypatch.setattr(
        knorm, "compiled_normalization", lambda cls: lambda *a: calls.append(1) or kernel(*a)
    )
    got = values()
    assert len(calls) == 2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, equal_nan=True)


@pytest.mark.parametrize(
    "sr", [semipack.LogSum(), semipack.Entropy(), semipack.LogCount()], ids=lambda s: s.name
)
def test_compiled_normalization_kernels_trace_the_shifted_exponential(
    sr: Semiring, monkeypatch
) -> None:
    """A fused normalisation kernel calls the log-space helpers, which run their own compiled
    forms on a base-less flat tensor (``set_``) from 16k entries: traced into the fused kernel
    that failed in inductor's fake tensors (float64 train-mode batch norm, EfficientNet: one
    RuntimeWarning and a traceback per kernel, then the eager fallback). Traced, they are the
    plain ops; no warning, and the values of the dense Jacobian."""
    if not compile_enabled():
        pytest.skip("compiled kernels are switched off (SEMIPACK_COMPILE=0)")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4096, 8, generator=gen, dtype=F64, requires_grad=True)  # 32k entries
    weight = torch.randn(8, generator=gen, dtype=F64)

    def value() -> torch.Tensor:
        y = F.layer_norm(x, (8,), weight, None).sin().sum()
        return semipack.grad(y, x, sr)[0]

    monkeypatch.setattr(knorm, "COMPILE_MIN_PAIRS", math.inf)  # the dense contraction
    want = value()
    monkeypatch.setattr(knorm, "COMPILE_MIN_PAIRS", 0)  # the fused kernel (float64: no native)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed compilation warns
        got = value()
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11, equal_nan=True)


def test_normalization_compiled_kernel_handles_outlier_features(semiring: Semiring) -> None:
    """Rows dominated by one or two huge features (x̂_j² > (n - 2) / 2), as in transformers with
    massive activations: the all-pairs kernels' diagonal correction does not hold there and those
    columns are recomputed exactly. A row with a single non-zero entry has x̂_0² = n - 1, where
    the true diagonal derivative 1 - (1 + x̂_0²) / n is (numerically) zero."""
    if not compile_enabled():
        pytest.skip("compiled kernels are switched off (SEMIPACK_COMPILE=0)")
    gen = torch.Generator().manual_seed(21)
    rows, n = 6, 40
    x = torch.randn(rows, n, generator=gen, dtype=F64)
    x[0, 3] = 400.0  # one massive feature
    x[1, 5], x[1, 9] = 300.0, -300.0  # two
    x[2] = 0.0
    x[2, 0] = 7.0  # a single non-zero entry
    x_hat, rstd = layer_norm_stats(x)
    assert (x_hat * x_hat > (n - 2) / 2).sum() >= 4
    gain = torch.randn(n, generator=gen, dtype=F64)
    m = random_state(semiring, rows, n, seed=9)
    got = normalized_messages(semiring, m, x_hat, rstd, gain, False, mode="compiled")
    want = dense(semiring, m, normalization_jacobian(x_hat, rstd, gain, False))
    assert_same_state(semiring, got, want)


def boundary_rows(n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_hat, rstd) with pairs exactly on |1 + x̂_i x̂_j| = 0 (x̂ = ±1), ties, exact zeros of x̂
    (one of them negative), a massive outlier feature, and ordinary rows."""
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(6, n, generator=gen, dtype=F64)
    x[0] = torch.tensor([1.0, -1.0] * (n // 2), dtype=F64)  # x̂ = ±1 exactly
    x[1, : n // 2], x[1, n // 2 :] = 2.0, -3.0  # two values, many ties
    x[2] = torch.arange(n, dtype=F64) - (n - 1) / 2
    x[3, :] = 0.0
    x[3, 4], x[3, 7] = 5.0, -5.0  # x̂ exactly 0 in the other columns
    x[4, 2] = 300.0  # one massive feature
    x_hat, rstd = layer_norm_stats(x, eps=0.0)
    x_hat[3, 0] = -0.0
    assert (x_hat[0].abs() == 1.0).all() and (x_hat[3] == 0.0).sum() == n - 2
    return x_hat, rstd


@pytest.mark.parametrize(
    "sr", [semipack.MaxProd(), semipack.LogSum(), semipack.Entropy()], ids=lambda s: s.name
)
@pytest.mark.parametrize("n", [12, 40, 768, 1030])
def test_native_normalization_kernels_match_float64_dense_jacobian(sr: Semiring, n: int) -> None:
    """The hand-written float32 kernels (used with or without compilation) against the float64
    dense Jacobian, on the boundary rows, at transformer width and past SORTED_MIN_ENTRIES
    (the O(n log n) kernels), with a no-path row."""
    if not knorm.native_available():
        pytest.skip("native kernels unavailable (no AVX2 or no C compiler)")
    x_hat, rstd = boundary_rows(n)
    gen = torch.Generator().manual_seed(24)
    gain = torch.randn(n, generator=gen, dtype=F64)
    m = random_state(sr, 6, n, seed=25)
    m[0][5, :] = NEG_INF  # a row without any path
    want = dense(sr, m, normalization_jacobian(x_hat, rstd, gain, False))
    f32 = torch.float32
    args = (x_hat.to(f32), rstd.to(f32), gain.to(f32), False)
    got = normalized_messages(sr, tuple(c.to(f32) for c in m), *args, mode="compiled")
    assert all(g.dtype == f32 for g in got)
    torch.testing.assert_close(got[0].double(), want[0], rtol=0, atol=5e-5)
    if isinstance(sr, semipack.Entropy):
        live = torch.isfinite(want[0])
        torch.testing.assert_close(got[1].double()[live], want[1][live], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sr", [semipack.LogCount(), semipack.Boolean()], ids=lambda s: s.name)
@pytest.mark.parametrize("n", [12, 40, 768, 1030])
def test_count_sorted_kernels_match_the_dense_float32_jacobian(sr: Semiring, n: int) -> None:
    """LogCount's and Boolean's O(n log n) kernels against the dense contraction in the same
    dtype (which entries are exactly 0 is a property of float32's own rounding: the rows of 2.0
    and -3.0 normalise to x̂ = ±1 exactly in float32, not in float64), on the boundary rows,
    where every pair of opposite signs of a ±1 row has 1 + x̂_i x̂_j = 0, with a no-path row."""
    if not knorm.native_available():
        pytest.skip("native kernels unavailable (no AVX2 or no C compiler)")
    f32 = torch.float32
    x_hat, rstd = (t.to(f32) for t in boundary_rows(n))
    gain = torch.randn(n, generator=torch.Generator().manual_seed(24)).to(f32)
    m = random_state(sr, 6, n, seed=25)
    m = tuple(c.to(f32) if c.is_floating_point() else c for c in m)
    m[0][5, :] = sr.zero[0]
    zero_pairs = (1.0 + x_hat[:, :, None] * x_hat[:, None, :] == 0).sum()
    assert zero_pairs >= (n // 2) ** 2 * 2  # rows 0 and 1
    got = normalized_messages(sr, m, x_hat, rstd, gain, False, mode="compiled")
    want = normalized_messages(sr, m, x_hat, rstd, gain, False, mode="eager")
    if isinstance(sr, semipack.Boolean):
        assert torch.equal(got[0], want[0]) and not want[0].all() and want[0].any()
        # reaching only the -1 entries of the ±1 row: every +1 entry's pairs with them are 0
        reach = (x_hat[:1] < 0).to(f32)
        from semipack.kernels.normalization import boolean_fused, boolean_sorted

        sorted_form = boolean_sorted(reach, x_hat[:1])[0]
        assert torch.equal(sorted_form, boolean_fused(reach, x_hat[:1])[0])
        assert torch.equal(sorted_form, x_hat[:1] < 0)
        return
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=2e-6)
    assert torch.equal(got[0].isinf(), want[0].isinf())


def test_log_count_sorted_kernel_finds_products_rounded_to_minus_one() -> None:
    """Pairs whose float32 product rounds to exactly -1 although v is not the float nearest
    -1 / c (one ulp beside it): the search window around -1 / c must hold them. Counts (a
    message of log 1 = 0 everywhere) equal the all-pairs kernel's exactly."""
    from semipack.kernels.normalization import log_count_fused, log_count_sorted

    cs, vs = [], []
    for c in torch.rand(4000, generator=torch.Generator().manual_seed(1)) * 3 + 0.1:
        target = -1.0 / c
        for direction in (-10.0, 10.0):
            v = torch.nextafter(target, torch.tensor(direction))
            if 1.0 + v * c == 0 and len(cs) < 40:
                cs.append(float(c))
                vs.append(float(v))
    assert len(cs) == 40
    x_hat = torch.tensor([cs + vs, vs + cs])
    m = torch.zeros_like(x_hat)
    assert (1.0 + x_hat[:, :, None] * x_hat[:, None, :] == 0).sum() >= 2 * 2 * 40
    got, want = log_count_sorted(m, x_hat)[0].exp(), log_count_fused(m, x_hat)[0].exp()
    assert torch.equal(got.round(), want.round()) and (want.round() < 80).any()


@pytest.mark.parametrize("n", [12, 40, 768, 1030])
def test_top_path_normalization_kernel_follows_a_best_edge(n: int) -> None:
    """TopPath through normalisation rows (the sorted envelope with its argmax, float32): the
    value is MaxProd's from the float64 dense Jacobian, and each output's successor id is that of
    an output entry i whose edge attains it (ids are unique here, so the id names i). Boundary
    rows: exact zero crossings, ties, outliers; a row and an output entry without paths."""
    if not knorm.native_available():
        pytest.skip("native kernels unavailable (no AVX2 or no C compiler)")
    x_hat, rstd = boundary_rows(n)
    gen = torch.Generator().manual_seed(31)
    gain = torch.randn(n, generator=gen, dtype=F64)
    gain[3] = 0.0  # an output entry without edges
    (values,) = random_state(semipack.MaxProd(), 6, n, seed=32)
    values[5, :] = NEG_INF  # a row without any path
    ids = torch.arange(6 * n).reshape(6, n)
    jac = normalization_jacobian(x_hat, rstd, gain, False)
    (want,) = dense(semipack.MaxProd(), (values,), jac)
    f32 = torch.float32
    args = (x_hat.to(f32), rstd.to(f32), gain.to(f32), False)
    got, succ = normalized_messages(
        semipack.TopPath(), (values.to(f32), ids), *args, mode="compiled"
    )
    assert got.dtype == f32 and succ.dtype == torch.int64
    torch.testing.assert_close(got.double(), want, rtol=0, atol=5e-5)
    live = torch.isfinite(want)
    assert (~live).any() and live.any()
    rows = torch.arange(6)[:, None].expand(6, n)
    i = succ - rows * n
    assert ((i >= 0) & (i < n))[live].all()
    edge = (
        values[rows, i.clamp(0, n - 1)] + jac[rows, i.clamp(0, n - 1), torch.arange(n)].abs().log()
    )
    torch.testing.assert_close(edge[live], want[live], rtol=0, atol=5e-5)


def test_native_normalization_kernels_take_float32_cpu_rows_only() -> None:
    """The C kernels read host memory: rows on another device (a CUDA tensor's pointer would
    crash them) or in another dtype go to the compiled or dense kernels."""
    from semipack.kernels import normalization as kernels
    from semipack.messages.normalization import native_kernel

    if not knorm.native_available():
        pytest.skip("native kernels unavailable (no AVX2 or no C compiler)")
    cpu = torch.zeros(2, 8)
    assert native_kernel(kernels.MAX_PROD, cpu) is kernels.max_prod_native
    assert native_kernel(kernels.TOP_PATH, cpu) is kernels.top_path_native
    assert native_kernel(kernels.MAX_PROD, cpu.double()) is None
    assert native_kernel(kernels.MAX_PROD, torch.zeros(2, 8, device="meta")) is None
    assert native_kernel(kernels.LOG_COUNT, cpu) is kernels.log_count_sorted
    assert native_kernel(kernels.SIGNED, cpu) is None  # no hand-written kernel


@pytest.mark.parametrize(
    "sr",
    [semipack.MaxProd(), semipack.TopPath(), semipack.LogSum(), semipack.Entropy()],
    ids=lambda s: s.name,
)
@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_a_nan_or_infinite_message_reaches_its_whole_normalisation_row(sr, poison) -> None:
    """A NaN message (a NaN weight downstream) or an infinite one (sqrt'(0) downstream) entering
    a layer norm row of 1024 entries: the Jacobian is dense, so every input of the row gets NaN
    (as torch's own gradient does) or an infinite value, as the dense Jacobian gives. The fused
    kernels shift rows by their largest message and drop NaN in maxima; such rows must not
    reach them (they gave finite values for half the row or all but one entry)."""
    n = 1024
    gen = torch.Generator().manual_seed(41)
    x = torch.randn(2, n, generator=gen, requires_grad=True)
    w = torch.randn(2, n, generator=gen)
    if poison == "nan":
        w[0, 5] = float("nan")

    def loss() -> torch.Tensor:
        y = torch.nn.functional.layer_norm(x, (n,))
        out = (y * w).sum()
        return out + (y[0, 5] - y[0, 5].detach()).sqrt() if poison == "inf" else out

    (got,) = semipack.grad(loss(), [x], sr)
    compiled = importlib.import_module("semipack.kernels.compiled")
    native = importlib.import_module("semipack.kernels.native")
    had_compile, had_native = compiled.compile_enabled(), native.native_available()
    try:  # the dense Jacobian: no fused kernel at all
        native.set_native(False)
        compiled.set_compile(False)
        (want,) = semipack.grad(loss(), [x], sr)
    finally:
        native.set_native(had_native)
        compiled.set_compile(had_compile)
    torch.testing.assert_close(got, want, equal_nan=True)
    if isinstance(sr, semipack.Entropy):
        return  # its readout is the entropy; the edge's weight shows in the other semirings
    if poison == "nan":
        assert torch.isnan(got[0]).all()
    else:
        assert torch.equal(got[0], torch.full((n,), float("inf")))
    assert torch.isfinite(got[1]).all()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_k_best_softmax_rows_match_the_dense_jacobian(k: int) -> None:
    """KBest's softmax and log_softmax rows through its exclusive k best (the row's 2k best
    paths, ranked once) equal the dense Jacobian's: values, and the successor of every slot
    holding a path (one-hot rows, masked keys and rows of one live entry included)."""
    sr = semipack.KBest(k)
    logits = softmax_logits()
    probs, log_probs = torch.softmax(logits, -1), torch.log_softmax(logits, -1)
    m = random_state(sr, *probs.shape, seed=4)
    cases = [
        (softmax_messages(sr, m, probs), dense(sr, m, softmax_jacobian(probs))),
        (log_softmax_messages(sr, m, log_probs), log_softmax_reference(sr, m, log_probs)),
    ]
    for got, want in cases:
        assert got is not None  # the O(n k) form, not the dense fallback
        values, ids = torch.stack(got[:k], -1), torch.stack(got[k:], -1)
        want_values, want_ids = torch.stack(want[:k], -1), torch.stack(want[k:], -1)
        torch.testing.assert_close(values, want_values, rtol=1e-9, atol=1e-11)
        live = torch.isfinite(want_values)
        assert live.any() and (~live).any()
        assert torch.equal(ids[live], want_ids[live])


def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """float32 entries as integers in the order of their values, one apart per ulp."""
    i = t.view(torch.int32).to(torch.int64)
    return torch.where(i < 0, -(i & 0x7FFFFFFF), i)


def _assert_kernel_values(got: torch.Tensor, want: torch.Tensor) -> None:
    """A compiled elementwise kernel's result against its eager form. On the CPU: the same
    bits (NaN matching NaN). On CUDA inductor emits Triton, whose exp, log and division round
    differently from CUDA's eager kernels: the same NaN, infinity and zero entries (no path
    appears or vanishes), finite values within 2 ulps (the H200's largest difference,
    2026-11-28, ``dev/gpu_check/unequal.py``)."""
    assert torch.equal(got.isnan(), want.isnan())
    if got.device.type == "cpu":
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
        return
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got == 0, want == 0)
    assert torch.equal(got[got.isinf()], want[want.isinf()])
    finite = got.isfinite()
    distance = (_ordered_bits(got[finite]) - _ordered_bits(want[finite])).abs()
    assert distance.numel() == 0 or int(distance.max()) <= 2


_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _GPU])], ids=["cpu", "cuda"]
)
@pytest.mark.parametrize("shape", [(300, 200), (7, 5)], ids=["fused", "eager"])
def test_entropy_elementwise_kernels_equal_their_eager_forms(shape, device: str) -> None:
    """The Entropy readout and mean surprisal run compiled on large states: the values of
    the eager ops (``_assert_kernel_values``: the same bits on the CPU), with "no path" (-inf),
    zero totals, infinities and NaN among the entries; the state pair's one-loop kernel gives
    the values of its two halves' kernels."""
    from semipack.kernels.logspace import abs_and_xlogx, exp_, log_magnitude_plus_, xlogx
    from semipack.semirings.entropy import (
        _entropy_pair,
        _entropy_readout,
        _mean_kernel,
        _mean_surprisal,
        _shared_shift,
    )

    same = _assert_kernel_values
    torch.manual_seed(0)
    log_z, mean = torch.randn(shape) * 30, torch.randn(shape)
    log_z.view(-1)[::7] = float("-inf")
    log_z.view(-1)[3::11] = float("inf")
    log_z.view(-1)[5::13] = float("nan")
    log_z, mean = log_z.to(device), mean.to(device)
    same(_entropy_readout(log_z, mean), _entropy_readout.eager(log_z, mean))
    total, weighted, less = torch.rand(shape), torch.randn(shape), torch.randn(shape)
    total.view(-1)[::5] = 0.0
    total.view(-1)[2::9] = float("inf")
    total, weighted, less = total.to(device), weighted.to(device), less.to(device)
    got = _mean_surprisal(total, weighted.clone(), less)
    same(got, _mean_kernel.eager(total, weighted.clone(), less))
    # over flat views with a 0-d subtrahend, and on a transposed layout
    scalar = torch.tensor(0.5, device=device)
    got = _mean_surprisal(total, weighted.clone(), scalar)
    same(got, _mean_kernel.eager(total, weighted.clone(), scalar))
    got = _mean_surprisal(total.t(), weighted.t().clone(), less.t())
    same(got, _mean_kernel.eager(total.t(), weighted.t().clone(), less.t()))
    # both halves of a product's state in one loop: the values of the mean's and the log's
    # own kernels, one after the other
    shift = torch.tensor(-3.25, device=device)
    for subtracted in (None, less):
        got = _entropy_pair(total.clone(), weighted.clone(), shift, subtracted)
        alone = total.clone()
        zero = torch.zeros((), device=device)
        mean = _mean_surprisal(alone, weighted.clone(), zero if subtracted is None else less)
        want = (log_magnitude_plus_(alone, shift), mean)
        for g, w in zip(got, want, strict=True):
            same(g, w)
    # an activation's magnitudes and their |x| log|x| in one loop: the values of the two
    # kernels
    x = torch.randn(shape)
    x.view(-1)[::6] = 0.0
    x.view(-1)[1::6] = -0.0
    x.view(-1)[2::17] = float("nan")
    x = x.to(device)
    mag, mag_log_mag = abs_and_xlogx(x)
    same(mag, x.abs())
    same(mag_log_mag, xlogx(x.abs()))
    # a message's shifted exponential and its product with the surprisal in one loop, written
    # in the message's own layout (channels-last included)
    for layout in (torch.contiguous_format, torch.channels_last):
        log_z4 = torch.randn(2, *shape, 3) - 3
        log_z4.view(-1)[::5] = float("-inf")
        log_z4 = log_z4.to(device=device, memory_format=layout)
        r4 = torch.rand(log_z4.shape).to(device=device, memory_format=layout)
        e, e_r, shift = _shared_shift((log_z4, r4))
        want_e = exp_(log_z4 - shift)
        assert e.stride() == log_z4.stride()
        same(e, want_e)
        same(e_r, want_e * r4)


@pytest.mark.parametrize(
    "op",
    [torch.ops.aten.cudnn_batch_norm_backward, torch.ops.aten.miopen_batch_norm_backward],
    ids=["cudnn", "miopen"],
)
def test_fused_batch_norm_backward_rules_draw_the_native_graph(op, semiring_name: str) -> None:
    """cuDNN's and MIOpen's train-mode batch norm backward (the ops autograd calls on a GPU)
    give the native rule's messages, bit for bit, for the input, gain and bias. The ops have no
    CPU kernel, so they are called with state-only messages: only the rule runs."""
    from helpers import SEMIRINGS

    from semipack.messages.message import Message

    sr = SEMIRINGS[semiring_name]()
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(4, 3, 2, 5, generator=gen, dtype=F64)
    weight = torch.tensor([0.5, 0.0, -2.0], dtype=F64)
    eps = 1e-5
    mean = x.mean((0, 2, 3))
    invstd = (x.var((0, 2, 3), unbiased=False) + eps).rsqrt()
    weights = torch.randn(x.shape, generator=gen, dtype=F64)
    weights[0, 1] = 0.0  # some output entries without a path
    msg = Message(None, sr.lift(weights), sr, F64)
    native = torch.ops.aten.native_batch_norm_backward(
        msg, x, weight, None, None, mean, invstd, True, eps, [True, True, True]
    )
    extra = [torch.empty(0)] if op is torch.ops.aten.cudnn_batch_norm_backward else []
    fused = op(x, msg, weight, None, None, mean, invstd, eps, *extra)
    assert len(fused) == len(native) == 3
    for got, want in zip(fused, native, strict=True):
        for a, b in zip(got.parts, want.parts, strict=True):
            assert torch.equal(a.isnan(), b.isnan())
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), (semiring_name, a, b)


class _RmsNorm(torch.nn.Module):
    def __init__(self, gain: torch.Tensor | None) -> None:
        super().__init__()
        self.gain = None if gain is None else torch.nn.Parameter(gain.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.gain, 1e-6)


@pytest.mark.parametrize("with_gain", [True, False], ids=["gain", "no_gain"])
def test_fused_rms_norm_backward_rule_draws_the_cpu_composite(
    semiring_name: str, with_gain: bool
) -> None:
    """The fused RMS norm backward (``_fused_rms_norm_backward``: what autograd calls for
    ``F.rms_norm`` and ``nn.RMSNorm`` on a GPU; trial 111 found it without a rule) gives the
    states the CPU's composite ``x · rsqrt(mean(x²) + eps) · w`` gives, for the input and the
    gain: values do not depend on the device. The op has no CPU kernel, so it is called with
    state-only messages; the composite's states come from a pass over ``F.rms_norm`` on the
    CPU. Exact zeros (an input entry, a whole row, a gain, an output without a path) keep
    their missing edges. TopPath is compared by its values (its ids are the pass's own)."""
    from helpers import SEMIRINGS

    from semipack.messages.message import Message

    sr = SEMIRINGS[semiring_name]()
    gen = torch.Generator().manual_seed(23)
    x0 = torch.randn(2, 3, 5, generator=gen, dtype=F64)
    x0[0, 1, 2] = 0.0  # no edge through its square
    x0[1, 2] = 0.0  # a row of zeros: r = eps^-1/2, no edge through any square
    gain = torch.randn(5, generator=gen, dtype=F64) if with_gain else None
    if gain is not None:
        gain[3] = 0.0
    weights = torch.randn(2, 3, 5, generator=gen, dtype=F64)
    weights[1, 0] = 0.0  # outputs without a path
    model, x = _RmsNorm(gain), x0.clone().requires_grad_(True)
    with semipack.extend(model, sr, keep_state=True):
        (model(x) * weights).sum().backward()
    wanted = [x.semiring_state] + ([model.gain.semiring_state] if with_gain else [])
    rstd = (x0.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
    message = Message(None, sr.lift(weights), sr, F64)
    got = torch.ops.aten._fused_rms_norm_backward(message, x0, [5], rstd, gain, [True, True])
    assert len(got) == 2 and (got[1] is not None) == with_gain
    for state, want in zip(got, wanted, strict=False):
        parts, want = state.parts, want if isinstance(want, tuple) else (want,)
        if semiring_name == "top_path":
            parts, want = (sr.path_slots(parts)[0],), (sr.path_slots(want)[0],)
        for a, b in zip(parts, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, equal_nan=True)


class _FusedRmsNormNode(torch.autograd.Function):
    """A stand-in for CUDA's ``FusedRmsNormBackward0`` node on the CPU: its backward calls the
    fused op, so a pass runs the op's rule as part of a graph (the paths through it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        rstd = (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
        ctx.save_for_backward(x, gain, rstd)
        return x * rstd * gain

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, gain, rstd = ctx.saved_tensors
        shape = [x.shape[-1]]
        return torch.ops.aten._fused_rms_norm_backward(grad, x, shape, rstd, gain, [True, True])


def test_top_paths_through_the_fused_rms_norm_step_through_the_composites_nodes() -> None:
    """A best path through the fused RMS norm visits the nodes the CPU's composite has (x·r,
    r, mean + eps, the mean, x²), named as there; only the norm's output is named by its own
    node. Input entry (0, 1) has no direct edge (its output's weight is 0): its best path goes
    through its square and the row's mean to output (0, 0)."""
    x0 = torch.tensor([[3.0, 0.01, -0.5, 0.2], [0.3, -1.0, 2.0, 0.7]], dtype=F64)
    gain = torch.tensor([1.5, 0.4, -1.0, 2.0], dtype=F64)
    weights = torch.tensor([[1.0, 0.0, 0.2, 0.1], [0.5, -2.0, 0.3, 1.0]], dtype=F64)
    found = {}
    for how in ("composite", "fused"):
        tp = semipack.TopPath()
        x, g = x0.clone().requires_grad_(True), gain.clone().requires_grad_(True)
        y = F.rms_norm(x, (4,), g, 1e-6) if how == "composite" else _FusedRmsNormNode.apply(x, g)
        semipack.grad((y * weights).sum(), (x, g), tp)
        found[how] = [
            (tp.path(leaf, i).value, [s.op for s in tp.path(leaf, i).steps])
            for leaf, entries in ((x, [(i, j) for i in range(2) for j in range(4)]), (g, range(4)))
            for i in entries
        ]
    through_r = found["composite"][1][1]
    assert through_r == ["Pow", "Mean", "Add", "Rsqrt", "Mul", "Mul", "Mul", "Sum"]
    for (v_c, ops_c), (v_f, ops_f) in zip(found["composite"], found["fused"], strict=True):
        assert v_f == pytest.approx(v_c, rel=1e-12)
        # the composite's output node (the gain's Mul) is the stand-in's own node in the fused
        # graph; every other step is the same node
        output = len(ops_c) - 3  # ..., y (the norm's output), y * weights, the sum
        assert ops_f[:output] + ops_f[output + 1 :] == ops_c[:output] + ops_c[output + 1 :]
        assert ops_f[output] == "_FusedRmsNormNode"


@pytest.mark.parametrize(
    "sr", [semipack.MaxProd(), semipack.LogSum(), semipack.Entropy()], ids=lambda s: s.name
)
def test_compiled_softmax_kernel_is_one_graph(sr: Semiring) -> None:
    """The softmax row kernel compiles without a graph break: a break (a data-dependent branch
    such as the eager cut of vanishing weights) splits it into pieces that recompile per call
    pattern, up to dynamo's limit, after which they run eagerly."""
    if not compile_enabled():
        pytest.skip("compiled kernels are switched off (SEMIPACK_COMPILE=0)")
    import torch._dynamo

    from semipack.messages.rowwise import softmax_from_log_probs

    gen = torch.Generator().manual_seed(31)
    m = sr.lift(torch.randn(6, 9, generator=gen))
    log_probs = torch.log_softmax(torch.randn(6, 9, generator=gen), -1)
    log_probs[0, 0] = -200.0  # a weight below the cut: the branch would be taken
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda *a: softmax_from_log_probs(sr, a[:-1], a[-1]))(
        *m, log_probs
    )
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(lambda *a: softmax_from_log_probs(sr, a[:-1], a[-1]))(*m, log_probs)
    eager = softmax_from_log_probs(sr, m, log_probs)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("shape", [(5, 7, 3), (20, 384, 1536), (300, 200, 250)])
def test_entropy_matmul_gives_its_definition_bitwise(shape) -> None:
    """Entropy's generic product (the path when no shared shift serves) forms the mean
    surprisal with the fused kernel above ``FUSED_MIN_ELEMENTS``: the same bits as the plain
    expression ``where(s > 0, (t1 - t2) / s, 0)``, with rows without a path, zero weights and
    zero columns. ``log s + m`` comes from the compiled log (``log_magnitude_plus_``): the same
    ``-inf`` where no path is, finite values within float rounding of torch's log."""
    from semipack.kernels import blas
    from semipack.kernels.logspace import shifted_exp, xlogx
    from semipack.semirings.base import repair_underflow

    sr = semipack.Entropy()
    n, k, m = shape
    gen = torch.Generator().manual_seed(41)
    a0 = torch.randn(n, k, generator=gen) * 30
    a0[0] = -math.inf
    a0[1, :5] = -math.inf
    a1 = torch.rand(n, k, generator=gen)
    w = torch.randn(k, m, generator=gen)
    w[:, 0] = 0.0
    w[min(3, k - 1)] = 0.0

    e, shift = shifted_exp(a0, -1)
    mag = w.abs()
    s = blas.matmul(e, mag)  # the products the semiring takes (oneDNN's when large)
    t = blas.matmul(e * a1, mag) - blas.matmul(e, xlogx(mag))
    mean = torch.where(s > 0, t / s, torch.zeros_like(s))
    want = repair_underflow(sr, (a0, a1), lambda: sr.lift(w), (s.log().add_(shift), mean), shift)
    got = sr.matmul((a0, a1), w)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got[0].isfinite(), want[0].isfinite())
    assert torch.equal(got[0] == -math.inf, want[0] == -math.inf)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(7, 5), (8, 128, 768)])
def test_log_add_exp_and_entropy_plus_match_float64(shape) -> None:
    """LogSum's and Entropy's plus run compiled on large states (``log(1 + e)`` where torch's
    logaddexp has a scalar log1p): within float32 rounding of the float64 logaddexp, relative to
    the magnitude (an absolute error in log space), and exactly -inf, inf or NaN where the
    float64 value is, with "no path" on one or both sides, equal and infinite arguments."""
    from semipack.kernels.logspace import log_add_exp

    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(shape, generator=gen) * 40, torch.randn(shape, generator=gen) * 40
    a.view(-1)[::7] = -math.inf
    b.view(-1)[::5] = -math.inf
    b.view(-1)[1::9] = a.view(-1)[1::9]
    a.view(-1)[2::31] = math.inf
    b.view(-1)[3::37] = math.nan
    want = torch.logaddexp(a.double(), b.double())
    got = log_add_exp(a, b)
    assert got.dtype == torch.float32
    # two float32 ulps of the value (at least of 1): float32 logaddexp's own rounding
    torch.testing.assert_close(got.double(), want, rtol=2.4e-7, atol=2.4e-7, equal_nan=True)
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got.isnan(), want.isnan())

    r_a, r_b = torch.rand(shape, generator=gen), torch.rand(shape, generator=gen)
    got_z, got_r = semipack.Entropy().plus((a, r_a), (b, r_b))
    z = want
    safe = torch.where(z.isfinite(), z, 0.0)
    want_r = (a.double() - safe).exp() * r_a.double() + (b.double() - safe).exp() * r_b.double()
    torch.testing.assert_close(got_z.double(), z, rtol=2.4e-7, atol=2.4e-7, equal_nan=True)
    torch.testing.assert_close(got_r.double(), want_r, rtol=1e-5, atol=1e-6, equal_nan=True)


def _affine_case(sr: Semiring) -> tuple[State, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A per-channel affine map's inputs, [4, 8, 1600] (past FUSED_MIN_ELEMENTS): channel 2's
    x̂ is all exactly 0 (its gain has no edge), channel 3 has a few zeros, sample 1 and channel
    5 have no path, and channel 6's one large message meets x̂ = 0 while the others lie 120
    nats below it (the shifted gain sum underflows: the recomputed channels)."""
    gen = torch.Generator().manual_seed(0)
    here = torch.get_default_device()  # drawn on the CPU, placed where the tests run

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cpu").to(here)

    x = draw(4, 8, 1600)
    mean = draw(1, 8, 1)
    invstd = draw(1, 8, 1).abs() + 0.5
    x[:, 2] = mean[0, 2]
    x[0, 3, :5] = mean[0, 3]
    x[:, 6, 0] = mean[0, 6]
    m = tuple(p.clone() for p in sr.lift(draw(4, 8, 1600) * 3))
    m[0][1] = NEG_INF
    m[0][:, 5] = NEG_INF
    m[0][:, 6, 0] = 30.0
    m[0][:, 6, 1:] -= 120.0
    return m, x, mean, invstd


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("name", ["MaxProd", "LogSum", "LogCount", "Entropy"])
def test_per_channel_gain_and_bias_messages_equal_the_float64_definition(
    name, compiled, monkeypatch
):
    """The gain's and bias's messages of a per-channel affine map (every batch norm, layer norm
    and group norm ends in one) from one fused reduction per algebra (compiled from
    FUSED_MIN_ELEMENTS entries), against ``scale`` by x̂ and ``sum`` over batch and positions
    in float64; where there is no edge or no path, exactly the same."""
    from semipack.messages.normalization import affine_param_messages

    kcompiled = importlib.import_module("semipack.kernels.compiled")
    monkeypatch.setitem(kcompiled._state, "enabled", compiled)
    sr = getattr(semipack, name)()
    m, x, mean, invstd = _affine_case(sr)
    got_w, got_b = affine_param_messages(sr, m, x, mean, invstd)
    m64 = tuple(p.double() for p in m)
    x_hat = (x.double() - mean.double()) * invstd.double()
    want_w = sr.sum(sr.scale(m64, x_hat), [0, 2])
    want_b = sr.sum(m64, [0, 2])
    for got, want in ((got_w, want_w), (got_b, want_b)):
        assert got[0].dtype == torch.float32 and got[0].shape == (8,)
        assert torch.equal(got[0] == NEG_INF, want[0] == NEG_INF)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.double(), w, rtol=2e-6, atol=2e-6)
    assert got_w[0][2] == NEG_INF and got_w[0][5] == NEG_INF and got_b[0][5] == NEG_INF
    # channel 6: its gain sum underflowed after the shift and was recomputed
    assert -125 < got_w[0][6] < -100


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("name", ["MaxProd", "LogSum", "Entropy"])
def test_norm_layers_gains_and_biases_equal_the_generic_ops(name, train):
    """Batch norm (eval and train), group norm and layer norm (module extension) hand their
    gains and biases the fused per-channel reduction on activations past FUSED_MIN_ELEMENTS:
    the same semiring values as with compilation off (each layer's generic ``scale`` and
    ``sum``), within float32 rounding."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.GroupNorm(2, 8),
        torch.nn.Flatten(),
        torch.nn.LayerNorm(8 * 24 * 24),
        torch.nn.Linear(8 * 24 * 24, 3),
    )
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.2, 0.2)
        model[1].running_var.uniform_(0.5, 2.0)
    model.train(train)
    x = torch.randn(8, 3, 24, 24)
    norms = [model[1], model[2], model[4]]

    def run() -> list[torch.Tensor]:
        model.zero_grad()
        with semipack.extend(model, getattr(semipack, name)()):
            model(x).logsumexp(-1).sum().backward()
        out = [p.semiring_grad.clone() for n in norms for p in (n.weight, n.bias)]
        for n in norms:
            for p in (n.weight, n.bias):
                del p.semiring_grad
        return out

    fused = run()
    before = compile_enabled()
    set_compile(False)
    try:
        generic = run()
    finally:
        set_compile(before)
    for got, want in zip(fused, generic, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "case", ["huge activations", "subnormal shifted terms", "an infinite entry", "a NaN entry"]
)
@pytest.mark.parametrize("name", ["MaxProd", "LogSum", "LogCount", "Entropy"])
def test_per_channel_gains_of_extreme_inputs_are_the_generic_ops(name, case):
    """Activations of 1e35 (e |x̂| summed in float32 overflowed to inf where the log-domain
    sum is about 90; trial 93), messages 103.6 nats below their channel's largest (on an x̂
    of 0) meeting x̂ of 1e10 (each exp(m - M) subnormal, with 1-3 significant bits, lifted
    above the recompute floor by |x̂|: 0.34 nats off; trial 93), and a channel holding an
    infinite or NaN x̂ (the generic ops'
    conventions for them apply: the fused kernel hands those channels back): the fused
    gain and bias messages equal the generic ops' in float64 (NaN where they give NaN)."""
    from semipack.messages.normalization import _affine_params_generic, affine_param_messages

    sr = getattr(semipack, name)()
    gen = torch.Generator().manual_seed(3)
    here = torch.get_default_device()
    x = torch.randn(8, 3, 4096, generator=gen, device="cpu").to(here)
    if case == "huge activations":
        x = x * 1e35
    else:
        x[0, 1, 0] = float("inf") if case == "an infinite entry" else float("nan")
    mean, invstd = torch.zeros(1, 3, 1, device=here), torch.ones(1, 3, 1, device=here)
    m = sr.lift(torch.randn(8, 3, 4096, generator=gen, device="cpu").to(here))
    if case == "subnormal shifted terms":
        x = (x.abs() + 0.5) * 1e10
        x[0, :, 0] = 0.0
        m = tuple(p.clone() for p in m)
        m[0][:] = -103.6
        m[0][0, :, 0] = 0.0
    got = affine_param_messages(sr, m, x, mean, invstd)
    # the generic ops in float64 (a mean surprisal near -80 here sums 32768 float32 terms)
    m64 = tuple(p.double() for p in m)
    want = _affine_params_generic(sr, *m64, x.double(), mean.double(), invstd.double())[:2]
    for got_state, want_state in zip(got, want, strict=True):
        for g, w in zip(got_state, want_state, strict=True):
            assert torch.isfinite(g[0]) and torch.isfinite(g[2])  # the ordinary channels
            torch.testing.assert_close(g.double(), w, rtol=2e-6, atol=2e-5, equal_nan=True)


def test_elementwise_kernels_compile_once_for_every_pattern_of_size_one_dims() -> None:
    """torch.compile specialises sizes 0 and 1 and guards on a view's base: the Entropy
    readouts and the smallest-magnitude check on convolution weights of 1 x 1, 3 x 3, 1 x 7 and
    7 x 1 kernels were each compiled again until the recompilation limit (trial 94, Inception
    v3). Over flat views of their memory they compile once (a second entry at most, for a
    tensor made in inference mode), with the same values."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from semipack.messages import shared_shift
    from semipack.semirings import entropy

    sr = semipack.Entropy()
    shapes = [(64, 64, 3, 3), (64, 512, 1, 1), (64, 64, 1, 7), (64, 64, 7, 1), (1, 64, 600)]
    for shape in shapes:
        state = (torch.randn(shape), torch.rand(shape))
        state[0].view(-1)[::9] = float("-inf")
        want = torch.where(torch.isfinite(state[0]), state[0] + state[1], float("nan"))
        got = sr.readout(state)
        assert got.shape == want.shape and got.stride() == state[0].stride()
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(
            got.nan_to_num(), want.nan_to_num()
        )
        into = sr.readout_into(state, torch.empty(shape))
        assert torch.equal(into.nan_to_num(), want.nan_to_num())
        weights = torch.randn(shape, requires_grad=True)
        smallest = shared_shift._smallest_magnitude(weights)
        assert smallest == weights.detach().abs().min().item()
    for fn in (entropy._readout_fused, entropy._readout_into_fused):
        assert len(_debug_get_cache_entry_list(fn.__code__)) <= 2
    assert len(_debug_get_cache_entry_list(shared_shift._nonzero_magnitude_min.__code__)) <= 2


def test_log_plus_with_a_shift_per_row_equals_the_eager_log_and_add() -> None:
    """``log_magnitude_plus_`` with a row maximum as the shift ([..., N, 1]) runs as
    [rows, cols] views (one compiled variant whatever the rank); any other broadcast takes the
    eager log and add. Zeros (no path) give -inf, NaN stays NaN; the compiled log is within
    float32 rounding of torch's."""
    from semipack.kernels.logspace import _rows, log_magnitude_, log_magnitude_plus_

    torch.manual_seed(0)
    for shape, shift_shape in [((4, 300, 64), (4, 300, 1)), ((300, 128), (1, 128))]:
        mag = torch.rand(shape)
        mag.view(-1)[::7] = 0.0
        mag.view(-1)[3::11] = float("nan")
        shift = torch.randn(shift_shape) * 10
        assert (_rows(mag, shift) is not None) == (shift_shape[-1] == 1)
        got = log_magnitude_plus_(mag.clone(), shift)
        want = log_magnitude_(mag.clone()).add_(shift)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.isneginf(), want.isneginf())
        finite = want.isfinite()
        torch.testing.assert_close(got[finite], want[finite], rtol=3e-7, atol=1e-6)


@pytest.mark.skipif(not knorm.native_available(), reason="no native kernels here")
@pytest.mark.parametrize("shape", [(2, 3, 8), (3, 5, 13), (1, 4, 1000), (2, 16, 49)], ids=str)
@pytest.mark.parametrize(
    "case", ["ordinary", "zero x̂", "+inf message on zero x̂", "NaN message", "NaN x", "inf x",
             "no path", "subnormal x̂"]
)  # fmt: skip
def test_native_max_affine_loop_equals_the_torch_reduction(shape, case):
    """MaxProd's per-channel gain and bias by the native loop (``max_affine_f32``) against
    torch's eager ``max_plus`` reduction in float64 on the same float32 inputs: equal within
    float32 rounding of the log, with -inf, +inf and NaN exactly where torch puts them (NaN
    for a NaN entry or +inf + log 0, +inf for an infinite |x̂|), in the vector body and in the
    tail of each row."""
    from semipack.kernels import affine_params
    from semipack.kernels.native import max_affine_f32

    gen = torch.Generator().manual_seed(sum(shape))
    m = torch.randn(shape, generator=gen) * 3
    x = torch.randn(shape, generator=gen)
    mean = torch.randn(1, shape[1], 1, generator=gen)
    invstd = torch.rand(1, shape[1], 1, generator=gen) + 0.5
    last = shape[2] - 1  # in the tail where the row length is not a multiple of 8
    if case == "zero x̂":
        x[:, 1] = mean[0, 1]
    elif case == "+inf message on zero x̂":
        x[0, 1, last] = mean[0, 1]
        m[0, 1, last] = float("inf")
    elif case == "NaN message":
        m[0, 1, 0] = float("nan")
    elif case == "NaN x":
        x[-1, 2, last] = float("nan")
    elif case == "inf x":
        x[0, 0, 3 % shape[2]] = float("inf")
    elif case == "no path":
        m[:, 2] = float("-inf")
    elif case == "subnormal x̂":
        mean[0, 0], x[:, 0] = 0.0, 0.0
        x[0, 0, 0] = 1e-30
        invstd[0, 0] = 1e-9  # x̂ = 1e-39: subnormal in float32
        assert 0 < ((x - mean) * invstd)[0, 0, 0] < torch.finfo(torch.float32).tiny
    got_gain, got_bias = max_affine_f32(m, x, mean, invstd)
    # torch's float32 x̂ is the kernel's (the same two ops); the reduction in float64 on it
    x_hat32 = (x - mean) * invstd
    (want_gain,), (want_bias,), _ = affine_params.max_plus(
        m.double(), x_hat32.double(), torch.zeros(1, 1, 1, dtype=torch.float64),
        torch.ones(1, 1, 1, dtype=torch.float64),
    )  # fmt: skip
    for got, want in ((got_gain, want_gain), (got_bias, want_bias)):
        assert got.dtype == torch.float32 and got.shape == (shape[1],)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got == float("inf"), want == float("inf"))
        assert torch.equal(got == float("-inf"), want == float("-inf"))
        torch.testing.assert_close(got.double(), want, rtol=3e-7, atol=3e-7, equal_nan=True)


@pytest.mark.skipif(not knorm.native_available(), reason="no native kernels here")
def test_eval_batch_norm_gains_take_the_native_loop(monkeypatch):
    """A MaxProd backward through an eval-mode batch norm hands its gain and bias to the native
    loop (contiguous [N, C, H*W] rows), and a layer norm's [rows, n, 1] layout does not."""
    from semipack.kernels import affine_params

    calls = []
    real = affine_params.max_affine_f32
    monkeypatch.setattr(
        affine_params, "max_affine_f32", lambda *a: calls.append(a[1].shape) or real(*a)
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.Flatten(),
        torch.nn.LayerNorm(8 * 6 * 6),
    ).eval()  # fmt: skip
    with semipack.extend(model, semipack.MaxProd()):
        model(torch.randn(2, 3, 6, 6)).sum().backward()
    assert calls == [torch.Size([2, 8, 36])]
    assert torch.isfinite(model[1].weight.semiring_grad).all()
