"""Timings of the max-plus kernels behind MaxProd / SignedMaxProd matmuls (not a test).

    python benchmarks/bench_tropical.py [--threads N] [--repeats R] [--threshold]

Prints, for a [1024, 768] x [768, 3072] float32 product: BLAS sgemm, the compiled maxplus and
maxplus_argmax, the eager blocked fallback, the generic ``blocked_matmul`` MaxProd used before,
and the naive broadcast-then-reduce (timed on a slice of rows and scaled, because the full
broadcast is 9.7 GB). ``--threshold`` also times eager vs compiled around COMPILE_MIN_PAIRS.
Times are medians of ``--repeats`` runs, wall clock; run on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import semipack
from semipack.kernels import set_compile
from semipack.kernels import tropical as trop
from semipack.semirings.base import blocked_matmul

N, K, M = 1024, 768, 3072
NAIVE_ROWS = 64


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def first_call_time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def report(name: str, seconds: float, pairs: int, note: str = "") -> None:
    print(f"{name:<44s} {seconds * 1e3:10.1f} ms {pairs / seconds / 1e9:8.2f} G pairs/s {note}")


def main_product(repeats: int) -> None:
    torch.manual_seed(0)
    a = torch.randn(N, K)
    b = torch.randn(K, M)
    pairs = N * K * M
    print(f"[{N}, {K}] x [{K}, {M}] float32, {torch.get_num_threads()} threads, {pairs:,} pairs")

    sgemm = median_time(lambda: a @ b, repeats)
    report("sgemm (a @ b)", sgemm, pairs, f"= {2 * pairs / sgemm / 1e9:.0f} GFLOP/s")
    # The first compiled call pays torch.compile's start-up (~5 s here) and, on a cold inductor
    # cache, the C++ build of the kernel; later processes load it from the on-disk cache.

    warm = first_call_time(lambda: trop.maxplus(a, b))
    fused = median_time(lambda: trop.maxplus(a, b), repeats)
    report("compiled maxplus", fused, pairs, f"(first call {warm:.1f} s)")
    warm = first_call_time(lambda: trop.maxplus_argmax(a, b))
    fused_arg = median_time(lambda: trop.maxplus_argmax(a, b), repeats)
    report("compiled maxplus_argmax", fused_arg, pairs, f"(first call {warm:.1f} s)")

    weights = torch.randn(K, M)
    for sr in (semipack.MaxProd(), semipack.SignedMaxProd()):
        state = sr.lift(torch.randn(N, K))
        t = median_time(lambda sr=sr, state=state: sr.matmul(state, weights), repeats)
        note = (
            "(does 8x the pairs: 4 components x 2 signs)"
            if isinstance(sr, semipack.SignedMaxProd)
            else ""
        )
        report(f"{sr.name}().matmul (compiled)", t, pairs, note)
    mp = semipack.MaxProd()
    mp_state = mp.lift(torch.randn(N, K))
    fused_mp = median_time(lambda: mp.matmul(mp_state, weights), repeats)

    set_compile(False)
    try:
        eager = median_time(lambda: trop.maxplus(a, b), max(1, repeats // 2))
        report("eager blocked maxplus (SEMIPACK_COMPILE=0)", eager, pairs)
        eager_arg = median_time(lambda: trop.maxplus_argmax(a, b), 1)
        report("eager blocked maxplus_argmax", eager_arg, pairs)
    finally:
        set_compile(True)
    generic = median_time(lambda: blocked_matmul(mp, mp_state, weights), 1)
    report("generic blocked_matmul(MaxProd)", generic, pairs)

    rows = a[:NAIVE_ROWS]
    # The naive temporary (64 rows: 604 MB) is page-faulted in afresh on most calls, which makes
    # its time swing by up to 7x with the allocator's state; the "warm" variant writes into a
    # preallocated buffer and is a lower bound, so ratios against it are conservative.
    rows = a[:NAIVE_ROWS]
    naive_slice = median_time(lambda: (rows[:, :, None] + b[None, :, :]).amax(-2), repeats)
    naive = naive_slice * N / NAIVE_ROWS
    report("naive broadcast-then-reduce", naive, pairs, f"(estimated from {NAIVE_ROWS} rows)")
    buffer = torch.empty(NAIVE_ROWS, K, M)

    def naive_warm() -> torch.Tensor:
        return torch.add(rows[:, :, None], b[None, :, :], out=buffer).amax(-2)

    warm_naive = median_time(naive_warm, repeats) * N / NAIVE_ROWS
    report("naive, temporary preallocated (lower bound)", warm_naive, pairs)

    for label, t in [
        ("compiled maxplus", fused),
        ("compiled maxplus_argmax", fused_arg),
        ("MaxProd().matmul", fused_mp),
    ]:
        print(
            f"naive / {label:<24s} = {naive / t:6.1f}x  (warm lower bound: {warm_naive / t:.1f}x)"
        )
    print("target: fused MaxProd >= 20x faster than naive")
    print(f"compiled maxplus / sgemm time   = {fused / sgemm:6.1f}x")


def threshold_sweep(repeats: int) -> None:
    """Eager vs compiled for square-ish problems around the compile threshold."""
    print(f"\nthreshold sweep (COMPILE_MIN_PAIRS = 2**{trop.COMPILE_MIN_PAIRS.bit_length() - 1})")
    saved = trop.COMPILE_MIN_PAIRS
    for log2 in range(14, 23):
        side = round(2 ** (log2 / 3))
        a, b = torch.randn(side, side), torch.randn(side, side)
        trop.COMPILE_MIN_PAIRS = 0
        trop.maxplus(a, b)  # compile / warm up this size family
        compiled_t = median_time(lambda a=a, b=b: trop.maxplus(a, b), repeats * 5)
        trop.COMPILE_MIN_PAIRS = 1 << 62
        eager_t = median_time(lambda a=a, b=b: trop.maxplus(a, b), repeats * 5)
        print(
            f"{side:4d}^3 = 2**{log2} pairs: eager {eager_t * 1e6:9.0f} us, "
            f"compiled {compiled_t * 1e6:9.0f} us"
        )
    trop.COMPILE_MIN_PAIRS = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threshold", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    main_product(args.repeats)
    if args.threshold:
        threshold_sweep(args.repeats)


if __name__ == "__main__":
    main()
