"""The BLAS forms of the sum-like semirings never cut a path by underflow.

LogSum, LogCount and Entropy multiply ``exp(a - rowmax)`` by the weights with BLAS. A product far
below the row's maximum underflows to 0 in float32 and would read as "no path". Such entries are
recomputed in the log domain (``semirings.base.repair_underflow``); these tests check the values
against hand-computed log-domain results and a float64 oracle.
"""

from __future__ import annotations

import math

import pytest
import torch
from oracle import build_graph, dynamic_programming

import semipack
import semipack.semirings.base as base
from semipack.kernels.native import native_available
from semipack.messages.shared_shift import shared_shift_products

SUM_LIKE = [semipack.LogSum, semipack.LogCount, semipack.Entropy]


def _state(sr: semipack.Semiring, log_values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A state with the given log-masses (Entropy: a mean surprisal of 0.5 everywhere)."""
    if isinstance(sr, semipack.Entropy):
        return (log_values, torch.full_like(log_values, 0.5))
    return (log_values,)


@pytest.mark.parametrize("semiring", SUM_LIKE)
def test_a_path_110_nats_below_the_row_maximum_survives(semiring) -> None:
    sr = semiring()
    out = sr.matmul(_state(sr, torch.tensor([[0.0, -110.0]])), torch.eye(2))
    assert out[0].tolist() == [[0.0, -110.0]]
    if isinstance(sr, semipack.Entropy):  # one path of weight 1: the mean surprisal carries over
        assert out[1].tolist() == [[0.5, 0.5]]


@pytest.mark.parametrize("semiring", [semipack.LogSum, semipack.Entropy])
def test_a_tiny_weight_meeting_a_low_message_keeps_its_path(semiring) -> None:
    """exp(-60) * 1e-30 ~ 8.8e-57 underflows float32; its log, -129.08, does not."""
    sr = semiring()
    w = torch.tensor([[1.0, 0.0], [1.0, 1e-30]])
    out = sr.matmul(_state(sr, torch.tensor([[0.0, -60.0]])), w)
    expected = -60.0 + math.log(1e-30)
    assert out[0][0, 0] == pytest.approx(math.log(1 + math.exp(-60)), abs=1e-6)
    assert out[0][0, 1].item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("semiring", SUM_LIKE)
def test_batched_products_are_repaired_per_batch_entry(semiring) -> None:
    sr = semiring()
    a = torch.tensor([[[0.0, -120.0]], [[0.0, 0.0]]])  # [2, 1, 2]: only entry 0 underflows
    out = sr.matmul(_state(sr, a), torch.eye(2).expand(2, 2, 2))
    assert out[0][0].tolist() == [[0.0, -120.0]]
    assert out[0][1].tolist() == [[0.0, 0.0]]


@pytest.mark.parametrize("semiring", SUM_LIKE)
def test_genuine_no_path_stays_no_path(semiring) -> None:
    """A zero weight column and a row without a path are structural: still -inf."""
    sr = semiring()
    w = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    out = sr.matmul(_state(sr, torch.tensor([[0.0, -110.0], [-math.inf, -math.inf]])), w)
    assert out[0][:, 1].tolist() == [-math.inf, -math.inf]
    assert out[0][1, 0].item() == -math.inf


@pytest.mark.parametrize("semiring", [semipack.LogSum, semipack.Entropy])
def test_shared_shift_products_are_repaired(semiring) -> None:
    """One global shift for the whole message: e^-20 * 1e-35 is a float32 subnormal (about one
    significant bit) and e^-30 * 1e-35 is 0; both come back exact."""
    sr = semiring()
    m = _state(sr, torch.tensor([[0.0, -30.0], [-5.0, -20.0]]))
    right = torch.tensor([[1.0, 0.0], [1.0, 1e-35]])
    found = shared_shift_products(sr, m, right=right, left=right)
    assert found is not None
    by_right, by_left, _ = found
    tiny = math.log(1e-35)
    assert by_right[0][0, 1].item() == pytest.approx(-30.0 + tiny, rel=1e-6)
    assert by_right[0][1, 1].item() == pytest.approx(-20.0 + tiny, rel=1e-6)
    # mᵀ ⊗ left: column 1 of the result gathers m[:, 1] through left[:, 1]
    assert by_left[0][1, 1].item() == pytest.approx(-20.0 + tiny, rel=1e-6)


@pytest.mark.parametrize("semiring", [semipack.LogSum, semipack.Entropy])
def test_suspects_in_one_column_are_recomputed_by_column(semiring, monkeypatch) -> None:
    """Every row's entry of one column underflows (e^-30 * 1e-35): the exact form recomputes
    that column alone, not every row whole (causal attention's last key left one column of each
    head's value message to recompute, and its rows were the whole product). Values against
    the definition in float64; the other columns keep the fast product's."""
    sr = semiring()
    torch.manual_seed(0)
    logs = torch.randn(8, 4)
    logs[:, 0] -= 30.0
    w = torch.rand(4, 6) + 0.5
    w[:, 5] = torch.tensor([1e-35, 0.0, 0.0, 0.0])
    fast = sr.matmul(_state(sr, logs), w[:, :5])
    calls = []
    blocked = base.blocked_lifted_matmul

    def spy(sr_, a, lifted):
        calls.append((tuple(a[0].shape), tuple(lifted[0].shape)))
        return blocked(sr_, a, lifted)

    monkeypatch.setattr(base, "blocked_lifted_matmul", spy)
    out = sr.matmul(_state(sr, logs), w)
    assert calls == [((8, 4), (4, 1))]
    expected = logs[:, 0].double() + math.log(1e-35)
    torch.testing.assert_close(out[0][:, 5].double(), expected, rtol=1e-6, atol=0.0)
    for got, want in zip(out, fast, strict=True):
        assert torch.equal(got[:, :5], want)


def test_subnormal_sums_are_recomputed_to_full_precision() -> None:
    sr = semipack.LogSum()
    w = torch.tensor([[1.0, 0.0], [1.0, 1e-30]])
    out = sr.matmul((torch.tensor([[0.0, -55.0]]),), w)  # e^-55 * 1e-30 = 1.3e-54: subnormal
    assert out[0][0, 1].item() == pytest.approx(-55.0 + math.log(1e-30), rel=1e-6)


class TinyRoute(torch.nn.Module):
    """x[0]'s only route to the loss: a 1e-30 weight, then a 1e-26 factor. In the matmul's
    backward the output message spans 60 nats, so e^-60 * 1e-30 underflows float32 there."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([[1e-30, 0.0], [0.0, 2.0]], dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.w
        return (out[:, 0] * 1e-26 + out[:, 1]).sum()


@pytest.mark.parametrize("name", ["log_sum", "log_count", "boolean", "entropy", "max_prod"])
def test_float32_model_keeps_the_float64_oracles_paths(name: str) -> None:
    x64 = torch.tensor([[1.0, 0.5]], dtype=torch.float64, requires_grad=True)
    model64 = TinyRoute(torch.float64)
    loss = model64(x64)
    (expected,) = dynamic_programming(build_graph(loss), [x64], name)
    makers = {
        "log_sum": semipack.LogSum,
        "log_count": semipack.LogCount,
        "boolean": semipack.Boolean,
        "entropy": semipack.Entropy,
        "max_prod": lambda: semipack.MaxProd(log=True),  # the linear readout would underflow
    }
    x32 = x64.detach().float().requires_grad_()
    model32 = TinyRoute(torch.float32)
    with semipack.extend(model32, makers[name]()):
        model32(x32).backward()
    got = x32.semiring_grad.double()
    if name == "boolean":
        assert torch.equal(x32.semiring_grad, expected)
    elif name == "max_prod":
        torch.testing.assert_close(got, expected.log(), rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(torch.isinf(got), torch.isinf(expected)), (got, expected)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    assert name == "boolean" or bool(torch.isfinite(got).all())


def test_the_one_reduction_check_finds_exactly_the_low_entries() -> None:
    """``repair_underflow`` first asks whether ``min(out) - shift`` is below the floor (per row
    for one shift per row, as a per-product shift has): this must agree with the entry-by-entry
    test, at the boundary too, and a NaN minimum must not hide a low entry."""
    from semipack.semirings.base import _none_below, precise_log_floor

    floor = precise_log_floor(torch.float32)
    torch.manual_seed(0)
    for trial in range(400):
        shift = torch.tensor(float(torch.randn(()) * 50))
        out = shift + floor + torch.randn(7, 5) * (10.0 ** (trial % 5 - 3))
        if trial % 7 == 0:
            out[2, 3] = float("nan")
        if trial % 11 == 0:  # an entry exactly at the boundary
            out[0, 0] = floor + shift
        entrywise = not bool(((out - shift) < floor).any())
        assert _none_below(out, shift, floor) == entrywise or (
            torch.isnan(out).any() and not _none_below(out, shift, floor)
        ), trial
    for trial in range(400):
        row_shift = torch.randn(3, 7, 1) * 50
        out = row_shift + floor + torch.randn(3, 7, 5) * (10.0 ** (trial % 5 - 3))
        if trial % 7 == 0:
            out[1, 2, 3] = float("nan")
        if trial % 11 == 0:
            out[2, 0, 0] = floor + row_shift[2, 0, 0]
        entrywise = not bool(((out - row_shift) < floor).any())
        assert _none_below(out, row_shift, floor) == entrywise or (
            torch.isnan(out).any() and not _none_below(out, row_shift, floor)
        ), trial
    # a shift per column (or any that would broadcast the rows) is left to the full check
    assert not _none_below(torch.zeros(7, 5), torch.zeros(1, 5), floor)
    assert not _none_below(torch.zeros(7, 5), torch.zeros(2, 7, 1), floor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_zero_safe_logarithm_gives_torchs_bits(dtype, monkeypatch) -> None:
    """``log_magnitude_`` keeps exact zeros away from torch's log (a slow path there) and, below
    ``SPECIAL_SAFE_MIN_ELEMENTS`` entries (eager), gives the same bits as ``log_``: zeros, NaN,
    infinity, subnormals, ordinary values. (Float32 takes the native loop where the library
    is built, with its own last bits: ``test_native_loops_give_the_same_bits_at_any_size``
    and ``tests/test_kernels_elementwise.py``; here the eager form is tested.)"""
    from semipack.kernels import logspace
    from semipack.kernels.logspace import ZERO_SAFE_MIN_ELEMENTS, log_magnitude_

    monkeypatch.setattr(logspace, "native_loops", lambda t: False)
    torch.manual_seed(0)
    x = torch.randn(ZERO_SAFE_MIN_ELEMENTS * 3).abs().to(dtype)
    x[::3] = 0.0
    special = [float("nan"), float("inf"), 0.0, -0.0, 1e-45, 3e-39, 1.0, 2.0]
    x[: len(special)] = torch.tensor(special).abs().to(dtype)
    want = x.clone().log_()
    got = log_magnitude_(x.clone())
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert got[2].item() == got[3].item() == float("-inf")


def _special_values_and_range(n: int, dtype: torch.dtype) -> torch.Tensor:
    """n entries: every special value of a log-space state, exponents whose exp is subnormal or
    underflows, and ordinary ones of both signs."""
    torch.manual_seed(5)
    x = torch.randn(n, dtype=torch.float64) * 40
    x[1::4] = -80.0 - 30.0 * torch.rand(len(x[1::4]), dtype=torch.float64)  # exp subnormal or 0
    x[2::7] = float("-inf")  # no path
    special = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 88.5, -87.5, -103.9, -104.5]
    x[: len(special)] = torch.tensor(special, dtype=torch.float64)
    return x.to(dtype)


def _assert_within_one_ulp(got: torch.Tensor, exact: torch.Tensor) -> None:
    """Same NaN, infinities and zeros as ``exact`` rounded; finite values within one unit in the
    last place (for subnormals: one step of the subnormal grid)."""
    rounded = exact.to(got.dtype)
    for same in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(same(got), same(rounded))
    finite = torch.isfinite(rounded)
    info = torch.finfo(got.dtype)
    step = torch.maximum(rounded.abs() * info.eps, torch.tensor(info.smallest_normal * info.eps))
    error = (got.double() - exact).abs()
    assert bool((error[finite] <= step[finite].double()).all())
    assert torch.equal(got[rounded == 0] == 0, torch.ones_like(got[rounded == 0], dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
def test_the_special_safe_exp_and_log_keep_every_value(dtype, layout) -> None:
    """``exp_``, ``exp_into``, ``exp`` and ``log_magnitude_`` run compiled on the CPU from
    ``SPECIAL_SAFE_MIN_ELEMENTS`` entries (ATen's exp and log take a scalar slow path on -inf,
    underflow and 0). Against a float64 reference: -inf -> 0 (no path) and log 0 -> -inf exactly,
    NaN and infinities kept, subnormal results kept (no path cut by the kernel), every finite
    value within one ulp; in place where asked, whatever the dims' order in memory."""
    from semipack.kernels import logspace

    n = logspace.SPECIAL_SAFE_MIN_ELEMENTS * 2
    x = _special_values_and_range(n * 3, dtype).reshape(6, n // 2)
    if layout == "channels_last":
        x = x.reshape(2, 3, 32, -1).contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":
        x = x.t().contiguous().t()
    exact = x.double().exp()

    given = x.clone()
    assert given.stride() == x.stride()
    got = logspace.exp_(given)
    assert got is given
    _assert_within_one_ulp(got, exact)
    into = torch.empty_like(x)
    assert logspace.exp_into(x, into) is into
    _assert_within_one_ulp(into, exact)
    readout = logspace.exp(x)  # a readout, and one written into memory: the same bits
    assert torch.equal(readout.isnan(), into.isnan())
    assert torch.equal(readout.nan_to_num(), into.nan_to_num())

    mag = x.abs()
    exact_log = mag.double().log()
    given = mag.clone()
    assert logspace.log_magnitude_(given) is given
    _assert_within_one_ulp(given, exact_log)
    assert bool(given[mag == 0].eq(float("-inf")).all())


@pytest.mark.parametrize("native", [True, False])
def test_the_special_safe_forms_leave_other_tensors_to_torch(monkeypatch, native) -> None:
    """The compiled forms (and the native float32 loops where they run) see only what they can
    run over flat: CPU float32/float64 tensors of one dense block; an expanded (overlapping)
    tensor, bfloat16, or two layouts go to torch's own op, with torch's bits."""
    from semipack.kernels import logspace

    calls: list[str] = []
    if native:
        if not logspace.native_available():
            pytest.skip("no native kernels here")
        monkeypatch.setattr(logspace, "exp_block_f32", lambda x, out: calls.append("exp_"))
    else:
        monkeypatch.setattr(logspace, "native_loops", lambda t: False)
    monkeypatch.setattr(logspace, "_exp_in_place", lambda x: calls.append("exp_") or x.exp_())
    monkeypatch.setattr(
        logspace, "_exp_into", lambda x, out: calls.append("exp_into") or torch.exp(x, out=out)
    )
    n = logspace.SPECIAL_SAFE_MIN_ELEMENTS
    dense = torch.randn(4, n).t()  # transposed: one dense block
    logspace.exp_(dense.clone())
    assert calls == ["exp_"]
    row = torch.randn(1, n)
    overlapping = row.expand(4, n)
    with pytest.raises(RuntimeError):  # torch refuses an in-place op on overlapping memory too
        logspace.exp_(overlapping)
    half = torch.randn(4, n, dtype=torch.bfloat16)
    assert torch.equal(logspace.exp_(half.clone()), half.exp())
    out = torch.empty(n, 4)  # contiguous: another layout than dense's
    assert torch.equal(logspace.exp_into(dense, out), torch.exp(dense))
    assert calls == ["exp_"]
    if native:  # the native loops take a dense float32 tensor of any size, no other
        logspace.exp_(torch.randn(3, 5).t())
        logspace.exp_into(torch.randn(7), torch.empty(7))
        assert calls == ["exp_"] * 3
        for other in (torch.randn(5, 7)[:, :3], torch.randn(7, dtype=torch.float64)):
            want = other.exp()
            assert torch.equal(logspace.exp_(other), want)  # in place, a view with gaps too
        assert calls == ["exp_"] * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shift_kind", ["scalar", "row", "full", "number"])
def test_the_one_pass_log_and_shift_keeps_every_path_and_the_values(dtype, shift_kind) -> None:
    """``log_magnitude_plus_`` (compiled above ``FUSED_MIN_ELEMENTS``) writes ``log|x| + shift``
    into ``x`` itself: -inf exactly at zeros (no path), NaN at NaN, +inf at inf, subnormals
    finite, and every finite value within float rounding of ``log_().add_(shift)``."""
    from semipack.kernels.compiled import FUSED_MIN_ELEMENTS
    from semipack.kernels.logspace import log_magnitude_plus_

    torch.manual_seed(2)
    rows = FUSED_MIN_ELEMENTS // 64 + 3
    x = (torch.randn(rows, 128) * 10).exp().to(dtype)
    x[:, ::5] = 0.0
    special = [float("nan"), float("inf"), 0.0, -0.0, 1e-45, 3e-39, 1.0, 2.0]
    x[0, : len(special)] = torch.tensor(special, dtype=torch.float64).abs().to(dtype)
    shift = {
        "scalar": torch.tensor(3.25, dtype=dtype),
        "row": torch.randn(rows, 1, dtype=dtype) * 50,
        "full": torch.randn(rows, 128, dtype=dtype),
        "number": -7.5,
    }[shift_kind]
    want = x.clone().log_().add_(shift)
    given = x.clone()
    got = log_magnitude_plus_(given, shift)
    assert got.data_ptr() == given.data_ptr()
    for same in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(same(got), same(want))
    assert torch.isfinite(got[0, 4:6]).all()  # subnormal magnitudes keep finite logs
    finite = torch.isfinite(want)
    tolerance = 4 * torch.finfo(dtype).eps * (want.abs() + x.log().abs()).nan_to_num(posinf=0)
    assert ((got - want).abs()[finite] <= tolerance[finite]).all()


def test_float_op_forms_of_masked_logs_give_the_masked_bits() -> None:
    """``finite_surprisal``, ``xlogx`` and ``finite_or_zero`` replace bool-mask expressions
    (``torch.where`` and ``masked_fill`` ran about 30x slower per entry than float ops here)
    and must give their bits: zeros, NaN, infinities, subnormals, ordinary values."""
    from semipack.kernels.logspace import finite_or_zero, finite_surprisal, xlogx

    torch.manual_seed(1)
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), 1e-45, 3e-39, 1.0, 2.5e30])
    mag = torch.cat([special, torch.randn(5000).abs(), torch.zeros(100)])
    log_w = mag.log()
    want = torch.where(torch.isfinite(log_w), -log_w, torch.zeros_like(log_w))
    assert torch.equal(finite_surprisal(log_w), want)
    want = mag.log().mul_(mag).masked_fill_(~(mag > 0), 0.0)
    kept = mag.clone()
    got = xlogx(mag)
    assert torch.equal(got, want) and not got.isnan().any()
    assert torch.equal(got.signbit(), want.signbit())  # -0.0 gives +0.0 too
    assert torch.equal(mag.nan_to_num(), kept.nan_to_num())  # the magnitudes stay
    for x in (log_w, -log_w, mag):
        want = torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype))
        assert torch.equal(finite_or_zero(x), want)


@pytest.mark.parametrize("name", ["MaxProd", "LogSum", "Entropy", "TopPath", "SignedMaxProd"])
def test_the_branch_free_forms_for_accelerators_give_the_same_bits(name, monkeypatch) -> None:
    """On a GPU the shortcuts decided by reading a value back (no zeros to guard in a log, no
    vanishing weight to cut) run branch-free. Forced on the CPU, the whole backward gives the
    same bits: a ReLU network (exact zeros in large logs) with weights far below the cut. The
    host's float32 exp and log are torch's here on both sides: the native loops round
    differently (within one ulp, ``test_kernels_elementwise.py``), and what is compared is the
    branches."""
    from torch.utils._pytree import tree_leaves

    from semipack.kernels import logspace

    monkeypatch.setattr(logspace, "native_loops", lambda t: False)

    class MaskedSoftmax(torch.nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            mask = torch.zeros(h.shape[-1])
            mask[::3] = -1e4  # log-probabilities near -1e4: far below the cut, no edge
            return torch.softmax(h + mask, -1)

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 96), MaskedSoftmax()
    )
    x = torch.randn(64, 64)

    def values() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with semipack.extend(model, getattr(semipack, name)()):
            model(x).pow(2).sum().backward()
        return [t.clone() for p in model.parameters() for t in tree_leaves(p.semiring_grad)]

    from semipack.semirings import base

    cut, vanishing = base.cut_vanishing, []

    def spy(log_abs: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        vanishing.append(bool((log_abs < base.NO_EDGE_LOG).any()))
        return cut(log_abs, in_place)

    monkeypatch.setattr(base, "cut_vanishing", spy)
    on_host = values()
    # weights below the cut reached it (LogSum's softmax has a closed form without log weights)
    assert any(vanishing) or name == "LogSum"
    calls = []
    monkeypatch.setattr(logspace, "checks_on_host", lambda t: calls.append(1) and False)
    branch_free = values()
    assert calls  # the forms for accelerators ran
    for a, b in zip(on_host, branch_free, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_the_one_read_global_shift_decides_as_the_host_form(monkeypatch) -> None:
    """``global_shift`` on a GPU reads one pair of values back instead of up to four; every
    decision (no finite entry, NaN, +inf, a span at the limit) is the host form's."""
    from semipack.kernels import logspace
    from semipack.kernels.shared_shift import SHARED_SHIFT_SPAN, global_shift

    inf, nan = float("inf"), float("nan")
    span = torch.tensor(SHARED_SHIFT_SPAN)
    cases = [
        torch.tensor([1.0, -3.0, 0.5]),
        torch.tensor([-inf, -inf]),
        torch.tensor([-inf, 2.0, -5.0]),
        torch.tensor([nan, 1.0]),
        torch.tensor([inf, 1.0]),
        torch.tensor([-inf, 0.0]) - torch.tensor([0.0, 1.0]),
        torch.stack([torch.tensor(3.0), torch.tensor(3.0) - span]),  # exactly at the limit
        torch.stack([torch.tensor(3.0), torch.tensor(3.0) - span.nextafter(span + 1)]),
        torch.tensor([7.25]),
        torch.tensor([]),
        torch.randn(50, 30, dtype=torch.float64) * 20,
    ]
    host = [global_shift(c) for c in cases]
    monkeypatch.setattr(logspace, "checks_on_host", lambda t: False)
    device = [global_shift(c) for c in cases]
    assert [h is None for h in host] == [d is None for d in device]
    assert [h is None for h in host] == [False, True, False, True, True, False, False, True,
                                         False, True, True]  # fmt: skip
    for h, d in zip(host, device, strict=True):
        if h is not None:
            assert torch.equal(h, d)


@pytest.mark.parametrize("kind", ["conv1d", "conv2d", "linear"])
def test_a_weight_near_the_smallest_subnormal_keeps_its_paths_in_a_convolution(kind) -> None:
    """A convolution's shared-shift sums are not repaired as a matmul's are: a weight of the
    smallest float32 subnormal times a message of 0.3 is 0 there (LogSum lost that path: log w
    where log 1.3 w is right), and Entropy over four equal paths read 1.11 nats, not log 4
    (trial 45). Such operands take the exact log-domain path. Hand values: x reaches two
    outputs with weight w, seeded 1 and 0.3 (LogSum: log 1.3 w); x[:, 0] reaches four outputs
    with weight w each (Entropy: log 4)."""
    dt = torch.float32
    w = torch.tensor(1.4e-45, dtype=dt)  # the smallest subnormal

    def layer(out_features: int) -> torch.nn.Module:
        if kind == "linear":
            return torch.nn.Linear(4, out_features, bias=False)
        conv = torch.nn.Conv1d if kind == "conv1d" else torch.nn.Conv2d
        return conv(4, out_features, 1, bias=False)

    def run(sr, out_features: int, seed: list[float]):
        mod = layer(out_features).to(dt)
        with torch.no_grad():
            mod.weight.zero_()
            mod.weight[:, 0] = w
        x = torch.ones(1, 4, dtype=dt, requires_grad=True)
        shaped = {"linear": x, "conv1d": x[..., None], "conv2d": x[..., None, None]}[kind]
        with semipack.extend(mod, sr):
            out = mod(shaped)
            out.backward(torch.tensor(seed, dtype=dt).reshape(out.shape))
        return x.semiring_grad[0, 0].item()

    total = run(semipack.LogSum(), 2, [1.0, 0.3])
    assert total == pytest.approx(math.log(1.3 * w.item()), abs=1e-5)
    assert run(semipack.Entropy(), 4, [1.0] * 4) == pytest.approx(math.log(4), abs=1e-3)


@pytest.mark.skipif(not native_available(), reason="needs the native library")
def test_native_loops_give_the_same_bits_at_any_size() -> None:
    """Float32 CPU log-space values get the native loops' bits whatever the size of the tensor
    that holds them: two paths that lift the same entries in tensors of different sizes (a
    depthwise kernel's log of x and the per-tap path's of its zero-padded copy) must agree bit
    for bit, which a size threshold between torch's ops and the loops broke. Each prefix of a
    tensor, computed alone, equals the same entries computed in the whole; and both are within
    one ulp of float64's exact values (``tests/test_kernels_elementwise.py`` holds the loops to
    that on every special value)."""
    from semipack.kernels.logspace import exp_, exp_into, log_magnitude_, log_magnitude_plus_

    torch.manual_seed(0)
    whole = torch.randn(40_000) * 30
    whole[::5] = float("-inf")
    magnitudes = whole.exp().abs()
    magnitudes[::7] = 0.0
    logs = log_magnitude_(magnitudes.clone())
    exps = exp_(whole.clone())
    exps_into = exp_into(whole, torch.empty_like(whole))
    logs_plus = log_magnitude_plus_(magnitudes.clone(), torch.tensor(1.5))
    for n in (1, 7, 16, 100, 4_095, 4_096, 16_383, 16_384, 40_000):
        assert torch.equal(log_magnitude_(magnitudes[:n].clone()), logs[:n]), n
        assert torch.equal(exp_(whole[:n].clone()), exps[:n]), n
        assert torch.equal(exp_into(whole[:n], torch.empty(n)), exps_into[:n]), n
        plus = log_magnitude_plus_(magnitudes[:n].clone(), torch.tensor(1.5))
        assert torch.equal(plus, logs_plus[:n]), n
    exact_log = magnitudes.double().log()
    exact_exp = whole.double().exp()
    ulp_log = torch.finfo(torch.float32).eps * exact_log.abs().clamp_min(1e-30)
    finite = exact_log.isfinite()
    assert torch.equal(logs.isfinite(), finite)
    assert bool(((logs.double() - exact_log)[finite].abs() <= ulp_log[finite]).all())
    finfo = torch.finfo(torch.float32)
    nonzero = (exact_exp > finfo.tiny) & (exact_exp < finfo.max)  # normal float32 results
    ulp_exp = finfo.eps * exact_exp
    assert torch.equal(exps.isinf(), exact_exp >= finfo.max)  # overflow where float32 does
    assert bool(((exps.double() - exact_exp)[nonzero].abs() <= ulp_exp[nonzero]).all())


@pytest.mark.skipif(not native_available(), reason="needs the native loops")
def test_compiled_kernels_do_not_trace_into_the_native_library() -> None:
    """A compiled kernel that exponentiates (Entropy's rows through a LayerNorm of 1024 x 768:
    ``_entropy_rows``) asks ``exp_`` for the native loops while torch.compile traces it; the
    answer there is no, and it must come before the library's cached checks are called, which
    dynamo traced with a warning ("functools.lru_cache-wrapped function"). A fresh process:
    dynamo warns once per process."""
    import subprocess
    import sys

    code = (
        "import torch, semipack\n"
        "torch.manual_seed(0)\n"
        "norm = torch.nn.LayerNorm(768)\n"
        "x = torch.randn(1024, 768, requires_grad=True)\n"
        "with semipack.extend(norm, semipack.Entropy()):\n"
        "    norm(x).pow(2).sum().backward()\n"
        "print(float(x.semiring_grad[0].sum()) == float(x.semiring_grad[0].sum()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
    assert "lru_cache" not in out.stderr, out.stderr[-2000:]
