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
model's backward can be read kind by kind against its plain one. ``--compare`` (with
``--workload``) times the plain backward and the semiring's in turns in one process and prints,
per kind of node, both medians, the semiring's extra milliseconds and their share of the whole
extra time: where a ratio above its floor goes (BENCHMARKS.md, "Targets").
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
    parser.add_argument("--compare", action="store_true", help="against plain, in turns")
    args = parser.parse_args()
    if args.workload is not None and args.compare:
        return compared_by_kind(args.workload, args.semiring, args.passes)
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


def _pass_by_kind(work, semiring) -> tuple[dict[str, float], float]:
    """One backward of ``work`` (a plain one for ``semiring`` None): seconds per kind of node,
    and the whole backward's seconds."""
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
    summed: dict[str, float] = defaultdict(float)
    for k, end in ends:
        if k in starts:
            summed[_kind(nodes[k])] += end - starts[k]
    return summed, whole


def _kind(node) -> str:
    """A node's kind, the same for a module extension's node and the plain node it replaces
    (``LinearFunctionBackward`` and ``AddmmBackward0`` are both a linear layer)."""
    name = node.name()
    return _SAME_KIND.get(name, name)


#: Plain nodes and the extension nodes that stand for them under ``semipack.extend``.
_SAME_KIND = {
    "ConvolutionBackward0": "convolution",
    "ConvFunctionBackward": "convolution",
    "AddmmBackward0": "linear",
    "AddmmFunctionBackward": "linear",  # Hugging Face's Conv1D (GPT-2)
    "MmBackward0": "linear",
    "LinearFunctionBackward": "linear",
    "NativeLayerNormBackward0": "layer norm",
    "LayerNormFunctionBackward": "layer norm",
    "EmbeddingBackward0": "embedding",
    "EmbeddingFunctionBackward": "embedding",
    "ScaledDotProductFlashAttentionForCpuBackward0": "attention",
    "AttentionFunctionBackward": "attention",
}


def by_kind(workload: str, semiring_name: str, passes: int) -> None:
    """A ``cases.py`` workload's backward, its nodes' times summed per kind of node (medians
    over the passes, milliseconds); ``semiring_name`` ``plain`` for a plain backward."""
    work = WORKLOADS[workload]()
    semiring = None if semiring_name == "plain" else getattr(semipack, semiring_name)()
    per_kind: dict[str, list[float]] = defaultdict(list)
    wholes = []
    for i in range(passes + 3):
        summed, whole = _pass_by_kind(work, semiring)
        if i < 3:  # warm-up: kernels compile
            continue
        for kind, spent in summed.items():
            per_kind[kind].append(spent)
        wholes.append(whole)
    print(f"{workload}, {semiring_name}, medians of {passes} passes (milliseconds)")
    for kind in sorted(per_kind, key=lambda kind: -statistics.median(per_kind[kind])):
        print(f"  {kind:44s} {statistics.median(per_kind[kind]) * 1e3:8.1f}")
    print(f"  {'whole backward':44s} {statistics.median(wholes) * 1e3:8.1f}")


def compared_by_kind(workload: str, semiring_name: str, passes: int) -> None:
    """Plain and semiring backwards of a workload in turns: per kind of node the medians of
    both (milliseconds), the semiring's extra time and its share of the whole extra time. What
    the nodes do not account for (the pass's set-up, leaf readouts run as hooks, the engine
    between nodes) is the line "outside the nodes". An extension that stands for several plain
    nodes (eager attention's products, softmax and masking) shows its whole time under its own
    kind and theirs as negative extra time under theirs."""
    work = WORKLOADS[workload]()
    semiring = getattr(semipack, semiring_name)()
    times: dict[str, dict[str, list[float]]] = {v: defaultdict(list) for v in ("plain", "semiring")}
    for i in range(passes + 3):
        for variant, sr in (("plain", None), ("semiring", semiring)):
            summed, whole = _pass_by_kind(work, sr)
            if i < 3:  # warm-up: kernels compile
                continue
            summed["outside the nodes"] = whole - sum(summed.values())
            summed["whole backward"] = whole
            for kind in set(summed) | set(times[variant]):
                times[variant][kind].append(summed.get(kind, 0.0))
    median = {
        v: {kind: statistics.median(t) * 1e3 for kind, t in kinds.items()}
        for v, kinds in times.items()
    }
    plain, semi = median["plain"], median["semiring"]
    extra = semi["whole backward"] - plain["whole backward"]
    print(
        f"{workload}, {semiring_name} against plain, in turns, medians of {passes} passes "
        f"(milliseconds; whole {semi['whole backward'] / plain['whole backward']:.2f}x plain)"
    )
    print(f"  {'kind':44s} {'plain':>8s} {semiring_name:>8s} {'extra':>8s} {'share':>6s}")
    kinds = [k for k in set(plain) | set(semi) if k != "whole backward"]
    for kind in sorted(kinds, key=lambda k: -(semi.get(k, 0.0) - plain.get(k, 0.0))):
        p, s = plain.get(kind, 0.0), semi.get(kind, 0.0)
        if max(p, s) < 0.05:
            continue
        print(f"  {kind:44s} {p:8.1f} {s:8.1f} {s - p:8.1f} {(s - p) / extra:6.0%}")
    print(
        f"  {'whole backward':44s} {plain['whole backward']:8.1f} "
        f"{semi['whole backward']:8.1f} {extra:8.1f}"
    )


if __name__ == "__main__":
    main()
