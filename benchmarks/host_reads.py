"""Values read back to Python during one semiring backward, counted by source line.

    python benchmarks/host_reads.py --workloads bert_layer resnet18_eval \
        --semirings MaxProd LogSum Entropy [--accelerator]

Why: on a GPU every ``bool(t)``, ``t.item()``, ``t.tolist()``, ``int(t)`` or ``float(t)``
waits for all queued kernels, so the next ops' Python work stops overlapping with the GPU's.
A plain backward reads nothing back. This counts the reads on the CPU, where they can be
found without a GPU. ``--accelerator`` runs the code as it runs on a GPU: the host-side
shortcuts off (``kernels.logspace.checks_on_host``) and the CPU-only native kernels off, so
what is counted is what a CUDA backward would read back.
"""

from __future__ import annotations

import argparse
import collections
import traceback

import torch
from bench_cpu_time import semiring_named
from cases import WORKLOADS
from common import backward_step

from semipack.kernels import logspace
from semipack.kernels.native import set_native

READS = ("__bool__", "item", "tolist", "__int__", "__float__")


def count_reads(counts: collections.Counter, active: list[bool]) -> None:
    """Wrap the reads on ``torch.Tensor`` to count them by caller while ``active[0]``."""
    for name in READS:
        original = getattr(torch.Tensor, name)

        def read(self, *args, _original=original, _name=name, **kwargs):
            if active[0]:
                caller = traceback.extract_stack(limit=2)[0]
                where = caller.filename.split("semipack/")[-1]
                counts[f"{_name} at {where}:{caller.lineno}"] += 1
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, read)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["bert_layer"], choices=WORKLOADS)
    parser.add_argument("--semirings", nargs="+", default=["MaxProd", "LogSum", "Entropy"])
    parser.add_argument("--accelerator", action="store_true", help="count as a GPU would read")
    parser.add_argument("--top", type=int, default=5, help="source lines listed per semiring")
    args = parser.parse_args()
    if args.accelerator:
        logspace.checks_on_host = lambda t: False
        set_native(False)
    counts: collections.Counter = collections.Counter()
    active = [False]
    count_reads(counts, active)
    for name in args.workloads:
        work = WORKLOADS[name]()
        for sr_name in args.semirings:
            step = backward_step(work.model, work.loss, semiring_named(sr_name))
            step()()  # warm-up: kernels compile, weight forms are kept
            backward = step()
            counts.clear()
            active[0] = True
            backward()
            active[0] = False
            lines = ", ".join(f"{k} ({v})" for k, v in counts.most_common(args.top))
            print(f"{name} {sr_name}: {sum(counts.values())} reads; {lines}", flush=True)


if __name__ == "__main__":
    main()
