"""Semiring backward over plain backward on a CUDA device: wall time and peak memory.

    python benchmarks/bench_cuda.py --workloads bert_layer resnet18_eval gpt2_tiny \
        --semirings MaxProd LogSum Entropy --repeats 7

The same workloads as ``run.py`` (``cases.py``), built on the GPU. Each backward is timed from
its start to a ``torch.cuda.synchronize()`` after it, so queued kernels count; the forward runs
before the clock starts. Every variant runs twice to warm up (kernels compile, the caching
allocator fills), then the variants take turns for ``--repeats`` rounds and the median of each
is reported. Peak memory is the largest allocation during the backward above what was allocated
when it started, over the plain backward's.

With ``--host-checks`` every semiring also runs with the CPU's host-side shortcuts turned on
(``semipack.kernels.logspace.checks_on_host`` answering true, so the zero-safe log and the
early exits read device values back as they do on the CPU), interleaved with the default run:
the GPU time that skipping those reads saves.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_cpu_time import semiring_named
from cases import WORKLOADS
from common import backward_step

from semipack.kernels import logspace


def timed_backward(step) -> tuple[float, int]:
    """Wall seconds and peak extra bytes of one backward on the current CUDA device."""
    backward = step()
    torch.cuda.synchronize()
    start_bytes = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    backward()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return seconds, torch.cuda.max_memory_allocated() - start_bytes


def with_host_checks(step):
    """``step`` whose backward takes the CPU's host-read shortcuts on any device."""

    def patched_step():
        backward = step()

        def patched_backward():
            original = logspace.checks_on_host
            logspace.checks_on_host = lambda t: True
            try:
                backward()
            finally:
                logspace.checks_on_host = original

        return patched_backward

    return patched_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["bert_layer"], choices=WORKLOADS)
    parser.add_argument("--semirings", nargs="+", default=["MaxProd", "LogSum", "Entropy"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--host-checks", action="store_true", help="also time host-read forms")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda.py needs a CUDA device")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for name in args.workloads:
        work = WORKLOADS[name]("cuda")
        steps = {"plain": backward_step(work.model, work.loss, None)}
        for sr_name in args.semirings:
            steps[sr_name] = backward_step(work.model, work.loss, semiring_named(sr_name))
            if args.host_checks:
                steps[f"{sr_name} host checks"] = with_host_checks(steps[sr_name])
        for step in steps.values():
            for _ in range(2):
                timed_backward(step)
        times: dict[str, list[float]] = {key: [] for key in steps}
        peaks: dict[str, list[int]] = {key: [] for key in steps}
        for _ in range(args.repeats):
            for key, step in steps.items():
                seconds, peak = timed_backward(step)
                times[key].append(seconds)
                peaks[key].append(peak)
        plain = statistics.median(times["plain"])
        plain_peak = max(statistics.median(peaks["plain"]), 1)
        columns = "  ".join(
            f"{key} {statistics.median(times[key]) / plain:.2f}x"
            f" (mem {statistics.median(peaks[key]) / plain_peak:.2f}x)"
            for key in steps
            if key != "plain"
        )
        print(f"{name}: plain {plain * 1e3:.2f} ms  {columns}", flush=True)


if __name__ == "__main__":
    main()
