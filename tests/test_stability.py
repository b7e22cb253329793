"""Log-space states keep deep graphs finite where linear-scale path sums would overflow."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import semipack

FLOAT32_MAX_LOG = math.log(torch.finfo(torch.float32).max)  # ≈ 88.7


class ResidualMLP(nn.Module):
    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


@pytest.fixture(scope="module")
def deep_model() -> ResidualMLP:
    torch.manual_seed(0)
    return ResidualMLP(depth=24, width=256)


@pytest.mark.parametrize(
    "sr",
    [semipack.LogSum(), semipack.Entropy(), semipack.LogCount(), semipack.MaxProd(log=True)],
    ids=lambda s: s.name,
)
def test_deep_residual_mlp_stays_finite(deep_model: ResidualMLP, sr) -> None:
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    deep_model.zero_grad()
    with semipack.extend(deep_model, sr):
        deep_model(x).sum().backward()
    for p in deep_model.parameters():
        assert torch.isfinite(p.semiring_grad).all(), p.shape
    first = deep_model.layers[0].weight.semiring_grad
    if isinstance(sr, semipack.LogCount):
        # Paths from the output to layer 0 double at every residual block: 2^24 * 256^23 * ...
        # far beyond float32's range, which is why counts are kept as logs.
        assert first.min() > FLOAT32_MAX_LOG
    if isinstance(sr, semipack.LogSum):
        assert first.max() > 0 and torch.isfinite(first).all()
    if isinstance(sr, semipack.Entropy):
        # at most log(number of paths)
        count = semipack.grad(
            deep_model(x).sum(), deep_model.layers[0].weight, semipack.LogCount()
        )[0]
        assert (first >= 0).all() and (first <= count + 1e-3).all()
