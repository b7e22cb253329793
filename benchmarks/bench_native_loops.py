"""A whole backward with semipack's native float32 exp and log loops against the compiled ones.

    OMP_NUM_THREADS=2 python benchmarks/bench_native_loops.py --semiring LogSum \
        --workload minilm_1x20 --rounds 15

``semipack.kernels.logspace.native_loops`` decides, per tensor, whether the exponentials and
logarithms over whole float32 CPU tensors (readouts into ``p.semiring_grad``, the logarithm
that ends each log-space product, Entropy's shifted exponentials) run the native loops of
``kernels/native/elementwise.c`` or the compiled ones. This script times, in one process and
in turns round after round, a semiring backward with the native loops, one with the compiled
loops (the switch patched to say no, in ``logspace`` and in ``semirings.entropy``, which
imports it), one with the native loops only from 16k entries and torch's ops below (the
routing before they ran at every size: ``native_from_16k``), one with GELU's and SiLU's
log-derivatives and ReLU's cut by their compiled kernels instead of their native loops
(``kernels/native/log_derivatives.c`` and ``semipack_cut_below_f32``, since the twenty-eighth
session: ``compiled_activations``), and a plain backward; it prints
each variant's median and fastest round (the first two rounds are warm-up) and the medians'
ratio to the plain one. The machines these numbers come from are shared: read medians, and
expect spreads of 10-20%.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

from cases import WORKLOADS
from common import backward_step

import semipack
from semipack.kernels import cuts, log_derivatives, logspace
from semipack.semirings import entropy


@contextlib.contextmanager
def native_from_16k() -> Iterator[None]:
    """The native loops for ``exp_``, ``exp_into`` and ``log_magnitude_`` only from
    ``SPECIAL_SAFE_MIN_ELEMENTS`` entries, torch's ops below (the routing before the twenty-fifth
    session, when they ran at every size), for the block."""
    kept = logspace._native_block

    def large(t) -> bool:
        return t.numel() >= logspace.SPECIAL_SAFE_MIN_ELEMENTS and kept(t)

    logspace._native_block = large
    try:
        yield
    finally:
        logspace._native_block = kept


@contextlib.contextmanager
def compiled_loops() -> Iterator[None]:
    """The compiled loops where the native ones would run, for the block."""
    kept = logspace.native_loops

    def never(t) -> bool:
        return False

    logspace.native_loops = entropy.native_loops = never
    try:
        yield
    finally:
        logspace.native_loops = entropy.native_loops = kept


@contextlib.contextmanager
def compiled_activations() -> Iterator[None]:
    """GELU's and SiLU's log-derivatives and ReLU's cut by their compiled kernels (large
    tensors; eager forms below their sizes), as before their native loops, for the block."""
    forms, kept = dict(log_derivatives.NATIVE_SPECS), cuts._native_flat
    log_derivatives.NATIVE_SPECS.clear()
    cuts._native_flat = lambda part, x: None
    try:
        yield
    finally:
        log_derivatives.NATIVE_SPECS.update(forms)
        cuts._native_flat = kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--semiring", default="LogSum")
    parser.add_argument("--workload", default="minilm_1x20", choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    work = WORKLOADS[args.workload]()
    plain = backward_step(work.model, work.loss, None)
    semiring = backward_step(work.model, work.loss, getattr(semipack, args.semiring)())
    variants: dict[str, Callable[[], Callable[[], object]]] = {
        "native loops": semiring,
        "native from 16k": semiring,
        "compiled loops": semiring,
        "compiled activations": semiring,
        "plain": plain,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.rounds + 2):
        for name, step in variants.items():
            context = {
                "compiled loops": compiled_loops,
                "native from 16k": native_from_16k,
                "compiled activations": compiled_activations,
            }.get(name, contextlib.nullcontext)()
            with context:
                backward = step()
                start = time.perf_counter()
                backward()
                spent = time.perf_counter() - start
            if round_ >= 2:
                times[name].append(spent)
    base = statistics.median(times["plain"])
    print(f"{args.workload}, {args.semiring}, {args.rounds} rounds (milliseconds)")
    for name, spent in times.items():
        median = statistics.median(spent)
        print(
            f"  {name:20s} median {median * 1e3:7.1f}  fastest {min(spent) * 1e3:7.1f}  "
            f"median / plain {median / base:5.2f}"
        )


if __name__ == "__main__":
    main()
