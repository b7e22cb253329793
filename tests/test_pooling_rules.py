"""Max pooling's disjoint-window route (``rules.pooling``): a scatter of each output's state
in place of a plus-reduction by destination. It must give the reduction's bits: every
semiring, zero-mass states from ReLU, ties, ``ceil_mode`` windows and a product of
semirings; overlapping windows keep the reduction. The reduction itself is checked against
the brute-force oracle in ``tests/test_oracle.py``."""

from __future__ import annotations

import pytest
import torch
from helpers import SEMIRINGS
from torch import nn

import semipack
from semipack.rules import pooling

POOLS = {
    "2x2": nn.MaxPool2d(2),
    "ceil_mode": nn.MaxPool2d(2, ceil_mode=True),
    "3x3 stride 3 padded": nn.MaxPool2d(3, 3, padding=1),
    "dilated": nn.MaxPool2d(2, stride=3, dilation=2),
    "3d": nn.MaxPool3d(2),
}


def _model(pool: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    three_d = isinstance(pool, nn.MaxPool3d)
    conv = nn.Conv3d(2, 3, 3, padding=1) if three_d else nn.Conv2d(2, 3, 3, padding=1)
    return nn.Sequential(conv, nn.ReLU(), pool, nn.Flatten(), nn.LazyLinear(2)).double()


def _values(model, x, sr, disjoint_route: bool, monkeypatch) -> list[torch.Tensor]:
    if not disjoint_route:
        monkeypatch.setattr(pooling, "_disjoint_windows", lambda call, nsp: False)
    with semipack.extend(model, sr, keep_state=True):
        model(x).tanh().sum().backward()
    monkeypatch.undo()
    return [part.clone() for p in model.parameters() for part in p.semiring_state]


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("name", [*SEMIRINGS, "product"])
def test_disjoint_windows_give_the_reductions_bits(pool, name, monkeypatch) -> None:
    model = _model(POOLS[pool])
    shape = (3, 2, 5, 5, 5) if pool == "3d" else (3, 2, 7, 7)
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x[:, :, ::2] = 0.5  # ties inside windows
    model(x)  # the lazy layer's shape
    make = SEMIRINGS.get(name)
    sr = make() if make else semipack.Product(semipack.MaxProd(log=True), semipack.Entropy())
    scattered = _values(model, x, sr, True, monkeypatch)
    reduced = _values(model, x, sr, False, monkeypatch)
    for a, b in zip(scattered, reduced, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_overlapping_windows_are_not_disjoint() -> None:
    class Call(dict):
        pass

    overlapping = Call(kernel_size=[3, 3], stride=[2, 2], dilation=[1, 1])
    assert not pooling._disjoint_windows(overlapping, 2)
    assert pooling._disjoint_windows(Call(kernel_size=[2, 2], stride=[], dilation=[1, 1]), 2)
    assert not pooling._disjoint_windows(Call(kernel_size=[2], stride=[2], dilation=[2]), 1)
