"""Time spent in Python's garbage collector over many semiring passes of one workload.

A semiring pass keeps many small Python objects alive until it ends; collections run during
it move them to older generations, and once enough have moved Python walks every object of the
process (a full collection: hundreds of milliseconds after importing transformers). The
script runs ``--passes`` forward and backward passes of a workload from ``cases.py`` inside
``semipack.extend`` and reports, per generation, the collections and the time in them (from
``gc.callbacks``), then the passes' median, total and longest time. Medians hide full
collections (rare, long): read the total and the longest pass.

Run: ``OMP_NUM_THREADS=1 python benchmarks/bench_gc.py --workload minilm_1x20 --semiring
MaxProd --passes 200``; against another tree, ``PYTHONPATH=<tree>`` (the script uses only
the public API).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from cases import WORKLOADS

import semipack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="minilm_1x20", choices=list(WORKLOADS))
    parser.add_argument("--semiring", default="MaxProd")
    parser.add_argument("--passes", type=int, default=200)
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]()
    semiring = getattr(semipack, args.semiring)()

    def one_pass() -> None:
        for leaf in workload.leaves():
            leaf.grad = None
        with semipack.extend(workload.model, semiring):
            workload.loss().backward()

    for _ in range(5):  # warm-up: kernels compiled, caches filled
        one_pass()
    spans: list[tuple[int, float]] = []  # (generation, seconds) per collection
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spans.append((info["generation"], time.perf_counter() - started[0]))

    gc.callbacks.append(timed)
    times = []
    try:
        for _ in range(args.passes):
            start = time.perf_counter()
            one_pass()
            times.append(time.perf_counter() - start)
    finally:
        gc.callbacks.remove(timed)
    print(f"{args.workload} {args.semiring}, {args.passes} passes (forward and backward)")
    for generation in range(3):
        seconds = [s for g, s in spans if g == generation]
        print(
            f"  generation {generation}: {len(seconds)} collections, "
            f"{sum(seconds) * 1e3:.1f} ms in all, longest {max(seconds, default=0) * 1e3:.1f} ms"
        )
    print(
        f"  passes: median {statistics.median(times) * 1e3:.1f} ms, total {sum(times):.2f} s, "
        f"longest {max(times) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
