"""Per-sample semiring values against the batch value alone (not a test).

    python benchmarks/bench_per_sample.py [--repeats 9] [--semirings MaxProd LogSum Entropy Real]

Workloads (CPU, float32, one step = forward + backward, timed whole):

* ``mlp``: Linear 256->512, GELU, LayerNorm, Linear 512->512, GELU, Linear 512->10 on a batch
  of 32 vectors, cross-entropy;
* ``transformer``: Embedding (vocab 1000, width 64), two ``nn.TransformerEncoderLayer`` (4
  heads, feed-forward 128, batch first, eval mode), Linear 64->10 on the first token, on a batch
  of 8 sequences of 32 tokens, cross-entropy;
* ``cnn``: the CNN of ``bench_backpack.py`` (two 3x3 convolutions, pools, Linear 2048->10) on a
  batch of 32 RGB images of 32 x 32, cross-entropy.

Variants: ``plain`` (a plain backward), ``batch`` (``semipack.extend(model, sr)``) and
``per_sample`` (``semipack.extend(model, sr, per_sample=True)``). They take turns within every
round after one warm-up round; the ratio printed is the median over rounds of each round's
``per_sample / batch``, with the variants' median times.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import interleaved, machine, median_ratio, medians

import semipack


def mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    model = nn.Sequential(
        nn.Linear(256, 512), nn.GELU(), nn.LayerNorm(512), nn.Linear(512, 512), nn.GELU(),
        nn.Linear(512, 10),
    )  # fmt: skip
    return model, (torch.randn(32, 256),), torch.randint(0, 10, (32,))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.emb(ids))[:, 0])


def transformer() -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    return Transformer().eval(), (torch.randint(0, 1000, (8, 32)),), torch.randint(0, 10, (8,))


def cnn() -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )  # fmt: skip
    return model, (torch.randn(32, 3, 32, 32),), torch.randint(0, 10, (32,))


WORKLOADS = {"mlp": mlp, "transformer": transformer, "cnn": cnn}


def step(model, inputs, target, sr=None, per_sample=False) -> Callable[[], None]:
    def run() -> None:
        for p in model.parameters():
            p.grad = None
        if sr is None:
            F.cross_entropy(model(*inputs), target).backward()
            return
        with semipack.extend(model, sr, per_sample=per_sample):
            F.cross_entropy(model(*inputs), target).backward()

    return run


def bench(workload: str, semiring: str, repeats: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    model, inputs, target = WORKLOADS[workload]()
    make = getattr(semipack, semiring)
    variants = {
        "plain": step(model, inputs, target),
        "batch": step(model, inputs, target, make()),
        "per_sample": step(model, inputs, target, make(), per_sample=True),
    }
    return interleaved(variants, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--semirings", nargs="+", default=["MaxProd", "LogSum", "Entropy", "Real"])
    args = parser.parse_args()
    print(machine())
    print(f"forward + backward, medians of {args.repeats} interleaved rounds")
    print(
        f"{'workload':<12} {'semiring':<9} {'plain':>9} {'batch':>9} {'per_sample':>11} "
        f"{'per_sample / batch':>19}"
    )
    for workload in args.workloads:
        for name in args.semirings:
            rounds = bench(workload, name, args.repeats)
            ratio = median_ratio(rounds["per_sample"], rounds["batch"])
            t = medians(rounds)
            print(
                f"{workload:<12} {name:<9} {t['plain'] * 1e3:>7.1f}ms {t['batch'] * 1e3:>7.1f}ms "
                f"{t['per_sample'] * 1e3:>9.1f}ms {ratio:>19.2f}"
            )


if __name__ == "__main__":
    main()
