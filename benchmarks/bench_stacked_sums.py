"""Entropy's weight messages in two sums against three, in one process, the two in turns.

    python benchmarks/bench_stacked_sums.py --workloads resnet18_eval resnet18_train \
        minilm_1x20 --rounds 12

Why in one process: on a shared VM whose speed drifts by tens of percent within minutes, two
code trees timed one after the other differ by more than this change. Here the same process
runs a plain backward, Entropy with its weight sums stacked (``[e·r; e]`` against
``[|x|; -|x| log|x|]``, ``semirings.entropy._stacked_sums``) and Entropy with three sums (the
stacked form switched off), in turns for ``--rounds`` rounds after two warm-up passes each.
Wall time of the backward alone, torch's threads as set (``--threads``, default 2, as
``run.py``); each line gives the sorted times and the medians.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from cases import WORKLOADS
from common import backward_seconds, backward_step

import semipack
import semipack.semirings.entropy as entropy


def _unstacked(m, stacked: bool = True):
    """``_shared_shift_stacked`` with the stacked form off: the three-sum path."""
    return _STACKED(m, stacked=False)


_STACKED = entropy._shared_shift_stacked


def _time(variant: str, steps: dict[str, Callable[[], Callable[[], object]]]) -> float:
    """Seconds of one backward of ``variant`` (its forward runs before the clock starts)."""
    entropy._shared_shift_stacked = _unstacked if variant == "three sums" else _STACKED
    return backward_seconds(steps["plain" if variant == "plain" else "entropy"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["resnet18_train"], choices=WORKLOADS)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.workloads:
        work = WORKLOADS[name]()
        steps = {
            "plain": backward_step(work.model, work.loss, None),
            "entropy": backward_step(work.model, work.loss, semipack.Entropy()),
        }
        times: dict[str, list[float]] = {"plain": [], "three sums": [], "two sums": []}
        try:
            for variant in times:
                _time(variant, steps), _time(variant, steps)
            for _ in range(args.rounds):
                for variant, kept in times.items():
                    kept.append(_time(variant, steps))
        finally:
            entropy._shared_shift_stacked = _STACKED
        for variant, kept in times.items():
            ms = sorted(round(t * 1e3) for t in kept)
            print(f"{name} {variant}: median {statistics.median(kept) * 1e3:.0f} ms {ms}")


if __name__ == "__main__":
    main()
