"""Attention masks by value: a key masked by any additive value (``-1e4``, ``-1e9``,
``finfo.min``, ``-inf``) or by ``False`` has no path, in float16, float32 and float64, through
``F.scaled_dot_product_attention`` (extension and generic path) and through a hand-written
``softmax(S + mask) @ V``; a weak but representable key (bias -50) keeps its path.

The reference is the boolean mask, which is structural by definition (PyTorch drops the key),
and Real, which must equal autograd. The rule behind the additive cases: an edge whose
log-weight is below float64's smallest subnormal (``NO_EDGE_LOG``) is no edge.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

import semipack
from semipack.semirings.base import NO_EDGE_LOG

KEEP = torch.tensor([[True, True, True, False]])  # key 3 is padding
SEMIRINGS = [semipack.Boolean, semipack.LogSum, semipack.Entropy]
FILLS = [-1e4, -1e9, "finfo.min", float("-inf")]


def _leaves(dtype: torch.dtype) -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 1, 4, 3, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def _mask(dtype: torch.dtype, fill) -> Tensor:
    if fill == "bool":
        return KEEP
    value = torch.finfo(dtype).min if fill == "finfo.min" else fill
    return torch.zeros(1, 4, dtype=dtype).masked_fill(~KEEP, value)


def _attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, hand_written: bool) -> Tensor:
    if not hand_written:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = q @ k.transpose(-1, -2) / 3**0.5
    boolean = mask.dtype == torch.bool
    scores = scores.masked_fill(~mask, float("-inf")) if boolean else scores + mask
    return scores.softmax(-1) @ v


def _values(dtype, fill, sr, extensions: bool, hand_written: bool) -> list[Tensor]:
    q, k, v = _leaves(dtype)
    with semipack.extend(None, sr, extensions=extensions):
        _attention(q, k, v, _mask(dtype, fill), hand_written).sum().backward()
    return [q.semiring_grad, k.semiring_grad, v.semiring_grad]


ROUTES = [(True, False), (False, False), (False, True)]
ROUTE_IDS = ["sdpa-extension", "sdpa-generic", "hand-written"]


@pytest.mark.parametrize(("extensions", "hand_written"), ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("fill", FILLS, ids=str)
@pytest.mark.parametrize("sr", SEMIRINGS, ids=lambda s: s.__name__)
def test_any_additive_mask_cuts_the_key_like_a_boolean_mask(
    sr, fill, dtype, extensions: bool, hand_written: bool
) -> None:
    if dtype == torch.float16 and fill == -1e9:
        pytest.skip("-1e9 is not a float16 number")
    want = _values(dtype, "bool", sr(), extensions, hand_written)
    got = _values(dtype, fill, sr(), extensions, hand_written)
    for name, a, b in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, equal_nan=True, msg=name)
    reach = _values(dtype, fill, semipack.Boolean(), extensions, hand_written)
    assert not reach[1][..., 3, :].any() and not reach[2][..., 3, :].any()  # padding: no path
    assert reach[2][..., :3, :].all()


@pytest.mark.parametrize(("extensions", "hand_written"), ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_a_weak_key_keeps_its_path(dtype, extensions: bool, hand_written: bool) -> None:
    """A bias of -50 makes the key's weight about e^-50: tiny, representable, a real edge
    (its gradient is non-zero in float64) that neither dtype may cut."""
    q, k, v = _leaves(torch.float64)
    (plain,) = torch.autograd.grad(_attention(q, k, v, _mask(torch.float64, -50.0), False).sum(), v)
    assert (plain[..., 3, :] != 0).all()
    reach = _values(dtype, -50.0, semipack.Boolean(), extensions, hand_written)
    assert reach[2][..., 3, :].all()
    log_max = _values(dtype, -50.0, semipack.MaxProd(log=True), extensions, hand_written)[2]
    want = _values(torch.float64, -50.0, semipack.MaxProd(log=True), extensions, hand_written)[2]
    torch.testing.assert_close(log_max.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("extensions", [True, False])
def test_a_row_masked_everywhere_by_finfo_min_stays_uniform(extensions: bool) -> None:
    """Hugging Face masks with ``finfo.min``: a query whose every key is masked that way gets a
    uniform softmax in the forward (each key weight 1/4), a real dependence that keeps its
    edges; Real equals autograd through the reference decomposition (PyTorch's math kernel)
    and MaxProd reads 1/4 for each value entry.

    (PyTorch's fused CPU kernel differentiates that row with weight 1 per key: its saved
    logsumexp, finfo.min + log 4, rounds to finfo.min. semipack follows the forward's 1/4.)"""
    q, k, v = _leaves(torch.float32)
    mask = torch.full((4, 4), torch.finfo(torch.float32).min)
    mask[1:, :] = 0.0  # only query 0 is fully masked
    with sdpa_kernel(SDPBackend.MATH):
        (want,) = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, mask).sum(), v)
    with semipack.extend(None, semipack.Real(), extensions=extensions):
        F.scaled_dot_product_attention(q, k, v, mask).sum().backward()
    torch.testing.assert_close(v.semiring_grad, want, rtol=1e-6, atol=1e-7)
    (best,) = semipack.grad(
        F.scaled_dot_product_attention(q, k, v, mask)[..., 0, :].sum(), v, semipack.MaxProd()
    )
    torch.testing.assert_close(best, torch.full_like(best, 0.25), rtol=1e-6, atol=0)


def test_the_no_edge_threshold_is_float64s_smallest_subnormal() -> None:
    assert math.exp(NO_EDGE_LOG) == math.ulp(0.0) == 2.0**-1074
    assert pytest.approx(-744.44007, abs=1e-5) == NO_EDGE_LOG
