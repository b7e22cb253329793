"""Fast paths are methods of the semiring class: a subclass inherits them while it keeps the
algebra, loses them (to the generic versions) when it changes the algebra, and has its own used
when it overrides one.

The oracle for "loses them" is a LogSum whose plus is max: the max-product semiring over the
same |w|, i.e. MaxProd read in log space. Had it kept LogSum's kernels (log-sum-exp exclusive
reductions, normalisation and shared-shift BLAS forms, logcumsumexp) it would compute LogSum's
values instead.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import MinProd

import semipack
from semipack.messages.normalization import normalized_messages
from semipack.messages.rowwise import has_fast_rowwise, log_softmax_messages, softmax_messages
from semipack.messages.shared_shift import shared_shift_products
from semipack.semirings.base import (
    DERIVED_OPERATIONS,
    Semiring,
    blocked_lifted_matmul,
    kernel_owner,
)

F64 = torch.float64


class MaxOverLogs(semipack.LogSum):
    """LogSum with max instead of log-sum-exp: MaxProd(log=True) in disguise."""

    def plus(self, a, b):
        return (torch.maximum(a[0], b[0]),)

    def sum(self, a, dims, keepdim=False):
        return (a[0].amax(dims, keepdim=keepdim),)


class CountingMatmul(semipack.MaxProd):
    """MaxProd with its own matmul (the parent's, counted): only a fast path is overridden."""

    calls = 0

    def matmul(self, a, w):
        CountingMatmul.calls += 1
        return super().matmul(a, w)


class CountingExclusive(semipack.MaxProd):
    calls = 0

    def exclusive_plus(self, a):
        CountingExclusive.calls += 1
        return super().exclusive_plus(a)


FAST_PATHS = [
    "exclusive_plus",
    "softmax_closed_form",
    "compiles_rowwise",
    "normalization_kernel",
    "shared_shift_products",
    "shared_shift_conv",
    "prefix_plus",
    "lift_is_multiplicative",
]


def test_fast_paths_are_declared_derived_operations() -> None:
    assert set(FAST_PATHS) <= set(DERIVED_OPERATIONS)
    assert not hasattr(Semiring, "keeps_primitives_of")


def test_a_subclass_that_changes_plus_gets_the_generic_fast_paths() -> None:
    for name in FAST_PATHS:
        assert getattr(MaxOverLogs, name) is getattr(Semiring, name), name
    sr = MaxOverLogs()
    m = sr.lift(torch.randn(5, 7, dtype=F64))
    probs = torch.softmax(torch.randn(5, 7, dtype=F64), -1)
    assert not has_fast_rowwise(sr) and has_fast_rowwise(semipack.LogSum())
    assert softmax_messages(sr, m, probs) is None
    assert log_softmax_messages(sr, m, probs.log()) is None
    assert type(sr).normalization_closed_form is Semiring.normalization_closed_form
    assert sr.normalization_kernel() is None  # no fast path: the generic dense contraction
    x_hat = torch.randn(5, 7, dtype=F64)
    ones = torch.ones(5, dtype=F64)
    assert normalized_messages(sr, m, x_hat, ones, torch.ones(7, dtype=F64), False, "eager") is None
    assert shared_shift_products(sr, m, right=torch.randn(7, 3, dtype=F64)) is None
    assert shared_shift_products(semipack.LogSum(), m, right=torch.randn(7, 3, dtype=F64))


def _through_fast_path_ops(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A graph through every fast path: linear, layer_norm, softmax, log_softmax, cumsum."""
    h = F.layer_norm(x @ w, (w.shape[1],))
    return (h.softmax(-1) + h.log_softmax(-1).exp()).cumsum(-1).sum()


@pytest.mark.parametrize("extensions", [True, False])
def test_a_subclass_that_changes_plus_computes_its_own_algebra(extensions: bool) -> None:
    """Every message of MaxOverLogs equals MaxProd's (in log space), not LogSum's."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 5, generator=gen, dtype=F64, requires_grad=True)
    w = torch.randn(8, 8, generator=gen, dtype=F64)
    lin = torch.nn.Linear(5, 8).to(F64)
    got, want, flow = [], [], []
    for sr, out in [(MaxOverLogs(), got), (semipack.MaxProd(log=True), want), (None, flow)]:
        with semipack.extend(lin, sr or semipack.LogSum(), extensions=extensions):
            (g,) = semipack.grad(_through_fast_path_ops(lin(x), w), x, sr or semipack.LogSum())
        out.append(g)
    torch.testing.assert_close(got[0], want[0], rtol=1e-9, atol=1e-9)
    assert not torch.allclose(got[0], flow[0])  # LogSum's values differ: the check has teeth


def test_a_subclass_that_changes_plus_gets_the_generic_prefix_scan() -> None:
    sr = MaxOverLogs()
    m = (torch.randn(4, 6, dtype=F64),)
    torch.testing.assert_close(sr.prefix_plus(m, 1)[0], m[0].cummax(1).values, rtol=0, atol=0)


def test_a_subclass_that_overrides_only_matmul_has_it_used() -> None:
    sr = CountingMatmul()
    assert CountingMatmul.exclusive_plus is semipack.MaxProd.exclusive_plus  # keeps the others
    assert not sr.has_lifted_matmul()  # relies on matmul: generic again
    x = torch.randn(4, 5, dtype=F64, requires_grad=True)
    w = torch.randn(5, 3, dtype=F64)
    before = CountingMatmul.calls
    (got,) = semipack.grad((x @ w).sum(), x, sr)
    (want,) = semipack.grad((x @ w).sum(), x, semipack.MaxProd())
    assert CountingMatmul.calls > before
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_subclass_that_overrides_only_the_exclusive_reduction_has_it_used() -> None:
    sr = CountingExclusive()
    assert has_fast_rowwise(sr) and not sr.compiles_rowwise()  # compiling relies on it
    x = torch.randn(3, 9, dtype=F64, requires_grad=True)
    before = CountingExclusive.calls
    (got,) = semipack.grad(x.softmax(-1).sin().sum(), x, sr)
    (want,) = semipack.grad(x.softmax(-1).sin().sum(), x, semipack.MaxProd())
    assert CountingExclusive.calls > before
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_overriding_a_derived_operation_drops_the_fast_paths_relying_on_it() -> None:
    class OwnScaleLog(semipack.LogSum):
        def scale_log(self, a, log_abs, sign=1.0):
            return super().scale_log(a, log_abs, sign)

    # the native softmax kernel would bypass scale_log; the exclusive reduction does not use it
    assert OwnScaleLog.softmax_closed_form is Semiring.softmax_closed_form
    assert OwnScaleLog.scale_log_owned is Semiring.scale_log_owned
    assert OwnScaleLog.exclusive_plus is semipack.LogSum.exclusive_plus
    assert OwnScaleLog().uses_edge_signs()


def test_a_new_magnitude_keeps_only_what_is_written_through_it() -> None:
    class Doubled(semipack.LogSum):  # no log_magnitude: the log forms fall back
        def magnitude(self, w):
            return 2 * w.abs()

    lc = semipack.LogCount
    assert lc.lift_log is semipack.LogSum.lift_log and lc.matmul is semipack.LogSum.matmul
    assert lc.softmax_closed_form is Semiring.softmax_closed_form  # native kernel is |w|'s
    assert lc.normalization_kernel is not semipack.LogSum.normalization_kernel
    assert Doubled.lift_log is Semiring.lift_log
    assert Doubled.shared_shift_products is Semiring.shared_shift_products
    assert not Doubled().lift_is_multiplicative()
    assert Doubled.exclusive_plus is semipack.LogSum.exclusive_plus


class LogAddExp:
    """A mixin with LogSum's plus and sum, listed before MaxProd: the class body is empty."""

    def plus(self, a, b):
        return (torch.logaddexp(a[0], b[0]),)

    def sum(self, a, dims, keepdim=False):
        return (a[0].logsumexp(dims, keepdim=keepdim),)


class SumThroughMixin(LogAddExp, semipack.MaxProd):
    """LogSum's algebra in MaxProd's clothes (its readout exponentiates)."""


def test_a_mixin_that_changes_the_algebra_drops_the_parents_fast_paths() -> None:
    """Only the class body was read: MaxProd's kernels ran and gave MaxProd's values."""
    for name in FAST_PATHS:
        assert getattr(SumThroughMixin, name) is getattr(Semiring, name), name
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 5, generator=gen, dtype=F64, requires_grad=True)
    w = torch.randn(8, 8, generator=gen, dtype=F64)
    lin = torch.nn.Linear(5, 8).to(F64)
    values = []
    for sr in (SumThroughMixin(), semipack.LogSum(log=False), semipack.MaxProd()):
        with semipack.extend(lin, sr):
            (g,) = semipack.grad(_through_fast_path_ops(lin(x), w), x, sr)
        values.append(g)
    torch.testing.assert_close(values[0], values[1], rtol=1e-9, atol=0)
    assert not torch.allclose(values[0], values[2])


class Tempered(semipack.LogSum):
    """LogSum of |w|^(1/t): a setting of the instance that its lift reads."""

    def __init__(self, t: float) -> None:
        super().__init__()
        self.t = t

    def magnitude(self, w):
        return w.abs() ** (1.0 / self.t)

    def log_magnitude(self, log_abs):
        return log_abs / self.t

    def lift_is_multiplicative(self):
        return True


class EntropyInBits(semipack.Entropy):
    """Only the readout changes; the constructor takes an argument."""

    def __init__(self, unit: float) -> None:
        super().__init__()
        self.unit = unit

    def readout(self, a):
        return super().readout(a) / self.unit


def test_kept_kernels_are_shared_only_where_the_algebra_is_the_classs() -> None:
    assert kernel_owner(semipack.LogSum(log=False), "compiles_rowwise") is semipack.LogSum
    assert kernel_owner(EntropyInBits(2.0), "normalization_kernel") is semipack.Entropy
    tempered = Tempered(2.0)
    assert kernel_owner(tempered, "compiles_rowwise") is tempered


def test_kernels_kept_across_calls_are_built_for_the_instance() -> None:
    """Softmax rows of 2^18 entries and float32 layer norms run kernels compiled once: built
    from ``type(sr)()`` they dropped a temperature (8 nats off) or raised a TypeError."""
    tempered = Tempered(2.0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 512, generator=gen)
    c = torch.randn(512, 512, generator=gen)
    values = []
    for dtype in (torch.float32, F64):  # the compiled kernel, then the eager float64 form
        leaf = x.to(dtype).requires_grad_()
        (g,) = semipack.grad((leaf.softmax(-1) * c.to(dtype)).sum(), leaf, tempered)
        values.append(g.double())
    torch.testing.assert_close(values[0], values[1], rtol=0, atol=1e-4)
    leaf = torch.randn(4, 64, generator=gen, requires_grad=True)
    (got,) = semipack.grad(F.layer_norm(leaf, (64,)).sum(), leaf, EntropyInBits(math.log(2)))
    (want,) = semipack.grad(F.layer_norm(leaf, (64,)).sum(), leaf, semipack.Entropy())
    torch.testing.assert_close(got, want / math.log(2), rtol=1e-6, atol=0)


class MinOfLogs(MinProd):
    """The README's MinProd with a kept lift: its lift reads no setting."""

    def lift_cache_key(self):
        return ()

    def has_lifted_matmul(self):  # a convolution then lifts its weights once, and keeps them
        return True

    def matmul_lifted(self, a, lifted):
        return blocked_lifted_matmul(self, a, lifted)


class MinOfSurprisals(MinOfLogs):
    """Shortest path over the surprisals -log|w|: another lift under the same (empty) key. (A
    new lift drops the inherited products on lifted weights: it defines them again.)"""

    def lift(self, w):
        w = w.to(self.state_dtype(w.dtype))
        return (torch.where(w == 0, math.inf, -w.abs().log()),)

    def lift_cache_key(self):
        return ()

    has_lifted_matmul = MinOfLogs.has_lifted_matmul
    matmul_lifted = MinOfLogs.matmul_lifted


def test_kept_lifts_of_two_semirings_with_the_same_key_stay_apart() -> None:
    """Kept lifts were keyed by ``lift_cache_key`` alone: the second semiring read the first
    one's lifted weights."""
    conv = torch.nn.Conv1d(2, 3, 3).to(F64)
    x = torch.randn(1, 2, 7, dtype=F64, generator=torch.Generator().manual_seed(1))
    values = []
    for sr in (MinOfSurprisals(), MinOfLogs(), MinOfSurprisals()):
        leaf = x.clone().requires_grad_()  # its message is the product with the kept lift
        with semipack.extend(conv, sr):
            conv(leaf).sum().backward()
        values.append(leaf.semiring_grad)
    torch.testing.assert_close(values[2], values[0], rtol=0, atol=0)
    assert not torch.allclose(values[1], values[0])
