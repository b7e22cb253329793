"""Print the semiring values of a small model: one backward pass per semiring.

A two-layer MLP classifies four points; for every semiring we run the backward inside
``semipack.extend`` and summarise the first layer's ``weight.semiring_grad``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import semipack


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.GELU(), nn.LayerNorm(4), nn.Linear(4, 2))
    x = torch.randn(4, 3, requires_grad=True)
    y = torch.tensor([0, 1, 1, 0])

    semirings = [
        semipack.Real(),
        semipack.MaxProd(),
        semipack.SignedMaxProd(),
        semipack.LogSum(),
        semipack.Entropy(),
        semipack.Boolean(),
        semipack.LogCount(),
    ]
    print("first layer weight, one row per semiring (entries of weight[0]):")
    for sr in semirings:
        model.zero_grad()
        with semipack.extend(model, sr):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        value = model[0].weight.semiring_grad
        if isinstance(value, semipack.Extremes):
            row = " ".join(
                f"[{lo:+.4f}, {hi:+.4f}]"
                for lo, hi in zip(value.smallest[0], value.largest[0], strict=False)
            )
        else:
            row = " ".join(f"{v:+.4f}" if v.dtype != torch.bool else str(bool(v)) for v in value[0])
        print(f"  {sr.name:>14}: {row}")
    print("regular gradient  :", " ".join(f"{v:+.4f}" for v in model[0].weight.grad[0]))
    print("input x, Entropy of paths to each entry of x[0]:")
    (h,) = semipack.grad(F.cross_entropy(model(x), y), x, semipack.Entropy())
    print("  ", " ".join(f"{v:.4f}" for v in h[0]))


if __name__ == "__main__":
    main()
