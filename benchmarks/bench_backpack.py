"""BackPACK and a semiring in one backward against the two in separate runs (not a test).

    python benchmarks/bench_backpack.py [--repeats 7] [--block 3] [--batch 32] [--semirings ...]

Workload: a CNN on CPU (conv 3->16 3x3, ReLU, max pool, conv 16->32 3x3, ReLU, average pool,
flatten, linear 2048->10) on ``--batch`` 32 x 32 RGB images, cross-entropy loss, with BackPACK's
BatchGrad, Variance and DiagGGNExact. Each variant is one step, forward and backward, timed
whole (separate runs need a forward each):

* ``plain``: a plain backward;
* ``backpack``: BackPACK's extensions alone;
* ``semiring``: ``semipack.extend`` alone (the plain model, no hooks);
* ``combined``: both in one backward (README "BackPACK in the same backward").

The variants take turns within every round (so drift on a shared machine hits all alike) after
one warm-up round; medians over ``--repeats`` rounds are printed, with the ratio of the combined
step to the two separate steps, ``combined / (backpack + semiring)``: the median over rounds of
each round's ratio (a round lasts a fraction of a second, so load from other processes mostly
hits a whole round and cancels in its ratio). Within its turn a variant runs ``--block`` times
in a row and the last run is timed (``common.interleaved``): the steady state of a training
loop that repeats one step. With ``--block 1`` each timed step follows another variant's and
pays for its different allocations (the combined step after the semiring step was 5-10% slower
than in a row of combined steps).
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import backpack
from backpack import extensions as bpe
from common import interleaved, machine, median_ratio, medians, sign_test

import semipack


def cnn() -> nn.Module:
    """[batch, 3, 32, 32] -> [batch, 10]."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    )


def step(
    model: nn.Module, loss: nn.Module, x: torch.Tensor, y: torch.Tensor, contexts: Callable
) -> Callable[[], None]:
    """A variant: one forward and backward inside the context managers ``contexts()`` makes
    (fresh ones each call), with the model's gradients and results cleared first."""

    def run() -> None:
        for p in model.parameters():
            p.grad = None
        with ExitStack() as stack:
            for context in contexts():
                stack.enter_context(context)
            loss(model(x), y).backward()

    return run


def bench(semiring: str, batch: int, repeats: int, block: int) -> dict[str, list[float]]:
    """The four variants for one semiring; returns each one's times in seconds, by round."""
    torch.manual_seed(0)
    plain = cnn()
    hooked = backpack.extend(copy.deepcopy(plain))
    hooked_loss, plain_loss = backpack.extend(nn.CrossEntropyLoss()), nn.CrossEntropyLoss()
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    make = getattr(semipack, semiring)

    def extensions() -> AbstractContextManager[Any]:
        return backpack.backpack(bpe.BatchGrad(), bpe.Variance(), bpe.DiagGGNExact())

    variants = {
        "plain": step(plain, plain_loss, x, y, lambda: []),
        "backpack": step(hooked, hooked_loss, x, y, lambda: [extensions()]),
        "semiring": step(plain, plain_loss, x, y, lambda: [semipack.extend(plain, make())]),
        "combined": step(
            hooked,
            hooked_loss,
            x,
            y,
            lambda: [extensions(), semipack.extend(hooked, make())],
        ),
    }
    return interleaved(variants, repeats, block)


def main() -> None:
    """Parse the options, run each semiring's variants and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--block", type=int, default=3, help="runs per turn, the last timed")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--semirings", nargs="+", default=["Entropy", "MaxProd", "LogSum"])
    args = parser.parse_args()
    # PyTorch warns at every backward that the first module's hooks fire without an input
    # gradient (the images need none); BackPACK alone warns alike
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    print(machine())
    print(
        f"CNN, batch {args.batch}, 32x32x3 images; BackPACK: BatchGrad, Variance, DiagGGNExact; "
        f"forward + backward, medians of {args.repeats} interleaved rounds, "
        f"the last of {args.block} runs in a row timed"
    )
    print(
        f"{'semiring':<9} {'plain':>8} {'backpack':>9} {'semiring':>9} {'combined':>9} "
        f"{'combined / (backpack + semiring)':>33} {'rounds faster (sign test p)':>28}"
    )
    for name in args.semirings:
        rounds = bench(name, args.batch, args.repeats, args.block)
        separate = [b + s for b, s in zip(rounds["backpack"], rounds["semiring"], strict=True)]
        ratio = median_ratio(rounds["combined"], separate)
        wins, p = sign_test(rounds["combined"], separate)
        t = medians(rounds)
        print(
            f"{name:<9} {t['plain'] * 1e3:>6.1f}ms {t['backpack'] * 1e3:>7.1f}ms "
            f"{t['semiring'] * 1e3:>7.1f}ms {t['combined'] * 1e3:>7.1f}ms {ratio:>33.2f} "
            f"{f'{wins}/{len(separate)} (p = {p:.1g})':>28}"
        )


if __name__ == "__main__":
    main()
