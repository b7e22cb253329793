"""Measurement helpers shared by the benchmark script and the pytest-benchmark cases.

Time: median wall time of repeated runs after a warm-up run (which also compiles kernels).
Memory: peak resident memory during forward + backward, above the resident memory just before the
forward, read from Linux's high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``).
glibc serves large tensors with mmap and returns them on free, so the high-water mark follows the
live tensors; it includes everything the backward holds (saved activations, messages, kernel
temporaries).
"""

from __future__ import annotations

import gc
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

import semipack


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_memory(fn: Callable[[], object], reset: Callable[[], None] | None = None) -> int:
    """Peak bytes resident above the starting point while ``fn`` runs (Linux only).

    ``reset`` drops results of earlier runs (``.grad``, ``.semiring_grad``) *before* the
    starting point is read, so that freeing them inside ``fn`` does not hide new allocations.
    """
    if reset is not None:
        reset()
    gc.collect()
    base = _status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fn()
    return max(0, _status("VmHWM:") - base)


@dataclass
class Measurement:
    seconds: float
    peak_bytes: int


def backward_seconds(
    step: Callable[[], Callable[[], object]], clock: Callable[[], float] = time.perf_counter
) -> float:
    """Seconds of one backward by ``clock``: ``step()`` runs a forward (before the clock
    starts) and returns the backward to time."""
    backward = step()
    start = clock()
    backward()
    return clock() - start


def time_backward(step: Callable[[], Callable[[], object]], repeats: int = 3) -> float:
    """Median backward time; ``step()`` runs a forward and returns the backward to time."""
    step()()  # warm-up: compiles kernels, fills caches
    return statistics.median(backward_seconds(step) for _ in range(repeats))


def time_backwards_interleaved(
    steps: dict[object, Callable[[], Callable[[], object]]], repeats: int = 3
) -> dict[object, float]:
    """Fastest backward time of each step, the steps taking turns within every round.

    On a shared machine the speed drifts and jumps over a run (on the 2-core VM of BENCHMARKS.md
    the same plain backward took 0.18-0.29 s within an hour). Timing the variants in turns
    (plain, then each semiring, then plain again, ...) spreads the drift over all of them, and
    the fastest round of each is the one least disturbed: the ratio of minima is the most
    repeatable estimate of what a semiring backward costs against a plain one.
    """
    for step in steps.values():
        step()()  # warm-up: compiles kernels, fills caches
    times: dict[object, list[float]] = {key: [] for key in steps}
    for _ in range(repeats):
        for key, step in steps.items():
            times[key].append(backward_seconds(step))
    return {key: min(t) for key, t in times.items()}


def interleaved(
    variants: dict[str, Callable[[], object]],
    repeats: int,
    block: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Wall times (or ``clock``'s: ``time.process_time`` for CPU time) of each variant (a whole
    step each) in each of ``repeats`` rounds, the variants taking turns within every round,
    after one warm-up round (native kernels build, caches fill): drift on a shared machine hits
    every variant alike.

    With ``block`` > 1 a variant runs ``block`` times in a row per turn and the last is timed:
    its steady state, as in a training loop repeating one step. A step right after another
    variant pays for that variant's allocations (large tensors come back from the OS as fresh
    pages), which favours whichever variant allocates like its predecessor.
    """
    for run in variants.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            for _ in range(block - 1):
                run()
            start = clock()
            run()
            times[name].append(clock() - start)
    return times


def medians(rounds: dict[str, list[float]]) -> dict[str, float]:
    """Each variant's median time over the rounds of ``interleaved``."""
    return {variant: statistics.median(times) for variant, times in rounds.items()}


def median_ratio(numerator: list[float], denominator: list[float]) -> float:
    """The median over rounds of one round's ratio: variants timed in the same round share
    its drift, so the ratio of a round is steadier than a ratio of medians."""
    return statistics.median(n / d for n, d in zip(numerator, denominator, strict=True))


def sign_test(numerator: list[float], denominator: list[float]) -> tuple[int, float]:
    """How many rounds have ``numerator < denominator``, and the one-sided sign-test p-value
    of that many or more if either were as likely to be faster (ties count against): the
    chance that noise alone makes the numerator look faster this often."""
    wins = sum(n < d for n, d in zip(numerator, denominator, strict=True))
    rounds = len(numerator)
    p = sum(math.comb(rounds, k) for k in range(wins, rounds + 1)) / 2**rounds
    return wins, p


def memory_of(
    step: Callable[[], Callable[[], object]], reset: Callable[[], None] | None = None
) -> int:
    """Peak memory of one forward + backward, after a warm-up run.

    Run it in a process started with ``MALLOC_MMAP_THRESHOLD_`` fixed (see ``run.py``): only
    then does freed memory go back to the OS so that the high-water mark follows live tensors.
    That setting slows large allocations down, so times are measured in another process.
    """
    step()()
    return peak_memory(lambda: step()(), reset)


def backward_step(
    model: torch.nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    semiring: semipack.Semiring | None = None,
    extensions: bool = True,
    regular_grads: bool = True,
) -> Callable[[], Callable[[], object]]:
    """A step: forward under ``extend`` (or plain), returning the backward to run."""

    def step():
        model.zero_grad(set_to_none=True)
        context = (
            semipack.extend(model, semiring, extensions=extensions, regular_grads=regular_grads)
            if semiring is not None
            else nullcontext()
        )
        context.__enter__()
        loss = loss_fn()

        def backward():
            try:
                loss.backward()
            finally:
                context.__exit__(None, None, None)

        return backward

    return step


def clear_results(tensors) -> Callable[[], None]:
    """A reset for ``peak_memory``: forget gradients and semiring values of these leaves."""
    tensors = list(tensors)

    def reset() -> None:
        for t in tensors:
            t.grad = None
            if hasattr(t, "semiring_grad"):
                del t.semiring_grad

    return reset


#: (cpuinfo flag, name) from the widest vector instructions down; the native kernels use AVX2.
SIMD_LEVELS = (("avx512f", "AVX-512"), ("avx2", "AVX2"))


def machine() -> str:
    cpu, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu == "unknown CPU":
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = next((name for flag, name in SIMD_LEVELS if flag in flags), None)
    if simd is not None:
        cpu = f"{cpu} ({simd})"
    return (
        f"{cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}"
    )
