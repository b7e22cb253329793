"""A process's first semiring backward against its later ones: what interactive use waits for.

    python benchmarks/bench_first_call.py --workloads minilm_1x20 resnet18_eval \
        --semirings plain MaxProd LogSum Entropy --rounds 3

Someone explaining one sentence or one image runs a script, or a notebook cell, once: the
backward they wait for is the process's first. For each workload and semiring this starts a
fresh Python process (``--rounds`` times, in turns), which times ``import torch``, ``import
semipack``, building the workload, and then three steps, each a forward and a backward under
``semipack.extend`` (a plain forward and backward for ``plain``), its gradients cleared before.
The first step pays what a process pays once: building or loading the native kernels, lifting
the weights (kept across passes after that), compiling or loading inductor kernels, lazy
imports. The third is the steady state. Each figure is the median over the rounds, in seconds.

The inductor and native kernels' caches on disk are what the machine holds (the first round
fills them where they are empty): these are the figures of a user's second session onward.
The machines these numbers come from are shared: read medians, and expect spreads of 10-20%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = 3


def child(workload: str, semiring: str) -> dict[str, object]:
    """Run in the fresh process: the import, build and step times, in seconds."""
    start = time.perf_counter()
    import torch

    after_torch = time.perf_counter()
    import semipack

    after_semipack = time.perf_counter()
    sys.path.insert(0, str(HERE))
    from cases import WORKLOADS

    work = WORKLOADS[workload]()
    built = time.perf_counter()
    steps = []
    for _ in range(STEPS):
        work.model.zero_grad(set_to_none=True)
        began = time.perf_counter()
        if semiring == "plain":
            work.loss().backward()
        else:
            with semipack.extend(work.model, getattr(semipack, semiring)()):
                work.loss().backward()
        steps.append(time.perf_counter() - began)
    return {
        "torch": after_torch - start,
        "semipack": after_semipack - after_torch,
        "build": built - after_semipack,
        "steps": steps,
        "threads": torch.get_num_threads(),
    }


def measure(workload: str, semiring: str) -> dict[str, object]:
    """One fresh process's figures."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", workload, semiring],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="*", default=["minilm_1x20", "resnet18_eval"])
    parser.add_argument("--semirings", nargs="*", default=["plain", "MaxProd", "LogSum", "Entropy"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    runs: dict[tuple[str, str], list[dict[str, object]]] = {}
    for _ in range(args.rounds):
        for workload in args.workloads:
            for semiring in args.semirings:
                runs.setdefault((workload, semiring), []).append(measure(workload, semiring))
    print(
        "| workload | semiring | import torch | import semipack | first step | second | third "
        "| first / third |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (workload, semiring), done in runs.items():
        imports = [statistics.median(float(r[key]) for r in done) for key in ("torch", "semipack")]
        step = [statistics.median(float(r["steps"][i]) for r in done) for i in range(STEPS)]
        print(
            f"| {workload} | {semiring} | {imports[0]:.2f} | {imports[1]:.2f} | "
            f"{step[0]:.2f} | {step[1]:.2f} | {step[2]:.2f} | {step[0] / step[2]:.1f} |"
        )
    print(f"\nSeconds, medians of {args.rounds} fresh processes ({done[0]['threads']} threads).")


if __name__ == "__main__":
    main()
