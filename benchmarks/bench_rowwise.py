"""Time the generic dense-Jacobian path against the row-wise kernels at BERT-base sizes.

    python benchmarks/bench_rowwise.py [--repeats 3] [--dtype float32]

* layer_norm: 1024 rows x 768 (batch 8 x 128 tokens, hidden 768), compiled fused kernels;
* softmax: 96 * 128 rows x 128 (8 x 12 heads x 128 queries over 128 keys), O(n) kernels;
* log_softmax: 128 rows x 30522 (a masked-LM head over BERT's vocabulary), O(n) kernels.

The generic path (``contract_rows`` with the dense Jacobian) is timed on a slice of the rows and
scaled up to all of them. Both are run alternately ``--repeats`` times (so load from other
processes hits both alike) and medians are printed; the kernel gets one warm-up call first (for
the compiled kernels it includes compiling, printed separately).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import semipack
from semipack.messages.normalization import normalized_messages
from semipack.messages.rowwise import log_softmax_messages, softmax_messages
from semipack.rules.normalization import normalized_contract_dense
from semipack.rules.softmax import log_softmax_contract_dense, softmax_contract_dense
from semipack.semirings import Semiring, State

SEMIRINGS: list[Semiring] = [
    semipack.Real(),
    semipack.MaxProd(),
    semipack.SignedMaxProd(),
    semipack.LogSum(),
    semipack.LogCount(),
    semipack.Entropy(),
    semipack.Boolean(),
]


def random_state(sr: Semiring, rows: int, n: int, dtype: torch.dtype, seed: int) -> State:
    """Plausible messages: log-space values around 0, a tenth of the entries without a path."""
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for zero in sr.zero:
        if isinstance(zero, bool):
            parts.append(torch.rand(rows, n, generator=gen) > 0.1)
            continue
        part = torch.randn(rows, n, generator=gen, dtype=dtype)
        part[torch.rand(rows, n, generator=gen) < 0.1] = zero
        parts.append(part)
    return tuple(parts)


def interleaved(
    generic: Callable[[], object], scale: float, fast: Callable[[], object], repeats: int
) -> tuple[float, float, float]:
    """Median times of ``generic`` (times ``scale``) and ``fast``, run alternately so that load
    from other processes hits both alike; also returns the first (warm-up) call of ``fast``."""
    start = time.perf_counter()
    fast()
    first = time.perf_counter() - start
    generic_times, fast_times = [], []
    for _ in range(repeats):
        for fn, out in ((generic, generic_times), (fast, fast_times)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(generic_times) * scale, statistics.median(fast_times), first


def report(op: str, sr: Semiring, generic: float, fast: float, note: str = "") -> None:
    speedup = generic / fast if fast > 0 else float("inf")
    print(
        f"{op:<12} {sr.name:<14} generic {generic:9.3f} s   kernel {fast:8.4f} s   "
        f"x{speedup:8.1f}  {note}",
        flush=True,
    )


def bench_layer_norm(dtype: torch.dtype, repeats: int, slice_rows: int) -> None:
    rows, n = 1024, 768
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n, generator=gen, dtype=dtype)
    var, mean = torch.var_mean(x, -1, unbiased=False, keepdim=True)
    rstd = (var + 1e-12).rsqrt()
    x_hat = (x - mean) * rstd
    rstd = rstd.squeeze(-1)
    gain = torch.randn(n, generator=gen, dtype=dtype)
    print(f"\nlayer_norm {rows} x {n} ({dtype}); generic timed on {slice_rows} rows, scaled")
    for sr in SEMIRINGS:
        m = random_state(sr, rows, n, dtype, 1)
        part = tuple(c[:slice_rows] for c in m)

        def generic(sr=sr, part=part) -> State:
            xs, rs = x_hat[:slice_rows], rstd[:slice_rows]
            return normalized_contract_dense(sr, part, xs, rs, gain, False)

        def fast(sr=sr, m=m) -> State | None:
            return normalized_messages(sr, m, x_hat, rstd, gain, False, mode="compiled")

        slow, quick, first = interleaved(generic, rows / slice_rows, fast, repeats)
        report("layer_norm", sr, slow, quick, f"(first call, compiling: {first:.1f} s)")


def bench_softmax(dtype: torch.dtype, repeats: int) -> None:
    rows, n = 96 * 128, 128
    gen = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(rows, n, generator=gen, dtype=dtype) * 3, -1)
    slice_rows = 1024
    print(f"\nsoftmax {rows} x {n} ({dtype}); generic timed on {slice_rows} rows, scaled")
    for sr in SEMIRINGS:
        m = random_state(sr, rows, n, dtype, 3)
        part = tuple(c[:slice_rows] for c in m)

        def generic(sr=sr, part=part) -> State:
            return softmax_contract_dense(sr, part, probs[:slice_rows])

        def fast(sr=sr, m=m) -> State | None:
            return softmax_messages(sr, m, probs)

        slow, quick, _ = interleaved(generic, rows / slice_rows, fast, repeats)
        report("softmax", sr, slow, quick)


def bench_log_softmax(dtype: torch.dtype, repeats: int) -> None:
    rows, n = 128, 30522
    gen = torch.Generator().manual_seed(4)
    log_probs = torch.log_softmax(torch.randn(rows, n, generator=gen, dtype=dtype) * 3, -1)
    slice_rows = 1
    print(f"\nlog_softmax {rows} x {n} ({dtype}); generic timed on {slice_rows} row, scaled")
    for sr in SEMIRINGS:
        m = random_state(sr, rows, n, dtype, 5)
        part = tuple(c[:slice_rows] for c in m)

        def generic(sr=sr, part=part) -> State:
            return log_softmax_contract_dense(sr, part, log_probs[:slice_rows])

        def fast(sr=sr, m=m) -> State | None:
            return log_softmax_messages(sr, m, log_probs)

        slow, quick, _ = interleaved(generic, rows / slice_rows, fast, repeats)
        report("log_softmax", sr, slow, quick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--slice-rows", type=int, default=64, help="layer_norm generic slice")
    parser.add_argument("--only", choices=["layer_norm", "softmax", "log_softmax"], default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.only in (None, "softmax"):
        bench_softmax(dtype, args.repeats)
    if args.only in (None, "log_softmax"):
        bench_log_softmax(dtype, args.repeats)
    if args.only in (None, "layer_norm"):
        bench_layer_norm(dtype, args.repeats, args.slice_rows)


if __name__ == "__main__":
    main()
