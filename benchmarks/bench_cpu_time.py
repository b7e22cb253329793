"""Semiring backward over plain backward in CPU time, one thread, for any built-in semiring.

    OMP_NUM_THREADS=1 python benchmarks/bench_cpu_time.py --workloads minilm_1x20 bert_layer \
        --semirings TopPath MaxProd --repeats 5

Why CPU time: on a shared machine the wall time of a 2-thread run moves by tens of percent when
a neighbour takes a core; the process's own CPU time on one thread moves far less, so the ratio
of two variants measured in turns is repeatable to a few percent. ``run.py`` stays the reference
table (wall time, the threads a user has); this script is for semirings it does not time
(TopPath, KBest(k), SignedMaxProd, ...) and for A/B checks of one change. Each variant runs once
to warm up (kernels compile, caches fill), then the variants take turns for ``--repeats``
rounds; the median of each is reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from cases import WORKLOADS
from common import backward_seconds, backward_step

import semipack


def semiring_named(name: str) -> semipack.Semiring:
    """A built-in semiring by class name; ``KBest`` takes k after a colon (``KBest:3``)."""
    if name.startswith("KBest"):
        _, _, k = name.partition(":")
        return semipack.KBest(int(k) if k else 2)
    cls = getattr(semipack, name, None)
    if not (isinstance(cls, type) and issubclass(cls, semipack.Semiring)):
        raise SystemExit(f"not a built-in semiring: {name!r}")
    return cls()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["minilm_1x20"], choices=WORKLOADS)
    parser.add_argument("--semirings", nargs="+", default=["TopPath", "MaxProd"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.workloads:
        work = WORKLOADS[name]()
        steps = {"plain": backward_step(work.model, work.loss, None)}
        for sr_name in args.semirings:
            steps[sr_name] = backward_step(work.model, work.loss, semiring_named(sr_name))
        for step in steps.values():
            step()()
        times: dict[str, list[float]] = {key: [] for key in steps}
        for _ in range(args.repeats):
            for key, step in steps.items():
                times[key].append(backward_seconds(step, time.process_time))
        plain = statistics.median(times["plain"])
        ratios = "  ".join(
            f"{key} {statistics.median(times[key]) / plain:.2f}x" for key in args.semirings
        )
        print(f"{name}: plain {plain * 1e3:.1f} ms CPU  {ratios}", flush=True)


if __name__ == "__main__":
    main()
