"""oneDNN against MKL for the sum-like semirings' float32 products, on this machine.

    python benchmarks/bench_blas_choice.py --workloads bert_layer minilm_1x20 \
        --semirings LogSum Entropy --rounds 6

``semipack.kernels.blas`` sends LogSum's, LogCount's and Entropy's large float32 CPU products
to oneDNN where PyTorch's CPU capability is AVX-512 and to ``torch.matmul`` (MKL) elsewhere
(``blas.default_onednn``). This script measures the choice where it runs, in two parts:

* the products alone: the shapes a BERT layer and a MiniLM sentence give (messages times |W|,
  transposed messages times |x|), each through ``blas.matmul`` with oneDNN on and off, and
  through ``blas.subtract_product`` (Entropy's third sum), medians in microseconds;
* whole semiring backwards of the workloads with oneDNN on and off (``blas.set_onednn``), in
  one process and in turns round after round (the order flips every round; the first round is
  warm-up), beside a plain backward: each variant's median and its ratio to the plain one.

The machines these numbers come from are shared: read medians, and expect spreads of 10-20%.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from cases import WORKLOADS
from common import backward_step

import semipack
from semipack.kernels import blas

#: (label, n, k, m, left transposed): the left operand [n, k] is a message ([tokens, out]) or a
#: transposed one (a weight message's e^T, column-major), the right one [k, m] a transposed
#: weight (|W|^T, column-major) or an input's magnitudes (row-major).
PRODUCTS = [
    ("BERT input message e @ |W|, [1024, 3072] x [3072, 768]", 1024, 3072, 768, False),
    ("BERT input message e @ |W|, [1024, 768] x [768, 3072]", 1024, 768, 3072, False),
    ("BERT weight message e^T @ |x|, [3072, 1024] x [1024, 768]", 3072, 1024, 768, True),
    ("BERT weight message e^T @ |x|, [768, 1024] x [1024, 3072]", 768, 1024, 3072, True),
    ("sentence input message, [20, 1536] x [1536, 384]", 20, 1536, 384, False),
    ("sentence weight message, [1536, 20] x [20, 384]", 1536, 20, 384, True),
    ("sentence weight message, [384, 20] x [20, 384]", 384, 20, 384, True),
]


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    spent = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        spent.append(time.perf_counter() - start)
    return statistics.median(spent) * 1e6


def _operands(n: int, k: int, m: int, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(k, n, generator=gen).t() if transposed else torch.rand(n, k, generator=gen)
    b = torch.rand(k, m, generator=gen) if transposed else torch.rand(m, k, generator=gen).t()
    return a, b


def products(repeats: int) -> None:
    """Each product with oneDNN on and off, in turns (two turns each; the second is printed).
    A transposed left operand of more than ``blas.ONEDNN_COPY_MAX`` entries stays on MKL with
    oneDNN on as well (its line says so): both columns are MKL there."""
    print("products (microseconds, median of the second turn)")
    for label, n, k, m, transposed in PRODUCTS:
        a, b = _operands(n, k, m, transposed)
        c = torch.rand(n, m)
        blas.set_onednn(True)
        if not blas._on_onednn(a, b):
            label += " (MKL in both: too large to copy)"
        got: dict[str, float] = {}
        for _ in range(2):
            for onednn in (True, False):
                blas.set_onednn(onednn)
                name = "oneDNN" if onednn else "MKL"
                got[name] = _median_us(lambda a=a, b=b: blas.matmul(a, b), repeats)
                got[name + " subtract"] = _median_us(
                    lambda a=a, b=b, c=c: blas.subtract_product(c.clone(), a, b), repeats
                )
        print(
            f"  {label:92s} oneDNN {got['oneDNN']:8.0f}  MKL {got['MKL']:8.0f}  |  subtract: "
            f"oneDNN {got['oneDNN subtract']:8.0f}  MKL {got['MKL subtract']:8.0f}"
        )


def backwards(workload: str, semiring_name: str, rounds: int) -> None:
    work = WORKLOADS[workload]()
    plain = backward_step(work.model, work.loss, None)
    semiring = backward_step(work.model, work.loss, getattr(semipack, semiring_name)())
    times: dict[str, list[float]] = {"oneDNN": [], "MKL": [], "plain": []}
    for round_ in range(rounds + 1):
        order = ["oneDNN", "MKL", "plain"] if round_ % 2 else ["MKL", "oneDNN", "plain"]
        for name in order:
            blas.set_onednn(name == "oneDNN")
            backward = (plain if name == "plain" else semiring)()
            start = time.perf_counter()
            backward()
            if round_ >= 1:
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain"])
    line = "  ".join(
        f"{name} {statistics.median(t) * 1e3:7.1f} ms ({statistics.median(t) / base:4.2f}x)"
        for name, t in times.items()
    )
    print(f"{workload}, {semiring_name}, medians of {rounds} rounds: {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="*", default=["bert_layer"], choices=list(WORKLOADS))
    parser.add_argument("--semirings", nargs="*", default=["LogSum", "Entropy"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=9, help="calls per product and turn")
    args = parser.parse_args()
    if blas._LINEAR is None:
        raise SystemExit("this PyTorch has no oneDNN product (not x86-64, or no mkldnn)")
    previous = blas.set_onednn(True)
    try:
        print(
            f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} threads; default here: "
            f"{'oneDNN' if blas.default_onednn() else 'MKL'}"
        )
        products(args.repeats)
        for workload in args.workloads:
            for name in args.semirings:
                backwards(workload, name, args.rounds)
    finally:
        blas.set_onednn(previous)


if __name__ == "__main__":
    main()
