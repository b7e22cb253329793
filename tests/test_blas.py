"""The sum-like semirings' float32 products on oneDNN (``semipack/kernels/blas.py``).

Against float64 products of the same operands (non-negative, as the semirings' are: relative
error bounded by the inner size times float32's epsilon), with exact zeros kept (a row or a
column without any non-zero term gives exactly 0); the fallbacks give ``torch.matmul``'s own
bits; and whole LogSum / Entropy backwards of a float32 MLP agree with the same backward in
float64 (where every product is ``torch.matmul``'s). Skipped where PyTorch has no oneDNN.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import semipack
from semipack.kernels import blas

pytestmark = pytest.mark.skipif(blas._LINEAR is None, reason="no oneDNN in this PyTorch")


@pytest.fixture
def counted(monkeypatch):
    """Counts the products that run on oneDNN, switched on whatever ``SEMIPACK_ONEDNN`` says."""
    monkeypatch.setitem(blas._state, "enabled", True)
    calls = {"linear": 0, "binary": 0}
    real = blas._LINEAR

    class Counting:
        def __call__(self, *args):
            calls["linear"] += 1
            return real(*args)

        def binary(self, *args):
            calls["binary"] += 1
            return real.binary(*args)

    monkeypatch.setattr(blas, "_LINEAR", Counting())
    return calls


def operands(n: int, k: int, m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative operands spanning several orders of magnitude, with a zero row of ``a`` and
    a zero column of ``b``: products without any path."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, k, generator=gen).mul_(3).exp_()
    b = torch.rand(k, m, generator=gen)
    a[1] = 0.0
    b[:, 2] = 0.0
    return a, b


def assert_near_float64(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    want = a.double() @ b.double()
    k = a.shape[-1]
    assert torch.equal(got == 0, want == 0)  # a path is never cut, none is made up
    rel = ((got.double() - want).abs() / want.clamp_min(1e-300)).max().item()
    assert rel < 2 * k * torch.finfo(torch.float32).eps, rel


@pytest.mark.parametrize("shape", [(256, 128, 64), (20, 384, 1536), (1024, 20, 384)], ids=str)
def test_large_products_run_on_onednn_within_float32_rounding(counted, shape):
    a, b = operands(*shape)
    got = blas.matmul(a, b)
    assert counted["linear"] == 1
    assert got.shape == (shape[0], shape[2]) and got.is_contiguous()
    assert_near_float64(got, a, b)


def test_a_small_transposed_left_operand_is_copied_to_onednn(counted):
    """A sentence's weight message: e^T [1536, 20] @ x [20, 384]."""
    e, x = operands(20, 1536, 384, seed=4)  # e [20, 1536], x's rows: the first 20 of [1536, 384]
    e_t, x = e.t(), x[:20]
    got = blas.matmul(e_t, x)
    assert counted["linear"] == 1
    assert got.shape == (1536, 384) and got.is_contiguous()
    assert_near_float64(got, e_t, x)


def test_batched_rows_are_one_product(counted):
    a, b = operands(4 * 64, 96, 200, seed=1)
    got = blas.matmul(a.reshape(4, 64, 96), b)
    assert counted["linear"] == 1 and got.shape == (4, 64, 200)
    assert_near_float64(got.reshape(256, 200), a, b)


@pytest.mark.parametrize(
    "case", ["small", "float64", "transposed rows", "batched right", "grad", "switched off"]
)
def test_other_products_are_torch_matmul_bit_for_bit(counted, case):
    a, b = operands(256, 128, 64, seed=2)
    if case == "small":
        a, b = a[:8, :16], b[:16, :8]
    elif case == "float64":
        a, b = a.double(), b.double()
    elif case == "transposed rows":  # a large weight message's e^T: it would be copied whole
        a = torch.rand(blas.ONEDNN_COPY_MAX + 1, 4).t().contiguous().t()
        b = b[:4]
    elif case == "batched right":
        a, b = a.reshape(2, 128, 128), torch.stack([b, b])
    elif case == "grad":
        a.requires_grad_(True)
    previous = blas.set_onednn(case != "switched off")
    try:
        got = blas.matmul(a, b)
    finally:
        blas.set_onednn(previous)
    assert counted["linear"] == 0
    assert torch.equal(got, torch.matmul(a, b))


def test_subtracting_a_product_keeps_the_rows_it_does_not_reach(counted):
    a, b = operands(300, 200, 100, seed=3)
    c = torch.rand(300, 100) * 1e3
    want = c.double() - a.double() @ b.double()
    kept = c[1].clone()  # a's row 1 is zero: its row of the product is exactly 0
    got = blas.subtract_product(c.clone(), a, b)
    assert counted["binary"] == 1
    assert torch.equal(got[1], kept)
    scale = (c.double().abs() + (a.double() @ b.double())).max().item()
    assert (got.double() - want).abs().max().item() < 4 * 200 * 1.2e-7 * scale
    # below the size oneDNN takes, BLAS subtracts in place
    small = torch.rand(4, 5)
    assert blas.subtract_product(small, a[:4, :6], b[:6, :5]) is small


@pytest.mark.parametrize("semiring", [semipack.LogSum, semipack.Entropy])
def test_semiring_backward_with_onednn_products_matches_float64(counted, semiring):
    """A float32 MLP large enough for oneDNN (input messages of 128 x 256 x 512) against the
    same model in float64, whose products all run on ``torch.matmul``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 256), nn.Tanh(), nn.Linear(256, 512), nn.Tanh())
    x = torch.randn(128, 512)
    results = {}
    for dtype in (torch.float64, torch.float32):
        net = model.to(dtype)
        net.zero_grad(set_to_none=True)
        inputs = x.to(dtype).requires_grad_(True)  # its message is a product too
        with semipack.extend(net, semiring()):
            net(inputs).pow(2).sum().backward()
        results[dtype] = [p.semiring_grad.double() for p in [*net.parameters(), inputs]]
        if dtype == torch.float64:
            assert counted["linear"] == 0
    assert counted["linear"] >= 2  # the float32 run took oneDNN for its input messages
    for got, want in zip(results[torch.float32], results[torch.float64], strict=True):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_a_product_onednn_refuses_falls_back_to_torch_matmul_for_good(monkeypatch):
    """A build whose oneDNN op raises (another platform's, a missing primitive): the product
    comes from ``torch.matmul``, one warning says so, and later products skip oneDNN."""
    calls = []

    class Refusing:
        def __call__(self, *args):
            calls.append("linear")
            raise RuntimeError("no primitive for this shape")

        def binary(self, *args):
            calls.append("binary")
            raise RuntimeError("no primitive for this shape")

    monkeypatch.setattr(blas, "_LINEAR", Refusing())
    monkeypatch.setitem(blas._state, "enabled", True)
    a, b = operands(256, 128, 64, seed=5)
    with pytest.warns(RuntimeWarning, match="oneDNN's product failed"):
        got = blas.matmul(a, b)
    assert torch.equal(got, torch.matmul(a, b))
    c = torch.rand(256, 64)
    assert torch.equal(blas.subtract_product(c.clone(), a, b), c.clone().addmm_(a, b, alpha=-1))
    assert calls == ["linear"]  # switched off after the first failure


@pytest.mark.parametrize(
    ("variable", "capability", "expected"),
    [
        (None, "AVX512", True),
        (None, "AVX512_BF16", True),
        (None, "AVX2", False),
        (None, "DEFAULT", False),
        ("1", "AVX2", True),
        ("0", "AVX512", False),
        (" Off ", "AVX512", False),
        ("yes", "AVX2", True),
        ("", "AVX2", False),  # cleared with SEMIPACK_ONEDNN=: the default again
        ("  ", "AVX512", True),
    ],
)
def test_onednn_by_default_only_on_avx512_cpus(monkeypatch, variable, capability, expected):
    """MKL was faster than oneDNN on every product measured on an AVX2-only CPU (the module
    docstring), so oneDNN is the default only where PyTorch's CPU kernels are AVX-512 ones;
    ``SEMIPACK_ONEDNN`` decides wherever it is set."""
    if variable is None:
        monkeypatch.delenv("SEMIPACK_ONEDNN", raising=False)
    else:
        monkeypatch.setenv("SEMIPACK_ONEDNN", variable)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert blas.default_onednn() is expected


@pytest.mark.parametrize("value", ["off", "no", 0, 1, None])
def test_set_onednn_takes_only_a_bool(value):
    """A string that means off in the environment variable would be true as a bool: refused,
    and the setting stays as it was."""
    before = dict(blas._state)
    with pytest.raises(TypeError, match="set_onednn takes True or False"):
        blas.set_onednn(value)
    assert blas._state == before
