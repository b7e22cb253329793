"""Where a semiring backward of the monitor's example CNN spends its time, node by node.

On a model this small a semiring step's cost is per autograd node, not arithmetic: this puts
a pre-hook and a hook on every node of the loss's graph (inside ``semipack.extend``) and
reports the median time between them per node over ``--passes`` passes, then the whole
backward's median; what the nodes do not account for is spent outside them (the pass's
set-up, the leaves' readouts). The hooks add a few microseconds per node, and the hook after
each node makes the engine hold its incoming gradient until then, so activations do not write
into it (``messages.donation``): they allocate as they would without that.

Run: ``OMP_NUM_THREADS=1 python benchmarks/bench_node_times.py --semiring MaxProd`` (or
``Product`` for the monitor's own ``Product(MaxProd(log=True), Entropy(flow=True))``).
``--workload resnet18_eval`` (any name of ``cases.py``, or ``plain`` as the semiring for a
plain backward) times a whole model instead and sums the nodes of each kind per pass, so a
model's backward can be read kind by kind against its plain one.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict

from bench_monitor import task
from cases import WORKLOADS
from torch import nn

import semipack


def _nodes(root) -> list:
    """Every node of the graph behind ``root``, each once."""
    seen, out, stack = set(), [], [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        out.append(node)
        stack.extend(f for f, _ in node.next_functions)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--semiring", default="MaxProd")
    parser.add_argument("--passes", type=int, default=100)
    parser.add_argument("--workload", default=None, choices=list(WORKLOADS))
    args = parser.parse_args()
    if args.workload is not None:
        return by_kind(args.workload, args.semiring, args.passes)
    model, batches = task("example", 1)
    x, y = batches[0]
    lossfunc = nn.CrossEntropyLoss()
    if args.semiring == "Product":
        semiring = semipack.Monitor(model, every=1).semiring
    else:
        semiring = getattr(semipack, args.semiring)()
    spans: dict[str, list[float]] = defaultdict(list)
    for i in range(args.passes + 20):
        model.zero_grad()
        with semipack.extend(model, semiring):
            loss = lossfunc(model(x), y)
            starts: dict[int, float] = {}
            ends: list[tuple[int, float]] = []
            nodes = _nodes(loss.grad_fn)
            for k, node in enumerate(nodes):
                node.register_prehook(
                    lambda g, k=k, starts=starts: starts.__setitem__(k, time.perf_counter())
                )
                node.register_hook(
                    lambda gi, go, k=k, ends=ends: ends.append((k, time.perf_counter()))
                )
            start = time.perf_counter()
            loss.backward()
            whole = time.perf_counter() - start
        if i < 20:  # warm-up
            continue
        for k, end in ends:
            if k in starts:
                spans[f"{k:02d} {nodes[k].name()}"].append(end - starts[k])
        spans["whole backward"].append(whole)
    print(f"example CNN, {args.semiring}, medians of {args.passes} passes (microseconds)")
    for name in sorted(spans):
        print(f"  {name:44s} {statistics.median(spans[name]) * 1e6:8.0f}")


def _timed(nodes: list, starts: dict[int, float], ends: list[tuple[int, float]]) -> None:
    for k, node in enumerate(nodes):
        node.register_prehook(lambda g, k=k: starts.__setitem__(k, time.perf_counter()))
        node.register_hook(lambda gi, go, k=k: ends.append((k, time.perf_counter())))


def by_kind(workload: str, semiring_name: str, passes: int) -> None:
    """A ``cases.py`` workload's backward, its nodes' times summed per kind of node (medians
    over the passes, milliseconds); ``semiring_name`` ``plain`` for a plain backward."""
    work = WORKLOADS[workload]()
    semiring = None if semiring_name == "plain" else getattr(semipack, semiring_name)()
    per_kind: dict[str, list[float]] = defaultdict(list)
    wholes = []
    for i in range(passes + 3):
        for leaf in work.leaves():
            leaf.grad = None
        context = semipack.extend(work.model, semiring) if semiring else contextlib.nullcontext()
        with context:
            loss = work.loss()
            starts: dict[int, float] = {}
            ends: list[tuple[int, float]] = []
            nodes = _nodes(loss.grad_fn)
            _timed(nodes, starts, ends)
            start = time.perf_counter()
            loss.backward()
            whole = time.perf_counter() - start
        if i < 3:  # warm-up: kernels compile
            continue
        summed: dict[str, float] = defaultdict(float)
        for k, end in ends:
            if k in starts:
                summed[nodes[k].name()] += end - starts[k]
        for kind, spent in summed.items():
            per_kind[kind].append(spent)
        wholes.append(whole)
    print(f"{workload}, {semiring_name}, medians of {passes} passes (milliseconds)")
    for kind in sorted(per_kind, key=lambda kind: -statistics.median(per_kind[kind])):
        print(f"  {kind:44s} {statistics.median(per_kind[kind]) * 1e3:8.1f}")
    print(f"  {'whole backward':44s} {statistics.median(wholes) * 1e3:8.1f}")


if __name__ == "__main__":
    main()
