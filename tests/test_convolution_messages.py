"""Convolution messages one tap at a time equal the im2col window-map reference, every semiring."""

from __future__ import annotations

import pytest
import torch
from conv_reference import window_map_messages

import semipack
from semipack.rules.convolution import per_tap_messages
from semipack.rules.windows import ConvGeometry

SEMIRINGS = [
    semipack.Real(),
    semipack.MaxProd(),
    semipack.SignedMaxProd(),
    semipack.LogSum(),
    semipack.LogCount(),
    semipack.Entropy(),
    semipack.Boolean(),
]

GEOMETRIES = {
    "conv2d_padded": dict(x=(2, 4, 6, 5), w=(6, 4, 3, 3), stride=1, padding=1, dilation=1),
    "strided_dilated_groups": dict(
        x=(2, 4, 9, 8), w=(6, 2, 3, 2), stride=(2, 1), padding=(2, 0), dilation=(2, 3), groups=2
    ),
    "conv1d": dict(x=(3, 2, 11), w=(5, 2, 4), stride=3, padding=2, dilation=1),
    "depthwise": dict(x=(2, 3, 5, 5), w=(3, 1, 3, 3), stride=1, padding=0, dilation=1, groups=3),
    "conv3d": dict(x=(1, 2, 4, 5, 3), w=(3, 2, 2, 3, 2), stride=1, padding=(1, 0, 1), dilation=1),
}


def _tensors(geometry: dict, dtype: torch.dtype, sr):
    gen = torch.Generator().manual_seed(11)

    def draw(shape):
        t = torch.randn(shape, generator=gen, dtype=torch.float64)
        return torch.where(torch.rand(shape, generator=gen) < 0.2, 0.0, t).to(dtype)

    x, w = draw(geometry["x"]), draw(geometry["w"])
    conv = {3: torch.nn.functional.conv1d, 4: torch.nn.functional.conv2d}.get(
        x.dim(), torch.nn.functional.conv3d
    )
    groups = geometry.get("groups", 1)
    out = conv(x, w, None, geometry["stride"], geometry["padding"], geometry["dilation"], groups)
    # An output message: the lift of random edge weights (zeros: entries without a path).
    m = sr.lift(draw(out.shape) * 3)
    return x, w, m, groups


@pytest.mark.parametrize("sr", SEMIRINGS, ids=lambda s: s.name)
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_per_tap_messages_equal_the_window_maps(sr, geometry: str, dtype) -> None:
    g = GEOMETRIES[geometry]
    x, w, m, groups = _tensors(g, dtype, sr)
    geometry = ConvGeometry.of(x.dim() - 2, g["stride"], g["padding"], g["dilation"], groups)
    args = (sr, m, x, w, geometry, (True, True, True))
    exact = isinstance(sr, (semipack.MaxProd, semipack.SignedMaxProd, semipack.Boolean))
    tol = {} if not exact else {"rtol": 0, "atol": 0}
    if not exact and dtype == torch.float32:
        tol = {"rtol": 1e-5, "atol": 1e-5}
    for got, want in zip(per_tap_messages(*args), window_map_messages(*args), strict=True):
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape
            if isinstance(sr, semipack.Entropy) and a is got[1]:
                live = torch.isfinite(got[0])
                a, b = a[live], b[live]
            torch.testing.assert_close(a, b, equal_nan=True, **tol)
