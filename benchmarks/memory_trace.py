"""Resident memory at every autograd node of one backward: where a semiring backward's peak is.

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/memory_trace.py bert_layer LogSum
    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/memory_trace.py bert_layer plain

For each node that runs (in order) it prints the resident memory above the pre-forward level
when the node starts ("at start") and the high-water mark while it ran ("peak inside"), read from
Linux's /proc/self/status. The gap between the two is the node's own temporaries; "at start" is
what the backward holds between nodes (saved activations, gradients, messages, results). Set the
mmap threshold as shown so that freed tensors go back to the OS and the numbers follow live
tensors (as in benchmarks/run.py's memory column).
"""

from __future__ import annotations

import argparse
import gc

from cases import WORKLOADS
from torch.autograd.graph import Node

import semipack


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def _reset_high_water_mark() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _graph_nodes(root: Node | None) -> list[Node]:
    seen: dict[Node, None] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen[node] = None
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(seen)


def _before(node: Node, starts: dict[Node, float], base: float):
    def hook(grads):
        starts[node] = _status_mb("VmRSS:") - base
        _reset_high_water_mark()

    return hook


def _after(node: Node, starts: dict[Node, float], base: float, rows: list):
    def hook(grad_inputs, grad_outputs):
        rows.append((node.name(), starts[node], _status_mb("VmHWM:") - base))

    return hook


def trace(
    workload_name: str, semiring_name: str, extensions: bool
) -> list[tuple[str, float, float]]:
    """[(node name, MB at start, MB peak inside)] for one backward after a warm-up run."""
    workload = WORKLOADS[workload_name]()
    rows: list[tuple[str, float, float]] = []
    for _ in range(2):  # the first pass compiles kernels and fills caches
        rows.clear()
        for leaf in workload.leaves():
            leaf.grad = None
            if hasattr(leaf, "semiring_grad"):
                del leaf.semiring_grad
        gc.collect()
        base = _status_mb("VmRSS:")
        context = None
        if semiring_name != "plain":
            sr = getattr(semipack, semiring_name)()
            context = semipack.extend(workload.model, sr, extensions=extensions)
            context.__enter__()
        loss = workload.loss()
        starts: dict[Node, float] = {}
        handles = []  # removed after the pass: AccumulateGrad nodes outlive the graph
        for node in _graph_nodes(loss.grad_fn):
            handles.append(node.register_prehook(_before(node, starts, base)))
            handles.append(node.register_hook(_after(node, starts, base, rows)))
        loss.backward()
        for handle in handles:
            handle.remove()
        del loss, handles, starts  # nodes keep their saved state alive
        if context is not None:
            context.__exit__(None, None, None)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("semiring", help="a semipack semiring class name, or 'plain'")
    parser.add_argument("--generic", action="store_true", help="extend(..., extensions=False)")
    parser.add_argument("--min-mb", type=float, default=1.0, help="hide nodes below this peak")
    args = parser.parse_args()
    rows = trace(args.workload, args.semiring, not args.generic)
    print(f"{'at start':>9} {'peak inside':>12}  node   (MB above the pre-forward level)")
    for name, start, peak in rows:
        if peak - start >= args.min_mb or name.endswith("FunctionBackward"):
            print(f"{start:9.1f} {peak:12.1f}  {name}")
    top = max(rows, key=lambda row: row[2])
    held = max(row[1] for row in rows)
    print(f"peak {top[2]:.1f} MB inside {top[0]}; most held between nodes {held:.1f} MB")


if __name__ == "__main__":
    main()
