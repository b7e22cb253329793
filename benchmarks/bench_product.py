"""One backward with ``Product(MaxProd(), Entropy(), LogSum())`` against the three separate
backwards it replaces, on the workloads of ``cases.py``.

Run: ``python benchmarks/bench_product.py --workloads minilm_1x20 linear --repeats 5``. The
variants take turns within every round (``time_backwards_interleaved``); the line per workload
gives the fastest round of each, and the product's time over the sum of the three.
"""

from __future__ import annotations

import argparse

from cases import WORKLOADS
from common import backward_step, time_backwards_interleaved

import semipack

FACTORS = (semipack.MaxProd, semipack.Entropy, semipack.LogSum)


def measure(name: str, repeats: int) -> dict[str, float]:
    """Seconds per backward: plain, each factor alone, and the product."""
    work = WORKLOADS[name]()
    steps = {"plain": backward_step(work.model, work.loss)}
    for make in FACTORS:
        steps[make.__name__] = backward_step(work.model, work.loss, make())
    product = semipack.Product(*(make() for make in FACTORS))
    steps["Product"] = backward_step(work.model, work.loss, product)
    return time_backwards_interleaved(steps, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["minilm_1x20", "linear"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for name in args.workloads:
        t = measure(name, args.repeats)
        separate = sum(t[make.__name__] for make in FACTORS)
        parts = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in t.items())
        print(f"{name}: {parts}; product / (sum of the three) = {t['Product'] / separate:.2f}")


if __name__ == "__main__":
    main()
